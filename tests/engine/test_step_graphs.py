"""Whole steps padded to a token bucket for CUDA graphs (engine/step_graphs.py): the
layout's buffer, and the padded step's logits against the unpadded PyTorch path."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.paged_attention import triton_available
from engine.sequence import SamplingParams, Sequence
from engine.step_graphs import StepGraphs, StepInputs, token_buckets
from tests.engine.test_attention_layouts import DEVICES, backend_engines, run_planned_step


def test_token_buckets_cover_every_step_size():
    assert token_buckets(2048)[:12] == [8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    for budget in (1, 8, 100, 512, 2048, 3000):
        buckets = token_buckets(budget)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max(budget, 8)
        # above 32 tokens a step pads by under a quarter of its size
        for tokens in range(33, budget + 1):
            bucket = next(b for b in buckets if b >= tokens)
            assert bucket - tokens < tokens / 4 or bucket == buckets[-1]


def sequence(prompt: int, computed: int, blocks: list[int]) -> Sequence:
    seq = Sequence(token_ids=list(range(100, 100 + prompt)), params=SamplingParams())
    seq.num_computed_tokens = computed
    seq.block_table = blocks
    return seq


def test_the_buffer_of_a_mixed_step():
    """Two decode rows and a chunk after cached context: tokens, positions, slots, each
    sequence's table and tiles, logits at the tokens that sample, padding to the spare."""
    inputs = StepInputs(block_size=4, spare_block=50, width=4, group=2, max_seqs=8)
    layout = inputs.layout(16, 32)  # 64 rows / group 2
    assert (layout.seqs, layout.logits, layout.tiles) == (8, 8, 9)
    seqs = [sequence(6, 5, [3, 7]), sequence(2, 1, [9]), sequence(10, 4, [1, 2, 5])]
    buffer, sampling = inputs.build(layout, seqs, [1, 1, 5])
    ids, positions, slots, logits, table, lens, starts, tile_seqs, tile_starts = layout.views(
        buffer
    )
    assert ids[:7].tolist() == [105, 101, 104, 105, 106, 107, 108]
    assert positions[:7].tolist() == [5, 1, 4, 5, 6, 7, 8]
    assert slots[:7].tolist() == [
        7 * 4 + 1,
        9 * 4 + 1,
        2 * 4,
        2 * 4 + 1,
        2 * 4 + 2,
        2 * 4 + 3,
        5 * 4,
    ]
    # padding: position 0, the spare block's slots in turn
    assert positions[7:].tolist() == [0] * 9
    assert slots[7:].tolist() == [50 * 4 + i % 4 for i in range(9)]
    assert sampling == seqs[:2]  # the chunk ends before its prompt does
    assert logits.tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    table = table.reshape(8, 4)
    assert table[:3].tolist() == [[3, 7, 0, 0], [9, 0, 0, 0], [1, 2, 5, 0]]
    assert lens[:3].tolist() == [6, 2, 9]
    assert starts.tolist() == [0, 1, 2, 7, 7, 7, 7, 7, 7]
    assert tile_seqs.tolist()[:4] == [0, 1, 2, -1] and set(tile_seqs[3:].tolist()) == {-1}
    assert tile_starts[:3].tolist() == [0, 1, 2]


def test_every_step_fits_its_bucket():
    """Random steps of up to max_seqs sequences and the budget's tokens: each token in one
    tile of its own sequence, the tile table within the layout's."""
    rng = random.Random(1)
    inputs = StepInputs(block_size=16, spare_block=999, width=64, group=3, max_seqs=32)
    buckets = token_buckets(512)
    for _ in range(300):
        count = rng.randint(1, 32)
        counts = [rng.choice([1, 1, 1, rng.randint(1, 200)]) for _ in range(count)]
        while sum(counts) > 512:
            counts[counts.index(max(counts))] //= 2
        seqs = []
        for new in counts:
            done = rng.randint(0, 1024 - 16 - new)
            blocks = list(range(-(-(done + new) // 16)))
            seqs.append(sequence(done + new, done, blocks))
        block_q = rng.choice([5, 21])
        layout = inputs.layout(next(b for b in buckets if b >= sum(counts)), block_q)
        buffer, _ = inputs.build(layout, seqs, counts)
        *_, starts, tile_seqs, tile_starts = layout.views(buffer)
        covered = np.zeros(layout.tokens, dtype=int)
        for seq, start in zip(tile_seqs.tolist(), tile_starts.tolist(), strict=True):
            if seq < 0:
                continue
            end = min(start + layout.block_q, starts[seq + 1])
            assert starts[seq] <= start < end
            covered[start:end] += 1
        assert covered[: sum(counts)].tolist() == [1] * sum(counts)
        assert not covered[sum(counts) :].any()


@pytest.mark.skipif(triton_available() is not None, reason=f"{triton_available()}")
@pytest.mark.parametrize("device", DEVICES)
def test_a_padded_step_matches_the_torch_path(tiny_llama: Path, device: str):
    """Steps through the step graphs' padded layout (op by op; replayed on CUDA), the
    Triton kernel (on CPU, Triton's interpreter) against PyTorch ops: the same logits at
    every step of prompts, a chunk after cached context, a prefix-cache hit and decode
    rows; a step with drafts is not theirs."""
    engines = backend_engines(tiny_llama, device)
    runner = engines[0].runner
    runner.step_graphs = StepGraphs(runner.model, runner.cache, 16, 8, max_tokens=64, max_seqs=8)
    if device == "cuda":
        runner.step_graphs.capture()
    runner.step_graphs_ready = True
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (5, 16, 40)]
    prompts.append(prompts[1] + [rng.randrange(3, 400) for _ in range(9)])  # shares a block
    plan: list[list[tuple[int, int, list[int]]]] = [
        [(0, 5, []), (1, 16, []), (2, 21, [])],  # 42 tokens: the 48 bucket
        [(0, 1, []), (1, 1, []), (2, 19, []), (3, 9, [])],  # 3: 16 tokens cached
        [(0, 1, []), (1, 1, []), (2, 1, []), (3, 1, [])],
        [(0, 1, [7, 8]), (1, 1, []), (2, 1, []), (3, 1, [])],  # drafts: another path
    ]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    seqs = [[Sequence(token_ids=list(p), params=params) for p in prompts] for _ in engines]
    for step in plan:
        outputs = [
            run_planned_step(engine, engine_seqs, step)
            for engine, engine_seqs in zip(engines, seqs, strict=True)
        ]
        if any(drafts for _, _, drafts in step):
            assert runner.last_path in ("decode", "mixed")
            continue
        assert runner.last_path == "step_graph"
        (logits, order), (expected, expected_order) = outputs
        assert sorted(order) == sorted(expected_order)
        # the step graphs keep the batch's order; the torch path sorts its rows
        rows = {index: row for row, index in enumerate(order)}
        expected_rows = {index: row for row, index in enumerate(expected_order)}
        for index in order:
            torch.testing.assert_close(
                logits[rows[index]], expected[expected_rows[index]], atol=1e-4, rtol=1e-4
            )
        for index in expected_order:
            token = int(expected[expected_rows[index]].argmax())
            for engine_seqs in seqs:
                engine_seqs[index].token_ids.append(token)
    assert [engine_seqs[3].num_cached_tokens for engine_seqs in seqs] == [16, 16]


@pytest.mark.skipif(triton_available() is not None, reason=f"{triton_available()}")
def test_the_capture_probe_writes_the_spare_block_alone(tiny_llama: Path):
    """The inputs a graph is captured and checked on: one short prompt in the spare block,
    padding after it. Every block the engine hands out keeps its contents."""
    config = EngineConfig(model=str(tiny_llama), num_blocks=16, block_size=16, max_model_len=64)
    engine = LLMEngine(config)
    engine.load()
    runner = engine.runner
    runner.model.set_kernels(False)
    runner.cache.kv.normal_()
    before = runner.cache.kv.clone()
    graphs = StepGraphs(runner.model, runner.cache, 16, 4, max_tokens=40, max_seqs=4)
    spare = runner.cache.spare_block
    for layout in graphs.layouts.values():
        graphs._load(graphs.probe(layout), wait=True)
        logits = graphs._forward(layout)()
        assert logits.shape == (layout.logits, engine.model_config.vocab_size)
        assert torch.isfinite(logits[0]).all()
    kv = runner.cache.kv
    assert torch.equal(kv[:, :, :spare], before[:, :, :spare])
    assert not torch.equal(kv[:, :, spare], before[:, :, spare])


def test_decode_only_steps_take_short_tiles(tiny_llama: Path):
    """Steps of single tokens take the short-tile layouts up to max_seqs rows, as an eager
    step would; a step with a longer chunk the long tiles."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_blocks=16, max_model_len=64))
    engine.load()
    runner = engine.runner
    graphs = StepGraphs(runner.model, runner.cache, 16, 4, max_tokens=256, max_seqs=20)
    assert (graphs.short_q, graphs.long_q) == (8, 32)  # 16 and 64 rows of group 2
    assert graphs.layout_for([1] * 20).block_q == 8
    assert graphs.layout_for([1] * 19 + [2]).block_q == 8
    assert graphs.layout_for([1] * 10 + [30]).block_q == 32
    assert graphs.layout_for([1] * 4).tokens == 8
    assert {tokens for tokens, q in graphs.layouts if q == 8} == {8, 16, 24}
