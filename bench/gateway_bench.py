"""Gateway overhead: TTFT through the gateway minus TTFT straight to the same engine.

    python -m bench.gateway_bench [--quick] [--mount] [--engine URL] [--seconds S] [--twins]
                                  [--out DIR]

Sets up what it needs on stores of its own (PostgreSQL `cp_bench_gateway`, Redis db 8;
override with BENCH_GATEWAY_DATABASE_URL / BENCH_GATEWAY_REDIS_URL; both are emptied,
and dropped or emptied again at the end): migrates, creates a tenant with a key, starts
a real engine (`python -m engine serve --model smollm2 --threads 1`, unless --engine
names a running one) and a gateway process (`controlplane.gateway.asgi` under uvicorn;
with --mount, `controlplane.asgi` as the `web` process serves it), and publishes a
routing table that sends the bench model to that engine.

Then, against the same engine, in one run:

- 1 stream: requests one after another, alternating direct and gateway (ABBA order,
  so drift in the machine's load falls on both alike); TTFT p50 and p95 of each path.
- 32 streams: rounds in which 32 closed-loop workers each send two requests (one
  under --quick) on one path, rounds alternating between the paths (ABBA); the
  workers' starts are spread over a request's duration, as in steady traffic (not 32
  requests in one burst); TTFT p50 and p95, and throughput: content tokens of a
  path's rounds over their time.

Every request sends the same prompt, greedy (temperature 0): the engine's prefix cache
then keeps its prefill short and steady, so its own variation hides less of the
gateway's, and both paths see the same cache. The client is a lean keep-alive HTTP/1.1
client (the gateway's own upstream client and stream meter), so on a two-core machine
the load generator takes as little CPU from the gateway as it can.
Figures: added TTFT (gateway minus direct) at p50 (target <= 1.5 ms) and p95, and
throughput loss at 32 streams (target <= 5 %), each against the direct measurement.
Notes: a 95 % bootstrap interval of each p50 difference, resampling the design's units
(pairs of requests at 1 stream, pairs of rounds at 32: a round's requests share its
engine batches, so they are not independent samples). At 32 streams that interval is
about +-10 ms wide in the default 120 s on two shared cores (the engine's step, not the
gateway, sets the spread); `--seconds` buys a longer run, `--twins` a paired measurement.
Every TTFT, with its unit, goes to `samples.json` in the output folder.

--twins adds a phase after the rounds (40 % of the time the 1-stream part leaves): 32
closed-loop workers through the gateway, 4 of them each sending every request together
with a direct twin. A pair usually joins the same engine step, so the engine's variation
mostly cancels and the gateway's share of a TTFT at 32 gateway streams shows within a
fraction of a millisecond; the engine then carries 36 streams, so this is a note, not a
figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.stats import percentile
from engine.config import SERVING_SECRET_VARIABLE, EngineSecrets

REPO_ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 120
QUICK_BUDGET_S = 90
TEARDOWN_S = 12  # stopping the processes, dropping the stores, the plot
MODEL_NAME = "bench-gateway"
TARGET_ADDED_P50_MS = 1.5
TARGET_LOSS_PERCENT = 5.0
CONCURRENCY = 32
CONCURRENT_MAX_TOKENS = 8
TWINS = 4  # --twins: how many of the gateway workers have a direct twin
TWINS_KEY = f"{CONCURRENCY} streams, twins"
# One prompt for every request, greedy: the engine's prefix cache makes its prefill
# short and steady, so its own variation hides less of the gateway's.
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


# -- measurements ------------------------------------------------------------------------


@dataclass
class PathSamples:
    ttfts: list[float] = field(default_factory=list)  # seconds
    rounds: list[int] = field(default_factory=list)  # the round (or pair) of each TTFT
    tokens: int = 0  # content events of the measured rounds
    window_s: float = 0.0  # the rounds' time
    errors: dict[str, int] = field(default_factory=dict)  # reason -> count

    def add_error(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    def percentile(self, q: float) -> float | None:
        """q as a fraction (0..1)."""
        return percentile(self.ttfts, q * 100)

    @property
    def throughput(self) -> float | None:
        return self.tokens / self.window_s if self.window_s > 0 else None


@dataclass
class Result:
    started: float
    ttft: float | None
    token_times: list[float]
    error: str = ""  # empty when the request succeeded

    @property
    def duration(self) -> float:
        return self.token_times[-1] - self.started if self.token_times else 0.0


class Client:
    """Streams chat completions and timestamps their content events."""

    def __init__(self, keys: dict[str, str]) -> None:
        """`keys`: base URL -> its bearer key (the tenant's API key for the gateway, the
        engine's serving secret for the direct path): the same headers on both paths."""
        from controlplane.gateway.upstream import UpstreamPool

        self.pool = UpstreamPool(connect_timeout_s=5, read_timeout_s=120, keepalive_expiry_s=60)
        self.headers = {
            url: [("content-type", "application/json"), ("authorization", f"Bearer {key}")]
            for url, key in keys.items()
        }

    async def stream(self, base_url: str, max_tokens: int) -> Result:
        from controlplane.gateway.metering import StreamMeter

        body = json.dumps(
            {
                "model": MODEL_NAME,
                "messages": MESSAGES,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            }
        ).encode()
        started = time.perf_counter()
        # The gateway's own stream meter finds the content events (a byte scan per event).
        meter = StreamMeter(started=started, is_usage_stripped=False, is_capturing=False)
        try:
            response = await self.pool.post(
                base_url, "/v1/chat/completions", body, self.headers[base_url]
            )
        except Exception as error:
            return Result(started, None, [], f"{type(error).__name__}: {error}")
        try:
            if response.status != 200:
                text = (await response.read())[:200].decode(errors="replace")
                return Result(started, None, [], f"HTTP {response.status}: {text}")
            buffer = b""
            while piece := await response.read_some():
                _, buffer = meter.feed_bytes(buffer + piece, time.perf_counter())
        except Exception as error:
            return Result(
                started, meter.ttft_s, _token_times(meter), f"{type(error).__name__}: {error}"
            )
        finally:
            response.close()
        ttft = meter.ttft_s
        return Result(started, ttft, _token_times(meter), "" if ttft is not None else "no content")


def _token_times(meter: Any) -> list[float]:
    """The content events' arrival times, from the meter's first time and gaps."""
    if meter.first_token_at is None:
        return []
    times = [meter.first_token_at]
    for gap in meter.gaps:
        times.append(times[-1] + gap)
    return times


def _order(index: int) -> tuple[str, str]:
    """ABBA: direct first in pairs 0, 3, 4, 7, ...; gateway first in the others."""
    return ("direct", "gateway") if index % 4 in (0, 3) else ("gateway", "direct")


async def measure_single(
    client: Client, urls: dict[str, str], until: float, max_tokens: int
) -> tuple[dict[str, PathSamples], list[float]]:
    """Pairs of requests, one per path; also each pair's gateway-minus-direct TTFT."""
    samples = {name: PathSamples() for name in urls}
    differences = []
    index = 0
    while time.perf_counter() < until or index < 4:
        ttfts = {}
        for name in _order(index):
            result = await client.stream(urls[name], max_tokens)
            if result.error or result.ttft is None:
                samples[name].add_error(result.error or "no content")
            else:
                samples[name].ttfts.append(result.ttft)
                samples[name].rounds.append(index)
                ttfts[name] = result.ttft
        if len(ttfts) == 2:
            differences.append(ttfts["gateway"] - ttfts["direct"])
        index += 1
    return samples, differences


def bootstrap_interval(direct: PathSamples, gateway: PathSamples, q: float) -> tuple[float, float]:
    """A 95 % bootstrap interval of percentile(gateway, q) - percentile(direct, q).

    What is resampled is the unit of the design, not single requests: a pair of requests
    at 1 stream, a pair of rounds at 32 (requests of one round share its engine batches,
    so they are not independent; resampling them one by one would make the interval
    look narrower than it is).
    """
    by_unit: dict[int, tuple[list[float], list[float]]] = {}
    for ttft, unit in zip(direct.ttfts, direct.rounds, strict=True):
        by_unit.setdefault(unit, ([], []))[0].append(ttft)
    for ttft, unit in zip(gateway.ttfts, gateway.rounds, strict=True):
        by_unit.setdefault(unit, ([], []))[1].append(ttft)
    units = [pair for pair in by_unit.values() if pair[0] and pair[1]]
    rng = random.Random(0)
    estimates = []
    for _ in range(1000):
        drawn = rng.choices(units, k=len(units))
        d = PathSamples(ttfts=[t for pair in drawn for t in pair[0]]).percentile(q)
        g = PathSamples(ttfts=[t for pair in drawn for t in pair[1]]).percentile(q)
        estimates.append(g - d)  # type: ignore[operator]
    estimates.sort()
    return estimates[25], estimates[974]


async def _round(
    client: Client,
    url: str,
    requests_each: int,
    max_tokens: int,
    into: PathSamples,
    stagger_s: float,
    durations: list[float],
    round_index: int = -1,
) -> None:
    """CONCURRENCY closed-loop workers, each sending `requests_each` requests in turn.

    Worker i starts i * stagger_s after the first, so that requests arrive spread over a
    request's duration as in steady traffic, not as one burst of 32 at a time.
    """
    start = time.perf_counter()

    async def worker(index: int) -> None:
        await asyncio.sleep(index * stagger_s)
        for _ in range(requests_each):
            result = await client.stream(url, max_tokens)
            if result.error or result.ttft is None:
                into.add_error(result.error or "no content")
                continue
            into.ttfts.append(result.ttft)
            into.rounds.append(round_index)
            into.tokens += len(result.token_times)
            durations.append(result.duration)

    await asyncio.gather(*(worker(index) for index in range(CONCURRENCY)))
    into.window_s += time.perf_counter() - start


async def measure_concurrent(
    client: Client,
    urls: dict[str, str],
    until: float,
    requests_each: int,
    max_tokens: int,
    durations: list[float],
) -> tuple[dict[str, PathSamples], int]:
    samples = {name: PathSamples() for name in urls}
    pair_s = 0.0
    index = 0
    # Only whole pairs of rounds (one per path), so both paths get the same work.
    while index < 1 or time.perf_counter() + pair_s < until:
        pair_started = time.perf_counter()
        for name in _order(index):
            stagger_s = statistics.median(durations) / CONCURRENCY if durations else 0.0
            await _round(
                client,
                urls[name],
                requests_each,
                max_tokens,
                samples[name],
                stagger_s,
                durations,
                round_index=index,
            )
        pair_s = time.perf_counter() - pair_started
        index += 1
    return samples, index


async def measure_twins(
    client: Client, urls: dict[str, str], until: float, max_tokens: int, durations: list[float]
) -> dict[str, PathSamples]:
    """CONCURRENCY closed-loop workers through the gateway, TWINS of them shadowed.

    A shadowed worker sends each request together with a direct twin (same instant, same
    prompt): both usually join the same engine step, so the engine's own variation, which
    swamps a millisecond in the rounds' comparison, mostly cancels within a pair. The
    gateway carries CONCURRENCY streams, as in a gateway round; the engine carries
    CONCURRENCY + TWINS.
    """
    samples = {name: PathSamples() for name in urls}
    stagger_s = statistics.median(durations) / CONCURRENCY
    pair_index = 0

    async def worker(index: int) -> None:
        nonlocal pair_index
        await asyncio.sleep(index * stagger_s)
        while time.perf_counter() < until:
            if index >= TWINS:
                await client.stream(urls["gateway"], max_tokens)
                continue
            pair_index += 1
            unit = pair_index
            results = await asyncio.gather(
                client.stream(urls["gateway"], max_tokens),
                client.stream(urls["direct"], max_tokens),
            )
            if all(not result.error and result.ttft is not None for result in results):
                for name, result in zip(("gateway", "direct"), results, strict=True):
                    samples[name].ttfts.append(result.ttft)  # type: ignore[arg-type]
                    samples[name].rounds.append(unit)

    await asyncio.gather(*(worker(index) for index in range(CONCURRENCY)))
    return samples


async def measure(
    urls: dict[str, str],
    key: str,
    engine_secret: str,
    deadline: float,
    quick: bool,
    twins: bool = False,
) -> tuple[dict[str, dict[str, PathSamples]], list[str]]:
    client = Client({urls["direct"]: engine_secret, urls["gateway"]: key})
    notes = []
    # Warm both paths: connections, the gateway's key cache, the engine's first batches.
    for _ in range(3):
        for name in ("direct", "gateway"):
            await client.stream(urls[name], 2)
    warm = {name: PathSamples() for name in urls}
    durations: list[float] = []  # of requests at CONCURRENCY streams, for the stagger
    for name in ("direct", "gateway"):
        await _round(client, urls[name], 1, CONCURRENT_MAX_TOKENS, warm[name], 0.0, durations)
    available = deadline - time.perf_counter()
    single_until = time.perf_counter() + available * 0.4
    single, differences = await measure_single(client, urls, single_until, max_tokens=1)
    notes.append(f"1 stream: {len(differences)} pairs of requests (max_tokens 1), ABBA order")
    if differences:
        notes.append(
            f"1 stream: median of the pairs' TTFT differences (gateway - direct) "
            f"{statistics.median(differences) * 1000:+.2f} ms"
        )
    requests_each = 1 if quick else 2
    concurrent_until = deadline
    if twins:
        concurrent_until = time.perf_counter() + (deadline - time.perf_counter()) * 0.6
    concurrent, round_pairs = await measure_concurrent(
        client, urls, concurrent_until, requests_each, CONCURRENT_MAX_TOKENS, durations
    )
    result = {"1": single, str(CONCURRENCY): concurrent}
    if twins:
        result[TWINS_KEY] = await measure_twins(
            client, urls, deadline, CONCURRENT_MAX_TOKENS, durations
        )
        notes.append(
            f"{TWINS_KEY}: {CONCURRENCY} workers through the gateway, {TWINS} of them with a "
            f"direct twin sent at the same instant ({len(result[TWINS_KEY]['direct'].ttfts)} "
            "pairs); not a figure: the engine carries more streams than in the rounds"
        )
    notes.append(
        f"{CONCURRENCY} streams: {round_pairs} pairs of rounds, ABBA order; a round: "
        f"{CONCURRENCY} workers x {requests_each} request(s) of max_tokens "
        f"{CONCURRENT_MAX_TOKENS}, their starts spread over a request's median duration "
        f"({statistics.median(durations):.2f} s); throughput: content tokens / round time"
    )
    await client.pool.aclose()
    return result, notes


# -- figures -----------------------------------------------------------------------------


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def figures_from(samples: dict[str, dict[str, PathSamples]]) -> list[dict[str, Any]]:
    figures = []
    for streams, paths in samples.items():
        if streams == TWINS_KEY:
            continue  # notes only
        direct, gateway = paths["direct"], paths["gateway"]
        label = "1 stream" if streams == "1" else f"{streams} streams"
        for q, name in ((0.5, "p50"), (0.95, "p95")):
            d, g = direct.percentile(q), gateway.percentile(q)
            figure: dict[str, Any] = {
                "name": f"added TTFT {name}, {label}",
                "unit": "ms",
                "reference": f"direct to the engine, TTFT {name}, {label}",
            }
            if d is None or g is None:
                figures.append(figure | {"value": None, "skipped": "no successful requests"})
                continue
            figures.append(
                figure
                | {
                    "value": _ms(g - d),
                    "reference_value": _ms(d),
                    "ratio": g / d,
                    "target": f"value <= {TARGET_ADDED_P50_MS}"
                    if name == "p50"
                    else "shown (p50 is the target)",
                }
            )
    paths = samples[str(CONCURRENCY)]
    direct_rate, gateway_rate = paths["direct"].throughput, paths["gateway"].throughput
    figure = {
        "name": f"throughput loss, {CONCURRENCY} streams",
        "unit": "%",
        "reference": f"direct to the engine, content tokens/s at {CONCURRENCY} streams",
    }
    if direct_rate and gateway_rate is not None:
        figures.append(
            figure
            | {
                "value": round((1 - gateway_rate / direct_rate) * 100, 2),
                "reference_value": round(direct_rate, 2),
                "ratio": gateway_rate / direct_rate,
                "target": f"value <= {TARGET_LOSS_PERCENT:g}",
            }
        )
    else:
        figures.append(figure | {"value": None, "skipped": "no tokens measured"})
    return figures


def plot(samples: dict[str, dict[str, PathSamples]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = {streams: paths for streams, paths in samples.items() if streams != TWINS_KEY}
    fig, axes = plt.subplots(1, len(samples), figsize=(10, 4))
    for axis, (streams, paths) in zip(axes, samples.items(), strict=True):
        for name, style in (("direct", "-"), ("gateway", "--")):
            values = sorted(t * 1000 for t in paths[name].ttfts)
            if values:
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                axis.plot(values, fractions, style, label=f"{name} (n={len(values)})")
        axis.set_title(f"TTFT, {streams} stream{'s' if streams != '1' else ''}")
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# -- set-up ------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _is_up(url: str, path: str, headers: dict[str, str] | None = None) -> bool:
    import httpx

    try:
        return httpx.get(url + path, headers=headers, timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


def _wait(predicate, timeout: float, what: str, processes: list) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, process, log in processes:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                raise RuntimeError(f"{name} exited with {process.returncode}: {tail}")
        if predicate():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not within {timeout:.0f} s")


def _reset_stores(database_url: str, redis_url: str, *, drop: bool = False) -> None:
    import psycopg
    import redis

    base, name = database_url.rsplit("/", 1)
    if not name.replace("_", "").isalnum():
        raise ValueError(f"database name {name!r}: letters, digits and '_' only")
    with psycopg.connect(f"{base}/postgres", autocommit=True) as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not drop:
            connection.execute(f'CREATE DATABASE "{name}"')
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()


def _create_tenant() -> tuple[str, int]:
    from controlplane.registry.models import Artifact, Model, ModelVersion
    from controlplane.tenants.services import api_key_create, tenant_create

    model = Model.objects.create(name=MODEL_NAME, task="chat")
    artifact = Artifact.objects.create(digest=uuid.uuid4().hex * 2, format="gguf", size_bytes=1)
    version = ModelVersion.objects.create(
        model=model,
        label="bench",
        artifact=artifact,
        serving_config={
            "dtype": "float32",
            "max_model_len": 2048,
            "kv_block_size": 16,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 512,
        },
    )
    tenant = tenant_create(
        actor=None,
        slug="bench-gateway",
        name="Gateway bench",
        requests_per_minute=1_000_000,
        tokens_per_minute=1_000_000_000,
        allowed_models=[model],
    )
    return api_key_create(actor=None, tenant=tenant, name="bench").raw_key, version.pk


def run_bench(
    out_dir: Path,
    quick: bool,
    *,
    engine_url: str | None = None,
    engine_secret: str = "",
    mount: bool = False,
    budget_s: float | None = None,
    twins: bool = False,
) -> dict[str, Any]:
    started = time.monotonic()
    budget = budget_s or (QUICK_BUDGET_S if quick else BUDGET_S)
    out_dir.mkdir(parents=True, exist_ok=True)
    database_url = os.environ.get(
        "BENCH_GATEWAY_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/cp_bench_gateway"
    )
    redis_url = os.environ.get("BENCH_GATEWAY_REDIS_URL", "redis://127.0.0.1:6379/8")
    try:
        _reset_stores(database_url, redis_url)
    except Exception as error:
        return {"skipped": f"PostgreSQL or Redis not available: {error}"}
    spool = Path(tempfile.mkdtemp(prefix="gateway-bench-spool-"))
    env = {
        **os.environ,
        "DEBUG": "1",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "CELERY_QUEUE": "bench-gateway",
        "CHANNELS_PREFIX": "bench-gateway",
        "LOG_LEVEL": "WARNING",
        "LOG_FORMAT": "text",
        "GATEWAY_SPOOL_DIR": str(spool),
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update({k: env[k] for k in ("DEBUG", "DJANGO_SETTINGS_MODULE", "DATABASE_URL",
                                           "REDIS_URL", "CELERY_QUEUE", "CHANNELS_PREFIX",
                                           "LOG_LEVEL", "LOG_FORMAT")})  # fmt: skip
    processes: list[tuple[str, subprocess.Popen, Path]] = []

    def spawn(name: str, args: list[str], **extra_env: str) -> None:
        log = out_dir / f"{name}.log"
        with log.open("wb") as handle:
            # Same process group as the bench: the suite's time limit stops them too.
            process = subprocess.Popen(args, cwd=REPO_ROOT, env={**env, **extra_env},
                                       stdout=handle, stderr=subprocess.STDOUT)  # fmt: skip
        processes.append((name, process, log))

    try:
        if engine_url is None:
            port = _free_port()
            engine_secrets = EngineSecrets.generate()
            engine_secret = engine_secrets.serving
            spawn("engine", [sys.executable, "-m", "engine", "serve", "--model", "smollm2",
                             "--threads", "1", "--host", "127.0.0.1", "--port", str(port),
                             "--served-model-name", MODEL_NAME, "--device", "cpu",
                             "--log-level", "warning"], **engine_secrets.environment())  # fmt: skip
            engine_url = f"http://127.0.0.1:{port}"
        elif not engine_secret:
            return {"skipped": f"--engine needs that engine's {SERVING_SECRET_VARIABLE}"}
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
                       cwd=REPO_ROOT, env=env, check=True)  # fmt: skip
        import django

        django.setup()
        key, version_id = _create_tenant()
        gateway_port = _free_port()
        app = "controlplane.asgi:application" if mount else "controlplane.gateway.asgi:application"
        spawn("gateway", [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1",
                          "--port", str(gateway_port), "--no-access-log",
                          "--log-level", "warning"])  # fmt: skip
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        _wait(lambda: _is_up(gateway_url, "/v1/models"), 60, "gateway", processes)
        engine_headers = {"Authorization": f"Bearer {engine_secret}"}
        _wait(lambda: _is_up(engine_url, "/health", engine_headers), 180, "engine", processes)

        from controlplane.rollouts.routing import routing_table_publish

        routing_table_publish(
            deployment=MODEL_NAME,
            model=MODEL_NAME,
            versions=[{"version_id": version_id, "label": "bench", "weight": 100,
                       "endpoints": [engine_url],
                       "endpoint_secrets": {engine_url: engine_secret}}],
        )  # fmt: skip

        def routed() -> bool:
            import httpx

            response = httpx.get(
                f"{gateway_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2
            )
            return MODEL_NAME in [m["id"] for m in response.json().get("data", [])]

        _wait(routed, 20, "the bench model routed by the gateway", processes)
        setup_s = time.monotonic() - started
        measure_s = budget - TEARDOWN_S - setup_s
        if measure_s < 20:
            return {"skipped": f"set-up took {setup_s:.0f} s of the {budget} s budget"}
        deadline = time.perf_counter() + measure_s
        urls = {"direct": engine_url, "gateway": gateway_url}
        load_before = os.getloadavg()[0]
        samples, notes = asyncio.run(measure(urls, key, engine_secret, deadline, quick, twins))
        # Other work on the machine shows here (this run's own busy engine thread makes 1).
        notes.append(
            f"load average (1 min) {load_before:.1f} as the measurement began, "
            f"{os.getloadavg()[0]:.1f} as it ended"
        )
    finally:
        for _, process, _ in reversed(processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _, process, _ in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        with contextlib.suppress(Exception):
            _reset_stores(database_url, redis_url, drop=True)
    figures = figures_from(samples)
    notes = [
        f"engine: smollm2 (its default dtype), 1 torch thread, {engine_url}; gateway: {app} "
        f"(uvicorn, its own process{'; the web app with /v1/ mounted' if mount else ''})",
        f"set-up {setup_s:.0f} s, measured {measure_s:.0f} s",
        *notes,
    ]
    for streams, paths in samples.items():
        direct, gateway = paths["direct"].ttfts, paths["gateway"].ttfts
        if len(direct) >= 10 and len(gateway) >= 10:
            low, high = bootstrap_interval(paths["direct"], paths["gateway"], 0.5)
            unit = "pairs of rounds" if streams == str(CONCURRENCY) else "pairs of requests"
            added = paths["gateway"].percentile(0.5) - paths["direct"].percentile(0.5)  # type: ignore[operator]
            notes.append(
                f"{streams} stream(s): added TTFT p50 {added * 1000:+.2f} ms, 95 % bootstrap "
                f"interval [{low * 1000:+.2f}, {high * 1000:+.2f}] ms (resampling {unit})"
            )
        if streams == TWINS_KEY and direct:
            paired = [g - d for g, d in zip(gateway, direct, strict=True)]
            notes.append(
                f"{streams}: median of the pairs' TTFT differences (gateway - direct) "
                f"{statistics.median(paired) * 1000:+.2f} ms"
            )
        for name, path_samples in paths.items():
            p50, p95 = _ms(path_samples.percentile(0.5)), _ms(path_samples.percentile(0.95))
            line = (
                f"{streams} stream(s), {name}: n={len(path_samples.ttfts)} "
                f"errors={sum(path_samples.errors.values())} TTFT p50 {p50} ms p95 {p95} ms"
            )
            if streams == str(CONCURRENCY) and path_samples.throughput:
                line += f", {path_samples.throughput:.1f} tokens/s"
            notes.append(line)
            for reason, count in sorted(path_samples.errors.items(), key=lambda i: -i[1])[:3]:
                notes.append(f"  {count} x {reason}")
    (out_dir / "samples.json").write_text(
        json.dumps(
            {
                streams: {
                    name: {"ttft_s": path.ttfts, "round": path.rounds, "errors": path.errors}
                    for name, path in paths.items()
                }
                for streams, paths in samples.items()
            }
        )
    )
    result: dict[str, Any] = {"figures": figures, "notes": notes}
    if plot(samples, out_dir / "ttft.png"):
        result["plots"] = ["ttft.png"]
    return result


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    """The bench step: measure, plot into out_dir, return the figures."""
    return run_bench(out_dir, quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_BUDGET_S} s instead of {BUDGET_S} s"
    )
    parser.add_argument(
        "--engine",
        help="base URL of a running engine (default: start one); its serving secret in"
        f" ${SERVING_SECRET_VARIABLE}",
    )
    parser.add_argument("--mount", action="store_true", help="serve via controlplane.asgi")
    parser.add_argument(
        "--twins",
        action="store_true",
        help=f"after the rounds, {TWINS} of {CONCURRENCY} gateway streams with direct twins",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        help="the whole run's time budget (default as above): longer runs, narrower intervals",
    )
    parser.add_argument("--out", type=Path, help="folder for logs and the plot")
    args = parser.parse_args()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    result = run_bench(
        out_dir,
        args.quick,
        engine_url=args.engine,
        engine_secret=os.environ.get(SERVING_SECRET_VARIABLE, ""),
        mount=args.mount,
        budget_s=args.seconds,
        twins=args.twins,
    )
    if "skipped" in result:
        raise SystemExit(f"skipped: {result['skipped']}")
    for figure in result["figures"]:
        if figure.get("skipped"):
            print(f"{figure['name']}: skipped ({figure['skipped']})")
            continue
        print(
            f"{figure['name']}: {figure['value']} {figure['unit']} "
            f"(reference {figure['reference_value']}: {figure['reference']}; "
            f"target {figure['target']})"
        )
    for note in result["notes"]:
        print(f"  {note}")
    print(f"logs and plot in {out_dir}")


if __name__ == "__main__":
    main()
