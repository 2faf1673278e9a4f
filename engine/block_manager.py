"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, and a prefix cache.

The cache tensors live in the model runner; this class only decides which block
holds which tokens. A full block is named by hash((parent hash, its tokens)), so
equal prefixes map to equal chains and can be shared. Freed blocks that still
hold a named prefix stay findable until the allocator needs them.

Placement keeps each sequence's blocks adjacent where it can: the CPU attention
kernel reads a sequence's keys block after block, and the hardware prefetcher
streams adjacent blocks but not scattered ones (decode attention ran about 1.5x
as fast over adjacent blocks). A sequence's next block is the one after its last
when that one is free; otherwise a new run starts in the largest run of free
blocks, with room for what the sequence may still generate and half of the run's
slack left before it for the sequence whose blocks end there.

Cached blocks (free, still holding a named prefix) are evicted least recently
released first, one release at a time: the oldest block and the cached blocks
next to it that were released with it (a finished sequence's run) become free
together. Placement evicts when no free run has the room it wants, up to that many
blocks, and takes the largest free run it then has.
"""

from __future__ import annotations

import re
from collections import OrderedDict

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
        # 1 where no live sequence holds the block (free, or cached and evictable)
        self.available = bytearray(b"\x01") * num_blocks
        self.uncached = bytearray(b"\x01") * num_blocks  # free: available, no named prefix
        self.num_available = num_blocks
        # available blocks that still hold a named prefix, least recently released first
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.released_at = [0] * num_blocks  # the `free` call that released each block
        self.releases = 0
        # Reserve a few blocks so admitting a request does not force an immediate preemption.
        self.watermark_blocks = max(1, num_blocks // 100)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.num_available

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self, block: int) -> int:
        if block in self.evictable:
            del self.evictable[block]
            self._forget(block)
        self.available[block] = self.uncached[block] = 0
        self.num_available -= 1
        self.ref_counts[block] = 1
        return block

    def _run_start(self, room: int) -> int:
        """Where a new run of blocks begins that may grow to `room` blocks: in the largest
        run of free blocks, after evicting cached ones (up to `room`) while no run has the
        room; after half of the run's slack, so that the sequence ending just before it
        can grow as well. The caller has checked that a block is available."""
        start, length = _largest_run(self.uncached)
        evicted = 0
        while length < room and evicted < room and self.evictable:
            evicted += self._evict_oldest()
            start, length = _largest_run(self.uncached)
        if length == 0:
            raise RuntimeError("no free KV cache block: the caller must check availability")
        if start == 0:  # no sequence ends before it
            return 0
        return start + max(0, length - room) // 2

    def _evict_oldest(self) -> int:
        """Free the least recently released cached block and the cached blocks adjacent to
        it that the same `free` released; returns how many."""
        oldest, _ = self.evictable.popitem(last=False)
        release = self.released_at[oldest]
        first = last = oldest
        while first > 0 and self._evictable_from(first - 1, release):
            first -= 1
        while last + 1 < self.num_blocks and self._evictable_from(last + 1, release):
            last += 1
        for block in range(first, last + 1):
            self.evictable.pop(block, None)
            self._forget(block)
            self.uncached[block] = 1
        return last - first + 1

    def _evictable_from(self, block: int, release: int) -> bool:
        return block in self.evictable and self.released_at[block] == release

    def _extend(self, seq: Sequence, count: int, room: int) -> list[int]:
        """`count` available blocks continuing `seq`'s block table, adjacent where possible.
        The caller has checked that `count` blocks are available."""
        blocks: list[int] = []
        last = seq.block_table[-1] if seq.block_table else -1
        for index in range(count):
            block = last + 1
            if not (last >= 0 and block < self.num_blocks and self.uncached[block]):
                block = self._run_start(room - index)
            last = self._take(block)
            blocks.append(block)
        return blocks

    def _room(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` holds at its limit, beyond those holding `num_tokens` tokens."""
        limit = seq.num_prompt_tokens + seq.params.max_tokens
        room = self.blocks_needed(limit) - self.blocks_needed(num_tokens)
        return max(0, min(room, MAX_ROOM_BLOCKS))

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
        self.available[block] = 1
        self.num_available += 1
        self.released_at[block] = self.releases
        block_hash = self.block_hashes[block]
        if block_hash != -1 and self.hash_to_block.get(block_hash) == block:
            self.evictable[block] = None
        else:
            self._forget(block)
            self.uncached[block] = 1

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
                self.available[block] = 0
                self.num_available -= 1
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.block_table += self._extend(seq, num_new, num_new + self._room(seq, len(seq)))
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
        seq.block_table += self._extend(seq, missing, missing + self._room(seq, num_tokens))
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
        self.releases += 1
        for block in seq.block_table:
            self._release(block)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.last_block_hash = -1


# A sequence's blocks are placed with room for at most this many more: a chat request
# without max_tokens may run to the model's context, and runs of this length already
# read as one stream.
MAX_ROOM_BLOCKS = 32
_RUN = re.compile(rb"\x01+")


def _largest_run(flags: bytearray) -> tuple[int, int]:
    """(start, length) of the longest run of 1s; (0, 0) when there is none."""
    best = (0, 0)
    for run in _RUN.finditer(flags):
        if run.end() - run.start() > best[1]:
            best = (run.start(), run.end() - run.start())
    return best
