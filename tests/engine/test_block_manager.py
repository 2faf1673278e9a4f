"""Allocator invariants: reference counts, prefix sharing, eviction, adjacent placement."""

from __future__ import annotations

import random

from engine.block_manager import MAX_ROOM_BLOCKS, BlockManager
from engine.sequence import SamplingParams, Sequence


def seq(tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(token_ids=list(tokens), params=SamplingParams(max_tokens=max_tokens))


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


def test_cached_blocks_are_evicted_least_recently_released_first():
    manager = BlockManager(num_blocks=12, block_size=2)
    manager.watermark_blocks = 0
    older, newer = seq([1, 2, 3, 4, 5], max_tokens=1), seq([6, 7, 8, 9, 10], max_tokens=1)
    for s in (older, newer):
        assert manager.allocate(s)
        computed(manager, s)
    manager.free(older)
    manager.free(newer)
    assert len(manager.evictable) == 4  # two full, named blocks of each stay findable
    small = seq(list(range(100, 105)), max_tokens=1)  # fits in the free blocks
    assert manager.allocate(small)
    assert len(manager.hash_to_block) == 4
    manager.free(small)
    # 6 blocks in one run: the free ones are split around the newer sequence's, so the
    # older sequence's cached blocks go, and they are enough
    big = seq(list(range(200, 211)), max_tokens=1)
    assert manager.allocate(big)
    assert big.block_table == list(range(big.block_table[0], big.block_table[0] + 6))
    assert all(manager.block_tokens[b] is None for b in big.block_table)
    manager.free(big)
    again = seq([6, 7, 8, 9, 10], max_tokens=1)
    assert manager.allocate(again)
    assert again.num_computed_tokens == 4  # the newer prefix survived
    manager.free(again)
    first = seq([1, 2, 3, 4, 5])
    assert manager.allocate(first)
    assert first.num_computed_tokens == 0  # the older one was evicted
    manager.free(first)
    assert manager.num_free_blocks == 12


def test_interleaved_sequences_keep_their_blocks_adjacent():
    """Sequences admitted together and growing a token at a time in turn, as decode
    steps grow them, each keep one run of blocks: placement leaves room after each."""
    manager = BlockManager(num_blocks=400, block_size=4)
    seqs = [seq(list(range(10 * i, 10 * i + 9)), max_tokens=40) for i in range(6)]
    for s in seqs:
        assert manager.allocate(s)
    for _ in range(40):
        for s in seqs:
            s.token_ids.append(7)
            assert manager.ensure_capacity(s, len(s))
    for s in seqs:
        table = s.block_table
        assert len(table) == 13
        assert table == list(range(table[0], table[0] + len(table)))


def test_a_sequence_without_room_continues_in_a_new_run():
    manager = BlockManager(num_blocks=10, block_size=2)
    manager.watermark_blocks = 0
    first = seq([1, 2, 3], max_tokens=1)  # 2 blocks, room for none beyond
    second = seq([4, 5, 6], max_tokens=1)
    assert manager.allocate(first) and manager.allocate(second)
    assert first.block_table == [0, 1]
    first.token_ids += [7, 8]  # past its own limit: still served
    assert manager.ensure_capacity(first, len(first))
    assert len(set(first.block_table) | set(second.block_table)) == 5


def test_room_is_capped_for_requests_that_may_run_to_the_context():
    manager = BlockManager(num_blocks=1000, block_size=16)
    assert manager._room(seq([1] * 20, max_tokens=10_000), 20) == MAX_ROOM_BLOCKS
    assert manager._room(seq([1] * 20, max_tokens=30), 20) == 2  # 50 tokens: 4 blocks, 2 held


def test_random_traffic_keeps_the_books():
    """Admissions (some sharing prefixes), growth, preemption-like frees and finishes in
    random order: reference counts, the available maps and the hash index stay
    consistent, and every block ends up available again."""
    rng = random.Random(3)
    manager = BlockManager(num_blocks=64, block_size=4)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    for _ in range(600):
        action = rng.random()
        if action < 0.3:
            suffix = [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            tokens = rng.choice(prefixes) + suffix
            s = seq(tokens, max_tokens=rng.randrange(1, 40))
            if manager.allocate(s):
                computed(manager, s)
                live.append(s)
        elif action < 0.85 and live:
            s = rng.choice(live)
            s.token_ids.append(rng.randrange(1000))
            if manager.ensure_capacity(s, len(s)):
                computed(manager, s)
            else:
                manager.free(s)
                live.remove(s)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            manager.free(s)
        holders: dict[int, int] = {}
        for s in live:
            assert len(s.block_table) == manager.blocks_needed(s.num_computed_tokens)
            for block in s.block_table:
                holders[block] = holders.get(block, 0) + 1
        for block in range(manager.num_blocks):
            assert manager.ref_counts[block] == holders.get(block, 0)
            assert manager.available[block] == (block not in holders)
            named = manager.block_hashes[block] != -1
            assert manager.uncached[block] == (block not in holders and not named)
            assert (block in manager.evictable) == (block not in holders and named)
        assert manager.num_free_blocks == manager.num_blocks - len(holders)
        for block_hash, block in manager.hash_to_block.items():
            assert manager.block_hashes[block] == block_hash
    for s in live:
        manager.free(s)
    assert manager.num_free_blocks == manager.num_blocks


def test_ensure_capacity_refuses_when_full():
    manager = BlockManager(num_blocks=3, block_size=2)
    manager.watermark_blocks = 0
    a = seq([1, 2, 3])
    assert manager.allocate(a)
    assert manager.ensure_capacity(a, 6)
    assert not manager.ensure_capacity(a, 7)
    assert len(a.block_table) == 3
