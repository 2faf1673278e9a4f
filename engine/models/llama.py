"""Llama-family decoder over a paged KV cache: RMSNorm, RoPE, grouped-query attention, SwiGLU.

All sequences of a step are flattened into one token axis so every matmul sees the
whole batch. Only attention is per sequence: on CUDA with Triton, every token of the
step is a query of one launch of the paged attention kernel (paged_attention.py); where
the fused bf16 CPU kernel
(decode_attention.c) is available, every decode row is one of its rows, with its own
blocks and length, and with bf16 compute so is every token of a prefill chunk (causal by
their lengths); else single-token rows (decodes) run in groups of similar length against
K gathered from the paged cache and V summed straight from it. Prefill chunks the kernel
does not take run one SDPA each.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from engine.config import LlamaConfig
from engine.models import decode_attention
from engine.models.layers import (
    Embedding,
    Linear,
    RMSNorm,
    apply_rotary,
    cpu_has_amx,
    rotary_tables,
)
from engine.models.paged_attention import PagedAttentionMetadata, paged_attention

MADV_HUGEPAGE = 14  # <sys/mman.h>


class StepLogits(NamedTuple):
    logits: torch.Tensor  # [sampled rows, vocab] fp32
    greedy: list[int] | None  # each row's first maximum, where the step kernel found it


@dataclass(slots=True)
class PrefillChunk:
    start: int  # offset of the chunk in the flattened token axis
    length: int  # query tokens in this chunk
    context: int  # tokens already in the cache before this chunk
    gather_ids: torch.Tensor | None  # blocks with context + chunk (gather_blocks); None: no context
    # [length, blocks * block_size] bool, on CPU when context > 0; on CUDA None: the keys
    # are cut at the chunk's end and a lower-right causal bias keeps flash attention
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """Single-token rows start:end, their blocks padded to the widest row of the group."""

    start: int
    end: int
    key_ids: torch.Tensor  # [kv_heads * rows * blocks]: K planes only, for gather_blocks
    # [kv_heads * rows * group, keys]: V rows of the flat slot view, for embedding_bag on
    # CPU; None on CUDA, where V is gathered like K
    value_slots: torch.Tensor | None
    bias: torch.Tensor  # [kv_heads * rows, 1, blocks * block_size]: 0, or -inf for padding


@dataclass(slots=True)
class DecodeTable:
    """Every token of the step as a row of the fused attention kernel (decode rows, then
    each prefill chunk's tokens): each row's own blocks and length, no padding read."""

    block_table: torch.Tensor  # [rows, widest row's blocks] int32, short rows padded with 0
    lengths: torch.Tensor  # [rows] int32: keys per row, the row's own token included


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] cache slot written by each token
    num_decode: int = 0  # the first num_decode tokens are single-token rows
    # the Triton kernel's metadata for every token of the step (and nothing else below)
    paged: PagedAttentionMetadata | None = None
    # with the fused kernel, a DecodeTable of every token (and no decode groups or
    # prefill chunks); else decode groups and prefill chunks for PyTorch ops
    decode_table: DecodeTable | None = None
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


HUGE_PAGE = 2 * 2**20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under a large CPU tensor (madvise
    MADV_HUGEPAGE on its 2 MiB-aligned interior), where THP is set to `madvise` or
    `always`; before the tensor is first written. Attention reads the KV cache in 2 KB
    blocks wherever the allocator put them, and with 4 KiB pages nearly every block costs
    a TLB miss: decode attention over scattered blocks ran about 28 % faster on huge pages
    (AMD EPYC, Zen 4). The packed matrices a decode step streams: see pack_all_rows."""
    if sys.platform != "linux":
        return False
    address = tensor.data_ptr()
    start = (address + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = address + tensor.numel() * tensor.element_size()
    length = (end - start) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(start, length, MADV_HUGEPAGE) == 0


def pack_all_rows(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """pack_rows of every weight, one after another in one CPU buffer that starts on a
    2 MiB boundary and asks for huge pages before it is written. A decode step streams
    them all once: alternated step by step against the same matrices packed one tensor
    each, decode steps took 0.94 of the time (AMD EPYC VM; one buffer on 4 KiB pages:
    0.97 to 0.99). A sum over a fresh 280 MB buffer read 30 % faster on huge pages while
    the VM's memory ran fast, 5 % while it ran slow."""
    shapes = [decode_attention.packed_shape(weight) for weight in weights]
    sizes = [math.prod(shape) for shape in shapes]
    slack = HUGE_PAGE // 2  # bf16 elements
    buffer = torch.empty(sum(sizes) + slack, dtype=torch.bfloat16)
    start = (-buffer.data_ptr() % HUGE_PAGE) // 2
    advise_huge_pages(buffer)
    packed = []
    for weight, shape, size in zip(weights, shapes, sizes, strict=True):
        view = buffer[start : start + size].view(shape)
        packed.append(decode_attention.pack_rows(weight, out=view))
        start += size
    return packed


class KVCache:
    """K and V blocks of every layer in one tensor: [layers, 2 * kv_heads, blocks, block_size, dim].

    K heads then V heads, outermost: one index_copy_ writes a step's K and V, and a
    gather of blocks (gather_blocks) yields [heads, rows, keys, dim], contiguous, which
    batched matmuls read as is; each block copies block_size * dim values at once.
    """

    def __init__(
        self,
        config: LlamaConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        spare_block: bool = False,
    ):
        # One block past those the block manager hands out, where the padding rows of a
        # CUDA graph's fixed-size step write (engine/cuda_graphs.py).
        self.spare_block = num_blocks if spare_block else None
        shape = (
            config.num_layers,
            2 * config.num_kv_heads,
            num_blocks + int(spare_block),
            block_size,
            config.head_dim,
        )
        self.kv = torch.empty(shape, dtype=dtype, device=device)
        # asked before the pages are touched
        self.huge_pages = device.type == "cpu" and advise_huge_pages(self.kv)
        # zeros, not garbage: padded decode rows read unused slots (scores masked to -inf,
        # probabilities 0), and NaN - inf or 0 * NaN would still be NaN.
        self.kv.zero_()

    @staticmethod
    def bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def gather_blocks(
    cache: torch.Tensor, gather_ids: torch.Tensor, rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """[planes, rows, keys, dim] from (planes of) a layer's cache [planes, blocks, size, dim].

    gather_ids holds plane * num_blocks + block for every plane and every block of every
    row. An embedding lookup on the flat [planes * blocks, size * dim] view copies whole
    blocks and runs ~4x faster than index_select on dim 1.
    """
    planes, _, size, dim = cache.shape
    flat = cache.view(-1, size * dim)
    return F.embedding(gather_ids, flat).view(planes, rows, -1, dim).to(dtype)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        qkv: Linear,
        output: Linear,
    ):
        super().__init__()
        # bf16 CPU kernels, set by LlamaModel.set_kernels (None: PyTorch ops)
        self.decode_kernel: decode_attention.DecodeAttentionKernel | None = None
        self.rotary_kernel: decode_attention.RotaryCacheWriteKernel | None = None
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv = qkv  # fused [q; k; v] rows: one matmul instead of three
        self.output = output

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # hidden: [tokens, hidden]; cache: this layer's [2 * kv_heads, blocks, block_size, dim]
        tokens = hidden.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(hidden)
        if self.rotary_kernel is not None:
            # q and k rotated in place, k and v written to the cache: one pass
            self.rotary_kernel(qkv, cos, sin, meta.slot_mapping, cache, heads)
            q = qkv[:, : heads * dim].view(tokens, heads, dim)
            kv = qkv[:, heads * dim :].view(tokens, 2 * kv_heads, dim)
        else:
            q, kv = self._rotate_and_write(qkv, cos, sin, cache, meta.slot_mapping)

        if meta.paged is not None:  # every token in one launch, K/V read from the cache
            out = paged_attention(q, cache, kv_heads, meta.paged, self.scale)
            return self.output(out.view(tokens, heads * dim))
        # Attention outputs in token order: decode rows, then prefill chunks.
        table = meta.decode_table
        if table is not None:
            assert self.decode_kernel is not None
            rows = q[: table.lengths.shape[0]]
            if rows.dtype != torch.bfloat16:  # fp32 compute: q rounded for the bf16 cache
                rows = rows.to(torch.bfloat16)
            out = self.decode_kernel(rows, cache, table.block_table, table.lengths, self.scale)
            parts = [out.to(q.dtype)]
        else:
            parts = [self._decode(q[g.start : g.end], cache, g) for g in meta.decode_groups]
        for chunk in meta.prefills:
            end = chunk.start + chunk.length
            # 4-D inputs: the CPU flash kernel takes them (3-D falls back to the math path)
            qp = q[chunk.start : end].transpose(0, 1)[None]  # [1, heads, length, dim]
            if chunk.gather_ids is None:
                kvp = kv[chunk.start : end].transpose(0, 1)[None]  # [1, 2 * kv_heads, length, dim]
                op = F.scaled_dot_product_attention(
                    qp, kvp[:, :kv_heads], kvp[:, kv_heads:], is_causal=True, enable_gqa=True
                )
            else:
                kvp = gather_blocks(cache, chunk.gather_ids, 1, q.dtype).transpose(0, 1)
                mask: torch.Tensor | None = chunk.mask
                if mask is None:  # the GPU layout: causal from the lower right (flash)
                    keys = chunk.context + chunk.length
                    kvp = kvp[:, :, :keys]
                    mask = causal_lower_right(chunk.length, keys)
                op = F.scaled_dot_product_attention(
                    qp, kvp[:, :kv_heads], kvp[:, kv_heads:], attn_mask=mask, enable_gqa=True
                )
            parts.append(op[0].transpose(0, 1))  # [length, heads, dim]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.output(out.reshape(tokens, heads * dim))

    def _rotate_and_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated together in PyTorch ops, k and v written to their cache slots:
        (q [tokens, heads, dim], kv [tokens, 2 * kv_heads, dim])."""
        tokens = qkv.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
        v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        kv = torch.cat((qk[:, heads:], v), dim=1)
        cache.view(2 * kv_heads, -1, dim).index_copy_(1, slots, kv.transpose(0, 1).to(cache.dtype))
        return qk[:, :heads], kv

    def decode_padded(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        gather_ids: torch.Tensor | None,
        bias: torch.Tensor | None,
        paged: PagedAttentionMetadata | None = None,
    ) -> torch.Tensor:
        """One new token per row, every shape fixed by the rows and the table's width, so
        that a CUDA graph can replay it (engine/cuda_graphs.py): each row attends to all
        of its table's blocks, the keys past its length masked by `bias` [rows, 1, keys].
        gather_ids: plane * num_blocks + block for every plane, row and table column.
        With `paged`, the Triton kernel reads each row's keys from the cache instead."""
        rows = hidden.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q, _ = self._rotate_and_write(self.qkv(hidden), cos, sin, cache, slots)
        if paged is not None:
            out = paged_attention(q, cache, kv_heads, paged, self.scale)
            return self.output(out.view(rows, heads * dim))
        assert gather_ids is not None and bias is not None
        blocks = gather_blocks(cache, gather_ids, rows, hidden.dtype)  # [planes, rows, keys, dim]
        # the query heads of a KV head as its queries: [kv_heads, rows, group, dim]
        q = q.reshape(rows, kv_heads, -1, dim).transpose(0, 1)
        scores = torch.matmul(q, blocks[:kv_heads].transpose(2, 3)) * self.scale + bias
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(hidden.dtype)
        out = torch.matmul(probs, blocks[kv_heads:])  # [kv_heads, rows, group, dim]
        return self.output(out.transpose(0, 1).reshape(rows, heads * dim))

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        """q: [rows, heads, dim], one query per row -> [rows, heads, dim].

        The query heads sharing a KV head act as that head's queries, so K/V are never
        repeated; batched matmuls beat SDPA here (its CPU kernel is tiled for long
        queries). K is gathered, padded to the group's longest row (the bias masks the
        padding); probs @ V is an embedding_bag straight from the cache: a weighted sum
        of V rows per query, with no gathered copy of V.
        """
        rows = q.shape[0]
        kv_heads, dim = self.num_kv_heads, self.head_dim
        batch = kv_heads * rows
        # [kv_heads * rows, group, dim]
        qd = q.view(rows, kv_heads, -1, dim).transpose(0, 1).reshape(batch, -1, dim)
        keys = gather_blocks(cache[:kv_heads], group.key_ids, rows, q.dtype).view(batch, -1, dim)
        # scores: [kv_heads * rows, group, keys], scaled, padding at -inf, in one call
        scores = torch.baddbmm(group.bias, qd, keys.transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(cache.dtype)
        if group.value_slots is None:  # CUDA: V gathered like K; embedding_bag took 52 us there
            values = gather_blocks(cache[kv_heads:], group.key_ids, rows, q.dtype)
            out = torch.bmm(probs.to(q.dtype), values.view(batch, -1, dim))
            return out.view(kv_heads, rows, -1, dim).transpose(0, 1).reshape(rows, -1, dim)
        out = F.embedding_bag(
            group.value_slots,
            cache.view(-1, dim),
            per_sample_weights=probs.view(group.value_slots.shape),
            mode="sum",
        )  # [kv_heads * rows * group, dim]
        return out.view(kv_heads, rows, -1, dim).transpose(0, 1).reshape(rows, -1, dim).to(q.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, gate_up: Linear, down: Linear):
        super().__init__()
        self.gate_up = gate_up  # fused [gate; up] rows
        self.down = down
        self.silu_mul_kernel: decode_attention.SiluMulKernel | None = None  # set_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_mul_kernel is not None:
            return self.down(self.silu_mul_kernel(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(
        self,
        attention: LlamaAttention,
        mlp: LlamaMLP,
        input_norm: RMSNorm,
        post_attention_norm: RMSNorm,
    ):
        super().__init__()
        self.attention = attention
        self.mlp = mlp
        self.input_norm = input_norm
        self.post_attention_norm = post_attention_norm


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        storage: str,
        device: torch.device,
        compute_dtype: torch.dtype,
    ):
        """`weights` uses HF names (model.layers.N.self_attn.q_proj.weight, ...), fp32."""
        super().__init__()
        self.config = config
        self.compute_dtype = compute_dtype
        self.storage = storage

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device)

        def linear(*names: str) -> Linear:
            return Linear(torch.cat([take(n) for n in names]), storage, compute_dtype)

        eps = config.rms_norm_eps
        self.embed = Embedding(take("model.embed_tokens.weight"), storage, compute_dtype)
        layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            attention = LlamaAttention(
                config,
                linear(*(f"{prefix}self_attn.{p}_proj.weight" for p in "qkv")),
                linear(f"{prefix}self_attn.o_proj.weight"),
            )
            mlp = LlamaMLP(
                linear(f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"),
                linear(f"{prefix}mlp.down_proj.weight"),
            )
            layers.append(
                LlamaLayer(
                    attention,
                    mlp,
                    RMSNorm(take(f"{prefix}input_layernorm.weight"), eps, compute_dtype),
                    RMSNorm(take(f"{prefix}post_attention_layernorm.weight"), eps, compute_dtype),
                )
            )
            # Free the fp32 copies layer by layer to keep peak memory near the final size.
        self.layers = nn.ModuleList(layers)
        self.layer_list: list[LlamaLayer] = layers  # typed, and cheaper to iterate
        self.norm = RMSNorm(take("model.norm.weight"), eps, compute_dtype)
        if "lm_head.weight" in weights and not config.tie_word_embeddings:
            self.lm_head = linear("lm_head.weight")
        else:
            self.lm_head = self.embed.as_linear
        cos, signed_sin = rotary_tables(
            config.head_dim, config.max_position_embeddings, config.rope_theta, device
        )
        self.cos = cos.to(compute_dtype)
        self.signed_sin = signed_sin.to(compute_dtype)
        self.device_type = device.type
        # decode_padded through the Triton kernel (ModelRunner sets it with the backend)
        self.paged_attention = False
        self.set_kernels(True)
        # Every matrix but the embedding table has another full copy by now (oneDNN's
        # packed one, or the fp32 one for fp32 compute): its plain copy goes (see Linear).
        for linear in self._linears():
            if linear is not self.embed.as_linear:
                linear.release_plain()

    def set_kernels(self, enabled: bool) -> None:
        """Use the bf16 CPU kernels (decode_attention.c) where they build and fit the model's
        shapes, else PyTorch ops. float32 weights keep HF's exact order in PyTorch ops.

        - bf16 compute (CPUs with native bf16 dot products): every kernel; every token of
          a step, prefill chunks too, attends through the decode attention kernel, except
          on CPUs with AMX, where prefill chunks attend through the CPU flash SDPA.
        - fp32 compute on bf16 or int8 weights (CPUs without): the KV cache is bf16, so
          decode rows attend through the kernel (q rounded to bf16 for it), while prefill
          chunks keep the CPU flash SDPA, faster there than the kernel's per-key products.
        - Either way, with bf16 weights, decode-only steps of a few rows run whole in the
          step kernel, in bf16 as the bf16 compute path rounds.
        """
        config = self.config
        cpu = enabled and self.device_type == "cpu"
        usable = cpu and self.compute_dtype == torch.bfloat16
        fits = decode_attention.supports(config.num_heads, config.num_kv_heads, config.head_dim)
        bf16_cache = cpu and self.storage != "float32"
        self.decode_kernel = decode_attention.load() if bf16_cache and fits else None
        # With AMX, torch's flash SDPA multiplies on tiles and beats the kernel 2 to 2.7x
        # on prefill chunks (128 to 450 tokens); without, the kernel wins by 25 to 37 %.
        self.kernel_prefill = usable and not cpu_has_amx()
        norm_fits = config.hidden_size % 16 == 0
        self.norm_kernel = decode_attention.load_add_rms_norm() if usable and norm_fits else None
        rotary_fits = config.head_dim % 32 == 0 and config.head_dim <= decode_attention.MAX_HEAD_DIM
        rotary = decode_attention.load_rotary_cache_write() if usable and rotary_fits else None
        silu_fits = config.intermediate_size % 16 == 0
        silu_mul = decode_attention.load_silu_mul() if usable and silu_fits else None
        for layer in self.layer_list:
            layer.attention.decode_kernel = self.decode_kernel
            layer.attention.rotary_kernel = rotary
            layer.mlp.silu_mul_kernel = silu_mul
        step_fits = self.decode_kernel is not None and norm_fits and rotary_fits and silu_fits
        usable = cpu and self.storage == "bfloat16" and step_fits and self._pack_rows()
        self.step_kernel = self._decode_step_kernel() if usable else None
        self.step_max_rows = 0 if self.step_kernel is None else self.step_kernel.max_rows
        # With tiles (AMX, or their product on avx512_bf16), steps of more rows than the
        # step kernel's few multiply on the packed copies (linear_rows): faster than
        # oneDNN's matmul up to 64 rows (see docs/engine.md). With fp32 compute, so do
        # steps of up to 4 rows that are not decode-only (a short prompt alone): the bf16
        # copy, read at near the machine's bandwidth.
        tiles = usable and self.compute_dtype == torch.bfloat16 and decode_attention.row_tiles()
        few_rows = usable and self.compute_dtype == torch.float32
        rows_kernel = decode_attention.load_linear_rows() if tiles or few_rows else None
        for linear in self._linears():
            linear.rows_kernel = rows_kernel

    def _linears(self) -> list[Linear]:
        linears = [self.lm_head]
        for layer in self.layer_list:
            attention, mlp = layer.attention, layer.mlp
            linears += [attention.qkv, attention.output, mlp.gate_up, mlp.down]
        return linears

    def _pack_rows(self) -> bool:
        """Give every matrix its pack_rows copy (once), where the library has the few-row
        kernels and every matrix is bf16 of a shape they take; whether they all have one."""
        linears = self._linears()
        if all(m.rows_packed is not None for m in linears):
            return True
        shapes_fit = all(
            m.weight is not None
            and m.weight.dtype == torch.bfloat16
            and m.in_features % decode_attention.LINEAR_DEPTH == 0
            for m in linears
        )
        if not (shapes_fit and decode_attention.has_decode_step()):
            return False
        weights = [m.weight.detach() for m in linears if m.weight is not None]
        for m, packed in zip(linears, pack_all_rows(weights), strict=True):
            m.rows_packed = packed
        return True

    def _decode_step_kernel(self) -> decode_attention.DecodeStepKernel | None:
        """The whole-step kernel for decode-only steps (up to 4 rows, or 64 with tiles), on
        the packed matrices."""
        config = self.config

        def pack(linear: Linear) -> torch.Tensor:
            assert linear.rows_packed is not None
            return linear.rows_packed

        def bf16(tensor: torch.Tensor) -> torch.Tensor:  # norms are kept in the compute dtype
            return tensor.detach().to(torch.bfloat16)

        layers = [
            decode_attention.StepLayer(
                input_norm=bf16(layer.input_norm.weight),
                qkv=pack(layer.attention.qkv),
                output=pack(layer.attention.output),
                post_norm=bf16(layer.post_attention_norm.weight),
                gate_up=pack(layer.mlp.gate_up),
                down=pack(layer.mlp.down),
            )
            for layer in self.layer_list
        ]
        shape = decode_attention.DecodeStepShape(
            layers=config.num_layers,
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            dim=config.head_dim,
            intermediate=config.intermediate_size,
            vocab=self.lm_head.out_features,
            positions=self.cos.shape[0],
            eps=config.rms_norm_eps,
            scale=config.head_dim**-0.5,
        )
        table = self.embed.as_linear.weight
        assert table is not None  # the embedding table keeps its plain copy (Embedding)
        model = decode_attention.StepModel(
            final_norm=bf16(self.norm.weight),
            head=pack(self.lm_head),
            embedding=table.detach().contiguous(),  # bf16 storage: the table as it is
            cos=bf16(self.cos).contiguous(),
            signed_sin=bf16(self.signed_sin).contiguous(),
        )
        return decode_attention.load_decode_step(shape, layers, model)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        logits_indices: torch.Tensor,
    ) -> StepLogits:
        # input_ids, positions: [tokens]; logits [len(logits_indices), vocab] fp32. Steps of
        # decode rows only that the step kernel takes do not come here (ModelRunner).
        hidden = self.embed(input_ids)  # [tokens, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [tokens, 1, head_dim]
        sin = self.signed_sin[positions].unsqueeze(1)
        if self.norm_kernel is not None:
            return self._forward_fused(hidden, cos, sin, meta, cache, logits_indices)
        for index, layer in enumerate(self.layer_list):
            residual = hidden
            hidden = layer.attention(layer.input_norm(hidden), cos, sin, cache.kv[index], meta)
            hidden = residual + hidden
            hidden = hidden + layer.mlp(layer.post_attention_norm(hidden))
        # Only rows that sample need the (large) vocabulary projection.
        hidden = self.norm(hidden[logits_indices])
        return StepLogits(self.lm_head.forward_fp32(hidden), None)

    def decode_padded(self, inputs: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """fp32 logits [rows, vocab] of a decode-only step in fixed shapes, for CUDA graphs.

        inputs: [rows, 4 + width] int64, per row its last token, that token's position, the
        cache slot it writes, the sequence's length with it, then its block table padded
        to `width` (engine/cuda_graphs.py lays them out). Every op reads these through
        tensors alone (no host sync, no shape from their values), so that a graph
        captured once replays any inputs of the same shape.
        """
        rows, width = inputs.shape[0], inputs.shape[1] - 4
        kv = cache.kv  # [layers, planes, blocks, block_size, dim]
        planes, num_blocks, size = kv.shape[1], kv.shape[2], kv.shape[3]
        gather_ids = bias = paged = None
        if self.paged_attention:
            # each row a sequence of one query token: its table and length, one tile each
            counts = torch.arange(rows + 1, dtype=torch.int32, device=inputs.device)
            lengths = inputs[:, 3].to(torch.int32)  # contiguous, as the kernel reads it
            paged = PagedAttentionMetadata(
                inputs[:, 4:], lengths, counts, counts[:rows], counts[:rows], block_q=1
            )
        else:
            plane_rows = torch.arange(planes, device=inputs.device) * num_blocks
            gather_ids = (plane_rows[:, None, None] + inputs[None, :, 4:]).reshape(-1)
            keys = torch.arange(width * size, device=inputs.device)
            bias = torch.zeros((rows, width * size), dtype=self.compute_dtype, device=inputs.device)
            bias = bias.masked_fill(keys[None, :] >= inputs[:, 3:4], float("-inf"))[:, None, :]
        positions = inputs[:, 1]
        cos = self.cos[positions].unsqueeze(1)  # [rows, 1, head_dim]
        sin = self.signed_sin[positions].unsqueeze(1)
        slots = inputs[:, 2]
        hidden = self.embed(inputs[:, 0])
        for index, layer in enumerate(self.layer_list):
            update = layer.attention.decode_padded(
                layer.input_norm(hidden), cos, sin, kv[index], slots, gather_ids, bias, paged
            )
            hidden = hidden + update
            hidden = hidden + layer.mlp(layer.post_attention_norm(hidden))
        return self.lm_head.forward_fp32(self.norm(hidden))

    def _forward_fused(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        logits_indices: torch.Tensor,
    ) -> StepLogits:
        """The same layers with the residual stream kept apart: each sub-layer's output is
        added to it and normalised in one kernel call (vLLM's fused_add_rms_norm)."""
        norm = self.norm_kernel
        assert norm is not None
        residual = hidden.contiguous()  # the embedding rows: a fresh tensor, updated in place
        update: torch.Tensor | None = None  # the last sub-layer's output, not yet added
        for index, layer in enumerate(self.layer_list):
            normed = norm(update, residual, layer.input_norm.weight, layer.input_norm.eps)
            update = layer.attention(normed, cos, sin, cache.kv[index], meta)
            normed = norm(
                update, residual, layer.post_attention_norm.weight, layer.post_attention_norm.eps
            )
            update = layer.mlp(normed)
        # Only rows that sample need the final add, the norm and the vocabulary projection.
        rows = residual[logits_indices]
        assert update is not None
        hidden = norm(update[logits_indices], rows, self.norm.weight, self.norm.eps)
        return StepLogits(self.lm_head.forward_fp32(hidden), None)
