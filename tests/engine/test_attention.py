"""The fused bf16 decode attention kernel against a dense reference, alone and inside the model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models import decode_attention
from engine.scheduler import ScheduledBatch
from engine.sequence import SamplingParams, Sequence

kernel = decode_attention.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler or no AVX-512 here")


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
    cache = torch.randn(2 * kv_heads, num_blocks, block_size, dim, generator=generator)
    cache = cache.to(torch.bfloat16)
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
    out = kernel(
        q,
        cache,
        torch.tensor(padded, dtype=torch.int32),
        torch.tensor(lengths, dtype=torch.int32),
        dim**-0.5,
    )
    expected = reference_attention(q, cache, tables, lengths)
    assert out.dtype == torch.bfloat16 and out.shape == (len(lengths), heads, dim)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    # a row of one key returns that key's value exactly (up to bf16)
    torch.testing.assert_close(
        out[0].float().view(kv_heads, group, dim),
        cache[kv_heads:, tables[0][0], 0].float()[:, None].expand(-1, group, -1),
    )


def engine_for(tiny_llama: Path, use_kernel: bool) -> LLMEngine:
    config = EngineConfig(
        model=str(tiny_llama), dtype="bfloat16", num_blocks=128, block_size=16, max_model_len=512
    )
    engine = LLMEngine(config)
    engine.load()
    if not use_kernel:
        engine.runner.model.decode_kernel = None  # decode groups over gathered blocks
    return engine


@needs_kernel
def test_model_with_kernel_matches_decode_groups(tiny_llama: Path):
    """Mixed steps (decodes of ragged lengths beside prefill chunks with and without
    context), then decode-only steps, through both decode paths with the same tokens."""
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("bfloat16 computes in fp32 on this CPU: the kernel is not used")
    engines = [engine_for(tiny_llama, use_kernel=True), engine_for(tiny_llama, use_kernel=False)]
    assert engines[0].runner.uses_decode_kernel and not engines[1].runner.uses_decode_kernel
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (3, 16, 17, 45, 90, 150, 200)]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    seqs = [[Sequence(token_ids=list(p), params=params) for p in prompts] for _ in engines]
    # (sequence index, tokens) per step; a count of 1 on a computed prompt is a decode row
    plan: list[list[tuple[int, int]]] = [
        [(0, 3), (1, 16), (2, 17), (3, 45), (4, 90), (5, 60)],
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 90), (6, 100)],
        [(i, 1) for i in range(6)] + [(6, 100)],
        *[[(i, 1) for i in range(7)] for _ in range(6)],
    ]
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
            step_logits, sampling = engine.runner.run(batch)
            for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_computed_tokens += count
            row_of = {id(seq): row for row, seq in enumerate(sampling)}
            logits.append(step_logits[[row_of[id(engine_seqs[i])] for i in sampled]])
        # bf16 rounding apart (the kernel sums in fp32, the groups round probs to bf16);
        # a wrong block or mask would move logits by their own scale
        scale = logits[1].abs().max().item()
        difference = (logits[0] - logits[1]).abs()
        assert difference.max().item() <= 0.04 * scale
        assert difference.mean().item() <= 0.01 * scale
        tokens = logits[0].argmax(dim=-1).tolist()
        assert tokens == logits[1].argmax(dim=-1).tolist()
        for index, token in zip(sampled, tokens, strict=True):
            for engine_seqs in seqs:
                engine_seqs[index].token_ids.append(token)
