"""Varlen, causal, grouped-query attention in Triton, reading K/V straight from the paged
cache through block tables (no gather).

Every token of a step is a query row: the query tokens of sequence s are rows
query_starts[s]:query_starts[s + 1] of q and are its last query_len positions, so token i
of the chunk sits at seq_len - query_len + i and attends to keys 0..that position. A
decode row is a sequence of query_len 1, a prefill chunk or a row with drafts one of
query_len > 1, all in one launch.

One program takes a tile: BLOCK_Q consecutive query tokens of one sequence times the GROUP
query heads of one KV head, which share every K/V load; its rows (BLOCK_Q * GROUP, padded
to a power of two of at least 16 for tl.dot) run an online softmax in fp32 over TILE_N
keys at a time, up to the tile's last query position only. The grid is (tiles, kv_heads);
a tile of sequence -1 returns at once, so a caller may pad the tile table to a fixed size
(CUDA graphs). The kernel object is built from the plain function: JITFunction for CUDA
tensors, InterpretedFunction (Triton's interpreter) for CPU tensors, which tests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    IMPORT_ERROR: str | None = None
except ImportError as error:  # CPU-only installs: the engine runs without Triton
    triton = None
    tl = None
    IMPORT_ERROR = f"triton not importable: {error}"

MIN_DOT = 16  # tl.dot wants every operand dimension >= 16
# query rows (tokens * group) per program where a step has a longer chunk: K/V loads shared
# by more queries; steps of single tokens and short drafts take MIN_DOT
TARGET_ROWS = 64


def triton_available() -> str | None:
    """None where Triton imports, else why not."""
    return IMPORT_ERROR


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tokens_per_tile(group: int, longest_query: int) -> int:
    """Query tokens per program for GROUP query heads per KV head, in a step whose longest
    sequence has `longest_query` query tokens."""
    rows = MIN_DOT if longest_query * group <= MIN_DOT else TARGET_ROWS
    return max(1, rows // group)


@dataclass(slots=True)
class PagedAttentionMetadata:
    """What the kernel reads besides q and the cache (build_metadata makes every field a
    view of one int32 tensor: one host-to-device copy per step)."""

    block_tables: torch.Tensor  # [seqs, width] int32 (int64 accepted): block of key // block_size
    seq_lens: torch.Tensor  # [seqs]: keys of the sequence, this step's tokens included
    query_starts: torch.Tensor  # [seqs + 1]: the sequence's rows of q
    tile_seqs: torch.Tensor  # [tiles]: the tile's sequence, -1 for padding tiles
    tile_starts: torch.Tensor  # [tiles]: the tile's first row of q
    block_q: int  # query tokens per tile
    # rows of q in no tile (a step padded to a bucket, engine/step_graphs.py): zero output
    padded: bool = False

    def __post_init__(self) -> None:
        vectors = (self.seq_lens, self.query_starts, self.tile_seqs, self.tile_starts)
        if self.block_tables.stride(1) != 1 or any(v.stride(0) != 1 for v in vectors):
            raise ValueError("the kernel reads block table rows and the vectors contiguous")


def build_metadata(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    block_q: int,
    device: torch.device | str,
    num_tiles: int | None = None,
) -> PagedAttentionMetadata:
    """The metadata of sequences laid out one after another in q, from python lists, in one
    tensor construction (this runs every step). num_tiles: pad the tile table to this many
    with sentinel tiles (a fixed grid); None: as many as the sequences need."""
    seqs = len(seq_lens)
    if not seqs == len(block_tables) == len(query_lens):
        raise ValueError("block_tables, seq_lens and query_lens differ in length")
    width = max(1, max((len(row) for row in block_tables), default=1))
    flat: list[int] = []
    for row in block_tables:
        flat += row
        flat += [0] * (width - len(row))
    flat += seq_lens
    starts = [0]
    tile_seqs: list[int] = []
    tile_starts: list[int] = []
    for seq, (length, count) in enumerate(zip(seq_lens, query_lens, strict=True)):
        if not 0 < count <= length:
            raise ValueError(f"sequence {seq}: query_len {count} not in 1..seq_len {length}")
        begin = starts[-1]
        firsts = range(begin, begin + count, block_q)
        tile_seqs += [seq] * len(firsts)
        tile_starts += firsts
        starts.append(begin + count)
    tiles = len(tile_seqs)
    if num_tiles is not None:
        if num_tiles < tiles:
            raise ValueError(f"{tiles} tiles do not fit a table of {num_tiles}")
        tile_seqs += [-1] * (num_tiles - tiles)
        tile_starts += [0] * (num_tiles - tiles)
    flat += starts + tile_seqs + tile_starts
    values = torch.tensor(flat, dtype=torch.int32, device=device)
    ends = [seqs * width, seqs, seqs + 1, len(tile_seqs), len(tile_seqs)]
    parts = values.split(ends)
    return PagedAttentionMetadata(
        block_tables=parts[0].view(seqs, width),
        seq_lens=parts[1],
        query_starts=parts[2],
        tile_seqs=parts[3],
        tile_starts=parts[4],
        block_q=block_q,
    )


# Annotations stay strings (__future__), so this defines without Triton; tl is read
# when the kernel compiles or is interpreted.
def _paged_attention(
    q_ptr,
    cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_starts_ptr,
    tile_seqs_ptr,
    tile_starts_ptr,
    scale,
    num_kv_heads,
    stride_q_token,
    stride_q_head,
    stride_q_dim,
    stride_out_token,
    stride_out_head,
    stride_cache_plane,
    stride_cache_block,
    stride_cache_slot,
    stride_table,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.load(tile_seqs_ptr + tile)
    if seq < 0:  # padding of a fixed-size tile table
        return
    tile_start = tl.load(tile_starts_ptr + tile)
    query_start = tl.load(query_starts_ptr + seq)
    query_end = tl.load(query_starts_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - (query_end - query_start)  # keys before the chunk's first token

    # row r: token r // GROUP of the tile, query head kv_head * GROUP + r % GROUP
    rows = tl.arange(0, ROWS)
    token = tile_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < query_end)
    position = context + token - query_start  # the token's position: its last key
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM

    q_offsets = (
        token.to(tl.int64)[:, None] * stride_q_token
        + head[:, None] * stride_q_head
        + dims[None, :] * stride_q_dim
    )
    io_mask = row_valid[:, None] & dim_valid[None, :]
    # q in the cache's dtype: tensor-core products of bf16 where the cache is bf16
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0).to(cache_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)

    qk_scale = scale * 1.4426950408889634  # exp2 below: log2(e) folded into the scale
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.full([ROWS], 0.0, tl.float32)
    acc = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)

    last_token = tl.minimum(tile_start + BLOCK_Q, query_end) - 1
    num_keys = context + last_token - query_start + 1
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    k_plane = kv_head * stride_cache_plane
    v_plane = (num_kv_heads + kv_head) * stride_cache_plane
    for key_start in range(0, num_keys, TILE_N):
        keys = key_start + tl.arange(0, TILE_N)
        key_valid = keys < num_keys
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_valid, other=0)
        slot_offsets = (
            block.to(tl.int64) * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
        )
        kv_offsets = slot_offsets[:, None] + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(cache_ptr + k_plane + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(cache_ptr + v_plane + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        causal = (keys[None, :] <= position[:, None]) & key_valid[None, :]
        scores = tl.where(causal, scores, float("-inf"))
        # tl.max and tl.sum, spelled as their reductions: those two (and tl.zeros) are
        # @jit functions, which the interpreter cannot call when Triton was imported
        # without TRITON_INTERPRET; it runs these reductions in numpy
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, tl.standard._elementwise_max))
        # padding rows see no key: keep their exponents finite (their output is not stored)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        p = p.to(cache_ptr.dtype.element_ty)  # rounded as in a product of the cache dtype
        if UPCAST:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    out_offsets = (
        token.to(tl.int64)[:, None] * stride_out_token
        + head[:, None] * stride_out_head
        + dims[None, :]
    )
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


_kernels: dict[str, Any] = {}


def kernel_for(device: torch.device) -> Any:
    """The launchable kernel for tensors on `device`: compiled for CUDA, interpreted on CPU."""
    if IMPORT_ERROR is not None:
        raise RuntimeError(IMPORT_ERROR)
    kind = "cuda" if device.type == "cuda" else "interpreter"
    if kind not in _kernels:
        if kind == "cuda":
            from triton.runtime.jit import JITFunction

            _kernels[kind] = JITFunction(_paged_attention)
        else:
            from triton.runtime.interpreter import InterpretedFunction

            _fix_interpreter_index()
            _kernels[kind] = InterpretedFunction(_paged_attention)
    return _kernels[kind]


def _fix_interpreter_index() -> None:
    """The interpreter holds scalars as 1-element arrays and turns them into a range()
    bound with int(array), which numpy 2 refuses for arrays of one dimension: the key
    loop's runtime bound would fail. Its per-launch patch of tl.tensor gets .item()
    instead (the compiled kernel is untouched)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "item_index", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: self.handle.data.item())

    patch_lang_tensor.item_index = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def constants(
    group: int, block_q: int, dim: int, block_size: int, cache_dtype: torch.dtype, device: str
) -> dict[str, Any]:
    """The kernel's constexpr arguments."""
    block_d = max(MIN_DOT, next_power_of_2(dim))
    # The interpreter multiplies bf16 blocks wrongly (numpy has no bf16): there the
    # operands, rounded to the cache dtype as on the GPU, multiply in fp32.
    upcast = device != "cuda"
    return {
        "GROUP": group,
        "BLOCK_Q": block_q,
        "ROWS": max(MIN_DOT, next_power_of_2(block_q * group)),
        "HEAD_DIM": dim,
        "BLOCK_D": block_d,
        "BLOCK_SIZE": block_size,
        "TILE_N": 64 if block_d <= 64 else 32,
        # fp32 exactly (not TF32) where products are fp32; bf16/fp16 ones accumulate in fp32
        "PRECISION": "ieee" if upcast or cache_dtype == torch.float32 else None,
        "UPCAST": upcast,
    }


def paged_attention(
    q: torch.Tensor,
    cache_layer: torch.Tensor,
    num_kv_heads: int,
    meta: PagedAttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, dim], any strides (a slice of a fused qkv output); cache_layer:
    [2 * kv_heads, blocks, block_size, dim], K planes then V planes, dim contiguous.
    -> out [tokens, heads, dim] in q's dtype (rows of no tile: left as they
    were in a given `out`, zero in a new one where meta.padded)."""
    tokens, heads, dim = q.shape
    planes, _, block_size, cache_dim = cache_layer.shape
    if planes != 2 * num_kv_heads or cache_dim != dim or heads % num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} and cache {tuple(cache_layer.shape)} do not fit "
            f"{num_kv_heads} KV heads"
        )
    if cache_layer.stride(3) != 1:
        raise ValueError("the cache's head dimension must be contiguous")
    group = heads // num_kv_heads
    if out is None:
        allocate = torch.zeros if meta.padded else torch.empty
        out = allocate((tokens, heads, dim), dtype=q.dtype, device=q.device)
    elif out.stride(2) != 1:
        raise ValueError("out's head dimension must be contiguous")
    grid = (meta.tile_seqs.shape[0], num_kv_heads)
    kernel_for(q.device)[grid](
        q,
        cache_layer,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_starts,
        meta.tile_seqs,
        meta.tile_starts,
        scale,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        out.stride(0),
        out.stride(1),
        cache_layer.stride(0),
        cache_layer.stride(1),
        cache_layer.stride(2),
        meta.block_tables.stride(0),
        **constants(group, meta.block_q, dim, block_size, cache_layer.dtype, q.device.type),
        num_warps=4,
    )
    return out


def self_check(
    device: torch.device, dtype: torch.dtype, kv_heads: int, group: int, dim: int, block_size: int
) -> str | None:
    """None where the kernel runs on `device` for this shape and agrees with SDPA over
    gathered keys on a small batch (a decode row, a chunk after cached keys, a prompt);
    else why not. The engine's `auto` backend checks before it takes the kernel, so a
    Triton or driver that cannot build it leaves PyTorch ops instead of a failed engine."""
    generator = torch.Generator().manual_seed(0)
    context_and_queries = [(37, 1), (21, 19), (0, 9)]
    seq_lens = [context + count for context, count in context_and_queries]
    query_lens = [count for _, count in context_and_queries]
    needed = [-(-length // block_size) for length in seq_lens]
    order = torch.randperm(sum(needed), generator=generator).tolist()
    tables = [order[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(needed))]
    heads = kv_heads * group
    cache = torch.randn(2 * kv_heads, sum(needed), block_size, dim, generator=generator)
    q = torch.randn(sum(query_lens), heads, dim, generator=generator)
    scale = dim**-0.5
    try:
        meta = build_metadata(
            tables, seq_lens, query_lens, tokens_per_tile(group, max(query_lens)), device
        )
        out = paged_attention(q.to(device, dtype), cache.to(device, dtype), kv_heads, meta, scale)
        got = out.float().cpu()
    except Exception as error:  # a compiler or driver error: the reason is what matters
        return f"the Triton kernel failed to run: {error}"
    cache = cache.to(dtype).float()  # the values the kernel read
    q = q.to(dtype).float()
    worst = 0.0
    start = 0
    for table, length, count in zip(tables, seq_lens, query_lens, strict=True):
        keys = cache[:, table].flatten(1, 2)[:, :length]  # [planes, keys, dim]
        k = keys[:kv_heads].repeat_interleave(group, 0)
        v = keys[kv_heads:].repeat_interleave(group, 0)
        scores = q[start : start + count].transpose(0, 1) @ k.transpose(1, 2) * scale
        positions = torch.arange(length - count, length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > positions, float("-inf"))
        expected = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
        worst = max(worst, (got[start : start + count] - expected).abs().max().item())
        start += count
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if not worst <= tolerance:
        return f"the Triton kernel's output differs from PyTorch's by {worst:.3g}"
    return None
