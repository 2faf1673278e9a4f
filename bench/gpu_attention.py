"""The attention backends side by side on one loaded engine (bench/gpu_bench.py): decode
steps of many rows, more than the decode graphs take (they run op by op, as at 256 in
flight), timed alternately with the Triton paged attention kernel and with PyTorch ops.

Both backends read the same KV cache layout, so one engine switches between them
(ModelRunner.set_attention_backend) step by step: the same rows, contexts and weights,
in ABBA order so that drift (clocks, growing contexts) falls on both.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine.models.paged_attention import triton_available
from engine.sequence import SamplingParams, Sequence


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compare_backends(engine: Any, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """ms per decode step of len(prompts) rows (after their prefill) with each backend,
    `steps` of each; where Triton does not import, why not."""
    reason = triton_available()
    if reason is not None:
        return {"skipped": reason}
    runner = engine.runner
    device = engine.device
    chosen = runner.attention_backend
    params = SamplingParams(max_tokens=1_000_000, temperature=0, ignore_eos=True)
    seqs = [Sequence(token_ids=list(prompt), params=params) for prompt in prompts]
    for seq in seqs:
        engine.scheduler.add(seq)
    try:
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs):
            engine._step(record=False)  # the prompts, in budget-sized steps
        seconds: dict[str, list[float]] = {"triton": [], "torch": []}
        paths: set[str] = set()
        order = ("triton", "torch", "torch", "triton")
        for index in range(2 * steps):
            backend = order[index % 4]
            runner.set_attention_backend(backend)
            synchronize(device)
            started = time.perf_counter()
            engine._step(record=False)  # sampling reads the tokens: the step is done
            seconds[backend].append(time.perf_counter() - started)
            paths.add(runner.last_path)
    finally:
        runner.set_attention_backend(chosen)
        for seq in seqs:
            if not seq.is_finished:
                engine.scheduler.finish(seq, "abort")
    triton_ms = statistics.median(seconds["triton"]) * 1000
    torch_ms = statistics.median(seconds["torch"]) * 1000
    return {
        "rows": len(seqs),
        "context": statistics.mean(len(seq) for seq in seqs),
        "steps_each": steps,
        "paths": sorted(paths),
        "triton_ms": triton_ms,
        "torch_ms": torch_ms,
        "torch_over_triton": torch_ms / triton_ms,
    }
