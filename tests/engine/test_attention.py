"""The bf16 CPU kernels against plain references, alone and inside the model: the fused
decode attention, the residual add fused with RMSNorm, and greedy sampling's argmax."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models import decode_attention
from engine.models.layers import cpu_has_amx
from engine.sampler import greedy_tokens
from engine.scheduler import ScheduledBatch
from engine.sequence import SamplingParams, Sequence

kernel = decode_attention.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler or no AVX2 here")


def reference_attention(
    q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], lengths: list[int]
) -> torch.Tensor:
    """Plain fp32 softmax attention of each row over its own keys, read block by block."""
    rows, heads, dim = q.shape
    kv_heads, block_size = cache.shape[0] // 2, cache.shape[2]
    out = torch.empty(rows, heads, dim)
    for row in range(rows):
        blocks = torch.tensor(tables[row])
        keys = cache[:kv_heads, blocks].reshape(kv_heads, -1, dim)[:, : lengths[row]].float()
        values = cache[kv_heads:, blocks].reshape(kv_heads, -1, dim)[:, : lengths[row]].float()
        query = q[row].view(kv_heads, heads // kv_heads, dim).float()
        probs = torch.softmax(query @ keys.transpose(1, 2) * dim**-0.5, dim=-1)
        out[row] = (probs @ values).reshape(heads, dim)
    assert block_size > 0
    return out


def random_cache(
    kv_heads: int, num_blocks: int, block_size: int, dim: int, generator: torch.Generator
) -> torch.Tensor:
    """One layer's bf16 KV cache of random values: [2 * kv_heads, blocks, block_size, dim]."""
    cache = torch.randn(2 * kv_heads, num_blocks, block_size, dim, generator=generator)
    return cache.to(torch.bfloat16)


def run_kernel(
    q: torch.Tensor, cache: torch.Tensor, padded: list[list[int]], lengths: list[int]
) -> torch.Tensor:
    """The kernel on rows of padded block tables, at the usual scale."""
    assert kernel is not None
    tables = torch.tensor(padded, dtype=torch.int32)
    return kernel(q, cache, tables, torch.tensor(lengths, dtype=torch.int32), q.shape[-1] ** -0.5)


@needs_kernel
@pytest.mark.parametrize(
    ("kv_heads", "group", "dim", "block_size"),
    [(3, 3, 64, 16), (2, 4, 128, 16), (1, 1, 32, 8), (2, 2, 16, 32), (4, 2, 48, 24)],
)
def test_kernel_matches_reference(kv_heads: int, group: int, dim: int, block_size: int):
    assert kernel is not None
    generator = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    num_blocks = 96
    cache = random_cache(kv_heads, num_blocks, block_size, dim, generator)
    # ragged rows: one key, exactly one block, one past a block, several blocks
    lengths = [1, block_size, block_size + 1, 3 * block_size - 5, 5 * block_size + 7, 2]
    widest = max(-(-n // block_size) for n in lengths)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered blocks, as after a while of serving
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]
    padded = [t + [0] * (widest - len(t)) for t in tables]
    heads = kv_heads * group
    # q as the attention sees it: a view into the fused q|k rows, rows strided
    qk = torch.randn(len(lengths), heads + kv_heads, dim, generator=generator).to(torch.bfloat16)
    q = qk[:, :heads]
    out = run_kernel(q, cache, padded, lengths)
    expected = reference_attention(q, cache, tables, lengths)
    assert out.dtype == torch.bfloat16 and out.shape == (len(lengths), heads, dim)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    # a row of one key returns that key's value exactly (up to bf16)
    torch.testing.assert_close(
        out[0].float().view(kv_heads, group, dim),
        cache[kv_heads:, tables[0][0], 0].float()[:, None].expand(-1, group, -1),
    )


@needs_kernel
@pytest.mark.parametrize(
    ("kv_heads", "group", "dim", "block_size"),
    [(3, 3, 64, 16), (2, 4, 128, 16), (1, 3, 64, 32), (2, 2, 48, 16)],
)
def test_kernel_matches_reference_on_prefill_chunks(
    kv_heads: int, group: int, dim: int, block_size: int
):
    """Prefill chunks' tokens (one block table, lengths one apart) beside decode rows: with
    vdpbf16ps they attend as tiles of up to 48 query vectors (runs longer than a tile split,
    causal inside each tile), else row by row; the same attention either way."""
    assert kernel is not None
    generator = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    num_blocks = 64
    cache = random_cache(kv_heads, num_blocks, block_size, dim, generator)
    free = list(range(num_blocks))
    rng.shuffle(free)

    def table(length: int) -> list[int]:
        return [free.pop() for _ in range(-(-length // block_size))]

    decode = [(table(n), [n]) for n in (40, 3)]  # decode rows: one length each
    long_chunk = table(21 + 37)  # 37 tokens after 21 cached: lengths 22 .. 58
    short_chunk = table(5)  # a fresh prompt of 5 tokens: lengths 1 .. 5
    odd = table(30)  # rows of one table whose lengths are not one apart
    runs = [
        *decode,
        (long_chunk, list(range(22, 59))),
        (short_chunk, list(range(1, 6))),
        (odd, [30, 10, 11, 29]),
    ]
    tables = [blocks for blocks, lengths in runs for _ in lengths]
    lengths = [n for _, run_lengths in runs for n in run_lengths]
    widest = max(len(t) for t in tables)
    padded = [t + [0] * (widest - len(t)) for t in tables]
    q = torch.randn(len(lengths), kv_heads * group, dim, generator=generator).to(torch.bfloat16)
    out = run_kernel(q, cache, padded, lengths)
    expected = reference_attention(q, cache, tables, lengths)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def hf_add_rms_norm(x, residual, weight, eps):
    """HF's bf16 order: the add rounded to bf16, normalised in fp32, rounded, then scaled."""
    added = residual if x is None else residual + x
    hidden = added.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return added, weight * hidden.to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_add_rms_norm_matches_hf_order(rows: int):
    norm = decode_attention.load_add_rms_norm()
    assert norm is not None
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
    residual = (torch.randn(rows, 576, generator=generator) * 8).to(torch.bfloat16)
    weight = (torch.rand(576, generator=generator) + 0.5).to(torch.bfloat16)
    expected_residual, expected = hf_add_rms_norm(x, residual, weight, 1e-5)
    updated = residual.clone()
    out = norm(x, updated, weight, 1e-5)
    assert torch.equal(updated, expected_residual)  # the add rounds exactly as torch's
    # fp32 sums in another order: at most one bf16 rounding apart, and rarely that
    torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)
    assert (out == expected).float().mean().item() > 0.999
    # without x the residual is normalised as it is and left alone
    before = residual.clone()
    torch.testing.assert_close(
        norm(None, residual, weight, 1e-5), hf_add_rms_norm(None, before, weight, 1e-5)[1],
        atol=0, rtol=2**-7,
    )  # fmt: skip
    assert torch.equal(residual, before)


@needs_kernel
def test_add_rms_norm_refuses_what_it_cannot_read():
    norm = decode_attention.load_add_rms_norm()
    assert norm is not None
    rows = torch.zeros(4, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    for x, residual, w in [
        (rows.float(), rows, weight),  # fp32
        (rows, torch.zeros(4, 128, dtype=torch.bfloat16)[:, ::2], weight),  # strided
        (rows, rows.clone(), torch.ones(32, dtype=torch.bfloat16)),  # weight of another width
        (rows[:, :40].contiguous(), rows[:, :40].contiguous(), weight[:40]),  # 40 % 16 != 0
    ]:
        with pytest.raises(ValueError):
            norm(x, residual, w, 1e-5)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 7, 80])
def test_rotary_cache_write_matches_the_torch_ops(tokens: int):
    """Rotated q and k bit for bit as apply_rotary's bf16 ops; k and v in their slots."""
    from engine.models.layers import apply_rotary, rotary_tables

    rotary = decode_attention.load_rotary_cache_write()
    assert rotary is not None
    heads, kv_heads, dim, blocks, block_size = 9, 3, 64, 12, 16
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    qkv = (qkv * 3).to(torch.bfloat16)
    cos_table, sin_table = rotary_tables(dim, 512, 100000.0, torch.device("cpu"))
    positions = torch.randint(0, 512, (tokens,), generator=generator)
    cos = cos_table.to(torch.bfloat16)[positions].unsqueeze(1)
    sin = sin_table.to(torch.bfloat16)[positions].unsqueeze(1)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    cache = torch.zeros(2 * kv_heads, blocks, block_size, dim, dtype=torch.bfloat16)

    rotated = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    values = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim).clone()
    rotary(qkv, cos, sin, slots, cache, heads)
    assert torch.equal(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), rotated)
    flat = cache.view(2 * kv_heads, -1, dim)
    assert torch.equal(flat[:kv_heads, slots].transpose(0, 1), rotated[:, heads:])
    assert torch.equal(flat[kv_heads:, slots].transpose(0, 1), values)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_mul_matches_the_torch_ops(rows: int):
    silu_mul = decode_attention.load_silu_mul()
    assert silu_mul is not None
    generator = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=generator) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = silu_mul(gate_up)
    # expf from glibc, not torch's: at most one bf16 rounding apart, and rarely that
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=2**-7)
    assert (out == expected).float().mean().item() > 0.99
    with pytest.raises(ValueError):
        silu_mul(gate_up.float())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("vocab", [49152, 1000, 7])
def test_argmax_gives_each_rows_first_maximum(rows: int, vocab: int):
    argmax = decode_attention.load_argmax()
    assert argmax is not None
    generator = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=generator)
    # coarse values: many ties, so the first of equal maxima must win
    logits = (logits * 2).round()
    if rows > 1:
        logits[1] = float("-inf")  # all -inf: index 0
        logits[-1, vocab // 2] = float("nan")  # a NaN is the maximum, as torch says
        logits[-1, vocab - 1] = float("nan")
    assert argmax(logits) == logits.max(dim=-1).indices.tolist()
    assert argmax(logits) == logits.argmax(dim=-1).tolist()
    with pytest.raises(ValueError):
        argmax(logits.to(torch.bfloat16))


def engine_for(tiny_llama: Path, use_kernel: bool) -> LLMEngine:
    config = EngineConfig(
        model=str(tiny_llama), dtype="bfloat16", num_blocks=128, block_size=16, max_model_len=512
    )
    engine = LLMEngine(config)
    engine.load()
    if not use_kernel:
        engine.runner.model.set_kernels(False)  # PyTorch ops: decode groups, F.rms_norm, ...
    return engine


@needs_kernel
def test_model_with_kernel_matches_decode_groups(tiny_llama: Path):
    """Mixed steps (decodes of ragged lengths beside prefill chunks with and without
    context), then decode-only steps, through both decode paths with the same tokens.
    With bf16 compute the prefill chunks attend through the kernel too and the small ops
    are fused (but for AMX CPUs, where prefills keep SDPA); with fp32 compute (CPUs
    without native bf16) the decode rows only."""
    engines = [engine_for(tiny_llama, use_kernel=True), engine_for(tiny_llama, use_kernel=False)]
    assert engines[0].runner.uses_decode_kernel and not engines[1].runner.uses_decode_kernel
    model = engines[0].runner.model
    bf16_compute = model.compute_dtype == torch.bfloat16
    assert model.kernel_prefill == (bf16_compute and not cpu_has_amx())
    assert (model.norm_kernel is not None) == bf16_compute
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (3, 16, 17, 45, 90, 150, 200)]
    # (sequence index, tokens) per step; a count of 1 on a computed prompt is a decode row
    plan: list[list[tuple[int, int]]] = [
        [(0, 3), (1, 16), (2, 17), (3, 45), (4, 90), (5, 60)],
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 90), (6, 100)],
        [(i, 1) for i in range(6)] + [(6, 100)],
        *[[(i, 1) for i in range(7)] for _ in range(6)],
    ]
    compare_steps(engines, prompts, plan)


def compare_steps(
    engines: list[LLMEngine],
    prompts: list[list[int]],
    plan: list[list[tuple[int, int]]],
    max_share: float = 0.05,
    mean_share: float = 0.01,
) -> None:
    """Run the same steps through two engines (plan: per step, (prompt index, tokens)); the
    logits of every sampled row must agree to bf16 rounding (shares of the largest logit:
    by default) and pick the same token, which both then append (the second engine's: the
    reference)."""
    params = SamplingParams(max_tokens=64, temperature=0.0)
    seqs = [[Sequence(token_ids=list(p), params=params) for p in prompts] for _ in engines]
    for step in plan:
        # the sequences whose last token is computed in this step get logits
        sampled = [i for i, n in step if seqs[0][i].num_computed_tokens + n == len(seqs[0][i])]
        logits = []
        for engine, engine_seqs in zip(engines, seqs, strict=True):
            batch = ScheduledBatch()
            for index, count in step:
                seq = engine_seqs[index]
                if not seq.block_table:
                    assert engine.block_manager.allocate(seq)
                assert engine.block_manager.ensure_capacity(seq, seq.num_computed_tokens + count)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(count)
            output, sampling = engine.runner.run(batch)
            if output.greedy is not None:  # the step kernel's own argmax: the sampler's
                assert output.greedy == greedy_tokens(output.logits)
            for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_computed_tokens += count
            row_of = {id(seq): row for row, seq in enumerate(sampling)}
            logits.append(output.logits[[row_of[id(engine_seqs[i])] for i in sampled]])
        # bf16 rounding apart (the kernel sums in fp32, the groups round probs to bf16);
        # a wrong block or mask would move logits by their own scale. The worst logit of
        # the tiny models lands 0.03 to 0.04 of the scale apart on every kernel target
        # (0.036 on avx512_bf16, 0.040 on AVX-512F and AVX2 against bf16 PyTorch).
        scale = logits[1].abs().max().item()
        difference = (logits[0] - logits[1]).abs()
        assert difference.max().item() <= max_share * scale
        assert difference.mean().item() <= mean_share * scale
        # the same token wherever the reference's best two differ by more than the paths do
        # (bf16 logits tie now and then: a tie may fall either way)
        top = logits[1].topk(2, dim=-1).values
        decided = (top[:, 0] - top[:, 1]) > 2 * difference.max(dim=-1).values
        tokens = logits[1].argmax(dim=-1)
        assert torch.equal(logits[0].argmax(dim=-1)[decided], tokens[decided])
        for index, token in zip(sampled, tokens.tolist(), strict=True):
            for engine_seqs in seqs:
                engine_seqs[index].token_ids.append(token)


linear_rows = decode_attention.load_linear_rows()
needs_step_kernel = pytest.mark.skipif(linear_rows is None, reason="no C compiler, or no AVX2 here")


@needs_step_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 16, 17, 49, 64, 70, 130])
def test_linear_rows_matches_fp32_matmul(rows: int):
    """A few rows on vector registers; more on tiles where the CPU has avx512_bf16 (AMX's
    or their product on vdpbf16ps): partial tiles of rows and outputs, and more rows than
    one pass over the weight takes (64)."""
    assert linear_rows is not None
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(970, 576, generator=generator).to(torch.bfloat16)  # a partial tile
    x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
    out = linear_rows(x, decode_attention.pack_rows(weight), 970)
    expected = (x.float() @ weight.float().T).to(torch.bfloat16)
    # fp32 sums in another order, then one bf16 rounding: at most an ulp apart
    torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=2**-7)
    assert (out == expected).float().mean().item() > 0.9


def test_all_rows_are_packed_into_one_buffer_from_a_huge_page_boundary():
    from engine.models.llama import HUGE_PAGE, pack_all_rows

    weights = [torch.randn(out, 64).to(torch.bfloat16) for out in (40, 16, 7)]
    packed = pack_all_rows(weights)
    assert packed[0].data_ptr() % HUGE_PAGE == 0
    for weight, tensor, following in zip(weights, packed, [*packed[1:], None], strict=True):
        assert torch.equal(tensor, decode_attention.pack_rows(weight))
        if following is not None:  # one after another, no gap
            assert following.data_ptr() == tensor.data_ptr() + tensor.numel() * 2
    with pytest.raises(ValueError):  # pack_rows writes only into its own shape
        decode_attention.pack_rows(weights[0], out=torch.empty(2, 2, 16, 32, dtype=torch.bfloat16))


@needs_step_kernel
def test_linear_rows_refuses_what_it_cannot_read():
    assert linear_rows is not None
    with pytest.raises(ValueError):
        decode_attention.pack_rows(torch.zeros(32, 48, dtype=torch.bfloat16))  # 48 % 32
    with pytest.raises(ValueError):
        decode_attention.pack_rows(torch.zeros(32, 64))  # fp32
    packed = decode_attention.pack_rows(torch.zeros(40, 64, dtype=torch.bfloat16))
    assert packed.shape == (3, 2, 16, 32)  # 40 rows padded to 48
    with pytest.raises(ValueError):
        linear_rows(torch.zeros(2, 32, dtype=torch.bfloat16), packed, 40)  # narrower than W
    with pytest.raises(ValueError):
        linear_rows(torch.zeros(2, 64), packed, 40)  # fp32
    with pytest.raises(ValueError):
        linear_rows(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 49)  # more than packed


@needs_step_kernel
def test_decode_step_kernel_matches_the_pytorch_layers(tiny_llama_dim32: Path):
    """Decode-only steps of four rows down to one (and five and sixteen with tiles), all
    layers in one call, against the model in PyTorch ops: the same logits to bf16 rounding
    and the same KV cache."""
    engines = [
        engine_for(tiny_llama_dim32, use_kernel=True),
        engine_for(tiny_llama_dim32, use_kernel=False),
    ]
    model = engines[0].runner.model
    assert model.step_kernel is not None and engines[1].runner.model.step_kernel is None
    calls: list[int] = []
    step_kernel = model.step_kernel

    def counted(token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        calls.append(len(token_ids))
        return step_kernel(token_ids, *args, **kwargs)

    model.step_kernel = counted  # type: ignore[assignment]
    rng = random.Random(2)
    lengths = (5, 16, 33, 70, 12, *range(3, 14))
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in lengths]
    plan: list[list[tuple[int, int]]] = [
        [(0, 5), (1, 16), (2, 33), (3, 70)],
        *[[(i, 1) for i in range(4)] for _ in range(20)],  # rows cross block boundaries
        [(0, 1), (2, 1), (3, 1)],
        [(1, 1), (3, 1)],
        [(3, 1)],
        [(i, 1) for i in range(4)] + [(4, 12)],  # a prefill in the step: the layer path
        [(i, 1) for i in range(5)],  # five rows: the layer path, or the step kernel
        [(i, lengths[i]) for i in range(5, 16)],
        # sixteen: the layer path, or the step kernel's tiles (avx512_bf16 alone keeps up to
        # 12 rows on vectors, AMX none past 4)
        [(i, 1) for i in range(16)],
    ]
    compare_steps(engines, prompts, plan)
    # with tiles (AMX, or avx512_bf16 alone) the step kernel takes the five rows too
    tiles = decode_attention.row_tiles() is not None
    assert calls == [4] * 20 + [3, 2, 1] + ([5, 16] if tiles else [])
    assert model.step_max_rows == (64 if tiles else 4)
    # the few-row kernel serves steps the step kernel does not: 5 to 64 rows with tiles,
    # up to 4 with fp32 compute (CPUs without native bf16)
    fp32_compute = model.compute_dtype == torch.float32
    assert (model.lm_head.rows_kernel is not None) == (tiles or fp32_compute)
    caches = [engine.runner.cache.kv.float() for engine in engines]
    scale = caches[1].abs().max().item()
    assert (caches[0] - caches[1]).abs().max().item() <= 0.04 * scale


@needs_step_kernel
def test_drafted_steps_give_plain_decodings_logits(tiny_llama_dim32: Path):
    """Greedy verification keeps plain decoding's tokens only where each row of a step with
    drafts gets the very logits plain decoding would: requests' last tokens and drafts in
    one step of max_draft_rows rows against each token decoded alone, bit for bit, on
    every kernel target. The tiles that take other steps of 5 rows and more on AMX sum in
    another order than the vectors that drafted steps keep: there, without them, a row
    of about one round in three differed here."""
    engine = engine_for(tiny_llama_dim32, use_kernel=True)
    runner = engine.runner
    kernel = runner.model.step_kernel
    assert kernel is not None
    rows = runner.max_draft_rows
    tiles = decode_attention.row_tiles()
    assert rows == (12 if tiles else 4) == kernel.vector_rows
    per_request = [4, 3, 3, 2] if rows == 12 else [2, 2]  # the last token, then drafts
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for seed in range(6):
        rng = random.Random(seed)
        seqs, drafts = [], []
        for count in per_request:
            length = rng.randrange(17, 60)
            prompt = [rng.randrange(3, 400) for _ in range(length)]
            seq = Sequence(token_ids=prompt, params=params)
            assert engine.block_manager.allocate(seq)
            assert engine.block_manager.ensure_capacity(seq, length + count - 1)
            runner.run(ScheduledBatch(seqs=[seq], num_new_tokens=[length - 1]))
            seq.num_computed_tokens = length - 1
            seq.draft_token_ids = [rng.randrange(3, 400) for _ in range(count - 1)]
            seqs.append(seq)
            drafts.append(list(seq.draft_token_ids))
        together = runner.decode_step(seqs).logits
        assert together.shape[0] == rows
        row = 0
        for seq, tokens in zip(seqs, drafts, strict=True):
            seq.draft_token_ids = []
            prompt = list(seq.token_ids)
            for position in range(len(tokens) + 1):
                seq.token_ids = prompt + tokens[:position]
                alone = runner.decode_step([seq]).logits[0]
                assert torch.equal(together[row], alone), (seed, row, position)
                row += 1
            engine.block_manager.free(seq)


@needs_step_kernel
@pytest.mark.parametrize("count", ["one", "three", "most"])
def test_decode_step_kernel_greedy_tokens_are_each_rows_first_maximum(
    tiny_llama_dim32: Path, count: str
):
    """The step finds its greedy tokens inside its thread team, each thread in its own part
    of the vocabulary: a tie or a NaN across the parts goes to the first index, as the
    sampler's argmax has it (with tiles, the most rows, 64, take the tile path)."""
    engine = engine_for(tiny_llama_dim32, use_kernel=True)
    model = engine.runner.model
    step_kernel = model.step_kernel
    assert step_kernel is not None
    rows = {"one": 1, "three": 3, "most": step_kernel.max_rows}[count]
    head = step_kernel.model.head  # the packed vocabulary projection, [tiles, in/32, 16, 32]
    vocab = model.lm_head.out_features
    generator = torch.Generator().manual_seed(rows)

    def step() -> tuple[torch.Tensor, list[int]]:
        logits, greedy = step_kernel(
            torch.randint(0, vocab, (rows,), generator=generator).tolist(),
            engine.runner.cache.kv,
            list(range(rows)),  # row i's one key in block i
            [1] * rows,
            greedy=True,
        )
        assert greedy is not None and greedy == greedy_tokens(logits)
        return logits, greedy

    def copy_row(source: int, target: int) -> None:
        head[target // 16, :, target % 16] = head[source // 16, :, source % 16]

    _, first = step()
    # the first row's maximum copied to the first and the last output (the same inputs
    # again): three equal maxima in both parts of the vocabulary, the first output's first
    generator.manual_seed(rows)
    copy_row(first[0], 0)
    copy_row(first[0], vocab - 1)
    logits, tokens = step()
    assert tokens[0] == 0 and logits[0, 0] == logits[0, vocab - 1] == logits[0].max()
    # NaN outputs win, the first of them: one in each half
    head[(vocab - 1) // 16, :, (vocab - 1) % 16] = float("nan")
    logits, tokens = step()
    assert tokens == [vocab - 1] * rows
    nan_first = 17
    head[nan_first // 16, :, nan_first % 16] = float("nan")
    logits, tokens = step()
    assert tokens == [nan_first] * rows and logits[:, nan_first].isnan().all()


@needs_step_kernel
def test_decode_step_kernel_refuses_ids_and_lengths_out_of_range(tiny_llama_dim32: Path):
    """The kernel reads the embedding, rotary and cache rows its inputs name: one out of
    range is refused before anything is read or written."""
    engine = engine_for(tiny_llama_dim32, use_kernel=True)
    step_kernel = engine.runner.model.step_kernel
    assert step_kernel is not None
    cache = engine.runner.cache.kv
    before = cache.clone()
    vocab, positions = step_kernel.shape.vocab, step_kernel.shape.positions
    blocks = cache.shape[2]
    size = cache.shape[3]

    def call(token: int, length: int, block: int, width: int = 1) -> None:
        step_kernel([token], cache, [block] * width, [length])

    for token, length, block, width in [
        (vocab, 1, 0, 1),  # a token past the vocabulary
        (-1, 1, 0, 1),
        (5, 0, 0, 1),  # no position
        (5, positions + 1, 0, -(-(positions + 1) // size)),  # past the rotary tables
        (5, size + 1, 0, 1),  # its position's block is not in the table
        (5, 1, blocks, 1),  # a block past the cache
        (5, 1, -1, 1),
    ]:
        with pytest.raises(ValueError, match="out of range"):
            call(token, length, block, width)
    assert torch.equal(cache, before)
    call(5, 1, 0)  # in range: the cache's block 0 takes the token's keys and values
    assert not torch.equal(cache, before)
    logits, greedy = step_kernel([5], cache, [0], [1])
    assert greedy is None and logits.shape == (1, vocab)  # greedy tokens only when asked
    with pytest.raises(ValueError, match="one block table row per row"):
        step_kernel([5, 6], cache, [0, 1, 2], [1, 1])
    with pytest.raises(ValueError, match="KV cache"):
        step_kernel([5], cache.float(), [0], [1])
