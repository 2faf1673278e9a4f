"""A short real run against the serving engine: loadgen's counts against the engine's own."""

import json
import os
import subprocess
import sys

import httpx
import pytest

from engine.config import EngineSecrets
from loadgen.energy import parse_prometheus
from tests.conftest import start_process, stop_process, wait_until

from .openai_server import free_port

pytestmark = pytest.mark.slow

SECRETS = EngineSecrets.generate()
SERVING = {"Authorization": f"Bearer {SECRETS.serving}"}


def generation_tokens(port: int) -> float:
    # Labelled counters appear once counted: absent means zero.
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=SERVING, timeout=10).text
    return parse_prometheus(text).get("engine:generation_tokens_total", 0.0)


def is_healthy(port: int) -> bool:
    try:
        health = httpx.get(f"http://127.0.0.1:{port}/health", headers=SERVING, timeout=2)
        return health.status_code == 200
    except httpx.HTTPError:
        return False


def test_short_run_against_the_engine(tmp_path):
    port = free_port()
    engine = start_process(
        [sys.executable, "-m", "engine", "serve", "--model", "smollm2", "--dtype", "bfloat16",
         "--threads", "1", "--port", str(port)],
        tmp_path / "engine.log",
        **SECRETS.environment(),
    )  # fmt: skip
    try:
        wait_until(lambda: is_healthy(port), timeout=180, interval=0.5, message="engine not up")
        before = generation_tokens(port)
        out = tmp_path / "out"
        run = subprocess.run(
            [sys.executable, "-m", "loadgen", "--base-url", f"http://127.0.0.1:{port}",
             "--model", "smollm2", "--concurrency", "2", "--num-requests", "4",
             "--prompt-tokens", "12", "--max-tokens", "4", "--ignore-eos",
             "--metrics-url", f"http://127.0.0.1:{port}/metrics",
             "--out", str(out), "--no-progress"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "LOADGEN_API_KEY": SECRETS.serving},  # the engine's secret
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        after = generation_tokens(port)
    finally:
        stop_process(engine)
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["requests"] == 4
    assert summary["successes"] == 4
    assert summary["completion_tokens"] == 16
    assert summary["completion_tokens"] == after - before
    assert summary["usage_reported_share"] == 1.0
    assert summary["ttft_s"]["count"] == 4
    # One gap between consecutive content chunks; the engine may send two tokens in one
    # chunk when the client lags, so at most completion tokens minus one per request.
    assert 1 <= summary["itl_s"]["count"] <= 16 - 4
    # The engine exports no energy counter of its own: the step is skipped, not failed.
    assert summary["energy"] == {
        "available": False,
        "reason": "no energy counter found at the metrics URLs",
    }
    assert "TTFT ms" in run.stdout
    assert (out / "run_latency.png").exists()
