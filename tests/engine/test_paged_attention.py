"""The Triton paged attention kernel against SDPA over each sequence's gathered keys:
through Triton's interpreter on CPU, and compiled on CUDA where there is one."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.models import paged_attention as pa

pytestmark = pytest.mark.skipif(pa.triton_available() is not None, reason="needs triton")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]
BLOCK_SIZE = 16
# (context: keys cached before the step, query_len: this step's tokens) per sequence
DECODES = [(0, 1), (15, 1), (31, 1), (36, 1)]  # lengths 1, 16 and 32 (block multiples), 37
PREFILL = [(0, 40)]
CHUNK_AFTER_PREFIX = [(21, 19)]  # context not a block multiple
DRAFTS = [(30, 4)]  # the last token and 3 drafts
MIXED = DECODES[1:3] + PREFILL + CHUNK_AFTER_PREFIX + DRAFTS + DECODES[:1]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclasses.dataclass
class Case:
    q: torch.Tensor  # [tokens, heads, dim], a view into a fused qkv buffer
    cache: torch.Tensor  # [2 * kv_heads, blocks, block_size, dim]
    tables: list[list[int]]
    seq_lens: list[int]
    query_lens: list[int]


def make_case(
    seqs: list[tuple[int, int]],
    kv_heads: int,
    group: int,
    dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> Case:
    """Random q and cache; each sequence's blocks scattered over the cache in random order."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [context + count for context, count in seqs]
    query_lens = [count for _, count in seqs]
    needed = [-(-length // BLOCK_SIZE) for length in seq_lens]
    num_blocks = sum(needed) + 3
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = []
    for count in needed:
        tables.append(ids[:count])
        ids = ids[count:]
    heads = kv_heads * group
    tokens = sum(query_lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv.to(device)[:, : heads * dim].view(tokens, heads, dim)
    cache = torch.randn(2 * kv_heads, num_blocks, BLOCK_SIZE, dim, generator=gen).to(dtype)
    return Case(q, cache.to(device), tables, seq_lens, query_lens)


def reference(case: Case, kv_heads: int, scale: float) -> torch.Tensor:
    """Per sequence: its keys gathered, SDPA in fp32 under a lower-right causal mask, GQA."""
    parts = []
    start = 0
    for table, length, count in zip(case.tables, case.seq_lens, case.query_lens, strict=True):
        blocks = case.cache[:, table].flatten(1, 2)[:, :length].float()  # [planes, keys, dim]
        q = case.q[start : start + count].float().transpose(0, 1)[None]  # [1, heads, len, dim]
        out = F.scaled_dot_product_attention(
            q,
            blocks[None, :kv_heads],
            blocks[None, kv_heads:],
            attn_mask=causal_lower_right(count, length),
            scale=scale,
            enable_gqa=True,
        )
        parts.append(out[0].transpose(0, 1))
        start += count
    return torch.cat(parts)


def check(
    seqs: list[tuple[int, int]],
    device: str,
    kv_heads: int = 2,
    group: int = 2,
    dim: int = 64,
    dtype: torch.dtype = torch.float32,
    block_q: int | None = None,
    num_tiles: int | None = None,
) -> None:
    case = make_case(seqs, kv_heads, group, dim, dtype, device)
    meta = pa.build_metadata(
        case.tables,
        case.seq_lens,
        case.query_lens,
        block_q or pa.tokens_per_tile(group, max(count for _, count in seqs)),
        device,
        num_tiles,
    )
    scale = dim**-0.5
    out = pa.paged_attention(case.q, case.cache, kv_heads, meta, scale)
    assert out.dtype == dtype and out.shape == case.q.shape
    expected = reference(case, kv_heads, scale)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "seqs",
    [DECODES, PREFILL, CHUNK_AFTER_PREFIX, DRAFTS],
    ids=["decodes", "prefill", "chunk_after_prefix", "drafts"],
)
def test_each_kind_of_row(device: str, seqs: list[tuple[int, int]]):
    check(seqs, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("group", "dtype", "dim"),
    [
        (1, torch.float32, 64),
        (3, torch.float32, 48),
        (4, torch.float32, 80),
        (1, torch.bfloat16, 80),
        (3, torch.bfloat16, 64),
        (4, torch.bfloat16, 48),
    ],
)
def test_mixed_batch(device: str, group: int, dtype: torch.dtype, dim: int):
    """Decodes, a prefill, a chunk after cached context and drafts in one launch, several
    tiles per long chunk (block_q 8)."""
    check(MIXED, device, kv_heads=2, group=group, dim=dim, dtype=dtype, block_q=8)


@pytest.mark.parametrize("device", DEVICES)
def test_padded_tile_table(device: str):
    """Sentinel tiles (sequence -1) do nothing: a fixed grid, as CUDA graphs need."""
    check(MIXED, device, group=4, block_q=16, num_tiles=16)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_rows_as_a_fixed_graph_table(device: str):
    """decode_padded's layout: each row its own sequence of query_len 1, int64 block tables
    padded with a spare block, the tile table arange(rows)."""
    kv_heads, group, dim = 1, 4, 64
    case = make_case(DECODES, kv_heads, group, dim, torch.float32, device)
    width = max(len(row) for row in case.tables) + 1
    spare = case.cache.shape[1] - 1  # an unused block: make_case leaves 3
    tables = torch.tensor(
        [row + [spare] * (width - len(row)) for row in case.tables], device=device
    )
    rows = len(DECODES)
    lens = torch.tensor(case.seq_lens, device=device)
    meta = pa.PagedAttentionMetadata(
        block_tables=tables,
        seq_lens=lens,
        query_starts=torch.arange(rows + 1, device=device),
        tile_seqs=torch.arange(rows, device=device),
        tile_starts=torch.arange(rows, device=device),
        block_q=1,
    )
    out = pa.paged_attention(case.q, case.cache, kv_heads, meta, dim**-0.5)
    expected = reference(case, kv_heads, dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_build_metadata_lays_out_tiles():
    meta = pa.build_metadata([[3], [1, 2]], [5, 20], [1, 18], block_q=8, device="cpu", num_tiles=6)
    assert meta.block_tables.tolist() == [[3, 0], [1, 2]]
    assert meta.seq_lens.tolist() == [5, 20]
    assert meta.query_starts.tolist() == [0, 1, 19]
    assert meta.tile_seqs.tolist() == [0, 1, 1, 1, -1, -1]
    assert meta.tile_starts.tolist() == [0, 1, 9, 17, 0, 0]
    assert meta.block_tables.dtype == torch.int32
    with pytest.raises(ValueError, match="do not fit"):
        pa.build_metadata([[3], [1, 2]], [5, 20], [1, 18], block_q=8, device="cpu", num_tiles=3)


def test_compiles_for_cuda_without_a_gpu():
    """The compiled path through Triton's whole pipeline to an sm_90 cubin (its bundled
    ptxas), no GPU needed: bf16 products, 3 query heads per KV head, head_dim 80 padded."""
    backends = pytest.importorskip("triton.backends.compiler")
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import JITFunction

    kernel = JITFunction(pa._paged_attention)
    const = pa.constants(3, pa.tokens_per_tile(3, 100), 80, 16, torch.bfloat16, "cuda")
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update({name: "constexpr" for name in const})
    pointers = ["q_ptr", "cache_ptr", "out_ptr"]
    signature.update({name: "*bf16" for name in pointers}, scale="fp32")
    for name in ("block_tables_ptr", "seq_lens_ptr", "query_starts_ptr"):
        signature[name] = "*i32"
    signature.update(tile_seqs_ptr="*i32", tile_starts_ptr="*i32")
    source = ASTSource(kernel, signature, constexprs=const)
    try:
        compiled = compile(source, target=backends.GPUTarget("cuda", 90, 32))
    except RuntimeError as error:  # no ptxas for this platform
        pytest.skip(f"no CUDA toolchain: {error}")
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("device", DEVICES)
def test_self_check_passes_a_working_kernel_and_names_a_broken_one(
    device: str, monkeypatch: pytest.MonkeyPatch
):
    """The check `auto` runs before taking the kernel: None for the kernel as it is; the
    reason where its output is wrong or it raises."""
    for dtype in (torch.float32, torch.bfloat16):
        assert pa.self_check(torch.device(device), dtype, 2, 3, 64, BLOCK_SIZE) is None
    real = pa.paged_attention

    def shifted(*args, **kwargs):
        return real(*args, **kwargs) + 0.5

    monkeypatch.setattr(pa, "paged_attention", shifted)
    reason = pa.self_check(torch.device(device), torch.float32, 2, 3, 64, BLOCK_SIZE)
    assert reason is not None and "differs from PyTorch's by 0.5" in reason

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(pa, "paged_attention", broken)
    reason = pa.self_check(torch.device(device), torch.float32, 2, 3, 64, BLOCK_SIZE)
    assert reason == "the Triton kernel failed to run: PTX assembly failed"
