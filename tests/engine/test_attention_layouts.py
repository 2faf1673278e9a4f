"""The attention layouts of the PyTorch path: CUDA's against the CPU's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import model_runner
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.llm_engine import LLMEngine
from engine.model_runner import attention_backend_for
from engine.models.paged_attention import triton_available
from engine.scheduler import ScheduledBatch
from engine.sequence import SamplingParams, Sequence
from tests.engine.test_attention import compare_steps

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
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


def backend_engines(tiny_llama: Path, device: str) -> list[LLMEngine]:
    """Two engines of the tiny model in fp32 PyTorch ops: attention in the Triton kernel,
    then in PyTorch ops."""
    engines = []
    for backend in ("triton", "torch"):
        config = EngineConfig(
            model=str(tiny_llama), device=device, num_blocks=64, block_size=16, max_model_len=128
        )
        engine = LLMEngine(config)
        engine.load()
        engine.runner.model.set_kernels(False)
        engine.runner.set_attention_backend(backend)
        engines.append(engine)
    return engines


def run_planned_step(
    engine: LLMEngine, seqs: list[Sequence], step: list[tuple[int, int, list[int]]]
) -> tuple[torch.Tensor, list[int]]:
    """One step of (sequence index, new tokens, drafts after them) through the runner, its
    blocks allocated first; the logits and the indices of the sequences that sampled, in
    row order. The drafts are then rejected: the next step writes over their K/V."""
    batch = ScheduledBatch()
    for index, count, drafts in step:
        seq = seqs[index]
        if not seq.block_table:
            assert engine.block_manager.allocate(seq)
        seq.draft_token_ids = list(drafts)
        end = seq.num_computed_tokens + count + len(drafts)
        assert engine.block_manager.ensure_capacity(seq, end)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(count + len(drafts))
    output, sampling = engine.runner.run(batch)
    for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += count - len(seq.draft_token_ids)
        seq.draft_token_ids = []
        engine.block_manager.register_computed(seq)
    return output.logits, [seqs.index(seq) for seq in sampling]


@pytest.mark.skipif(triton_available() is not None, reason=f"{triton_available()}")
@pytest.mark.parametrize("device", DEVICES)
def test_triton_kernel_matches_the_torch_path(tiny_llama: Path, device: str):
    """Every token of a step in the Triton paged attention kernel (on CPU through Triton's
    interpreter) against PyTorch ops, both fp32: the same logits at every step of prompts,
    a chunk after cached context, a prompt whose first block is a prefix-cache hit, decode
    rows, drafts as chunks, then a decode step with drafts in decode_padded's fixed shapes
    (each row a sequence of its own, as the CUDA graphs replay it)."""
    engines = backend_engines(tiny_llama, device)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 16, 40)]
    prompts.append(prompts[1] + [rng.randrange(3, 400) for _ in range(9)])  # shares a block
    # per step: (prompt index, new tokens, drafts after them)
    plan: list[list[tuple[int, int, list[int]]]] = [
        [(0, 5, []), (1, 16, []), (2, 21, [])],
        [(0, 1, []), (1, 1, []), (2, 19, []), (3, 9, [])],  # 3: 16 tokens cached
        [(0, 1, [7, 8, 9]), (1, 1, []), (2, 1, [11, 12]), (3, 1, [])],
        [(0, 1, []), (1, 1, [5]), (2, 1, []), (3, 1, [])],
    ]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    seqs = [[Sequence(token_ids=list(p), params=params) for p in prompts] for _ in engines]
    for step in plan:
        outputs = []
        for engine, engine_seqs in zip(engines, seqs, strict=True):
            outputs.append(run_planned_step(engine, engine_seqs, step))
            assert engine.runner.last_path in ("decode", "mixed")
        (logits, order), (expected, expected_order) = outputs
        assert order == expected_order
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        # the first row of each sampled sequence is its next token
        rows = 0
        for index in order:
            token = int(expected[rows].argmax())
            rows += 1 + len(next(d for i, _, d in step if i == index))
            for engine_seqs in seqs:
                engine_seqs[index].token_ids.append(token)
    assert [engine_seqs[3].num_cached_tokens for engine_seqs in seqs] == [16, 16]

    padded = []
    for engine, engine_seqs in zip(engines, seqs, strict=True):
        graphs = DecodeGraphs(engine.runner.model, engine.runner.cache, 16, max_blocks=8)
        engine_seqs[2].draft_token_ids = [4, 6]
        padded.append(graphs.run(engine_seqs))
    assert padded[0].shape == (6, engines[0].model_config.vocab_size)
    torch.testing.assert_close(padded[0], padded[1], atol=1e-4, rtol=1e-4)


def test_attention_backend_setting(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch):
    """auto is PyTorch ops on CPU, and on CUDA without Triton; triton where it cannot run
    is refused at load with the reason; an unknown name at construction."""
    with pytest.raises(ValueError, match="attention_backend must be one of auto, triton, torch"):
        EngineConfig(model=str(tiny_llama), attention_backend="flash")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert attention_backend_for("auto", cpu) == "torch"
    assert attention_backend_for("torch", cuda) == "torch"
    config = EngineConfig(model=str(tiny_llama), num_blocks=64, attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend triton: needs CUDA"):
        LLMEngine(config).load()
    monkeypatch.setattr(model_runner, "triton_available", lambda: "triton not importable: x")
    assert attention_backend_for("auto", cuda) == "torch"
    with pytest.raises(ValueError, match="attention_backend triton: triton not importable"):
        attention_backend_for("triton", cuda)
    monkeypatch.setattr(model_runner, "triton_available", lambda: None)
    assert attention_backend_for("auto", cuda) == "triton"
    # a kernel that fails its check on the model's shape: auto keeps PyTorch ops
    assert attention_backend_for("auto", cuda, lambda: "differs by 0") == "torch"
    with pytest.raises(ValueError, match="attention_backend triton: differs by 0"):
        attention_backend_for("triton", cuda, lambda: "differs by 0")
    assert attention_backend_for("auto", cuda, lambda: None) == "triton"
