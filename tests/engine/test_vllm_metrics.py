"""A vLLM Grafana board reads the engine: the `vllm:*` series after real chat requests."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.engines.builtin import BuiltinAdapter
from agent.telemetry import TelemetryAccumulator
from engine import vllm_metrics
from tests.engine.conftest import EngineServer, start_server, stop_server

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Count to five.", "Name a primary color."]
SERIES = (("engine", "0"), ("model_name", "smollm2"))


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory):
    # Its own server: every counter starts at zero, so totals are these requests' alone.
    log = tmp_path_factory.mktemp("logs") / "smollm2-vllm-metrics.log"
    server = start_server(
        ["--model", "smollm2", "--dtype", "float32", "--served-model-name", "smollm2",
         "--max-model-len", "1024"],
        log,
    )  # fmt: skip
    yield server
    stop_server(server)


def scrape(server: EngineServer) -> tuple[dict, dict]:
    text = httpx.get(f"{server.base_url}/metrics", headers=server.serving).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families.values()
        for sample in family.samples
    }
    return families, samples


def test_vllm_names_carry_what_the_client_was_told(smollm2_server):
    _, before = scrape(smollm2_server)
    assert before[("vllm:prompt_tokens_total", SERIES)] == 0
    usages, reasons = [], []
    for question in QUESTIONS:
        response = smollm2_server.client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=12,
        )
        assert response.usage is not None
        usages.append(response.usage)
        reasons.append(response.choices[0].finish_reason)
    families, after = scrape(smollm2_server)
    count = len(QUESTIONS)
    prompt_tokens = sum(usage.prompt_tokens for usage in usages)
    completion_tokens = sum(usage.completion_tokens for usage in usages)

    expected_types = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
        "vllm:request_prompt_tokens": "histogram",
        "vllm:request_generation_tokens": "histogram",
        "vllm:iteration_tokens_total": "histogram",
        "vllm:spec_decode_num_drafts": "counter",
        "vllm:spec_decode_num_draft_tokens": "counter",
        "vllm:spec_decode_num_accepted_tokens": "counter",
    }
    assert {
        name: families[name].type for name in expected_types if name in families
    } == expected_types
    vllm_samples = [key for key in after if key[0].startswith("vllm:")]
    assert {dict(labels)["model_name"] for _, labels in vllm_samples} == {"smollm2"}
    assert {dict(labels)["engine"] for _, labels in vllm_samples} == {"0"}

    assert after[("vllm:prompt_tokens_total", SERIES)] == prompt_tokens
    assert after[("vllm:generation_tokens_total", SERIES)] == completion_tokens
    model = (("model_name", "smollm2"),)
    assert after[("engine:generation_tokens_total", model)] == completion_tokens

    successes = {
        dict(labels)["finished_reason"]: value
        for (name, labels), value in after.items()
        if name == "vllm:request_success_total"
    }
    assert sum(successes.values()) == count
    assert successes == {
        reason: float(reasons.count(reason)) for reason in ("stop", "length", "abort", "error")
    }

    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert after[(f"{histogram}_count", SERIES)] == count, histogram
    assert after[("vllm:request_prompt_tokens_sum", SERIES)] == prompt_tokens
    assert after[("vllm:request_generation_tokens_sum", SERIES)] == completion_tokens
    # One gap between each two tokens of a request.
    assert after[("vllm:inter_token_latency_seconds_count", SERIES)] == completion_tokens - count
    # Every step's tokens computed, prompt (less prefix cache hits) and generated, once.
    computed_prompt_tokens = after[("engine:prompt_tokens_total", model)]
    assert computed_prompt_tokens == prompt_tokens - after[("vllm:prefix_cache_hits_total", SERIES)]
    assert after[("vllm:iteration_tokens_total_sum", SERIES)] == (
        computed_prompt_tokens + completion_tokens
    )

    # speculative decoding: the twins and /admin/stats count the same verifications
    speculative = smollm2_server.stats()["speculative"]
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        value = after[(f"vllm:spec_decode_num_{name}_total", SERIES)]
        assert value == after[(f"engine:spec_decode_num_{name}_total", model)] == speculative[name]
    assert speculative["accepted_tokens"] <= speculative["draft_tokens"]

    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert after[(gauge, SERIES)] == 0  # nothing left running once all answered
    assert 0 <= after[("vllm:kv_cache_usage_perc", SERIES)] <= 1
    assert (
        after[("vllm:prefix_cache_queries_total", SERIES)]
        == after[("engine:prefix_cache_queries_total", model)]
    )
    assert (
        after[("vllm:prefix_cache_hits_total", SERIES)]
        == after[("engine:prefix_cache_hits_total", model)]
    )


def test_vllm_buckets_are_vllms(smollm2_server):
    _, samples = scrape(smollm2_server)

    def bounds(histogram: str) -> list[float]:
        return sorted(
            float(dict(labels)["le"])
            for name, labels in samples
            if name == f"{histogram}_bucket" and dict(labels)["le"] != "+Inf"
        )

    assert bounds("vllm:time_to_first_token_seconds") == list(
        vllm_metrics.TIME_TO_FIRST_TOKEN_BUCKETS
    )
    assert bounds("vllm:inter_token_latency_seconds") == list(vllm_metrics.INTER_TOKEN_BUCKETS)
    assert bounds("vllm:e2e_request_latency_seconds") == list(vllm_metrics.REQUEST_LATENCY_BUCKETS)
    assert bounds("vllm:iteration_tokens_total") == list(vllm_metrics.ITERATION_TOKEN_BUCKETS)
    # 1-2-5 up to --max-model-len 1024, as vLLM builds them
    assert bounds("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_the_agent_reads_them_into_a_heartbeats_figures(smollm2_server):
    """The agent's reading of our engine is its reading of vLLM (agent/engines/)."""
    adapter = BuiltinAdapter()

    def snapshot():
        text = httpx.get(f"{smollm2_server.base_url}/metrics", headers=smollm2_server.serving)
        return adapter.read_metrics(text.text)

    telemetry = TelemetryAccumulator()
    telemetry.begin_engine("engine", snapshot())
    response = smollm2_server.client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Count to five."}],
        temperature=0,
        max_tokens=12,
    )
    assert response.usage is not None
    figures = telemetry.observe({"engine": snapshot()})
    assert figures.prompt_tokens == response.usage.prompt_tokens
    assert figures.generated_tokens == response.usage.completion_tokens
    assert (figures.requests_ok, figures.requests_failed, figures.requests_aborted) == (1, 0, 0)
    assert figures.ttft_p50_s is not None and figures.ttft_p50_s > 0
    assert figures.itl_mean_s is not None and figures.itl_mean_s > 0
