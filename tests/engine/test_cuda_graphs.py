"""Decode steps in fixed shapes, as a CUDA graph replays them (engine/cuda_graphs.py): the
same logits as the step they stand for, padding rows and columns included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import GRAPH_ROWS, DecodeGraphs, table_widths
from engine.llm_engine import LLMEngine
from engine.models.paged_attention import triton_available
from engine.sequence import SamplingParams, Sequence

PROMPT_LENGTHS = [3, 9, 17, 30, 41]  # one to three blocks of 16 at the start
MAX_TOKENS = [70, 45, 30, 20, 10]  # rows end at different steps: five, then four... one


def test_table_widths_reach_the_widest_table():
    assert table_widths(1) == [1]
    assert table_widths(64) == [1, 2, 4, 8, 16, 32, 64]
    assert table_widths(48) == [1, 2, 4, 8, 16, 32, 48]


def generate(engine: LLMEngine) -> list[list[int]]:
    """Greedy outputs of PROMPT_LENGTHS prompts, all in flight at once."""
    seqs = []
    for index, (length, limit) in enumerate(zip(PROMPT_LENGTHS, MAX_TOKENS, strict=True)):
        prompt = [(7 * index + 3 * i) % 500 + 5 for i in range(length)]
        params = SamplingParams(max_tokens=limit, temperature=0, ignore_eos=True)
        seqs.append(Sequence(token_ids=prompt, params=params))
        engine.scheduler.add(seqs[-1])
    while not all(seq.is_finished for seq in seqs):
        engine._step(record=False)
    for seq in seqs:
        engine.block_manager.free(seq)
    return [seq.output_token_ids for seq in seqs]


# bf16: the layer path on CPU runs the bf16 kernels, the padded step PyTorch ops, and the
# logits (about 3 in size) part by up to 0.11 from their rounding; a wrong slot or mask
# moves them by whole units.
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 0.25)])
def test_padded_decode_gives_the_logits_of_the_step_it_stands_for(
    tiny_llama: Path, dtype: str, tolerance: float, monkeypatch: pytest.MonkeyPatch
):
    # one token per step (drafts, engine/speculative.py, run as chunks, not graphs)
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama), dtype=dtype, max_model_len=128, num_blocks=64,
            speculative="off",
        )
    )  # fmt: skip
    engine.load()
    runner = engine.runner
    assert runner.cache.spare_block == 64  # past the blocks the block manager hands out
    graphs = DecodeGraphs(runner.model, runner.cache, 16, max_blocks=8)
    run = runner.run
    buckets: set[tuple[int, int]] = set()
    decode_steps = 0

    def checked(batch):
        nonlocal decode_steps
        output, seqs = run(batch)
        if runner.decode_only(batch):
            decode_steps += 1
            padded = graphs.run(seqs)
            assert padded.shape == output.logits.shape and padded.dtype == torch.float32
            assert (padded - output.logits).abs().max() < tolerance
            width = max(-(-len(seq) // 16) for seq in seqs)
            buckets.add(graphs.bucket(len(seqs), width))
        return output, seqs

    monkeypatch.setattr(runner, "run", checked)
    generate(engine)
    # the engine's step timings name the way each step ran: no graphs on CPU
    stats = engine.stats()
    assert stats["steps"] == {"mixed": 1, "decode": decode_steps}
    step_seconds = stats["step_seconds"]
    assert isinstance(step_seconds, dict)
    assert step_seconds["decode"] > 0 and stats["decode_graphs"] == 0
    assert stats["attention_backend"] == "torch"  # auto: PyTorch ops and C kernels on CPU
    assert {rows for rows, _ in buckets} == {8, 4, 2, 1}  # five rows padded to eight, ...
    assert {width for _, width in buckets} == {4, 8}  # three blocks padded to four, ...
    assert all(rows in GRAPH_ROWS for rows, _ in buckets)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_graphs_replay_the_eager_tokens_on_cuda(tiny_llama: Path, dtype: str, attention: str):
    """The engine with its graphs against the engine eager: the same greedy tokens. With
    the Triton attention the first (mixed) step replays a step graph too."""
    if attention == "triton" and triton_available() is not None:
        pytest.skip(f"{triton_available()}")
    outputs = []
    for eager in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama), dtype=dtype, device="cuda", max_model_len=128,
                num_blocks=64, enforce_eager=eager, speculative="off",
                attention_backend=attention,
            )
        )  # fmt: skip
        engine.load()
        engine.warm_up()
        assert engine.runner.graphs_ready is not eager
        stepped = not eager and attention == "triton"
        assert engine.runner.step_graphs_ready is stepped
        outputs.append(generate(engine))
        steps = engine.stats()["steps"]
        assert isinstance(steps, dict)
        assert ("graph" in steps) is not eager
        assert ("step_graph" in steps) is stepped
    assert outputs[0] == outputs[1]
