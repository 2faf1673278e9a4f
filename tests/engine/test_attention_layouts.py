"""The attention layouts of the PyTorch path: CUDA's against the CPU's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.scheduler import ScheduledBatch
from engine.sequence import SamplingParams, Sequence
from tests.engine.test_attention import compare_steps


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ),
    ],
)
def test_gpu_layout_matches_the_cpu_layout(tiny_llama: Path, device: str):
    """The attention layout CUDA takes (prefill chunks after cached context cut at their
    end under a lower-right causal bias, V gathered as K for decode groups) against the
    CPU's (masks, embedding_bag), both in PyTorch ops and fp32: the same logits to fp32
    rounding at every step of mixed and decode-only steps."""
    engines = []
    for gpu_layout in (True, False):
        config = EngineConfig(
            model=str(tiny_llama), device=device, num_blocks=128, block_size=16, max_model_len=512
        )
        engine = LLMEngine(config)
        engine.load()
        engine.runner.model.set_kernels(False)
        engine.runner.gpu_layout = gpu_layout
        engines.append(engine)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 16, 33, 70, 150)]
    plan: list[list[tuple[int, int]]] = [
        [(0, 5), (1, 16), (2, 20), (3, 37), (4, 1)],  # chunks that end mid-block
        [(0, 1), (1, 1), (2, 13), (3, 33), (4, 64)],  # context: 20, 37 and 1 cached tokens
        [(0, 1), (1, 1), (2, 1), (3, 1), (4, 85)],
        *[[(i, 1) for i in range(5)] for _ in range(4)],
    ]
    compare_steps(engines, prompts, plan, max_share=1e-4, mean_share=1e-5)


@pytest.mark.parametrize("max_model_len", [512, 24])
def test_warm_up_runs_a_mixed_step_after_cached_context(tiny_llama: Path, max_model_len: int):
    """Warm-up runs a decode row beside a chunk that starts after a cached block (where the
    model is long enough for two blocks), then leaves no blocks taken and no counts."""
    config = EngineConfig(
        model=str(tiny_llama), num_blocks=64, block_size=16, max_model_len=max_model_len
    )
    engine = LLMEngine(config)
    engine.load()
    steps: list[list[tuple[int, int]]] = []  # (computed before the step, new tokens) per row
    run = engine.runner.run

    def recording_run(batch):
        steps.append(
            [
                (s.num_computed_tokens, n)
                for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            ]
        )
        return run(batch)

    engine.runner.run = recording_run  # type: ignore[method-assign]
    engine.warm_up()
    mixed_after_context = [
        step
        for step in steps
        if any(n == 1 for _, n in step) and any(done > 0 and n > 1 for done, n in step)
    ]
    assert bool(mixed_after_context) == (max_model_len == 512), steps
    assert engine.block_manager.usage == 0
    assert engine.block_manager.prefix_cache_queries == engine.block_manager.prefix_cache_hits == 0


@pytest.mark.parametrize("kernels", [False, True])
def test_a_one_token_chunk_of_a_prompt_attends_to_its_prefix_alone(tiny_llama: Path, kernels: bool):
    """A budget can leave a prompt a chunk of one token, which runs among the single-token
    rows: its keys end at its own position, not at the prompt's end. The prompt's last
    logits match those of the prompt computed in one chunk."""
    config = EngineConfig(
        model=str(tiny_llama), dtype="bfloat16" if kernels else "float32", num_blocks=64,
        block_size=16, max_model_len=256,
    )  # fmt: skip
    engine = LLMEngine(config)
    engine.load()
    engine.runner.model.set_kernels(kernels)
    rng = random.Random(5)
    prompt = [rng.randrange(3, 400) for _ in range(40)]
    other = [rng.randrange(3, 400) for _ in range(10)]
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def last_logits(plan: list[list[tuple[int, int]]]) -> torch.Tensor:
        seqs = [Sequence(token_ids=list(p), params=params) for p in (prompt, other)]
        for seq in seqs:
            assert engine.block_manager.allocate(seq)
            assert engine.block_manager.ensure_capacity(seq, len(seq))
        logits = torch.empty(0)
        for step in plan:
            batch = ScheduledBatch()
            for index, count in step:
                batch.seqs.append(seqs[index])
                batch.num_new_tokens.append(count)
            output, sampling = engine.runner.run(batch)
            for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_computed_tokens += count
            if seqs[0] in sampling:
                logits = output.logits[sampling.index(seqs[0])]
        for seq in seqs:
            engine.block_manager.free(seq)
        return logits

    whole = last_logits([[(0, 40)]])
    # the one-token chunk beside another prompt's chunk (a mixed step), then alone
    chunked = last_logits([[(0, 20)], [(0, 1), (1, 10)], [(0, 1)], [(0, 18)]])
    scale = whole.abs().max().item()
    assert (chunked - whole).abs().max().item() <= (0.05 if kernels else 1e-4) * scale
