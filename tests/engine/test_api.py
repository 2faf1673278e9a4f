"""The HTTP contract: models, errors, admission, faults, stats and metrics."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.conftest import bearer, new_secrets


def wait_for(predicate, timeout: float = 60, message: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(message or "condition not met")


def test_models_lists_served_name(tiny_server):
    models = tiny_server.client.models.list()
    assert models.data[0].id == "tiny"


def test_health_ready(tiny_server):
    response = httpx.get(f"{tiny_server.base_url}/health", headers=tiny_server.serving)
    assert (response.status_code, response.json()) == (200, {"status": "ready"})


def test_prompt_longer_than_max_model_len_is_400(tiny_server):
    with pytest.raises(openai.BadRequestError) as raised:
        tiny_server.client.completions.create(model="tiny", prompt=[5] * 300, max_tokens=4)
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"
    assert "maximum context length is 256 tokens" in error["message"]
    assert "300 in the prompt" in error["message"]


def test_prompt_plus_max_tokens_over_limit_is_400(tiny_server):
    response = httpx.post(
        f"{tiny_server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": [5] * 200, "max_tokens": 100},
        headers=tiny_server.serving,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_a_token_budget_caps_the_completion(tiny_server):
    # The gateway reserves a request's most tokens; the engine never goes past them.
    body = {"model": "tiny", "prompt": [5] * 10, "max_tokens": 50, "ignore_eos": True}
    url, serving = f"{tiny_server.base_url}/v1/completions", tiny_server.serving
    response = httpx.post(url, json=body, headers={**serving, "x-token-budget": "16"})
    assert response.status_code == 200
    answer = response.json()
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        10,
        6,
        16,
    )
    assert answer["choices"][0]["finish_reason"] == "length"
    roomy = httpx.post(url, json=body, headers={**serving, "x-token-budget": "60"})
    assert roomy.json()["usage"]["completion_tokens"] == 50


@pytest.mark.parametrize(
    ("budget", "code"),
    [("10", "token_budget_exceeded"), ("1e3", "invalid_value"), ("0", "invalid_value")],
)
def test_a_prompt_beyond_its_token_budget_is_refused(tiny_server, budget, code):
    response = httpx.post(
        f"{tiny_server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": [5] * 10, "max_tokens": 5},
        headers={**tiny_server.serving, "x-token-budget": budget},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "temperature": 5}, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "hi", "stop": 3}, "stop"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "hi", "seed": 2**64}, "seed"),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "stop_token_ids": list(range(33))}, "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": [512]}, "stop_token_ids"),  # past the vocabulary
        ({"prompt": "hi", "stop": ["x" * 257]}, "stop"),
        ({"prompt": "hi", "logit_bias": {"5": 100}}, "logit_bias"),
        ({"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
        ({"prompt": "hi", "best_of": 2}, "best_of"),
        ({"prompt": "hi", "temperture": 0.5}, "temperture"),
    ],
)
def test_bad_completion_parameters_name_the_field(tiny_server, body, param):
    response = httpx.post(
        f"{tiny_server.base_url}/v1/completions",
        json={"model": "tiny", **body},
        headers=tiny_server.serving,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_bad_chat_messages_name_the_field(tiny_server):
    response = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
        headers=tiny_server.serving,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages[0].role"


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"tools": [{"type": "function"}]}, "tools", "unsupported_field"),
        ({"n": 2}, "n", "invalid_value"),
        ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),  # without logprobs
        (
            {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
            "messages[0].tool_calls",
            "unknown_field",
        ),
    ],
)
def test_chat_fields_the_engine_does_not_implement_are_refused(tiny_server, extra, param, code):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}
    response = httpx.post(
        f"{tiny_server.base_url}/v1/chat/completions", json=body, headers=tiny_server.serving
    )
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, code)


def test_an_unknown_model_is_404(tiny_server):
    response = httpx.post(
        f"{tiny_server.base_url}/v1/completions",
        json={"model": "not-served-here", "prompt": "hi", "max_tokens": 1},
        headers=tiny_server.serving,
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "content",
    [b"{not json", b"[" * 100_000 + b"]" * 100_000, b'{"temperature": NaN, "prompt": "hi"}'],
    ids=["broken", "nested-past-the-recursion-limit", "nan"],
)
def test_malformed_json_is_400(tiny_server, content):
    response = httpx.post(
        f"{tiny_server.base_url}/v1/completions",
        content=content,
        headers={**tiny_server.serving, "content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] in {"invalid_json", "invalid_value"}


def test_unknown_route_is_404(tiny_server):
    response = httpx.get(f"{tiny_server.base_url}/v2/nothing", headers=tiny_server.serving)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def metric_values(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{server.base_url}/metrics", headers=server.serving).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_names_parallel_vllm_and_move_with_each_request(tiny_server):
    before = metric_values(tiny_server)
    tiny_server.client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=2, extra_body={"ignore_eos": True}
    )
    after = metric_values(tiny_server)
    model = (("model_name", "tiny"),)

    def moved(name: str, labels: tuple[tuple[str, str], ...] = model) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("engine:prompt_tokens_total") == 3
    assert moved("engine:generation_tokens_total") == 2
    finished = (("finished_reason", "length"), ("model_name", "tiny"))
    assert moved("engine:request_success_total", finished) == 1
    assert moved("engine:time_to_first_token_seconds_count") == 1
    assert moved("engine:inter_token_latency_seconds_count") == 1
    assert moved("engine:e2e_request_latency_seconds_count") == 1
    assert moved("engine:request_queue_time_seconds_count") == 1
    assert moved("engine:prefix_cache_queries_total") >= 1
    for gauge in (
        "engine:num_requests_running",
        "engine:num_requests_waiting",
        "engine:kv_cache_usage_perc",
    ):
        assert after[(gauge, model)] == 0  # nothing left running once it answered
    assert ("engine:num_preemptions_total", model) in after
    assert ("engine:prefix_cache_hits_total", model) in after


def test_admin_stats_shape(tiny_server, tiny_llama):
    tiny_server.client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    stats = tiny_server.stats()
    assert stats["model"] == str(tiny_llama)
    assert stats["served_model_name"] == "tiny"
    assert stats["dtype"] == "float32"
    assert stats["state"] == "ready"
    assert stats["faults"] == {"latency_ms_per_token": 0.0, "error_rate": 0.0}
    assert 0.0 <= stats["kv_cache_usage"] <= 1.0
    for key in ("running", "waiting", "prompt_tokens_total", "generation_tokens_total",
                "requests_finished_total", "requests_failed_total"):  # fmt: skip
        assert isinstance(stats[key], int), key
    last = stats["recent"][-1]
    assert set(last) == {"finished_at", "status", "ttft_s", "itl_mean_s", "itl_p95_s",
                         "prompt_tokens", "completion_tokens"}  # fmt: skip
    assert last["status"] == "ok"


def test_fault_injection_at_run_time(narrow_server):
    url, admin = narrow_server.base_url, narrow_server.admin
    bad = httpx.post(f"{url}/admin/faults", json={"error_rate": 1.5}, headers=admin)
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "error_rate"
    negative = {"latency_ms_per_token": -1}
    assert httpx.post(f"{url}/admin/faults", json=negative, headers=admin).status_code == 400
    response = httpx.post(f"{url}/admin/faults", json={"error_rate": 1.0}, headers=admin)
    assert response.json() == {"latency_ms_per_token": 20.0, "error_rate": 1.0}
    try:
        failed_before = narrow_server.stats()["requests_failed_total"]
        with pytest.raises(openai.InternalServerError) as raised:
            narrow_server.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                stream=True,
            )  # fmt: skip
        error = raised.value.body
        assert isinstance(error, dict)
        assert error["code"] == "injected_fault"
        stats = narrow_server.stats()
        assert stats["requests_failed_total"] == failed_before + 1
        assert stats["recent"][-1]["status"] == "error"
    finally:
        httpx.post(f"{url}/admin/faults", json={"error_rate": 0.0}, headers=admin)
    assert narrow_server.stats()["faults"] == {"latency_ms_per_token": 20.0, "error_rate": 0.0}


def test_full_queue_is_429_with_retry_after(narrow_server):
    url = narrow_server.base_url
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "ignore_eos": True}
    results: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                httpx.post(
                    f"{url}/v1/completions", json=body, headers=narrow_server.serving, timeout=120
                ).status_code
            )
        )
        for _ in range(2)
    ]
    threads[0].start()
    wait_for(lambda: narrow_server.stats()["running"] == 1)
    threads[1].start()
    wait_for(lambda: narrow_server.stats()["waiting"] == 1)
    response = httpx.post(f"{url}/v1/completions", json=body, headers=narrow_server.serving)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "queue_full"
    for thread in threads:
        thread.join()
    assert results == [200, 200]


def test_client_disconnect_aborts_and_frees_blocks(narrow_server):
    url = narrow_server.base_url
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60, headers=narrow_server.serving) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert narrow_server.stats()["running"] == 1
    # Leaving the block closes the connection mid-stream.
    wait_for(lambda: narrow_server.stats()["recent"][-1]["status"] == "aborted")
    stats = narrow_server.stats()
    assert stats["running"] == 0
    assert stats["kv_cache_usage"] == 0.0
    assert stats["recent"][-1]["completion_tokens"] < 200


def test_health_and_generation_are_503_while_loading(tiny_llama):
    import asyncio

    from engine.config import EngineConfig
    from engine.server import EngineApp

    engine_secrets = new_secrets()
    # lifespan not run: still loading
    app = EngineApp(EngineConfig(model=str(tiny_llama)), secrets=engine_secrets)
    serving, admin = bearer(engine_secrets.serving), bearer(engine_secrets.admin)

    async def calls() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            health = await client.get("/health", headers=serving)
            chat = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
                headers=serving,
            )
            stats = await client.get("/admin/stats", headers=admin)
            return health, chat, stats

    health, chat, stats = asyncio.run(calls())
    assert (health.status_code, health.json()) == (503, {"status": "loading"})
    assert chat.status_code == 503
    assert chat.json()["error"]["code"] == "loading"
    assert stats.json()["state"] == "loading"
    assert stats.json()["running"] == 0
