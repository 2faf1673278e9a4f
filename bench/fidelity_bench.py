"""Signal fidelity: do the servers' own signals agree with what a client measures?

Two comparisons, each in the same run as its reference:

- engine: a short loadgen run straight at a fresh engine. loadgen's completion tokens
  against the delta of the engine's `engine:generation_tokens_total` (target exact) and
  loadgen's mean TTFT against the engine's (`engine:time_to_first_token_seconds` sum/count
  delta; target within 5 %).
- gateway: a loadgen run through the gateway, joined by the `x-request-id` the gateway
  returns to its `RequestSample` rows. Per version: the gateway's TTFT p95 against
  loadgen's TTFT p95 over the same requests (target within 5 %), and the gateway's usage
  tokens against loadgen's (target exact). By default the step starts the demo's
  processes on stores of its own (`bench.stack`: PostgreSQL `cp_bench_fidelity`, Redis db
  5) and holds a rollout of the bfloat16 version at 50 %, so both versions get traffic.
  To measure a running gateway instead, set BENCH_GATEWAY_URL, BENCH_GATEWAY_API_KEY,
  BENCH_GATEWAY_MODEL (and DATABASE_URL / DJANGO_SETTINGS_MODULE as for manage.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from bench.stack import DEPLOYMENT, MODEL, DemoStack, wait_for
from engine.config import EngineSecrets
from loadgen.energy import parse_prometheus
from loadgen.report import write_run
from loadgen.runner import LoadConfig, RunResult, run_load
from loadgen.stats import Slo, percentile

BUDGET_S = 300
QUICK_BUDGET_S = 200
REPO_ROOT = Path(__file__).resolve().parent.parent
GATEWAY_UNAVAILABLE = "gateway not available"


# -- comparison functions --------------------------------------------------------------


def compare_ttft_p95_by_version(
    client_ttft: dict[str, float], gateway_rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per version, the gateway's TTFT p95 against the client's over the same requests.

    `client_ttft` maps request id to loadgen's TTFT; `gateway_rows` are the gateway's
    samples ({"request_id", "version", "ttft_s"}). Requests missing on either side, or
    without a TTFT, are left out of both.
    """
    by_version: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for row in gateway_rows:
        client = client_ttft.get(row["request_id"])
        if client is None or row.get("ttft_s") is None:
            continue
        gateway_values, client_values = by_version[str(row["version"])]
        gateway_values.append(float(row["ttft_s"]))
        client_values.append(client)
    figures = []
    for version, (gateway_values, client_values) in sorted(by_version.items()):
        figures.append(
            figure(
                f"gateway TTFT p95, version {version} (n={len(gateway_values)})",
                percentile(gateway_values, 95),
                "s",
                "loadgen TTFT p95, same requests",
                percentile(client_values, 95),
                "within 5%",
            )
        )
    return figures


def compare_usage(
    client_tokens: dict[str, tuple[int, int]], gateway_rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The gateway's metered prompt and completion tokens against loadgen's counts, summed
    over the requests both sides know (target exact)."""
    matched = [row for row in gateway_rows if row["request_id"] in client_tokens]
    gateway_prompt = sum(int(row["prompt_tokens"]) for row in matched)
    gateway_completion = sum(int(row["completion_tokens"]) for row in matched)
    client_prompt = sum(client_tokens[row["request_id"]][0] for row in matched)
    client_completion = sum(client_tokens[row["request_id"]][1] for row in matched)
    n = len(matched)
    return [
        figure(f"gateway prompt tokens (n={n})", gateway_prompt, "tokens",
               "loadgen usage prompt tokens", client_prompt, "exact"),
        figure(f"gateway completion tokens (n={n})", gateway_completion, "tokens",
               "loadgen completion tokens", client_completion, "exact"),
    ]  # fmt: skip


def figure(
    name: str,
    value: float | None,
    unit: str,
    reference: str,
    reference_value: float | None,
    target: str,
    skipped: str | None = None,
) -> dict[str, Any]:
    ratio = value / reference_value if value is not None and reference_value else None
    result: dict[str, Any] = {
        "name": name,
        "value": value,
        "unit": unit,
        "reference": reference,
        "reference_value": reference_value,
        "ratio": ratio,
        "target": target,
    }
    if skipped:
        result["skipped"] = skipped
    return result


# -- engine side -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The directly driven engine's secrets; loadgen sends the serving one as its API key.
ENGINE_SECRETS = EngineSecrets.generate()
ENGINE_HEADERS = {"Authorization": f"Bearer {ENGINE_SECRETS.serving}"}


def _engine_counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=ENGINE_HEADERS, timeout=10).text
    return parse_prometheus(text)


def _wait_healthy(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", headers=ENGINE_HEADERS, timeout=2)
            if health.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"engine did not become healthy within {timeout:.0f}s")


def engine_fidelity(out_dir: Path, quick: bool) -> tuple[list[dict[str, Any]], list[str]]:
    port = _free_port()
    log = (out_dir / "engine.log").open("wb")
    engine = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", "smollm2", "--dtype", "bfloat16",
         "--threads", "1", "--port", str(port)],
        cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, **ENGINE_SECRETS.environment()},
    )  # fmt: skip
    try:
        _wait_healthy(port, timeout=150)
        before = _engine_counters(port)
        config = LoadConfig(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key=ENGINE_SECRETS.serving,
            model="smollm2",
            concurrency=2,
            num_requests=6 if quick else 10,
            prompt_tokens=32,
            max_tokens=8 if quick else 16,
            ignore_eos=True,
            slo=Slo(ttft_s=5.0, tpot_s=1.0),
            metrics_urls=[f"http://127.0.0.1:{port}/metrics"],
            show_progress=False,
        )
        result = asyncio.run(run_load(config))
        after = _engine_counters(port)
    finally:
        engine.terminate()
        try:
            engine.wait(timeout=15)
        except subprocess.TimeoutExpired:
            engine.kill()
        log.close()
    write_run(out_dir, result, name="engine_run")

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    summary = result.summary
    ttft_count = delta("engine:time_to_first_token_seconds_count")
    engine_ttft_mean = (
        delta("engine:time_to_first_token_seconds_sum") / ttft_count if ttft_count else None
    )
    figures = [
        figure("engine generation tokens", delta("engine:generation_tokens_total"), "tokens",
               "loadgen completion tokens", summary["completion_tokens"], "exact"),
        figure("engine TTFT mean", engine_ttft_mean, "s",
               "loadgen TTFT mean", summary["ttft_s"]["mean"], "within 5%"),
    ]  # fmt: skip
    energy = summary["energy"] or {}
    if energy.get("available"):
        figures.append(
            figure("energy per output token", energy["joules_per_output_token"], "J/token",
                   "energy per token (prompt + output)", energy["joules_per_token"], "")
        )  # fmt: skip
    notes = [
        f"engine run: {summary['requests']} requests, concurrency 2, "
        f"{summary['output_token_throughput']:.2f} output tok/s, TTFT p95 "
        f"{summary['ttft_s']['p95']:.3f} s, TPOT p95 {summary['tpot_s']['p95']:.3f} s",
        "energy per token: "
        + ("measured" if energy.get("available") else f"skipped ({energy.get('reason')})"),
    ]
    return figures, notes


# -- gateway side ----------------------------------------------------------------------


def _gateway_samples(request_ids: list[str], wait_s: float) -> list[dict[str, Any]]:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    django.setup()
    from controlplane.telemetry.models import RequestSample

    deadline = time.monotonic() + wait_s
    while True:
        rows = list(
            RequestSample.objects.filter(request_id__in=request_ids).values(
                "request_id", "version__label", "ttft_s", "prompt_tokens", "completion_tokens"
            )
        )
        if len(rows) >= len(request_ids) or time.monotonic() > deadline:
            return [
                {**{k: v for k, v in row.items() if k != "version__label"},
                 "version": row["version__label"]}
                for row in rows
            ]  # fmt: skip
        time.sleep(1.0)


def _own_gateway(tmp: Path) -> tuple[DemoStack, str, str, str]:
    """The demo's processes on this step's stores, both SmolLM2 versions routed 50/50."""
    database_url = os.environ.get(
        "BENCH_FIDELITY_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/cp_bench_fidelity"
    )
    redis_url = os.environ.get("BENCH_FIDELITY_REDIS_URL", "redis://127.0.0.1:6379/5")
    stack = DemoStack.start(tmp, database_url, redis_url)
    try:
        stack.django_setup()
        import redis

        from contracts.routing import parse_routing_table, routing_key
        from controlplane.registry.models import ModelVersion
        from controlplane.rollouts import deployments
        from controlplane.rollouts.models import Deployment

        client = redis.Redis.from_url(redis_url)

        def routed() -> dict[int, int]:
            stack.check()
            raw = client.get(routing_key(DEPLOYMENT))
            if raw is None:
                return {}
            table = parse_routing_table(raw)
            return {v.version_id: v.weight for v in table.versions if v.endpoints}

        deployment = Deployment.objects.get(name=DEPLOYMENT)
        wait_for(lambda: routed() == {deployment.stable_version_id: 100}, 150, "stable routed")
        candidate = ModelVersion.objects.get(model__name=MODEL, label="q4_1-bf16")
        deployments.rollout_create(
            actor=None,
            deployment=deployment,
            candidate=candidate,
            stages=[{"weight": 50, "min_duration_s": 3600, "min_requests": 1}],
            policy={"min_samples": 1_000_000, "on_inconclusive": "hold"},
            reason="fidelity bench: both versions serve",
        )
        wait_for(lambda: routed().get(candidate.pk) == 50, 150, "candidate routed at 50 %")
        client.close()
    except BaseException:
        stack.stop()
        raise
    return stack, f"{stack.web_url}/v1", stack.credentials["api_keys"]["acme"], MODEL


def gateway_fidelity(quick: bool) -> tuple[list[dict[str, Any]], list[str]]:
    url = os.environ.get("BENCH_GATEWAY_URL")
    key = os.environ.get("BENCH_GATEWAY_API_KEY")
    model = os.environ.get("BENCH_GATEWAY_MODEL")
    if url and key and model:
        return _gateway_fidelity(url, key, model, quick)
    with tempfile.TemporaryDirectory(prefix="fidelity-bench-") as tmp:
        try:
            stack, url, key, model = _own_gateway(Path(tmp))
        except Exception as error:
            return skipped_gateway_figures(f"{GATEWAY_UNAVAILABLE} ({error})"), []
        try:
            return _gateway_fidelity(url, key, model, quick)
        finally:
            stack.stop()


def _gateway_fidelity(
    url: str, key: str, model: str, quick: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    config = LoadConfig(
        base_url=url,
        model=model,
        api_key=key,
        concurrency=2,
        num_requests=10 if quick else 24,
        prompt_tokens=32,
        max_tokens=8,
        show_progress=False,
    )
    try:
        result: RunResult = asyncio.run(run_load(config))
    except Exception as error:
        return skipped_gateway_figures(f"{GATEWAY_UNAVAILABLE} ({error})"), []
    ok = [r for r in result.requests if r.is_success and r.request_id]
    if not ok:
        reason = f"{GATEWAY_UNAVAILABLE} (no successful request with an x-request-id)"
        return skipped_gateway_figures(reason), []
    try:
        rows = _gateway_samples([r.request_id for r in ok if r.request_id], wait_s=30)
    except Exception as error:
        return skipped_gateway_figures(f"{GATEWAY_UNAVAILABLE} ({error})"), []
    client_ttft = {r.request_id: r.ttft_s for r in ok if r.request_id and r.ttft_s is not None}
    client_tokens = {
        r.request_id: (r.prompt_tokens, r.completion_tokens) for r in ok if r.request_id
    }
    figures = compare_ttft_p95_by_version(client_ttft, rows) + compare_usage(client_tokens, rows)
    notes = [f"gateway: {len(ok)} requests sent, {len(rows)} samples found in the database"]
    return figures, notes


def skipped_gateway_figures(reason: str = GATEWAY_UNAVAILABLE) -> list[dict[str, Any]]:
    return [
        figure("gateway TTFT p95 per version", None, "s", "loadgen TTFT p95, same requests",
               None, "within 5%", skipped=reason),
        figure("gateway usage tokens", None, "tokens", "loadgen token counts", None, "exact",
               skipped=reason),
    ]  # fmt: skip


def run(out_dir: Path, quick: bool) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        engine_figures, engine_notes = engine_fidelity(out_dir, quick)
        figures += engine_figures
        notes += engine_notes
    except Exception as error:
        notes.append(f"engine side failed: {type(error).__name__}: {error}")
    gateway_figures, gateway_notes = gateway_fidelity(quick)
    figures += gateway_figures
    notes += gateway_notes
    plots = [p.name for p in sorted(out_dir.glob("*.png"))]
    return {"figures": figures, "notes": notes, "plots": plots}
