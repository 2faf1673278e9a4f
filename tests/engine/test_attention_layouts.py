"""The attention layouts of the PyTorch path: CUDA's against the CPU's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
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
