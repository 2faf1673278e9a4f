"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, and a prefix cache.

The cache tensors live in the model runner; this class only decides which block
holds which tokens. A full block is named by hash((parent hash, its tokens)), so
equal prefixes map to equal chains and can be shared. Freed blocks that still
hold a named prefix stay findable until the allocator needs them (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes = [-1] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: deque[int] = deque(range(num_blocks))  # hold nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free, still cached; LRU first
        # Reserve a few blocks so admitting a request does not force an immediate preemption.
        self.watermark_blocks = max(1, num_blocks // 100)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash != -1 and self.hash_to_block.get(block_hash) == block:
            del self.hash_to_block[block_hash]
        self.block_hashes[block] = -1
        self.block_tokens[block] = None

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] > 0:
            return
        block_hash = self.block_hashes[block]
        if block_hash != -1 and self.hash_to_block.get(block_hash) == block:
            self.evictable[block] = None
        else:
            self._forget(block)
            self.free_blocks.append(block)

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """Blocks holding a prefix of `seq`, and the hash of the last one.

        Never the block holding the last token: that token must be computed to get logits.
        """
        hits: list[int] = []
        parent = -1
        if not self.enable_prefix_caching:
            return hits, parent
        size = self.block_size
        for index in range((len(seq) - 1) // size):
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            block_hash = hash((parent, tokens))
            block = self.hash_to_block.get(block_hash)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
            parent = block_hash
        return hits, parent

    def allocate(self, seq: Sequence) -> bool:
        """Blocks for all of a waiting sequence's tokens, sharing cached ones. False: no room."""
        hits, parent = self._cached_prefix(seq)
        num_new = self.blocks_needed(len(seq)) - len(hits)
        revived = sum(1 for block in hits if self.ref_counts[block] == 0)
        if self.num_free_blocks - revived - num_new < self.watermark_blocks:
            return False
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        seq.block_table = hits + [self._take_block() for _ in range(num_new)]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = parent
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq)
            self.prefix_cache_hits += seq.num_cached_tokens
        return True

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold `num_tokens` tokens. False: not enough free blocks."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if self.num_free_blocks < missing:
            return False
        seq.block_table.extend(self._take_block() for _ in range(missing))
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Name every block that became full and computed, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for index in range(seq.num_hashed_blocks, seq.num_computed_tokens // size):
            tokens = tuple(seq.token_ids[index * size : (index + 1) * size])
            block_hash = hash((seq.last_block_hash, tokens))
            block = seq.block_table[index]
            if self.block_hashes[block] == -1 and block_hash not in self.hash_to_block:
                self.block_hashes[block] = block_hash
                self.block_tokens[block] = tokens
                self.hash_to_block[block_hash] = block
            seq.last_block_hash = block_hash
            seq.num_hashed_blocks = index + 1

    def free(self, seq: Sequence) -> None:
        # Release the tail first so it is evicted before the more shareable head.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.last_block_hash = -1
