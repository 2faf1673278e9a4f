"""Where a serving step's time goes: the engine in-process on the serving workload, its
step phases timed from outside and a window of steps under torch.profiler.

The phases are timed by wrapping the engine's own calls on its instances (the scheduler's
schedule, the runner's prepare and run, the graphs' input build) and the `sample` that
engine/llm_engine.py imports; the engine's code is not changed. On CUDA the run wrapper
waits for the device after the forward pass is launched (the step waits there anyway, in
sampling), so that the forward's launch and its device time part.
"""

from __future__ import annotations

import gzip
import re
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function, schedule

from bench.engine_workload import DEVICE, Workload, synchronize

# In step order; "append" is the rest of LLMEngine._step: counting, appending the tokens,
# detokenizing, stop checks, metrics.
PHASES = ("schedule", "prepare", "forward_launch", "forward_wait", "sample", "append")
PHASE_TITLES = {
    "schedule": "scheduling (Scheduler.schedule)",
    "prepare": "input preparation (ModelRunner.prepare, decode and step graph inputs)",
    "forward_launch": "forward pass, host side until run returns",
    "forward_wait": "forward pass, waiting for the device after launch",
    "sample": "sampling (sample)",
    "append": "append, detokenize, stop checks, metrics",
}
HOST_PHASES = ("schedule", "prepare", "sample", "append")  # outside the forward pass


@dataclass(slots=True)
class StepRecord:
    path: str  # ModelRunner.last_path
    rows: int
    tokens: int  # scheduled tokens
    sampled: int  # output tokens this step
    profiled: bool
    total: float
    seconds: dict[str, float] = field(default_factory=dict)


class PhaseTimers:
    """Times LLMEngine._step's phases by wrapping what it calls; uninstall() restores."""

    def __init__(self, engine: Any):
        import engine.llm_engine as llm_engine_module

        self.engine = engine
        self.module = llm_engine_module
        self.current: dict[str, float] = {}
        self.batch: Any = None
        self.sampled = 0
        self.records: list[StepRecord] = []
        self.original_sample = llm_engine_module.sample

    def timed(self, phase: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            with record_function(f"gpu_bench.{phase}"):
                result = call(*args, **kwargs)
            self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - started
            return result

        return wrapper

    def install(self) -> None:
        engine, runner = self.engine, self.engine.runner
        schedule_call = self.timed("schedule", engine.scheduler.schedule)

        def scheduled() -> Any:
            self.batch = schedule_call()
            return self.batch

        engine.scheduler.schedule = scheduled
        runner.prepare = self.timed("prepare", runner.prepare)
        for graphs in (getattr(runner, "graphs", None), getattr(runner, "step_graphs", None)):
            if graphs is not None:
                graphs.inputs.build = self.timed("prepare", graphs.inputs.build)
        run = runner.run

        def run_and_wait(batch: Any) -> Any:
            started = time.perf_counter()
            with record_function("gpu_bench.forward"):
                result = run(batch)
            launched = time.perf_counter()
            synchronize()  # CUDA only; the step's sampling waits here anyway
            inner = self.current.get("prepare", 0.0)
            self.current["forward_launch"] = launched - started - inner
            self.current["forward_wait"] = time.perf_counter() - launched
            return result

        runner.run = run_and_wait
        timed_sample = self.timed("sample", self.original_sample)

        def counted_sample(logits: Any, seqs: list[Any], *rest: Any) -> Any:
            self.sampled = len(seqs)
            return timed_sample(logits, seqs, *rest)

        self.module.sample = counted_sample  # type: ignore[assignment]

    def uninstall(self) -> None:
        runner = self.engine.runner
        for owner, name in (
            (self.engine.scheduler, "schedule"),
            (runner, "prepare"),
            (runner, "run"),
        ):
            owner.__dict__.pop(name, None)
        for graphs in (getattr(runner, "graphs", None), getattr(runner, "step_graphs", None)):
            if graphs is not None:
                graphs.inputs.__dict__.pop("build", None)
        self.module.sample = self.original_sample

    def step(self, profiled: bool) -> StepRecord:
        self.current, self.batch, self.sampled = {}, None, 0
        started = time.perf_counter()
        self.engine._step()
        total = time.perf_counter() - started
        seconds = {phase: self.current.get(phase, 0.0) for phase in PHASES if phase != "append"}
        seconds["append"] = max(0.0, total - sum(seconds.values()))
        batch = self.batch
        record = StepRecord(
            path=self.engine.runner.last_path if batch is not None and batch.seqs else "empty",
            rows=0 if batch is None else len(batch.seqs),
            tokens=0 if batch is None else batch.num_tokens,
            sampled=self.sampled,
            profiled=profiled,
            total=total,
            seconds=seconds,
        )
        self.records.append(record)
        return record


# ---- grouping the profiler's self time ------------------------------------------------
GROUPS = ("linear", "attention", "copies", "sampling", "cuda_runtime", "host_python", "other")
GROUP_TITLES = {
    "linear": "linear layers (mm/addmm/linear/matmul, GEMM/GEMV kernels)",
    "attention": "attention (sdpa, flash/efficient kernels, decode attention)",
    "copies": "host-device copies (Memcpy HtoD/DtoH, aten::copy_/to/item)",
    "sampling": "sampling (argmax/softmax/multinomial/topk/sort)",
    "cuda_runtime": "CUDA runtime calls (kernel and graph launches, syncs)",
    "host_python": "host time outside any op (Python, ctypes kernels) in the step",
    "other": "other ops (norms, rotary, elementwise, indexing, casts)",
}
COPY_OPS = {"aten::copy_", "aten::to", "aten::_to_copy", "aten::_local_scalar_dense", "aten::item"}
LINEAR_OPS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"}
LINEAR_KERNELS = ("linear", "gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitk")
ATTENTION_NAMES = ("scaled_dot_product", "sdpa", "flash", "fmha", "attention", "embedding_bag")
SAMPLING_NAMES = ("argmax", "softmax", "multinomial", "topk", "sort")
DRIVER_CALL = re.compile(r"^cu[A-Z]")


def classify(name: str) -> str:
    """The group of one profiler event by its name (kernels and ops alike). Attention is
    looked for before sampling: the math SDPA fallback's aten::_softmax still counts
    there only when it runs under the sdpa op, so it reads as sampling (rare on CUDA)."""
    lower = name.lower()
    if name.startswith(("gpu_bench.", "ProfilerStep")):
        return "host_python"
    if "memcpy" in lower or "memset" in lower or name in COPY_OPS:
        return "copies"
    if name.startswith("cuda") or DRIVER_CALL.match(name):
        return "cuda_runtime"
    if any(part in lower for part in ATTENTION_NAMES):
        return "attention"
    if any(part in lower for part in SAMPLING_NAMES):
        return "sampling"
    if name in LINEAR_OPS or any(part in lower for part in LINEAR_KERNELS):
        return "linear"
    return "other"


def is_device_event(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith(("CUDA", "PrivateUse1"))


def group_events(events: Any, steps: int) -> dict[str, Any]:
    """Self time per group, in ms per profiled step: host (CPU events' self time) and device
    (kernels and copies on the GPU; a CPU op's device time is not added, so nothing is
    counted twice), with each group's heaviest names."""
    host: dict[str, float] = dict.fromkeys(GROUPS, 0.0)
    device: dict[str, float] = dict.fromkeys(GROUPS, 0.0)
    by_op: dict[str, float] = dict.fromkeys(GROUPS, 0.0)
    names: dict[str, list[tuple[float, float, int, str]]] = {g: [] for g in GROUPS}
    for event in events:
        group = classify(event.key)
        if is_device_event(event):
            cpu_us = 0.0
            # self_cuda_time_total before torch 2.4
            named = "self_device_time_total"
            device_us = float(getattr(event, named, getattr(event, "self_cuda_time_total", 0.0)))
        else:
            cpu_us, device_us = float(event.self_cpu_time_total), 0.0
            by_op[group] += float(getattr(event, "self_device_time_total", 0.0) or 0.0)
        host[group] += cpu_us
        device[group] += device_us
        names[group].append((cpu_us, device_us, int(event.count), event.key))
    if not any(device.values()):  # no kernel rows: the device time the ops launched
        device = by_op
    host_total, device_total = sum(host.values()), sum(device.values())
    table = {}
    for group in GROUPS:
        top = sorted(names[group], key=lambda item: -max(item[0], item[1]))[:6]
        table[group] = {
            "title": GROUP_TITLES[group],
            "host_ms_per_step": host[group] / 1000 / steps,
            "device_ms_per_step": device[group] / 1000 / steps,
            "host_share": host[group] / host_total if host_total else 0.0,
            "device_share": device[group] / device_total if device_total else 0.0,
            "top": [
                {
                    "name": name[:120],
                    "host_ms_per_step": cpu / 1000 / steps,
                    "device_ms_per_step": gpu / 1000 / steps,
                    "calls_per_step": count / steps,
                }
                for cpu, gpu, count, name in top
            ],
        }
    return {
        "groups": table,
        "host_ms_per_step": host_total / 1000 / steps,
        "device_ms_per_step": device_total / 1000 / steps,
    }


def phase_table(records: list[StepRecord]) -> dict[str, Any]:
    """The step phases over the unprofiled steps (the profiler slows the ones it records),
    per path; all steps where none ran unprofiled."""
    plain = [r for r in records if not r.profiled and r.rows] or [r for r in records if r.rows]
    if not plain:
        return {"steps": 0}
    seconds = sum(r.total for r in plain)
    by_phase = {p: sum(r.seconds[p] for r in plain) for p in PHASES}
    paths: dict[str, list[StepRecord]] = {}
    for record in plain:
        paths.setdefault(record.path, []).append(record)
    host = sum(by_phase[p] for p in HOST_PHASES)
    return {
        "steps": len(plain),
        "step_ms_mean": seconds / len(plain) * 1000,
        "useful_tokens_per_s": sum(r.sampled for r in plain) / seconds if seconds else None,
        "phases": {
            p: {
                "title": PHASE_TITLES[p],
                "ms_per_step": by_phase[p] / len(plain) * 1000,
                "share": by_phase[p] / seconds if seconds else 0.0,
            }
            for p in PHASES
        },
        "host_outside_forward_ms_per_step": host / len(plain) * 1000,
        "host_outside_forward_share": host / seconds if seconds else 0.0,
        "paths": {
            path: {
                "steps": len(group),
                "ms_mean": statistics.mean(r.total for r in group) * 1000,
                "rows_mean": statistics.mean(r.rows for r in group),
                "tokens_mean": statistics.mean(r.tokens for r in group),
            }
            for path, group in sorted(paths.items())
        },
    }


# ---- the run -------------------------------------------------------------------------
@dataclass(slots=True)
class ProfilePlan:
    skip_steps: int  # steps before the profiler's window (prefill-heavy first steps)
    active_steps: int  # steps recorded
    warmup_steps: int = 2


def profile_serving(
    engine: Any, workload: Workload, plan: ProfilePlan, out_dir: Path, name: str
) -> dict[str, Any]:
    """Serve the whole workload in-process (every request at once; the scheduler keeps
    max_num_seqs running), the profiler recording plan.active_steps steps after
    plan.skip_steps. Writes the chrome trace, profile_trace_<name>.json.gz; returns the
    phase and op tables."""
    from engine.sequence import SamplingParams, Sequence

    for prompt, limit in zip(workload.prompts, workload.max_tokens, strict=True):
        params = SamplingParams(max_tokens=limit, temperature=0, ignore_eos=True)
        engine.scheduler.add(Sequence(token_ids=prompt, params=params))
    cuda = DEVICE.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    first = plan.skip_steps + plan.warmup_steps
    window = range(first, first + plan.active_steps)
    trace = out_dir / f"profile_trace_{name}.json"

    def export(profiler: Any) -> None:
        profiler.export_chrome_trace(str(trace))

    timers = PhaseTimers(engine)
    timers.install()
    # one window, read right after it: nothing to accumulate across cycles
    warnings.filterwarnings("ignore", message=".*Profiler clears events")
    started = time.perf_counter()
    try:
        with profile(
            activities=activities,
            schedule=schedule(
                wait=plan.skip_steps, warmup=plan.warmup_steps, active=plan.active_steps
            ),
            on_trace_ready=export,
        ) as profiler:
            index = 0
            while engine.scheduler.has_work:
                timers.step(profiled=index in window)
                profiler.step()
                index += 1
        events = profiler.key_averages()
    finally:
        timers.uninstall()
    elapsed = time.perf_counter() - started
    records = timers.records
    profiled = [r for r in records if r.profiled]
    result: dict[str, Any] = {
        "steps": len(records),
        "seconds": elapsed,
        "useful_tokens": sum(r.sampled for r in records),
        "phases": phase_table(records),
        "profiled_steps": len(profiled),
        "profiled_paths": {
            p: sum(r.path == p for r in profiled) for p in sorted({r.path for r in profiled})
        },
        "profiled_wall_ms_per_step": statistics.mean(r.total for r in profiled) * 1000
        if profiled
        else None,
        "device_activity": "recorded" if cuda else "skipped: no CUDA device (host activity only)",
    }
    if profiled:
        result["ops"] = group_events(events, len(profiled))
    if trace.exists():
        packed = trace.with_name(trace.name + ".gz")
        with trace.open("rb") as source, gzip.open(packed, "wb") as target:
            shutil.copyfileobj(source, target)
        trace.unlink()
        result["trace"] = packed.name
    return result


def render_profile(name: str, result: dict[str, Any]) -> list[str]:
    """The profile as readable lines (profile.txt)."""
    lines = [
        f"== {name}: {result['steps']} steps of the serving workload in-process, "
        f"{result['useful_tokens']} useful tokens in {result['seconds']:.1f}s"
    ]
    phases = result["phases"]
    if phases.get("steps"):
        rate = phases["useful_tokens_per_s"]
        lines.append(
            f"step phases over {phases['steps']} unprofiled steps: mean step "
            f"{phases['step_ms_mean']:.2f} ms, {rate:.0f} useful tok/s"
        )
        for phase in PHASES:
            row = phases["phases"][phase]
            lines.append(f"  {row['title']:<58} {row['ms_per_step']:8.3f} ms  {row['share']:6.1%}")
        lines.append(
            f"  {'host time outside the forward pass':<58} "
            f"{phases['host_outside_forward_ms_per_step']:8.3f} ms  "
            f"{phases['host_outside_forward_share']:6.1%}"
        )
        lines.append(
            "  by path: "
            + "; ".join(
                f"{path} {row['steps']} steps, {row['ms_mean']:.2f} ms, "
                f"{row['rows_mean']:.0f} rows, {row['tokens_mean']:.0f} tokens"
                for path, row in phases["paths"].items()
            )
        )
    ops = result.get("ops")
    if ops:
        paths = ", ".join(f"{p} {n}" for p, n in result["profiled_paths"].items())
        lines.append(
            f"profiled window: {result['profiled_steps']} steps ({paths}), wall "
            f"{result['profiled_wall_ms_per_step']:.2f} ms/step under the profiler; "
            f"self time per step: host {ops['host_ms_per_step']:.2f} ms, device "
            f"{ops['device_ms_per_step']:.2f} ms; device activity "
            f"{result['device_activity']}"
        )
        lines.append(f"  {'group':<64} {'host ms':>9} {'share':>7} {'device ms':>10} {'share':>7}")
        for group in GROUPS:
            row = ops["groups"][group]
            lines.append(
                f"  {row['title']:<64} {row['host_ms_per_step']:9.3f} "
                f"{row['host_share']:7.1%} {row['device_ms_per_step']:10.3f} "
                f"{row['device_share']:7.1%}"
            )
            for top in row["top"][:3]:
                if top["host_ms_per_step"] or top["device_ms_per_step"]:
                    lines.append(
                        f"      {top['name'][:70]:<70} host {top['host_ms_per_step']:.3f} ms, "
                        f"device {top['device_ms_per_step']:.3f} ms, "
                        f"{top['calls_per_step']:.1f} calls"
                    )
    if result.get("trace"):
        lines.append(f"chrome trace: {result['trace']} (chrome://tracing or ui.perfetto.dev)")
    return lines
