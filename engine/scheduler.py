"""Continuous batching: each step spends a token budget on running sequences, then new ones.

Running sequences come first (one token each when decoding, with its drafts if
speculative decoding gave it any, a chunk when still prefilling), then waiting ones are
admitted in arrival order while blocks, budget and the sequence limit allow. When a
running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """Single-token rows first (batched decode attention), then prefill chunks (and
    decoding sequences with drafts)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            count = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), budget)
            # drafts (speculative decoding) follow the last token; the budget may cut them
            del seq.draft_token_ids[max(0, count - seq.num_uncomputed_tokens) :]
            while not self.block_manager.ensure_capacity(seq, seq.num_computed_tokens + count):
                victim = self.running.pop()  # newest first: it has the least work to lose
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            chosen.append((seq, count))
            budget -= count
            index += 1
        # Admitting right after a preemption would only thrash; wait for blocks to free up.
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            count = min(seq.num_uncomputed_tokens, budget)
            chosen.append((seq, count))
            budget -= count
        chosen.sort(key=lambda item: item[1] != 1)  # stable: single-token rows first
        return ScheduledBatch(
            seqs=[seq for seq, _ in chosen],
            num_new_tokens=[count for _, count in chosen],
            num_preempted=preempted,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.draft_token_ids.clear()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
