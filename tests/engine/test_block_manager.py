"""Allocator invariants: reference counts, prefix sharing, LRU eviction of cached blocks."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sequence import SamplingParams, Sequence


def seq(tokens: list[int]) -> Sequence:
    return Sequence(token_ids=list(tokens), params=SamplingParams(max_tokens=4))


def computed(manager: BlockManager, sequence: Sequence) -> None:
    sequence.num_computed_tokens = len(sequence)
    manager.register_computed(sequence)


def test_shared_prefix_blocks_are_reference_counted():
    manager = BlockManager(num_blocks=200, block_size=4)
    first = seq(list(range(10)))
    assert manager.allocate(first)
    assert len(first.block_table) == 3
    computed(manager, first)
    second = seq([*range(8), 99, 98, 97])
    assert manager.allocate(second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert second.num_computed_tokens == 8
    assert [manager.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (21, 8)
    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == 200
    assert manager.usage == 0.0


def test_last_token_is_never_served_from_cache():
    manager = BlockManager(num_blocks=200, block_size=4)
    first = seq(list(range(8)))
    manager.allocate(first)
    computed(manager, first)
    manager.free(first)
    again = seq(list(range(8)))
    assert manager.allocate(again)
    assert again.num_computed_tokens == 4  # the block holding the last token is recomputed


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    manager = BlockManager(num_blocks=6, block_size=2)
    manager.watermark_blocks = 0
    old = seq([1, 2, 3, 4, 5])
    manager.allocate(old)
    computed(manager, old)
    manager.free(old)
    assert len(manager.evictable) == 2  # two full, named blocks stay findable
    big = seq(list(range(100, 109)))  # needs 5 of 6 blocks: one cached block must go
    assert manager.allocate(big)
    assert (len(manager.evictable), len(manager.hash_to_block)) == (1, 1)
    manager.free(big)
    reuse = seq([1, 2, 3, 4, 5])
    manager.allocate(reuse)
    assert reuse.num_computed_tokens == 2  # the head block survived, the tail was evicted


def test_ensure_capacity_refuses_when_full():
    manager = BlockManager(num_blocks=3, block_size=2)
    manager.watermark_blocks = 0
    a = seq([1, 2, 3])
    assert manager.allocate(a)
    assert manager.ensure_capacity(a, 6)
    assert not manager.ensure_capacity(a, 7)
    assert len(a.block_table) == 3
