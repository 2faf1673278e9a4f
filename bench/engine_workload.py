"""What the engine benchmark runs and where: its options, workloads and device."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# `python -m bench.engine_bench` alone; as a step of `make bench` its own limits apply
# (engine_bench.BUDGET_S and QUICK_BUDGET_S).
ALONE_BUDGET_S = 400
ALONE_QUICK_BUDGET_S = 150
SMOLLM2_EOS = 2
DECODE_PROMPT = "Write a long story about a lighthouse keeper."
DECODE_ROUNDS = 3
# The headline decode ratio: windows of this many decode steps, each with a short read of
# memory either side of it (the read bandwidth of the shared VM moves by 2x within
# seconds, so a decode and a read seconds apart can see different machines)
DECODE_WINDOW = 16
WINDOW_READ_MIB = 256


@dataclass(slots=True)
class Options:
    model: str = "smollm2"
    dtype: str = "bfloat16"
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_num_batched_tokens: int = 512
    kv_cache_mb: int = 2048
    requests: int = 256
    prompt_range: tuple[int, int] = (32, 512)
    output_range: tuple[int, int] = (32, 256)
    in_flight: int = 64
    batch_size: int = 64  # HF static batch
    reference_batches: int = 1  # HF is timed on the first batches only (its rate, tok/s)
    decode_tokens: int = 128
    ttft_prompt: int = 128
    ttft_many: int = 32
    budget_s: float = ALONE_BUDGET_S
    skip_reference: bool = False
    reference_dtype: str | None = None  # None: the engine's dtype where it runs natively
    # Why vLLM's CPU build is left out as a reference; None: measured where it is built
    no_vllm: str | None = None
    attention_backend: str = "auto"  # the engine's --attention-backend


QUICK = Options(
    requests=32, prompt_range=(32, 256), output_range=(16, 64), in_flight=16, batch_size=16,
    decode_tokens=32, ttft_many=8, budget_s=ALONE_QUICK_BUDGET_S,
)  # fmt: skip


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]


def make_workload(count: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int = 1234) -> Workload:  # fmt: skip
    rng = random.Random(seed)
    prompts, limits = [], []
    for _ in range(count):
        length = rng.randint(*prompt_range)
        # ordinary text tokens of the SmolLM2 vocabulary (ids below ~100 are bytes/specials)
        prompts.append([rng.randint(300, 40000) for _ in range(length)])
        limits.append(rng.randint(*output_range))
    return Workload(prompts, limits)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(300, 40000) for _ in range(length)] for _ in range(count)]


# The engine serves on CUDA where present (engine.llm_engine.pick_device); the reference,
# the reads and the kernel ceilings run where it runs.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    """Wait for queued GPU work before a clock is read (nothing to wait for on CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
