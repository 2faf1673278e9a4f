"""Decode-only steps on CUDA, replayed from CUDA graphs.

A decode step of SmolLM2 launches several hundred small kernels; issued one by one from Python
they took 15.6 ms per step on an H200 whose weights would read in 0.075 ms, replayed
from a graph 1.96 ms (docs/engine.md).
As vLLM does (its CUDA graph runner), a decode-only step is captured once per shape and
replayed: the step's inputs are copied into one static buffer, the graph reruns every
kernel on it, and the logits come out in a static tensor.

Shapes are bucketed so that few graphs serve every step: the rows up to the next of
GRAPH_ROWS, the block table's width up to the next power of two (at most the blocks
of max_model_len). Padding rows write their K and V into a spare block past those the
block manager hands out (KVCache.spare_block) and attend to it alone; padding columns
of a table point there too and are masked by the row's length.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.models.llama import KVCache, LlamaModel
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

GRAPH_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def table_widths(max_blocks: int) -> list[int]:
    """Powers of two up to the widest table, and that width itself."""
    widths = [1]
    while widths[-1] < max_blocks:
        widths.append(min(2 * widths[-1], max_blocks))
    return widths


def capture_after_warm_up(
    step: Callable[[], torch.Tensor], stream: torch.cuda.Stream, pool: Any
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """Run `step` once on a side stream (kernels chosen, Triton compiled and workspaces
    made outside the capture), then capture it into the memory pool `pool` (None: a new
    one): the graph, its static output and the warm run's output."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output, warm


class DecodeInputs:
    """The step's inputs as decode_padded reads them, [rows, 4 + width] int64 (LlamaModel),
    built on the host in one tensor and copied to the static buffer in one copy."""

    def __init__(self, block_size: int, spare_block: int):
        self.block_size = block_size
        self.spare_block = spare_block

    def pad_row(self, width: int) -> list[int]:
        slot = self.spare_block * self.block_size
        return [0, 0, slot, 1] + [self.spare_block] * width

    def rows(self, seq: Sequence, width: int) -> list[list[int]]:
        """The sequence's last token, then each of its drafts (engine/speculative.py), one
        row each at the next position with the same block table: every row's K/V is
        written before any row attends, so the rows form a causal chunk."""
        size = self.block_size
        table = seq.block_table
        end = len(seq) + len(seq.draft_token_ids)
        blocks = -(-end // size)
        columns = [*table[:blocks], *[self.spare_block] * (width - blocks)]
        rows = []
        for position, token in enumerate(
            [seq.token_ids[-1], *seq.draft_token_ids], start=len(seq) - 1
        ):
            slot = table[position // size] * size + position % size
            rows.append([token, position, slot, position + 1, *columns])
        return rows

    def build(self, seqs: list[Sequence], rows: int, width: int) -> torch.Tensor:
        table = [row for seq in seqs for row in self.rows(seq, width)]
        table += [self.pad_row(width)] * (rows - len(table))
        return torch.tensor(table, dtype=torch.int64)


class DecodeGraphs:
    """Captures decode_padded for every bucket of rows and widths, then replays them."""

    def __init__(self, model: LlamaModel, cache: KVCache, block_size: int, max_blocks: int):
        assert cache.spare_block is not None, "the cache needs a spare block for padding"
        self.model = model
        self.cache = cache
        self.inputs = DecodeInputs(block_size, cache.spare_block)
        self.rows = list(GRAPH_ROWS)
        self.widths = table_widths(max_blocks)
        device = cache.kv.device
        self.static = torch.zeros(
            (self.rows[-1], 4 + self.widths[-1]), dtype=torch.int64, device=device
        )
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs' shared memory pool, once the first is captured

    @property
    def max_rows(self) -> int:
        return self.rows[-1]

    def bucket(self, rows: int, width: int) -> tuple[int, int]:
        return (
            self.rows[bisect.bisect_left(self.rows, rows)],
            self.widths[bisect.bisect_left(self.widths, width)],
        )

    def _step(self, rows: int, width: int) -> Callable[[], torch.Tensor]:
        view = self.static[:rows, : 4 + width]
        return lambda: self.model.decode_padded(view, self.cache)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket, the most rows and widest first, into one memory pool (a smaller
        graph reuses what a larger one freed). The static buffer holds padding rows, so
        the warm-up runs write only to the spare block."""
        started = time.monotonic()
        pad = self.inputs.pad_row(self.widths[-1])
        self.static.copy_(torch.tensor([pad] * self.rows[-1], dtype=torch.int64))
        stream = torch.cuda.Stream()
        for rows in reversed(self.rows):
            for width in reversed(self.widths):
                graph, logits, _ = capture_after_warm_up(self._step(rows, width), stream, self.pool)
                self.pool = graph.pool()
                self.graphs[(rows, width)] = (graph, logits)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode graphs (rows %s, table widths %s) in %.1fs",
            len(self.graphs), self.rows, self.widths, time.monotonic() - started,
        )  # fmt: skip

    @staticmethod
    def count_rows(seqs: list[Sequence]) -> int:
        return sum(1 + len(seq.draft_token_ids) for seq in seqs)

    def takes(self, seqs: list[Sequence]) -> bool:
        return 0 < self.count_rows(seqs) <= self.max_rows

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """fp32 logits of one decode step of these sequences: a row at each one's last
        token, then one at each of its drafts."""
        size = self.inputs.block_size
        width = max(-(-(len(seq) + len(seq.draft_token_ids)) // size) for seq in seqs)
        count = self.count_rows(seqs)
        rows, width = self.bucket(count, width)
        self.static[:rows, : 4 + width].copy_(self.inputs.build(seqs, rows, width))
        captured = self.graphs.get((rows, width))
        if captured is None:  # not captured (on CPU, in tests): the same step, op by op
            return self._step(rows, width)()[:count]
        graph, logits = captured
        graph.replay()
        return logits[:count].clone()  # the next replay overwrites the static output
