"""The runner against a real (small) OpenAI-compatible server over HTTP."""

import asyncio
import csv
import json
import threading
import time
from typing import Any

import pytest

from loadgen.__main__ import main
from loadgen.runner import LoadConfig, Runner, run_load
from loadgen.stats import Slo
from loadgen.trace import TraceRequest

from .openai_server import OpenAIServer, ServerThread, free_port


def test_trace_replay_maps_tenants_to_their_keys_and_writes_results(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"offset_s": 0.0, "prompt_tokens": 5, "max_tokens": 3, "tenant": "acme"}\n'
        '{"offset_s": 0.05, "prompt": "Hello", "max_tokens": 4, "tenant": "globex"}\n'
        '{"offset_s": 0.1, "prompt_tokens": 9, "max_tokens": 5, "tenant": "acme"}\n'
        '{"offset_s": 0.15, "prompt_tokens": 9, "max_tokens": 5, "tenant": "stranger"}\n'
    )
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"globex": "sk-globex"}))
    server = OpenAIServer(keys={"sk-acme", "sk-globex"})
    out = tmp_path / "out"
    with ServerThread(server) as running:
        code = main(
            [
                "--base-url", running.base_url, "--model", "m", "--trace", str(trace),
                "--tenant-key", "acme=sk-acme", "--tenant-keys", str(keys),
                "--metrics-url", f"http://127.0.0.1:{running.port}/metrics",
                "--out", str(out), "--no-progress",
            ]
        )  # fmt: skip
    assert code == 0
    assert server.requests_by_key == {"sk-acme": 2, "sk-globex": 1}
    summary = json.loads((out / "run.json").read_text())["summary"]
    assert summary["requests"] == 4
    assert summary["successes"] == 3
    assert summary["errors_by_status"] == {"401": 1}
    assert summary["completion_tokens"] == 12
    assert summary["usage_reported_share"] == 1.0
    assert summary["energy"]["available"] is True
    assert summary["energy"]["metrics_read"] == ["agent_energy_joules_total"]
    assert summary["energy"]["joules"] == pytest.approx(6.0)  # 12 tokens at 0.5 J
    assert summary["energy"]["joules_per_output_token"] == pytest.approx(0.5)
    with (out / "run_requests.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sorted((row["tenant"], row["status"]) for row in rows) == [
        ("acme", "200"),
        ("acme", "200"),
        ("globex", "200"),
        ("stranger", "401"),
    ]
    assert (out / "run_latency.png").stat().st_size > 1000


def test_without_a_usage_chunk_tokens_are_counted_by_content_chunks():
    server = OpenAIServer(send_usage=False)
    with ServerThread(server) as running:
        config = LoadConfig(
            base_url=running.base_url,
            model="m",
            endpoint="completions",
            concurrency=2,
            num_requests=4,
            max_tokens=6,
            prompt_tokens=3,
            show_progress=False,
        )
        result = asyncio.run(run_load(config))
    assert result.summary["completion_tokens"] == 24
    assert result.summary["usage_reported_share"] == 0.0
    assert all(r.content_chunks == 6 and len(r.itls) == 5 for r in result.requests)
    assert result.summary["itl_s"]["count"] == 20


def test_a_target_that_is_down_is_retried_with_backoff_not_a_crash():
    config = LoadConfig(
        base_url=f"http://127.0.0.1:{free_port()}",
        model="m",
        rate=20.0,
        duration_s=1.5,
        show_progress=False,
    )
    result = asyncio.run(run_load(config))
    summary = result.summary
    assert summary["successes"] == 0
    assert set(summary["errors_by_status"]) == {"connect_error"}
    # Back-off (0.5 s, then 1 s) drops the arrivals meant for the pause.
    assert summary["skipped_while_down"] > summary["requests"]


def test_forever_mode_keeps_aggregates_only_and_stops_on_request():
    server = OpenAIServer()
    snapshots: list[dict[str, Any]] = []

    async def scenario(base_url):
        config = LoadConfig(
            base_url=base_url,
            model="m",
            rate=15.0,
            tenants=["a", "b"],
            max_tokens=3,
            forever=True,
            max_concurrency=4,
            report_interval_s=0.5,
            slo=Slo(ttft_s=1.0, tpot_s=1.0),
            show_progress=False,
        )
        stop = asyncio.Event()
        runner = Runner(config, on_report=snapshots.append, stop=stop)
        task = asyncio.create_task(runner.run())
        await asyncio.sleep(1.6)
        stop.set()
        return await task

    with ServerThread(server) as running:
        result = asyncio.run(scenario(running.base_url))
    assert result.requests == []
    assert result.summary["requests"] > 5
    assert result.summary["slo_attainment"] == 1.0
    assert snapshots and snapshots[-1]["requests"] <= result.summary["requests"]
    assert result.summary["ttft_s"]["p95"] is not None  # from the streaming histogram


def test_a_sweep_reads_the_max_rate(tmp_path):
    server = OpenAIServer()
    out = tmp_path / "sweep"
    with ServerThread(server) as running:
        code = main(
            [
                "--base-url", running.base_url, "--model", "m", "--sweep-rates", "5,10",
                "--num-requests", "6", "--max-tokens", "2", "--out", str(out), "--no-progress",
            ]
        )  # fmt: skip
    assert code == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert [step["value"] for step in sweep["steps"]] == [5.0, 10.0]
    assert sweep["max_rate"]["rate"] == 10.0
    assert sweep["max_rate"]["is_lower_bound"] is True
    assert (out / "sweep.png").exists() and (out / "sweep.csv").exists()


def test_trace_request_validation_is_a_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        TraceRequest(offset_s=0, max_tokens=0, prompt="x")


def test_wait_ready_holds_the_load_until_the_model_is_listed(tmp_path):
    server = OpenAIServer()
    with ServerThread(server) as running:
        threading.Timer(1.5, lambda: server.models.append("m")).start()
        started = time.monotonic()
        code = main(
            ["--base-url", running.base_url, "--model", "m", "--concurrency", "1",
             "--num-requests", "2", "--max-tokens", "2", "--wait-ready", "30",
             "--no-progress", "--no-plots"]
        )  # fmt: skip
        waited = time.monotonic() - started
    assert code == 0
    assert waited >= 1.5
    assert sum(server.requests_by_key.values()) == 2  # none sent before the model was listed


def test_wait_ready_gives_up_with_a_clear_message():
    server = OpenAIServer()
    with ServerThread(server) as running, pytest.raises(SystemExit, match="m not served at"):
        main(
            ["--base-url", running.base_url, "--model", "m", "--concurrency", "1",
             "--num-requests", "1", "--wait-ready", "1", "--no-progress", "--no-plots"]
        )  # fmt: skip
    assert sum(server.requests_by_key.values()) == 0
