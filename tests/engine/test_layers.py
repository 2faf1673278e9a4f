"""Linear layers keep one plain copy of a matrix only where nothing else can serve it; the
KV cache asks for huge pages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, LlamaConfig
from engine.llm_engine import LLMEngine
from engine.models import decode_attention
from engine.models.layers import Linear
from engine.models.llama import KVCache, advise_huge_pages
from engine.sequence import SamplingParams, Sequence

ROW_COUNTS = [1, 2, 3, 4, 5, 8, 64]


def outputs(linear: Linear, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    with torch.inference_mode():
        return {rows: linear(x) for rows, x in inputs.items()}


def test_bf16_weights_with_fp32_compute_give_the_same_rows_without_the_plain_copy():
    """The path of CPUs without native bf16: batches multiply the fp32 copy, a few rows the
    bf16 one; without it, the few rows multiply their bf16-rounded values by the fp32 copy
    and round the result to bf16, as the bf16 matmul does."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator)
    linear = Linear(weight, "bfloat16", torch.float32)
    inputs = {rows: torch.randn(rows, 64, generator=generator) for rows in ROW_COUNTS}
    before = outputs(linear, inputs)
    assert linear.release_plain() and linear.weight is None
    after = outputs(linear, inputs)
    for rows in ROW_COUNTS:
        assert after[rows].dtype == torch.float32
        if rows <= 4:  # bf16 values either way; the fp32 sums may differ in order only
            assert torch.equal(after[rows], after[rows].to(torch.bfloat16).float())
            torch.testing.assert_close(after[rows], before[rows], rtol=2**-7, atol=1e-3)
        else:
            assert torch.equal(after[rows], before[rows])
    assert linear.storage_bytes == 96 * 64 * 2 and linear.in_features == 64
    kernel = decode_attention.load_linear_rows()
    if kernel is None:
        return
    # as the model sets it up: a few rows through the few-row kernel on the packed copy
    linear.rows_packed = decode_attention.pack_rows(weight.to(torch.bfloat16))
    linear.rows_kernel = kernel
    packed = outputs(linear, inputs)
    for rows in ROW_COUNTS:
        if rows <= 4:
            assert torch.equal(packed[rows], packed[rows].to(torch.bfloat16).float())
            torch.testing.assert_close(packed[rows], before[rows], rtol=2**-7, atol=1e-3)
        else:
            assert torch.equal(packed[rows], before[rows])


def test_bf16_compute_drops_the_plain_copy_only_beside_onednns():
    generator = torch.Generator().manual_seed(1)
    linear = Linear(torch.randn(80, 64, generator=generator), "bfloat16", torch.bfloat16)
    inputs = {
        rows: torch.randn(rows, 64, generator=generator).to(torch.bfloat16) for rows in ROW_COUNTS
    }
    before = outputs(linear, inputs)
    if linear.packed is None:  # no oneDNN here: the plain copy is the only one
        assert not linear.release_plain() and linear.weight is not None
        return
    assert linear.release_plain() and linear.weight is None
    after = outputs(linear, inputs)
    assert all(torch.equal(after[rows], before[rows]) for rows in ROW_COUNTS)


@pytest.mark.parametrize("storage", ["float32", "int8"])
def test_other_storages_keep_their_only_copy(storage: str):
    linear = Linear(torch.randn(32, 64), storage, torch.float32)
    assert not linear.release_plain() and linear.weight is not None
    assert linear.storage_bytes == 32 * 64 * (4 if storage == "float32" else 1)


def test_a_loaded_bf16_model_keeps_the_plain_copy_of_the_embedding_only(tiny_llama: Path):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="bfloat16", num_blocks=64))
    engine.load()
    model = engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    kept = [m for m in linears if m.weight is not None]
    assert model.embed.as_linear.weight is not None
    if engine.device.type == "cpu" and all(
        m.packed is not None or m.wide_weight is not None for m in linears
    ):
        assert kept == [model.embed.as_linear]
    # the roofline's bytes count every matrix once, in its storage dtype
    config = engine.model_config
    per_layer = config.hidden_size * (
        (config.num_heads + 2 * config.num_kv_heads) * config.head_dim  # q, k, v
        + config.num_heads * config.head_dim  # o
        + 3 * config.intermediate_size  # gate, up, down
    )
    matrices = config.num_layers * per_layer + config.vocab_size * config.hidden_size
    assert engine.weight_bytes == 2 * matrices
    # steps of every size still run: a lone 3-token prompt (few rows outside the step
    # kernel), a 40-token one, then decodes
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(token_ids=[5, 6, 7], params=params)]
    engine.scheduler.add(seqs[0])
    engine._step(record=False)
    seqs.append(Sequence(token_ids=list(range(3, 43)), params=params))
    engine.scheduler.add(seqs[1])
    while not all(seq.is_finished for seq in seqs):
        engine._step(record=False)
    assert [seq.num_output_tokens for seq in seqs] == [6, 6]


def test_kv_cache_asks_for_huge_pages_and_starts_zeroed():
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    cache = KVCache(config, 1024, 16, torch.bfloat16, torch.device("cpu"))  # 4 MiB
    assert cache.huge_pages == (sys.platform == "linux")
    assert not cache.kv.any()
    assert not advise_huge_pages(torch.empty(1024))  # no whole 2 MiB page inside


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32 logits path is CUDA's")
def test_logits_on_cuda_keep_the_fp32_accumulation():
    """bf16 weights on CUDA: the vocabulary projection keeps its fp32 sums (mm's out_dtype)
    rather than rounding each logit to bf16, which flipped SmolLM2's first token on the
    Paris prompt on an H200 ("L" for "The", 0.08 apart)."""
    torch.manual_seed(0)
    weight = torch.randn(512, 64, device="cuda")
    linear = Linear(weight, "bfloat16", torch.bfloat16)
    x = torch.randn(3, 64, device="cuda").to(torch.bfloat16)
    logits = linear.forward_fp32(x)
    assert linear.weight is not None
    exact = x.double() @ linear.weight.double().t()
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-4
    assert (linear(x).double() - exact).abs().max() > 1e-3  # the bf16-rounded outputs
