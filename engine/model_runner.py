"""Owns the model and the KV cache tensors; turns a scheduled batch into one forward pass."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.config import LlamaConfig
from engine.cuda_graphs import GRAPH_ROWS, DecodeGraphs
from engine.models.layers import SMALL_BATCH_ROWS
from engine.models.llama import (
    AttentionMetadata,
    DecodeGroup,
    DecodeTable,
    KVCache,
    LlamaModel,
    PrefillChunk,
    StepLogits,
)
from engine.models.paged_attention import build_metadata, tokens_per_tile, triton_available
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.step_graphs import StepGraphs

MAX_DECODE_GROUPS = 4
MAX_DRAFT_ROWS = GRAPH_ROWS[-1]  # the largest decode graph's rows
GROUP_FILL = 0.7  # a row joins a decode group while it fills this much of its width
# Prefill attention on CUDA: not cuDNN's, which builds an execution plan for each new
# shape (on an H200 a first step of new prompt lengths took up to 0.96 s, and the serving
# workload's mixed steps 167 ms on average against 28 ms once shapes repeat)
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

logger = logging.getLogger(__name__)


def attention_backend_for(
    setting: str,
    device: torch.device,
    check: Callable[[], str | None] | None = None,
) -> str:
    """ "triton" or "torch" for the engine setting attention_backend (engine.config) on
    `device`: auto takes the Triton kernel on CUDA where Triton imports and `check` (the
    kernel run on the model's shape, paged_attention.self_check) passes; an explicit
    "triton" where it cannot run is an error (tests force it on CPU through
    ModelRunner.set_attention_backend, in Triton's interpreter)."""
    if setting == "torch":
        return "torch"
    reason = "needs CUDA" if device.type != "cuda" else triton_available()
    if reason is None and check is not None:
        reason = check()
    if reason is None:
        return "triton"
    if setting == "triton":
        raise ValueError(f"attention_backend triton: {reason}")
    if device.type == "cuda":
        logger.warning("attention in PyTorch ops: %s", reason)
    return "torch"


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        config: LlamaConfig,
        num_blocks: int,
        block_size: int,
        cache_dtype: torch.dtype,
        device: torch.device,
        graph_blocks: int = 0,
        attention_backend: str = "torch",
        max_step_tokens: int = 0,
        max_step_seqs: int = 0,
    ):
        """graph_blocks: on CUDA, replay decode-only steps from CUDA graphs for block tables
        of up to this many blocks (engine/cuda_graphs.py; 0: every step runs eagerly).
        attention_backend: "triton" (engine/models/paged_attention.py) or "torch".
        max_step_tokens, max_step_seqs: the scheduler's bounds of a step; with graphs and
        the Triton attention, every other step replays a step graph of its token count
        (engine/step_graphs.py)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        # the spare block the graphs' padding rows write to, on every device (one block)
        self.cache = KVCache(config, num_blocks, block_size, cache_dtype, device, graph_blocks > 0)
        self.compute_dtype = model.compute_dtype
        graphs = graph_blocks > 0 and device.type == "cuda"
        self.graphs = DecodeGraphs(model, self.cache, block_size, graph_blocks) if graphs else None
        self.graphs_ready = False  # set once capture_graphs succeeded
        step_graphs = graphs and attention_backend == "triton" and max_step_tokens > 0
        self.step_graphs = (
            StepGraphs(model, self.cache, block_size, graph_blocks, max_step_tokens, max_step_seqs)
            if step_graphs
            else None
        )
        self.step_graphs_ready = False
        # the way the last step ran: "step_kernel", "graph", "step_graph", "decode"
        # (decode-only, op by op) or "mixed" (with prefill tokens); the engine times each
        # way (stats)
        self.last_path = ""
        self.last_decode_only = False  # whether the last step was decode-only (drafts aside)
        # plane * blocks: the first row of each K/V head plane in the flat cache view
        planes = torch.arange(2 * config.num_kv_heads, device=device)
        self.plane_offsets = planes * self.cache.kv.shape[2]
        self.key_offsets = self.plane_offsets[: config.num_kv_heads]
        self.value_offsets = self.plane_offsets[config.num_kv_heads :] * block_size
        self.slot_in_block = torch.arange(block_size, device=device)
        # The attention's layout for PyTorch ops. On CUDA, prefill chunks after cached
        # context cut their keys at the chunk's end under a lower-right causal bias (flash
        # attention takes it; no mask is built), and decode groups gather V as they gather K
        # (embedding_bag took 52 us a call on an H200). The CPU keeps the masks and
        # embedding_bag. Both give the same attention (tests/engine/test_attention_layouts.py).
        self.gpu_layout = device.type == "cuda"
        self.paged = False  # every token through the Triton kernel (set_attention_backend)
        self.set_attention_backend(attention_backend)

    def set_attention_backend(self, backend: str) -> None:
        """ "triton": every step's attention, graphs' too, in the Triton paged attention
        kernel (on CPU through Triton's interpreter: tests only); "torch": PyTorch ops and
        the CPU kernels."""
        if backend not in ("triton", "torch"):
            raise ValueError(f"attention backend must be triton or torch, got {backend!r}")
        self.paged = self.model.paged_attention = backend == "triton"
        self.attention_backend = backend

    def gather_ids(self, block_ids: list[int]) -> torch.Tensor:
        """Rows of the flat [planes * num_blocks, block] cache view for gather_blocks."""
        blocks = torch.tensor(block_ids, device=self.device)
        return (self.plane_offsets[:, None] + blocks[None, :]).view(-1)

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Sequence] = []
        prefills: list[PrefillChunk] = []
        pairs = list(zip(batch.seqs, batch.num_new_tokens, strict=True))
        # Single-token rows (decodes, or a chunk of one prompt token) longest first, so that
        # decode groups of similar lengths pad little; then decodes with drafts; then chunks.
        singles = sorted(
            (pair for pair in pairs if pair[1] == 1),
            key=lambda pair: pair[0].num_computed_tokens,
            reverse=True,
        )
        drafted = [pair for pair in pairs if pair[1] > 1 and pair[0].draft_token_ids]
        chunks = [pair for pair in pairs if pair[1] > 1 and not pair[0].draft_token_ids]
        ordered = singles + drafted + chunks
        seqs = [seq for seq, _ in ordered]
        counts = [count for _, count in ordered]
        num_decode = len(singles)
        use_kernel = self.uses_decode_kernel and not self.paged  # decode rows: the C kernel
        kernel_prefill = use_kernel and self.model.kernel_prefill  # and the prefill chunks
        # With the kernel, drafts attend through it as decode rows do, token by token: an
        # SDPA chunk rounds differently (q in fp32), and verification must see the logits
        # plain decoding would.
        num_rows = num_decode + len(drafted) if use_kernel else num_decode
        # the Triton kernel's per-sequence lists: every token of the step, in this order
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        for index, (seq, count) in enumerate(ordered):
            start = len(input_ids)
            done = seq.num_computed_tokens
            table = seq.block_table
            input_ids.extend(seq.tokens_at(done, count))
            positions.extend(range(done, done + count))
            slot_mapping.extend(
                table[p // size] * size + p % size for p in range(done, done + count)
            )
            drafts = len(seq.draft_token_ids)
            if done + count == len(seq) + drafts:
                # logits at the last token and at each draft (speculative decoding)
                logits_indices.extend(range(start + count - 1 - drafts, start + count))
                sampling.append(seq)
            if self.paged:
                tables.append(table[: -(-(done + count) // size)])
                seq_lens.append(done + count)
            elif index >= num_rows and not kernel_prefill:
                gather_ids = mask = None
                if done:
                    blocks = -(-(done + count) // size)
                    gather_ids = self.gather_ids(table[:blocks])
                    if not self.gpu_layout:  # else a lower-right causal bias
                        query_positions = torch.arange(done, done + count, device=self.device)
                        key_positions = torch.arange(blocks * size, device=self.device)
                        mask = key_positions[None, :] <= query_positions[:, None]
                prefills.append(PrefillChunk(start, count, done, gather_ids, mask))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, device=self.device), prefills=prefills
        )
        meta.num_decode = num_decode
        if self.paged:
            group = self.config.num_heads // self.config.num_kv_heads
            meta.paged = build_metadata(
                tables,
                seq_lens,
                counts,
                tokens_per_tile(group, max(counts)),
                self.device,
            )
        elif kernel_prefill:
            meta.decode_table = self._attention_table(seqs, counts, num_decode)
        elif use_kernel and num_rows:
            meta.decode_table = self._attention_table(
                seqs[:num_rows], counts[:num_rows], num_decode
            )
        elif num_decode:
            meta.decode_groups = self._decode_groups(seqs[:num_decode])
        return (
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            torch.tensor(logits_indices, device=self.device, dtype=torch.long),
            sampling,
        )

    @property
    def uses_decode_kernel(self) -> bool:
        return self.model.decode_kernel is not None and self.cache.kv.dtype == torch.bfloat16

    def _attention_table(
        self, seqs: list[Sequence], counts: list[int], num_decode: int
    ) -> DecodeTable:
        """Every token's row for the attention kernel: its sequence's blocks and its length
        (the keys up to its own position). A decode row attends to its whole sequence (the
        rows come longest first: the kernel hands them out in order); the i-th token of a
        prefill chunk after `context` cached tokens to context + i + 1 keys, which makes
        the chunk causal with no mask, and reads its context from the cache, no gather."""
        size = self.block_size
        ends = [seq.num_computed_tokens + count for seq, count in zip(seqs, counts, strict=True)]
        width = max(-(-end // size) for end in ends)

        def row(seq: Sequence, end: int) -> list[int]:
            blocks = -(-end // size)
            return seq.block_table[:blocks] + [0] * (width - blocks)

        decode = [row(seq, end) for seq, end in zip(seqs[:num_decode], ends, strict=False)]
        tables = [torch.tensor(decode, dtype=torch.int32, device=self.device).view(-1, width)]
        lengths = [torch.tensor(ends[:num_decode], dtype=torch.int32, device=self.device)]
        for seq, count, end in zip(
            seqs[num_decode:], counts[num_decode:], ends[num_decode:], strict=True
        ):
            table = torch.tensor(row(seq, end), dtype=torch.int32, device=self.device)
            tables.append(table.expand(count, width))
            lengths.append(
                torch.arange(end - count + 1, end + 1, dtype=torch.int32, device=self.device)
            )
        return DecodeTable(torch.cat(tables), torch.cat(lengths))

    def _decode_groups(self, seqs: list[Sequence]) -> list[DecodeGroup]:
        """Split single-token rows (longest first) into groups padded to their own longest.

        The decode attention gathers every row's blocks padded to the group's widest, so
        a group ends where a row needs under GROUP_FILL of the group's width; each group
        costs a few more operations per layer, hence at most MAX_DECODE_GROUPS.
        """
        size = self.block_size
        # each row's keys end at its own token: a decode's last, or a prompt's one-token chunk
        ends = [seq.num_computed_tokens + 1 for seq in seqs]
        widths = [-(-end // size) for end in ends]  # blocks, with the token computed now
        groups: list[DecodeGroup] = []
        start = 0
        while start < len(seqs):
            width = widths[start]
            end = start + 1
            last_group = len(groups) == MAX_DECODE_GROUPS - 1
            while end < len(seqs) and (last_group or widths[end] >= GROUP_FILL * width):
                end += 1
            block_ids: list[int] = []
            for seq in seqs[start:end]:
                row = seq.block_table[:width]
                block_ids.extend(row)
                block_ids.extend([0] * (width - len(row)))  # padding, masked out below
            lengths = torch.tensor(ends[start:end], device=self.device)
            key_positions = torch.arange(width * size, device=self.device)
            padding = key_positions[None, :] >= lengths[:, None]
            bias = torch.zeros(padding.shape, dtype=self.compute_dtype, device=self.device)
            bias.masked_fill_(padding, float("-inf"))
            kv_heads = self.config.num_kv_heads
            group = self.config.num_heads // kv_heads
            blocks = torch.tensor(block_ids, device=self.device).view(end - start, width)
            value_slots = None  # the GPU layout gathers V as K
            if not self.gpu_layout:
                # every key slot of every row: [rows, width * block_size]
                slots = (blocks[:, :, None] * size + self.slot_in_block).view(end - start, -1)
                # rows of the flat [planes * num_blocks * block_size, dim] view holding V,
                # one bag per (kv head, row, query head of the group): [kvh * rows * group, keys]
                value_slots = self.value_offsets[:, None, None, None] + slots[None, :, None, :]
                value_slots = value_slots.expand(-1, -1, group, -1).reshape(-1, width * size)
            groups.append(
                DecodeGroup(
                    start,
                    end,
                    (self.key_offsets[:, None] + blocks.view(1, -1)).view(-1),
                    value_slots,
                    # one row per (kv head, sequence), the decode attention's batch layout
                    bias.repeat(kv_heads, 1)[:, None, :],
                )
            )
            start = end
        return groups

    def capture_graphs(self) -> str | None:
        """Capture the decode graphs; None, or why every step stays eager."""
        if self.graphs is None:
            return "no graphs (not CUDA, or --enforce-eager)"
        try:
            self.graphs.capture()
        except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
            self.graphs = self.step_graphs = None
            return f"decode graphs not captured, every step runs eagerly: {error}"
        self.graphs_ready = True
        if self.step_graphs is not None:
            try:
                self.step_graphs.capture(self.graphs.pool)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
                self.step_graphs = None
                return f"step graphs not captured, steps with prefill run eagerly: {error}"
            self.step_graphs_ready = True
        return None

    @staticmethod
    def decode_only(batch: ScheduledBatch) -> bool:
        """Each sequence its last token, which samples (a decode, or a prompt's last token),
        and its drafts if it has any."""
        return all(
            seq.num_computed_tokens + 1 == len(seq) and count == 1 + len(seq.draft_token_ids)
            for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )

    @property
    def max_decode_rows(self) -> int:
        """The most rows a decode-only step runs in its fastest way (the step kernel), or 0
        where there is no such bound."""
        if self.model.step_kernel is not None and self.cache.kv.dtype == torch.bfloat16:
            return self.model.step_max_rows
        return 0

    @property
    def max_draft_rows(self) -> int:
        """The most rows a decode step with drafts may have: greedy verification keeps plain
        decoding's tokens only where each row computes as it would in a step of its own. The
        step kernel does on vectors, where it keeps drafted steps of up to its vector_rows
        (tiles, which take other steps of 5 rows and more on AMX, sum in another order);
        fp32 compute on bf16 or int8 weights rounds steps of up to
        SMALL_BATCH_ROWS rows to bf16 and keeps more in fp32, so drafts stay within those
        few rows there."""
        kernel = self.model.step_kernel
        if self.max_decode_rows and kernel is not None:
            return kernel.vector_rows
        model = self.model
        if model.compute_dtype == torch.float32 and model.storage != "float32":
            return SMALL_BATCH_ROWS
        return MAX_DRAFT_ROWS

    def takes_step_kernel(self, batch: ScheduledBatch) -> bool:
        """Whether a decode-only step is the step kernel's: few enough rows."""
        return 0 < batch.num_tokens <= self.max_decode_rows

    def decode_step(self, seqs: list[Sequence]) -> StepLogits:
        """A decode-only step in the step kernel, from the little it reads: each row's last
        token, its blocks and its length (the rows longest first, as _attention_table).

        A sequence's drafts are rows of their own at the next positions of its block table:
        the kernel writes every row's K/V before any row attends, so the row at length
        L + i sees the last token and the drafts before it, as a causal chunk would."""
        size = self.block_size
        ends = [len(seq) + len(seq.draft_token_ids) for seq in seqs]
        width = -(-max(ends) // size)
        token_ids: list[int] = []
        lengths: list[int] = []
        table: list[int] = []
        for seq, end in zip(seqs, ends, strict=True):
            blocks = -(-end // size)
            row = seq.block_table[:blocks] + [0] * (width - blocks)
            if seq.draft_token_ids:
                token_ids += [seq.token_ids[-1], *seq.draft_token_ids]
                lengths += range(len(seq), end + 1)
                table += row * (end + 1 - len(seq))
            else:
                token_ids.append(seq.token_ids[-1])
                lengths.append(end)
                table += row
        kernel = self.model.step_kernel
        assert kernel is not None
        drafted = len(token_ids) > len(seqs)
        return StepLogits(
            *kernel(token_ids, self.cache.kv, table, lengths, greedy=True, same_as_alone=drafted)
        )

    def run(self, batch: ScheduledBatch) -> tuple[StepLogits, list[Sequence]]:
        """Logits [rows, vocab] fp32 (and, from the step kernel, their greedy tokens) for
        the sequences whose last token was computed: one row each, at their last token,
        followed by one at each of their drafts."""
        decode_only = self.last_decode_only = self.decode_only(batch)
        if decode_only and self.takes_step_kernel(batch):  # no tensor op to record
            self.last_path = "step_kernel"
            seqs = sorted(batch.seqs, key=len, reverse=True)
            return self.decode_step(seqs), seqs
        graphs = self.graphs if self.graphs_ready else None
        if graphs is not None and decode_only and graphs.takes(batch.seqs):
            self.last_path = "graph"  # drafts as rows of their own, as in the step kernel
            seqs = list(batch.seqs)
            return StepLogits(graphs.run(seqs), None), seqs
        steps = self.step_graphs if self.step_graphs_ready and self.paged else None
        if steps is not None and steps.takes(batch.seqs, batch.num_new_tokens):
            self.last_path = "step_graph"
            logits, sampling = steps.run(batch.seqs, batch.num_new_tokens)
            return StepLogits(logits, None), sampling
        # elsewhere drafts run as a chunk after their sequence's context
        drafted = batch.num_tokens > len(batch.seqs)
        self.last_path = "decode" if decode_only and not drafted else "mixed"
        return self._run_layers(batch)

    @torch.inference_mode()
    def _run_layers(self, batch: ScheduledBatch) -> tuple[StepLogits, list[Sequence]]:
        input_ids, positions, meta, logits_indices, sampling = self.prepare(batch)
        cuda = self.device.type == "cuda"
        with sdpa_kernel(CUDA_ATTENTION) if cuda else contextlib.nullcontext():
            return self.model(input_ids, positions, meta, self.cache, logits_indices), sampling
