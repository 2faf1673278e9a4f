"""GPU benchmark of the serving engine: one command, figures beside their targets.

    python -m bench.gpu_bench --out DIR             # SmolLM2-135M and 1B shapes (a GPU)
    python -m bench.gpu_bench --out DIR --smoke     # a tiny shape, a few requests (a CPU)
    python -m bench.gpu_bench --out DIR --shapes llama-1b   # one shape

For each shape, random weights in a cached HF folder (bench/gpu_models.py), all in one run:

1. serving: the engine over HTTP (`--max-num-seqs 256 --max-num-batched-tokens 2048`),
   512 requests of 24-400 words, 32-256 output tokens each with ignore_eos, 256 in
   flight, useful output tok/s; against HF transformers `generate` in static batches of
   64 and of 256 on the same requests, weights and dtype, the faster of the two;
2. single-stream decode tok/s in-process against the memory roofline: the bytes of the
   weights over the device's read bandwidth, measured in the same run;
3. TTFT p50 of 64 simultaneous 128-token prompts over HTTP;
4. a profile of the serving workload in-process (bench/gpu_profile.py): step phases and
   the profiler's self time by group, with a chrome trace;
5. the ways attention runs side by side (bench/gpu_attention.py): steps of 128 and 256
   decode rows, more than the decode graphs take, alone and beside a 256-token prompt,
   with PyTorch ops, the Triton kernel op by op and the Triton kernel in step graphs.

Writes DIR/figures.json, DIR/summary.txt (the lines printed), DIR/profile.json,
DIR/profile.txt and DIR/profile_trace_<shape>.json.gz. Targets are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.engine_bench import (
    ADMIN_HEADERS,
    SERVING_HEADERS,
    start_engine,
    step_breakdown,
    stop_engine,
)
from bench.engine_client import run_serving, run_ttft
from bench.engine_inprocess import read_bandwidth_gbs
from bench.engine_reference import best_reference, reference_dtype
from bench.engine_workload import DEVICE, REPO_ROOT, Options, Workload
from bench.gpu_attention import compare_backends, describe
from bench.gpu_models import (
    LLAMA_1B,
    MODELS_DIR,
    SHAPES,
    SMOLLM2_135M,
    TINY,
    Shape,
    model_folder,
    token_prompts,
    word_prompts,
)
from bench.gpu_profile import ProfilePlan, profile_serving, render_profile
from bench.report import normalize_figure
from engine.config import ATTENTION_BACKENDS


@dataclass(slots=True)
class Plan:
    shapes: tuple[Shape, ...]
    requests: int = 512
    words: tuple[int, int] = (24, 400)
    outputs: tuple[int, int] = (32, 256)
    in_flight: int = 256
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_mb: int = 8192
    client_processes: int = 4  # one asyncio client parses ~20k SSE chunks/s at most
    warm_requests: int = 32  # served before the timed run, so first-shape costs are not in it
    reference_batches: tuple[int, ...] = (64, 256)
    reference_requests: int = 256  # HF's share of the workload: its first requests
    reference_seconds: float = 120.0  # HF's time limit per batch size
    decode_prompt: int = 32
    decode_tokens: int = 256
    decode_rounds: int = 3
    ttft_prompts: int = 64
    ttft_tokens: int = 128
    # attention backends side by side (bench/gpu_attention.py): decode steps of these many
    # rows after prompts of attention_prompt tokens, alone and beside a new prompt of
    # attention_chunk tokens, attention_steps with each backend
    attention_rows: tuple[int, ...] = (128, 256)
    attention_prompt: int = 384
    attention_chunk: int = 256
    attention_steps: int = 8
    attention_backend: str = "auto"  # the engine's --attention-backend
    profile: ProfilePlan = field(
        default_factory=lambda: ProfilePlan(skip_steps=30, active_steps=30)
    )
    seed: int = 1234


FULL = Plan(shapes=(SMOLLM2_135M, LLAMA_1B))
SMOKE = Plan(
    shapes=(TINY,),
    requests=8,
    words=(24, 40),
    outputs=(4, 8),
    in_flight=4,
    kv_cache_mb=64,
    client_processes=1,
    warm_requests=2,
    reference_batches=(2, 8),
    reference_requests=8,
    reference_seconds=30.0,
    decode_prompt=16,
    decode_tokens=16,
    decode_rounds=2,
    ttft_prompts=4,
    ttft_tokens=16,
    attention_rows=(6,),  # no step kernel takes head_dim 16: these steps run attention ops
    attention_prompt=20,
    attention_chunk=12,
    attention_steps=1,
    profile=ProfilePlan(skip_steps=1, active_steps=3, warmup_steps=1),
)
# The targets; a shape without an entry has its figures reported, not judged.
TARGETS: dict[str, dict[str, str]] = {
    LLAMA_1B.name: {
        "serving_ratio": "ratio >= 5",
        "serving_rate": "value >= 20000",
        "decode": "ratio >= 0.75",
        "ttft": "value <= 100",
    },
    SMOLLM2_135M.name: {"serving_ratio": "ratio >= 5"},
}


def target(shape: Shape, figure: str) -> str:
    return TARGETS.get(shape.name, {}).get(figure, "reported")


class Log:
    """Progress lines, printed as they come (with the seconds since the start: where a
    short GPU slot goes) and kept for summary.txt."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.started = time.monotonic()

    def __call__(self, line: str) -> None:
        line = f"{time.monotonic() - self.started:6.1f}s {line}"
        print(line, flush=True)
        self.lines.append(line)


# ---- the machine ---------------------------------------------------------------------
def device_read_bandwidth() -> tuple[float, str]:
    """GB/s of a sum over a buffer far beyond the caches, and how it was read. On CUDA
    2 GiB timed by CUDA events (the best of 10); elsewhere the host's memory."""
    if DEVICE.type != "cuda":
        return read_bandwidth_gbs(), (
            "device bandwidth skipped: no CUDA device; the host's memory read instead "
            "(a 512 MiB sum, engine_inprocess.read_bandwidth_gbs)"
        )
    data = torch.ones(2**29, device=DEVICE)  # 2 GiB of fp32
    data.sum()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(10):
        start.record()
        data.sum()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del data
    torch.cuda.empty_cache()
    return 2**31 / best / 1e9, "a 2 GiB fp32 sum on the device, CUDA events, best of 10"


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


# ---- the engine in-process: single stream and profile -----------------------------------
def in_process_engine(folder: Path, shape: Shape, plan: Plan) -> Any:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            dtype=shape.dtype,
            device=DEVICE.type,
            max_model_len=1024,
            max_num_seqs=plan.max_num_seqs,
            max_num_batched_tokens=plan.max_num_batched_tokens,
            kv_cache_memory_mb=plan.kv_cache_mb,
            # one token per step: the roofline compares a step's reads with one token
            # (bench/spec_bench.py measures drafts)
            speculative="off",
            attention_backend=plan.attention_backend,
        )
    )
    torch.set_grad_enabled(False)  # as the engine's step loop runs
    engine.load()
    engine.warm_up()
    return engine


def single_stream(engine: Any, prompt: list[int], tokens: int, rounds: int) -> list[float]:
    """Decode tok/s of one sequence after its prefill, per round after an untimed one
    (each step waits for the device: sampling reads the token)."""
    from engine.sequence import SamplingParams, Sequence

    rates = []
    for _ in range(rounds + 1):
        seq = Sequence(
            token_ids=prompt,
            params=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
        )
        engine.scheduler.add(seq)
        engine._step(record=False)  # prefill + first token
        started = time.perf_counter()
        while not seq.is_finished:
            engine._step(record=False)
        rates.append((seq.num_output_tokens - 1) / (time.perf_counter() - started))
    return rates[1:]  # the first loads kernels (oneDNN builds one per shape at first use)


def free_device_memory() -> None:
    """After the last reference to an engine or model is dropped: its cycles collected and,
    on CUDA, the cached blocks handed back for the process that runs next."""
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


# ---- the engine over HTTP --------------------------------------------------------------
def serve_share(
    base: str,
    headers: dict[str, str],
    workload: Workload,
    in_flight: int,
    deadline: float,
    start_at: float,
) -> dict[str, Any]:
    """One client process's share of the serving run, from the shared start time. The
    headers come from the parent: a spawned child imports engine_bench afresh, with
    secrets of its own."""
    time.sleep(max(0.0, start_at - time.time()))
    started = time.time()
    result = asyncio.run(run_serving(base, headers, workload, in_flight, deadline, ignore_eos=True))
    return {
        "tokens": result.tokens,
        "submitted": result.submitted,
        "started": started,
        "ended": time.time(),
        "itls": result.itls,
    }


def serve_http(
    base: str,
    headers: dict[str, str],
    workload: Workload,
    in_flight: int,
    processes: int,
    deadline: float,
) -> dict[str, Any]:
    """The workload over HTTP with `in_flight` open at a time, split over `processes`
    client processes (every processes-th request each); useful tok/s over the span from
    the first start to the last end."""
    shares = [
        Workload(workload.prompts[k::processes], workload.max_tokens[k::processes])
        for k in range(processes)
    ]
    if processes == 1:
        parts = [serve_share(base, headers, workload, in_flight, deadline, time.time())]
    else:
        start_at = time.time() + 8  # after the spawned clients' imports (a late one only
        # starts late: the span runs from the first start)
        with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
            futures = [
                pool.submit(
                    serve_share,
                    base,
                    headers,
                    share,
                    max(1, in_flight // processes),
                    deadline,
                    start_at,
                )
                for share in shares
            ]
            parts = [f.result() for f in futures]
    seconds = max(p["ended"] for p in parts) - min(p["started"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    itls = [itl for p in parts for itl in p["itls"]]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "rate": tokens / seconds,
        "submitted": sum(p["submitted"] for p in parts),
        "itl_p50_ms": statistics.median(itls) * 1000 if itls else None,
    }


def make_workload(folder: Path, plan: Plan, count: int, seed: int) -> Workload:
    prompts = word_prompts(folder, count, plan.words, seed)
    rng = random.Random(seed + 1)
    return Workload(prompts, [rng.randint(*plan.outputs) for _ in prompts])


# ---- one shape ---------------------------------------------------------------------------
def measure_shape(
    shape: Shape, plan: Plan, out_dir: Path, models_dir: Path, log: Log
) -> dict[str, Any]:
    started = time.monotonic()
    folder, built = model_folder(shape, models_dir)
    log(
        f"[{shape.name}] model folder {folder} ({'built' if built else 'cached'}; "
        f"{shape.parameters / 1e6:.0f}M parameters, {shape.dtype})"
    )
    workload = make_workload(folder, plan, plan.requests, plan.seed)
    prompt_tokens = [len(p) for p in workload.prompts]
    log(
        f"[{shape.name}] workload: {plan.requests} requests, prompts {min(prompt_tokens)}-"
        f"{max(prompt_tokens)} tokens (mean {statistics.mean(prompt_tokens):.0f}), outputs "
        f"{min(workload.max_tokens)}-{max(workload.max_tokens)}, "
        f"{sum(workload.max_tokens)} useful tokens"
    )
    result: dict[str, Any] = {
        "folder": str(folder), "parameters": shape.parameters, "skipped": [],
        "workload": {"requests": plan.requests, "prompt_tokens": sum(prompt_tokens),
                     "useful_tokens": sum(workload.max_tokens)},
    }  # fmt: skip

    bandwidth, how = device_read_bandwidth()
    result["read_bandwidth_gbs"], result["read_bandwidth_how"] = bandwidth, how
    if DEVICE.type != "cuda":
        result["skipped"].append(how)
    log(f"[{shape.name}] read bandwidth {bandwidth:.1f} GB/s ({how})")

    engine = in_process_engine(folder, shape, plan)
    weight_bytes = engine.weight_bytes
    prompt = token_prompts(folder, 1, plan.decode_prompt, seed=5)[0]
    rates = single_stream(engine, prompt, plan.decode_tokens, plan.decode_rounds)
    decode_path = engine.runner.last_path
    roofline = bandwidth * 1e9 / weight_bytes
    decode = statistics.median(rates)
    result["decode"] = {
        "rates": rates,
        "median": decode,
        "path": decode_path,
        "weight_bytes": weight_bytes,
        "roofline_tok_s": roofline,
        "ratio": decode / roofline,
    }
    log(
        f"[{shape.name}] single-stream decode {decode:.1f} tok/s (median of "
        f"{' '.join(f'{r:.1f}' for r in rates)}; steps ran as {decode_path}); roofline "
        f"{weight_bytes / 1e6:.0f} MB at {bandwidth:.0f} GB/s = {roofline:.0f} tok/s; "
        f"RATIO {decode / roofline:.2f} (target {target(shape, 'decode')})"
    )
    profile = profile_serving(engine, workload, plan.profile, out_dir, shape.name)
    result["attention"] = []
    (chunk,) = token_prompts(folder, 1, plan.attention_chunk, seed=0)
    for rows in plan.attention_rows:
        prompts = token_prompts(folder, rows, plan.attention_prompt, seed=rows)
        for beside in (None, chunk):
            compared = compare_backends(engine, prompts, plan.attention_steps, beside)
            result["attention"].append(compared)
            if "skipped" in compared:
                break
            log(describe(shape.name, compared))
        if "skipped" in compared:
            result["skipped"].append(f"attention backends side by side: {compared['skipped']}")
            break
    del engine
    free_device_memory()
    for line in render_profile(shape.name, profile):
        log(f"[{shape.name}] {line}")
    if DEVICE.type != "cuda":
        result["skipped"].append(f"profiler CUDA activity {profile['device_activity']}")
    result["profile"] = profile

    options = Options(
        model=str(folder),
        dtype=shape.dtype,
        in_flight=plan.max_num_seqs,
        max_num_batched_tokens=plan.max_num_batched_tokens,
        kv_cache_mb=plan.kv_cache_mb,
        attention_backend=plan.attention_backend,
    )
    process, base = start_engine(options)
    try:
        warm = make_workload(folder, plan, plan.warm_requests, plan.seed + 7)
        asyncio.run(
            run_serving(base, SERVING_HEADERS, warm, plan.in_flight, time.monotonic() + 600, True)
        )
        before = httpx.get(f"{base}/admin/stats", headers=ADMIN_HEADERS, timeout=10).json()
        serving = serve_http(
            base,
            SERVING_HEADERS,
            workload,
            plan.in_flight,
            plan.client_processes,
            time.monotonic() + 600,
        )
        stats = httpx.get(f"{base}/admin/stats", headers=ADMIN_HEADERS, timeout=10).json()
        asyncio.run(
            run_ttft(
                base,
                SERVING_HEADERS,
                token_prompts(folder, plan.ttft_prompts, plan.ttft_tokens, 21),
            )
        )
        ttft = asyncio.run(
            run_ttft(
                base,
                SERVING_HEADERS,
                token_prompts(folder, plan.ttft_prompts, plan.ttft_tokens, 22),
            )
        )
    finally:
        stop_engine(process)
    serving["steps"] = step_breakdown(before, stats)
    serving["preemptions"] = stats.get("num_preemptions_total", 0)
    serving["graphs"] = {
        "decode": stats.get("decode_graphs", 0),
        "step": stats.get("step_graphs", 0),
        "attention": stats.get("attention_backend", ""),
    }
    result["serving"] = serving
    log(
        f"[{shape.name}] engine over HTTP: {serving['submitted']} requests, {plan.in_flight} in "
        f"flight from {plan.client_processes} client process(es), {serving['tokens']} useful "
        f"tokens in {serving['seconds']:.1f}s = {serving['rate']:.0f} tok/s (in-process "
        f"{profile['phases'].get('useful_tokens_per_s') or 0:.0f}); steps {serving['steps']}; "
        f"preemptions {serving['preemptions']}; attention {serving['graphs']['attention']}, "
        f"graphs: {serving['graphs']['decode']} decode, {serving['graphs']['step']} step"
    )
    ttft_ms = sorted(t * 1000 for t in ttft)
    result["ttft"] = {
        "p50_ms": statistics.median(ttft_ms),
        "max_ms": ttft_ms[-1],
        "prompts": len(ttft),
    }
    log(
        f"[{shape.name}] TTFT of {len(ttft)} simultaneous {plan.ttft_tokens}-token prompts: p50 "
        f"{result['ttft']['p50_ms']:.0f} ms, max {ttft_ms[-1]:.0f} ms "
        f"(target {target(shape, 'ttft')})"
    )

    reference_options = replace(
        options,
        batch_size=max(plan.reference_batches),
        reference_batches=max(1, plan.reference_requests // max(plan.reference_batches)),
    )
    dtype, why = reference_dtype(reference_options)
    if why:
        result["skipped"].append(f"HF reference in {dtype}: {why}")
    budget = plan.reference_seconds * len(plan.reference_batches)
    tried = best_reference(
        reference_options,
        workload,
        dtype,
        time.monotonic() + budget,
        plan.reference_batches,
        ignore_eos=True,
    )
    result["reference"] = {
        str(size): {
            "tok_s": r.tokens / r.seconds,
            "tokens": r.tokens,
            "seconds": r.seconds,
            "requests": r.requests,
            "hit_time_limit": r.hit_time_limit,
        }
        for size, r in tried.by_batch_size.items()
    }
    result["reference_best_batch"], result["reference_dtype"] = tried.batch_size, str(dtype)
    for size, row in result["reference"].items():
        log(
            f"[{shape.name}] HF generate ({str(dtype).removeprefix('torch.')}), static batches "
            f"of {size}, first {row['requests']} requests: {row['tokens']} useful tokens in "
            f"{row['seconds']:.1f}s "
            f"= {row['tok_s']:.0f} tok/s"
            + ("; hit its time limit" if row["hit_time_limit"] else "")
        )
    ratio = serving["rate"] / tried.rate
    log(
        f"[{shape.name}] RATIO serving engine/best HF = {ratio:.2f}x ({serving['rate']:.0f} vs "
        f"{tried.rate:.0f} tok/s at batch {tried.batch_size}; target "
        f"{target(shape, 'serving_ratio')})"
    )
    result["seconds"] = time.monotonic() - started
    return result


def shape_figures(shape: Shape, result: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    targets = TARGETS.get(shape.name, {})
    serving, decode, reference = result["serving"], result["decode"], result["reference"]
    best = reference[str(result["reference_best_batch"])]
    rates = ", ".join(f"{size}: {row['tok_s']:.0f} tok/s" for size, row in reference.items())
    work = f"{plan.requests} requests, {plan.in_flight} in flight, HTTP"
    figures = [
        {
            "name": f"{shape.name}: serving throughput ({work})",
            "value": serving["rate"],
            "unit": "useful tok/s",
            "reference_value": best["tok_s"],
            "reference": f"HF generate, best static batch ({rates}), "
            f"{result['reference_dtype']}, same weights",
            "target": targets.get("serving_ratio", "reported"),
        },
        {
            "name": f"{shape.name}: serving throughput, absolute ({work})",
            "value": serving["rate"],
            "unit": "useful tok/s",
            "reference": "none",
            "reference_value": None,
            "target": targets.get("serving_rate", "reported"),
        },
        {
            "name": f"{shape.name}: single-stream decode ({decode['path']} steps)",
            "value": decode["median"],
            "unit": "tok/s",
            "reference_value": decode["roofline_tok_s"],
            "reference": f"memory roofline: {decode['weight_bytes'] / 1e6:.0f} MB of weights at "
            f"{result['read_bandwidth_gbs']:.0f} GB/s read ({result['read_bandwidth_how']})",
            "target": targets.get("decode", "reported"),
        },
        {
            "name": f"{shape.name}: TTFT p50, {result['ttft']['prompts']} simultaneous "
            f"{plan.ttft_tokens}-token prompts (HTTP)",
            "value": result["ttft"]["p50_ms"],
            "unit": "ms",
            "reference": "none",
            "reference_value": None,
            "target": targets.get("ttft", "reported"),
        },
        {
            "name": f"{shape.name}: serving in-process, unprofiled steps",
            "unit": "useful tok/s",
            "value": result["profile"]["phases"].get("useful_tokens_per_s"),
            "reference": "the same engine over HTTP",
            "reference_value": serving["rate"],
            "target": "reported",
        },
    ]
    return [normalize_figure(f) for f in figures]


def render_figures(figures: list[dict[str, Any]]) -> list[str]:
    lines = ["== figures (targets are printed, never asserted)"]
    for f in figures:
        value = "-" if f["value"] is None else f"{f['value']:.1f}"
        ratio = "" if f["ratio"] is None else f", ratio {f['ratio']:.2f}"
        reference = "" if f["reference_value"] is None else f" vs {f['reference_value']:.1f}"
        met = {True: "met", False: "NOT MET", None: "not judged"}[f["met"]]
        lines.append(
            f"{f['name']}: {value} {f['unit']}{reference}{ratio}; "
            f"target {f['target'] or '-'}: {met}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the figures and the profile"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny shape and a few requests (CPU, seconds)"
    )
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), help="default: both, or tiny with --smoke"
    )
    parser.add_argument(
        "--models-dir", type=Path, default=MODELS_DIR, help="the cache of model folders"
    )
    parser.add_argument(
        "--no-spec",
        action="store_true",
        help="skip the speculative decoding figures (bench/spec_bench.py on SmolLM2; "
        "never run with --smoke)",
    )
    parser.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="the engines' --attention-backend (the side-by-side steps time both)",
    )
    args = parser.parse_args(argv)
    plan = replace(SMOKE if args.smoke else FULL, attention_backend=args.attention_backend)
    if args.shapes:
        plan = replace(plan, shapes=tuple(SHAPES[name] for name in args.shapes))
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    log = Log()
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "none (CPU)"
    state = git_state()
    import transformers

    header = {
        **state,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "device": device,
        "host": f"{platform.node()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    log(
        f"gpu_bench: commit {state['commit'][:12]}{' (dirty)' if state['dirty'] else ''}, "
        f"{header['date']}, GPU {device}, torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    if DEVICE.type != "cuda":
        log(
            "no CUDA device: device bandwidth, CUDA synchronization and the profiler's CUDA "
            "activity are skipped (stated per shape)"
        )
    shapes: dict[str, Any] = {}
    figures: list[dict[str, Any]] = []
    for shape in plan.shapes:
        result = measure_shape(shape, plan, out_dir, args.models_dir, log)
        shapes[shape.name] = result
        figures += shape_figures(shape, result, plan)
    speculative: dict[str, Any] | None = None
    if not (args.smoke or args.no_spec):
        from bench.spec_bench import figures_of, measure_all

        free_device_memory()
        log("speculative decoding: SmolLM2, single stream, drafts auto vs off (spec_bench)")
        speculative = figures_of(measure_all(out_dir, quick=False))
        figures += speculative["figures"]
    summary = render_figures(figures)
    for line in summary:
        log(line)
    report = {
        **header,
        "figures": figures,
        "shapes": shapes,
        "skipped": sorted({s for r in shapes.values() for s in r["skipped"]}),
        "speculative": speculative["report"] if speculative else None,
    }
    (out_dir / "figures.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    profiles = {name: result["profile"] for name, result in shapes.items()}
    (out_dir / "profile.json").write_text(json.dumps(profiles, indent=2, default=str) + "\n")
    (out_dir / "profile.txt").write_text(
        "\n".join(line for name, p in profiles.items() for line in [*render_profile(name, p), ""])
    )
    (out_dir / "summary.txt").write_text("\n".join(log.lines) + "\n")
    print(
        f"gpu_bench: wrote {out_dir}/figures.json, summary.txt, profile.json, profile.txt",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
