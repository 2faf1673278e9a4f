"""Whole steps on CUDA with the Triton attention, prefill chunks included, replayed from
CUDA graphs by token count.

The decode graphs (engine/cuda_graphs.py) take decode-only steps of up to 64 rows. A
serving engine with hundreds of requests in flight admits new ones at almost every step,
so most of its steps mix decode rows with a prefill chunk, and those ran op by op: a few
hundred kernel launches from Python per step, whatever the GPU's share.

With the Triton kernel (engine/models/paged_attention.py) a step's attention reads all it
needs through tensors: block tables, lengths, query starts and a tile table that may be
padded with sentinel tiles. So the whole forward pass has fixed shapes once the step is
padded to a bucket of tokens: every bucket is captured once and any step of up to that
many tokens replays it. Padding tokens attend to nothing (no tile takes them, their rows
stay zero) and write their K/V to the cache's spare block (KVCache.spare_block).

The inputs of a step are laid out in one int64 buffer (StepLayout), built on the host with
numpy and copied to the device in one copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.cuda_graphs import capture_after_warm_up
from engine.models.llama import AttentionMetadata, KVCache, LlamaModel
from engine.models.paged_attention import PagedAttentionMetadata, tokens_per_tile
from engine.sequence import SamplingParams, Sequence

logger = logging.getLogger(__name__)

MIN_TOKENS = 8  # the smallest bucket


def token_buckets(max_tokens: int) -> list[int]:
    """8, 16, 24, 32, then four steps per power of two (40, 48, 56, 64, 80, ...), up to
    and including max_tokens: a step pads by under a quarter above 32 tokens."""
    buckets = [8, 16, 24, 32]
    power = 32
    while buckets[-1] < max_tokens:
        buckets += [power + power * step // 4 for step in range(1, 5)]
        power *= 2
    return [b for b in buckets if b < max_tokens] + [max(max_tokens, MIN_TOKENS)]


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Where each input of a step of `tokens` tokens sits in the buffer (int64)."""

    tokens: int
    seqs: int  # sequence slots: the step's, then the padding sequence
    width: int  # block table columns
    tiles: int
    logits: int  # rows projected to the vocabulary
    block_q: int  # query tokens per attention tile

    @property
    def sections(self) -> tuple[int, ...]:
        t, s = self.tokens, self.seqs
        return (t, t, t, self.logits, s * self.width, s, s + 1, self.tiles, self.tiles)

    @property
    def size(self) -> int:
        return sum(self.sections)

    def views(self, buffer: torch.Tensor | np.ndarray) -> list[Any]:
        out, start = [], 0
        for length in self.sections:
            out.append(buffer[start : start + length])
            start += length
        return out


class StepInputs:
    """Builds a step's buffer from its sequences, on the host."""

    def __init__(self, block_size: int, spare_block: int, width: int, group: int, max_seqs: int):
        self.block_size = block_size
        self.spare_block = spare_block
        self.width = width
        self.group = group
        self.max_seqs = max_seqs

    def layout(self, tokens: int, block_q: int) -> StepLayout:
        seqs = min(tokens, self.max_seqs)
        # each sequence's tiles: ceil(query_len / block_q) <= query_len / block_q + 1
        tiles = -(-tokens // block_q) + seqs
        return StepLayout(tokens, seqs, self.width, tiles, seqs, block_q)

    def build(
        self, layout: StepLayout, seqs: list[Sequence], counts: list[int]
    ) -> tuple[np.ndarray, list[Sequence]]:
        """The buffer (int64, layout.size) and the sequences that sample, in logits order:
        those whose last token this step computes. No drafts: the decode graphs take them.

        Padding tokens belong to no sequence and no tile: position 0, each writing its K/V
        to a slot of the spare block; their attention rows stay zero (padded metadata)."""
        size = self.block_size
        n = len(seqs)
        real = sum(counts)
        if n > layout.seqs or real > layout.tokens:
            raise ValueError(f"{n} sequences of {real} tokens do not fit {layout}")
        buffer = np.zeros(layout.size, dtype=np.int64)
        ids, positions, slots, logits, table, seq_lens, starts, tile_seqs, tile_starts = (
            layout.views(buffer)
        )
        table = table.reshape(layout.seqs, layout.width)
        counts_np = np.asarray(counts, dtype=np.int64)
        done = np.fromiter((seq.num_computed_tokens for seq in seqs), np.int64, n)
        starts[1 : n + 1] = np.cumsum(counts_np)
        starts[n + 1 :] = real  # empty slots
        seq_lens[:n] = done + counts_np
        # per sequence, then flat: its tokens and its table's blocks up to the step's end
        tokens: list[int] = []
        blocks: list[int] = []
        widths = (seq_lens[:n] + size - 1) // size
        for seq, count, first, width in zip(
            seqs, counts, done.tolist(), widths.tolist(), strict=True
        ):
            tokens += seq.tokens_at(first, count)
            blocks += seq.block_table[:width]
        table_rows = np.repeat(np.arange(n), widths)
        first_block = np.cumsum(widths) - widths
        table[table_rows, np.arange(len(blocks)) - first_block[table_rows]] = blocks
        lengths = np.fromiter((len(seq) for seq in seqs), np.int64, n)
        samples = np.flatnonzero(seq_lens[:n] == lengths)  # the last token computed now
        sampling = [seqs[index] for index in samples.tolist()]
        ids[:real] = tokens
        owner = np.repeat(np.arange(n), counts_np)  # each token's sequence
        position = np.arange(real) - starts[owner] + done[owner]
        positions[:real] = position
        slots[:real] = table[owner, position // size] * size + position % size
        slots[real:] = self.spare_block * size + np.arange(layout.tokens - real) % size
        logits[: len(samples)] = starts[samples + 1] - 1
        per_seq = -(-counts_np // layout.block_q)
        tile_owner = np.repeat(np.arange(n), per_seq)
        used = len(tile_owner)
        first_tile = np.cumsum(per_seq) - per_seq
        tile_seqs[:used] = tile_owner
        tile_seqs[used:] = -1
        tile_starts[:used] = (
            starts[tile_owner] + (np.arange(used) - first_tile[tile_owner]) * layout.block_q
        )
        return buffer, sampling


class StepGraphs:
    """Captures the forward pass of every token bucket, then replays steps in them."""

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        block_size: int,
        max_blocks: int,
        max_tokens: int,
        max_seqs: int,
    ):
        assert cache.spare_block is not None, "the cache needs a spare block for padding"
        self.model = model
        self.cache = cache
        group = model.config.num_heads // model.config.num_kv_heads
        self.inputs = StepInputs(block_size, cache.spare_block, max_blocks, group, max_seqs)
        self.group = group
        self.buckets = token_buckets(max_tokens)
        # Tiles of the Triton kernel's long queries for every bucket; where every sequence
        # has a token or a few (decode rows), short tiles as well, as an eager step would
        # take, for the buckets a decode-only step fills (up to max_seqs tokens).
        long_q = tokens_per_tile(group, max_tokens)
        self.short_q = tokens_per_tile(group, 1)
        keys = [(tokens, long_q) for tokens in self.buckets]
        if self.short_q != long_q:
            decode = next((b for b in self.buckets if b >= max_seqs), self.buckets[-1])
            keys += [(tokens, self.short_q) for tokens in self.buckets if tokens <= decode]
        self.layouts = {key: self.inputs.layout(*key) for key in keys}
        self.long_q = long_q
        device = cache.kv.device
        largest = max(layout.size for layout in self.layouts.values())
        self.static = torch.zeros(largest, dtype=torch.int64, device=device)
        # the host side of the one copy per step: pinned, so that the copy is a DMA
        self.host = torch.zeros(largest, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None

    def layout_for(self, counts: list[int]) -> StepLayout:
        """The smallest bucket that holds the step, in short tiles where its queries are."""
        tokens = sum(counts)
        bucket = next(size for size in self.buckets if tokens <= size)
        short = (bucket, self.short_q)
        if short in self.layouts and tokens_per_tile(self.group, max(counts)) == self.short_q:
            return self.layouts[short]
        return self.layouts[(bucket, self.long_q)]

    def takes(self, seqs: list[Sequence], counts: list[int]) -> bool:
        tokens = sum(counts)
        return (
            0 < tokens <= self.buckets[-1]
            and len(seqs) <= self.inputs.max_seqs
            and not any(seq.draft_token_ids for seq in seqs)
        )

    def _forward(self, layout: StepLayout) -> Any:
        ids, positions, slots, logits, table, seq_lens, starts, tile_seqs, tile_starts = (
            layout.views(self.static)
        )
        paged = PagedAttentionMetadata(
            table.view(layout.seqs, layout.width),
            seq_lens,
            starts,
            tile_seqs,
            tile_starts,
            layout.block_q,
            padded=True,
        )
        meta = AttentionMetadata(slot_mapping=slots, paged=paged)
        return lambda: self.model(ids, positions, meta, self.cache, logits).logits

    def _load(self, buffer: np.ndarray, wait: bool = False) -> None:
        """Into the static buffer, asynchronously: the step's sampling waits for the device
        before the next step writes the pinned buffer again."""
        host = self.host[: len(buffer)]
        host.numpy()[:] = buffer
        self.static[: len(buffer)].copy_(host, non_blocking=not wait)

    def probe(self, layout: StepLayout) -> np.ndarray:
        """A buffer of one short prompt in the spare block, padded to the layout: inputs
        for capture that run every kernel (attention tiles included) and write nowhere
        but the spare block."""
        count = min(layout.tokens, self.inputs.block_size)
        seq = Sequence(token_ids=list(range(1, count + 1)), params=SamplingParams())
        seq.block_table = [self.inputs.spare_block]
        return self.inputs.build(layout, [seq], [count])[0]

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """Every bucket, the largest first, into one memory pool (shared with the decode
        graphs where given), each after a run outside the capture (Triton compiles then).
        Each graph's replay must give its eager run's logits, else RuntimeError."""
        started = time.monotonic()
        self.pool = pool
        stream = torch.cuda.Stream()
        for key, layout in sorted(self.layouts.items(), reverse=True):
            self._load(self.probe(layout), wait=True)
            graph, logits, warm = capture_after_warm_up(self._forward(layout), stream, self.pool)
            self.pool = graph.pool()
            expected = warm[:1].clone()
            del warm
            graph.replay()
            if not torch.allclose(logits[:1], expected, rtol=1e-3, atol=1e-3):
                difference = (logits[:1] - expected).abs().max().item()
                raise RuntimeError(f"the step graph {key} replays {difference:g} off its eager run")
            self.graphs[key] = (graph, logits)
        torch.cuda.synchronize()
        logger.info(
            "captured %d step graphs (tokens %s) in %.1fs",
            len(self.graphs), self.buckets, time.monotonic() - started,
        )  # fmt: skip

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], counts: list[int]) -> tuple[torch.Tensor, list[Sequence]]:
        """fp32 logits of the sequences that sample (one row each, in the returned order)."""
        layout = self.layout_for(counts)
        buffer, sampling = self.inputs.build(layout, seqs, counts)
        self._load(buffer)
        captured = self.graphs.get((layout.tokens, layout.block_q))
        if captured is None:  # not captured (on CPU, in tests): the same step, op by op
            return self._forward(layout)()[: len(sampling)], sampling
        graph, logits = captured
        graph.replay()
        return logits[: len(sampling)].clone(), sampling  # the next replay overwrites it
