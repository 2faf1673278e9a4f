"""The ways a step's attention runs, side by side on one loaded engine (bench/gpu_bench.py):
steps of many decode rows, more than the decode graphs take (as at 256 in flight), alone
and beside a new prompt's chunk (a mixed step, as most serving steps are), timed in turn
with PyTorch ops, with the Triton paged attention kernel op by op and, where they were
captured (CUDA), with the Triton kernel in the step graphs (engine/step_graphs.py).

Every way reads the same KV cache layout, so one engine switches between them
(ModelRunner.set_attention_backend, step_graphs_ready) step by step: the same rows,
contexts and weights, in palindromic order (ABCCBA) so that drift (clocks, growing
contexts) falls on each alike.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine.models.paged_attention import triton_available
from engine.sequence import SamplingParams, Sequence

MODES = ("triton", "torch", "step_graphs")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def set_mode(runner: Any, mode: str, graphs_ready: bool) -> None:
    runner.set_attention_backend("torch" if mode == "torch" else "triton")
    runner.step_graphs_ready = graphs_ready and mode == "step_graphs"


def compare_backends(
    engine: Any, prompts: list[list[int]], steps: int, chunk: list[int] | None = None
) -> dict[str, Any]:
    """ms per step of len(prompts) decode rows (after their prefill), and with `chunk` a
    new prompt of those tokens beside them in every step, `steps` of each way; where
    Triton does not import, why not."""
    reason = triton_available()
    if reason is not None:
        return {"skipped": reason}
    runner = engine.runner
    device = engine.device
    chosen, graphs_ready = runner.attention_backend, runner.step_graphs_ready
    modes = [mode for mode in MODES if mode != "step_graphs" or graphs_ready]
    if chunk is not None:  # room for the new prompt among the running sequences
        prompts = prompts[: engine.scheduler.max_num_seqs - 1]
    params = SamplingParams(max_tokens=1_000_000, temperature=0, ignore_eos=True)
    seqs = [Sequence(token_ids=list(prompt), params=params) for prompt in prompts]
    for seq in seqs:
        engine.scheduler.add(seq)
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    paths: set[str] = set()
    order = modes + modes[::-1]
    try:
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs):
            engine._step(record=False)  # the prompts, in budget-sized steps
        for index in range(len(modes) * steps):
            mode = order[index % len(order)]
            set_mode(runner, mode, graphs_ready)
            extra = None
            if chunk is not None:  # a new prompt, computed whole in this step
                extra = Sequence(token_ids=list(chunk), params=params)
                engine.scheduler.add(extra)
            synchronize(device)
            started = time.perf_counter()
            engine._step(record=False)  # sampling reads the tokens: the step is done
            seconds[mode].append(time.perf_counter() - started)
            paths.add(runner.last_path)
            if extra is not None:
                engine.scheduler.finish(extra, "abort")
    finally:
        runner.set_attention_backend(chosen)
        runner.step_graphs_ready = graphs_ready
        for seq in seqs:
            if not seq.is_finished:
                engine.scheduler.finish(seq, "abort")
    ms = {mode: statistics.median(seconds[mode]) * 1000 for mode in modes}
    result: dict[str, Any] = {
        "rows": len(seqs),
        "chunk": len(chunk) if chunk is not None else 0,
        "context": statistics.mean(len(seq) for seq in seqs),
        "steps_each": steps,
        "paths": sorted(paths),
        **{f"{mode}_ms": value for mode, value in ms.items()},
        "torch_over_triton": ms["torch"] / ms["triton"],
    }
    if "step_graphs" in ms:
        result["eager_over_graphs"] = ms["triton"] / ms["step_graphs"]
    return result


def describe(shape: str, compared: dict[str, Any]) -> str:
    """One line of the summary."""
    chunk = f" beside a {compared['chunk']}-token prompt" if compared["chunk"] else ""
    line = (
        f"[{shape}] attention, steps of {compared['rows']} decode rows{chunk} (context "
        f"{compared['context']:.0f}, {compared['paths']}): Triton kernel "
        f"{compared['triton_ms']:.2f} ms/step, PyTorch ops {compared['torch_ms']:.2f}"
    )
    if "step_graphs_ms" in compared:
        line += f", Triton in step graphs {compared['step_graphs_ms']:.2f}"
    line += f"; RATIO torch/triton {compared['torch_over_triton']:.2f}x"
    if "eager_over_graphs" in compared:
        line += f"; RATIO eager/graphs {compared['eager_over_graphs']:.2f}x"
    return line
