"""Drives a workload against a target and aggregates what the client sees.

Open-loop workloads (a trace, Poisson arrivals) send each request at its arrival time;
`max_concurrency` bounds the requests in flight, and an arrival that finds every slot
busy waits for one (so memory stays bounded). Closed-loop workloads (fixed concurrency)
keep N requests in flight back to back. While the target refuses connections the runner
backs off (0.5 s doubling to 30 s) and drops the arrivals it would have sent meanwhile,
counted as `skipped_while_down`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import httpx

from loadgen.client import RequestResult, RequestSpec, request_body, send_request
from loadgen.energy import ENERGY_METRIC_NAMES, energy_delta, scrape_energy
from loadgen.progress import Progress
from loadgen.stats import RunStats, Slo, max_rate_at_attainment
from loadgen.trace import TraceRequest, synthetic_prompt


def normalize_base_url(base_url: str) -> str:
    """`http://host:port` becomes `http://host:port/v1`; a URL with a path is kept as given."""
    base = base_url.rstrip("/")
    if urlsplit(base).path in ("", "/"):
        base += "/v1"
    return base


@dataclass(slots=True)
class LoadConfig:
    base_url: str
    model: str
    api_key: str | None = None
    tenant_keys: dict[str, str] = field(default_factory=dict)
    endpoint: str = "chat"  # chat or completions
    # Workload: exactly one of trace, rate, concurrency.
    trace: list[TraceRequest] | None = None
    time_scale: float = 1.0  # trace offsets are multiplied by this
    rate: float | None = None  # Poisson arrivals per second, per tenant
    concurrency: int | None = None
    tenants: list[str] = field(default_factory=lambda: ["default"])
    prompt_tokens: int = 128
    max_tokens: int = 64
    # When to stop: the first of these reached; a trace also stops when it ends.
    num_requests: int | None = None
    duration_s: float | None = None
    forever: bool = False
    max_concurrency: int = 64
    slo: Slo = field(default_factory=lambda: Slo(ttft_s=2.0, tpot_s=0.2))
    metrics_urls: list[str] = field(default_factory=list)
    energy_metric_names: tuple[str, ...] = ENERGY_METRIC_NAMES
    timeout_s: float = 300.0
    temperature: float | None = None
    ignore_eos: bool = False
    seed: int = 0
    report_interval_s: float = 10.0
    show_progress: bool = True
    progress_label: str = ""

    def __post_init__(self) -> None:
        workloads = [self.trace is not None, self.rate is not None, self.concurrency is not None]
        if sum(workloads) != 1:
            raise ValueError("choose exactly one workload: a trace, a rate or a concurrency")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError("endpoint must be chat or completions")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        if not self.forever and self.trace is None and not (self.num_requests or self.duration_s):
            raise ValueError("a synthetic workload needs num_requests, duration_s or forever")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        if not self.tenants:
            raise ValueError("at least one tenant is required")

    @property
    def url(self) -> str:
        path = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"{normalize_base_url(self.base_url)}/{path}"

    def key_for(self, tenant: str) -> str | None:
        return self.tenant_keys.get(tenant, self.api_key)

    def describe(self) -> dict[str, Any]:
        workload: dict[str, Any]
        if self.trace is not None:
            workload = {"kind": "trace", "requests": len(self.trace), "time_scale": self.time_scale}
        elif self.rate is not None:
            workload = {"kind": "poisson", "rate_per_tenant": self.rate}
        else:
            workload = {"kind": "concurrency", "concurrency": self.concurrency}
        if self.trace is None:
            workload |= {"prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens}
        return {
            "url": self.url,
            "model": self.model,
            "workload": workload,
            "tenants": sorted({r.tenant for r in self.trace}) if self.trace else self.tenants,
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "forever": self.forever,
            "max_concurrency": self.max_concurrency,
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
            "metrics_urls": self.metrics_urls,
            "seed": self.seed,
        }


@dataclass(slots=True)
class RunResult:
    config: dict[str, Any]
    summary: dict[str, Any]
    requests: list[RequestResult]  # empty in forever mode


class Backoff:
    """Exponential back-off while the target refuses connections."""

    def __init__(self, first_s: float = 0.5, max_s: float = 30.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.failures = 0
        self.resume_at = 0.0

    def failure(self) -> float:
        self.failures += 1
        delay = min(self.first_s * 2 ** (self.failures - 1), self.max_s)
        self.resume_at = max(self.resume_at, time.monotonic() + delay)
        return delay

    def success(self) -> None:
        self.failures = 0
        self.resume_at = 0.0

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self.resume_at


class Runner:
    def __init__(
        self,
        config: LoadConfig,
        *,
        on_report: Callable[[dict[str, Any]], None] | None = None,
        stop: asyncio.Event | None = None,
    ) -> None:
        self.config = config
        self.on_report = on_report
        self.stop = stop or asyncio.Event()
        self.stats = RunStats(slo=config.slo, is_exact=not config.forever)
        self.window = RunStats(slo=config.slo, is_exact=False)
        self.results: list[RequestResult] = []
        self.backoff = Backoff()
        self.dispatched = 0
        self.skipped_while_down = 0
        self.in_flight = 0
        self.rng = random.Random(config.seed)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- workloads ---------------------------------------------------------------------

    def _synthetic_spec(self, tenant: str) -> RequestSpec:
        index = self.dispatched
        return RequestSpec(
            tenant=tenant,
            api_key=self.config.key_for(tenant),
            prompt=synthetic_prompt(self.config.prompt_tokens, f"{self.config.seed}:{index}"),
            max_tokens=self.config.max_tokens,
        )

    def _trace_arrivals(self) -> Iterator[tuple[float, RequestSpec]]:
        trace = self.config.trace or []
        # A looping trace restarts one mean gap after its last request.
        span = max(trace[-1].offset_s * len(trace) / max(len(trace) - 1, 1), 1.0)
        for cycle in itertools.count():
            for index, request in enumerate(trace):
                spec = RequestSpec(
                    tenant=request.tenant,
                    api_key=self.config.key_for(request.tenant),
                    prompt=request.prompt_text(index),
                    max_tokens=request.max_tokens,
                    session=request.session,
                )
                yield (cycle * span + request.offset_s) * self.config.time_scale, spec
            if not self.config.forever:
                return

    def _poisson_arrivals(self) -> Iterator[tuple[float, RequestSpec]]:
        # Independent Poisson streams per tenant merge into one at the summed rate, each
        # arrival belonging to a tenant chosen uniformly.
        assert self.config.rate is not None
        total_rate = self.config.rate * len(self.config.tenants)
        offset = 0.0
        while True:
            offset += self.rng.expovariate(total_rate)
            yield offset, self._synthetic_spec(self.rng.choice(self.config.tenants))

    # -- running ----------------------------------------------------------------------

    def _should_stop_dispatching(self, started: float) -> bool:
        if self.stop.is_set():
            return True
        if self.config.num_requests is not None and self.dispatched >= self.config.num_requests:
            return True
        duration = self.config.duration_s
        return duration is not None and time.monotonic() - started >= duration

    def _record(self, result: RequestResult) -> None:
        for stats in (self.stats, self.window):
            stats.record(
                status=result.status,
                is_success=result.is_success,
                started=result.started,
                e2e_s=result.e2e_s,
                ttft_s=result.ttft_s,
                itls=result.itls,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                usage_reported=result.is_usage_reported,
            )
        if not self.config.forever:
            self.results.append(result)
        if result.is_connection_failure:
            delay = self.backoff.failure()
            if self.backoff.failures == 1 or self.config.forever:
                print(
                    f"loadgen: target unreachable ({result.error}); retrying in {delay:.1f}s",
                    file=sys.stderr,
                )
        elif result.status not in ("timeout",):
            self.backoff.success()

    async def _one(self, client: httpx.AsyncClient, spec: RequestSpec) -> RequestResult:
        body = request_body(
            spec,
            model=self.config.model,
            endpoint=self.config.endpoint,
            temperature=self.config.temperature,
            ignore_eos=self.config.ignore_eos,
        )
        self.in_flight += 1
        try:
            result = await send_request(client, self.config.url, spec, body, self.config.endpoint)
        finally:
            self.in_flight -= 1
        self._record(result)
        return result

    async def _open_loop(self, client: httpx.AsyncClient, started: float) -> None:
        arrivals = (
            self._trace_arrivals() if self.config.trace is not None else self._poisson_arrivals()
        )
        slots = asyncio.Semaphore(self.config.max_concurrency)

        async def run_and_release(spec: RequestSpec) -> None:
            try:
                await self._one(client, spec)
            finally:
                slots.release()

        for offset, spec in arrivals:
            if self._should_stop_dispatching(started):
                break
            delay = started + offset - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), timeout=delay)
                if self._should_stop_dispatching(started):
                    break
            if self.backoff.is_down:
                self.skipped_while_down += 1
                self.dispatched += 1
                continue
            await slots.acquire()
            self.dispatched += 1
            task = asyncio.create_task(run_and_release(spec))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _closed_loop(self, client: httpx.AsyncClient, started: float) -> None:
        tenants = itertools.cycle(self.config.tenants)

        async def worker() -> None:
            while not self._should_stop_dispatching(started):
                if self.backoff.is_down:
                    wait = self.backoff.resume_at - time.monotonic()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), timeout=max(wait, 0.01))
                    continue
                self.dispatched += 1
                await self._one(client, self._synthetic_spec(next(tenants)))

        assert self.config.concurrency is not None
        await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))

    async def _ticker(self, progress: Progress, started: float) -> None:
        last_report = time.monotonic()
        while True:
            await asyncio.sleep(0.5)
            progress.update(
                done=self.stats.requests,
                ok=self.stats.successes,
                errors=self.stats.requests - self.stats.successes,
                in_flight=self.in_flight,
            )
            now = time.monotonic()
            if self.config.forever and now - last_report >= self.config.report_interval_s:
                window = self.window.summary(elapsed_s=now - last_report)
                last_report = now
                self.window = RunStats(slo=self.config.slo, is_exact=False)
                print(_window_line(window), file=sys.stderr)
                if self.on_report is not None:
                    self.on_report(self._summary(now - started, None))

    def _summary(self, elapsed: float, energy: dict[str, Any] | None) -> dict[str, Any]:
        summary = self.stats.summary(elapsed_s=elapsed)
        summary["skipped_while_down"] = self.skipped_while_down
        summary["energy"] = energy
        return summary

    async def run(self) -> RunResult:
        config = self.config
        limits = httpx.Limits(
            max_connections=config.max_concurrency + 4,
            max_keepalive_connections=config.max_concurrency,
        )
        timeout = httpx.Timeout(config.timeout_s, connect=10.0)
        total = config.num_requests
        if total is None and config.trace is not None and not config.forever:
            total = len(config.trace)
        progress = Progress(
            total=total,
            duration_s=config.duration_s,
            label=config.progress_label,
            is_enabled=config.show_progress,
        )
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            energy_before = await scrape_energy(
                client, config.metrics_urls, config.energy_metric_names
            )
            started = time.monotonic()
            ticker = asyncio.create_task(self._ticker(progress, started))
            try:
                if config.concurrency is not None:
                    await self._closed_loop(client, started)
                else:
                    await self._open_loop(client, started)
                if self._tasks:
                    await asyncio.gather(*list(self._tasks))
            finally:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
            elapsed = time.monotonic() - started
            energy_after = await scrape_energy(
                client, config.metrics_urls, config.energy_metric_names
            )
        progress.close(
            done=self.stats.requests,
            ok=self.stats.successes,
            errors=self.stats.requests - self.stats.successes,
        )
        energy = _energy_figures(energy_before, energy_after, self.stats, config.metrics_urls)
        return RunResult(
            config=config.describe(),
            summary=self._summary(elapsed, energy),
            requests=self.results,
        )


def _energy_figures(
    before: dict[str, tuple[str, float]],
    after: dict[str, tuple[str, float]],
    stats: RunStats,
    urls: list[str],
) -> dict[str, Any] | None:
    if not urls:
        return None
    delta = energy_delta(before, after)
    if delta is None:
        return {"available": False, "reason": "no energy counter found at the metrics URLs"}
    joules, names = delta
    total_tokens = stats.prompt_tokens + stats.completion_tokens
    return {
        "available": True,
        "metrics_read": names,
        "joules": joules,
        "joules_per_output_token": joules / stats.completion_tokens
        if stats.completion_tokens
        else None,
        "joules_per_token": joules / total_tokens if total_tokens else None,
    }


def _window_line(window: dict[str, Any]) -> str:
    ttft = window["ttft_s"]["p95"]
    tpot = window["tpot_s"]["p95"]
    attainment = window["slo_attainment"]
    return (
        f"loadgen: {window['requests']} req ({window['errors']} err) "
        f"{window['request_throughput']:.2f} req/s {window['output_token_throughput']:.1f} tok/s "
        f"ttft p95 {_ms(ttft)} tpot p95 {_ms(tpot)} "
        f"slo {'-' if attainment is None else f'{attainment * 100:.0f}%'}"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


async def run_load(
    config: LoadConfig,
    *,
    on_report: Callable[[dict[str, Any]], None] | None = None,
    handle_signals: bool = False,
) -> RunResult:
    """Run one workload to its end (or until SIGINT/SIGTERM when handle_signals)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    if handle_signals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, stop.set)
                installed.append(signum)
    try:
        return await Runner(config, on_report=on_report, stop=stop).run()
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


@dataclass(slots=True)
class SweepResult:
    parameter: str  # rate or concurrency
    steps: list[tuple[float, RunResult]]
    max_rate: dict[str, Any]


async def run_sweep(
    config: LoadConfig, parameter: str, values: list[float], *, goodput_target: float = 0.9
) -> SweepResult:
    """One run per value of `rate` or `concurrency`, and DistServe's max rate at the target.

    The x axis of the max-rate reading is the offered rate for a rate sweep and the achieved
    request throughput for a concurrency sweep.
    """
    steps: list[tuple[float, RunResult]] = []
    for value in values:
        label = f"{parameter}={value:g}"
        if parameter == "rate":
            step = replace(config, rate=value, concurrency=None, progress_label=label)
        else:
            step = replace(config, concurrency=int(value), rate=None, progress_label=label)
        steps.append((value, await run_load(step)))
    points = []
    for value, result in steps:
        attainment = result.summary["slo_attainment"] or 0.0
        x = value if parameter == "rate" else result.summary["request_throughput"]
        if parameter == "rate":
            x *= len(config.tenants)
        points.append((x, attainment))
    reading = max_rate_at_attainment(points, goodput_target)
    return SweepResult(
        parameter=parameter,
        steps=steps,
        max_rate={
            "target_attainment": goodput_target,
            "rate": reading.rate,
            "highest_measured": reading.highest_measured,
            "is_lower_bound": reading.is_lower_bound,
            "points": [{"rate": x, "slo_attainment": a} for x, a in points],
        },
    )
