"""Every route needs its bearer secret: the serving one for /v1/*, /health and /metrics,
the admin one for /admin/*. A refused request changes nothing but the refusal counter."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineSecrets
from tests.engine.conftest import REPO_ROOT, EngineServer, bearer, start_server, stop_server

COMPLETION = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SERVING_ROUTES = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("GET", "/v2/nothing", None),  # unknown paths too: no route is revealed
]
ADMIN_ROUTES = [
    ("POST", "/admin/faults", {"latency_ms_per_token": 500, "error_rate": 1.0}),
    ("GET", "/admin/faults", None),
    ("GET", "/admin/stats", None),
    ("POST", "/admin/drain", None),
]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("logs") / "auth-server.log"
    started = start_server(
        ["--model", str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32",
         "--max-model-len", "256", "--num-blocks", "64"],
        log,
    )  # fmt: skip
    yield started
    stop_server(started)


def call(server: EngineServer, method: str, path: str, body, headers: dict[str, str]):
    return httpx.request(method, f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def metric_values(server: EngineServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{server.base_url}/metrics", headers=server.serving, timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def refusals(values, scope: str) -> float:
    return values[("engine:unauthorized_requests_total", (("scope", scope),))]


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json() == {
        "error": {
            "message": "missing or invalid engine credentials",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_engine_credentials",
        }
    }


def wrong_credentials(server: EngineServer, scope: str) -> list[dict[str, str]]:
    right = server.secrets.serving if scope == "serving" else server.secrets.admin
    other = server.secrets.admin if scope == "serving" else server.secrets.serving
    return [
        {},
        bearer(secrets.token_hex(32)),
        bearer(other),  # the other route family's secret
        bearer(right[:-1]),
        bearer(right + "0"),
        {"Authorization": f"Basic {right}"},
        {"Authorization": right},
        {"Authorization": "Bearer"},
    ]


def test_refused_requests_change_nothing_but_the_refusal_counter(server: EngineServer) -> None:
    stats_before = server.stats()
    metrics_before = metric_values(server)
    for scope, routes in (("serving", SERVING_ROUTES), ("admin", ADMIN_ROUTES)):
        for method, path, body in routes:
            for headers in wrong_credentials(server, scope):
                assert_refused(call(server, method, path, body, headers))
    metrics_after = metric_values(server)
    counted = len(wrong_credentials(server, "serving"))
    assert refusals(metrics_after, "serving") - refusals(metrics_before, "serving") == (
        counted * len(SERVING_ROUTES)
    )
    assert refusals(metrics_after, "admin") - refusals(metrics_before, "admin") == (
        counted * len(ADMIN_ROUTES)
    )
    # No sequence started, no fault set, no drain, no other series moved.
    assert server.stats() == stats_before
    assert server.stats()["faults"] == {"latency_ms_per_token": 0.0, "error_rate": 0.0}
    unchanged = {key for key in metrics_before if key[0] != "engine:unauthorized_requests_total"}
    assert {key: metrics_after[key] for key in unchanged} == {
        key: metrics_before[key] for key in unchanged
    }
    # ... and the next request is served as if nothing had been tried.
    served = call(server, "POST", "/v1/completions", COMPLETION, server.serving)
    assert (served.status_code, served.json()["usage"]["completion_tokens"]) == (200, 2)


def test_the_serving_secret_cannot_set_faults(server: EngineServer) -> None:
    refused = call(
        server, "POST", "/admin/faults", {"error_rate": 1.0, "latency_ms_per_token": 0},
        server.serving,
    )  # fmt: skip
    assert_refused(refused)
    assert server.stats()["faults"] == {"latency_ms_per_token": 0.0, "error_rate": 0.0}
    served = call(server, "POST", "/v1/chat/completions", CHAT, server.serving)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["finish_reason"] in {"stop", "length"}


def test_the_admin_secret_cannot_serve(server: EngineServer) -> None:
    finished_before = server.stats()["requests_finished_total"]
    for method, path, body in SERVING_ROUTES:
        assert_refused(call(server, method, path, body, server.admin))
    assert server.stats()["requests_finished_total"] == finished_before


def test_the_right_secrets_open_their_routes(server: EngineServer) -> None:
    assert call(server, "GET", "/health", None, server.serving).json() == {"status": "ready"}
    models = call(server, "GET", "/v1/models", None, server.serving).json()
    assert models["data"][0]["id"] == "tiny"
    assert (
        "engine:unauthorized_requests_total"
        in call(server, "GET", "/metrics", None, server.serving).text
    )
    faults = {"latency_ms_per_token": 0.0, "error_rate": 1.0}
    try:
        set_response = call(server, "POST", "/admin/faults", faults, server.admin)
        assert (set_response.status_code, set_response.json()) == (200, faults)
        failed = call(server, "POST", "/v1/completions", COMPLETION, server.serving)
        assert (failed.status_code, failed.json()["error"]["code"]) == (500, "injected_fault")
    finally:
        healthy = {"latency_ms_per_token": 0.0, "error_rate": 0.0}
        assert call(server, "POST", "/admin/faults", healthy, server.admin).status_code == 200
    assert call(server, "GET", "/admin/faults", None, server.admin).json() == {
        "latency_ms_per_token": 0.0,
        "error_rate": 0.0,
    }


def run_cli(environment: dict[str, str], tiny_llama: Path) -> subprocess.CompletedProcess[str]:
    base = {key: value for key, value in os.environ.items() if not key.startswith("ENGINE_")}
    return subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--model", str(tiny_llama), "--port", "1"],
        cwd=REPO_ROOT,
        env={**base, **environment},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_engine_refuses_to_start_without_both_secrets(tiny_llama: Path) -> None:
    serving, admin = secrets.token_hex(32), secrets.token_hex(32)
    cases = [
        ({}, "ENGINE_SERVING_SECRET and ENGINE_ADMIN_SECRET not set"),
        ({"ENGINE_SERVING_SECRET": serving}, "ENGINE_ADMIN_SECRET not set"),
        ({"ENGINE_ADMIN_SECRET": admin}, "ENGINE_SERVING_SECRET not set"),
        (
            {"ENGINE_SERVING_SECRET": "short", "ENGINE_ADMIN_SECRET": admin},
            "ENGINE_SERVING_SECRET must be 32-256 visible ASCII characters without spaces",
        ),
        (
            {"ENGINE_SERVING_SECRET": serving, "ENGINE_ADMIN_SECRET": serving},
            "ENGINE_SERVING_SECRET and ENGINE_ADMIN_SECRET must differ",
        ),
    ]
    for environment, message in cases:
        with pytest.raises(ValueError) as refused:
            EngineSecrets.from_environment(environment)
        assert str(refused.value).startswith(message)
        assert serving not in str(refused.value) and admin not in str(refused.value)
    # The command line turns each refusal into its usage error, secrets left out (one
    # process: each start imports torch, about 10 s on a 2-core VM).
    environment, message = cases[-1]
    result = run_cli(environment, tiny_llama)
    assert result.returncode == 2, result.stderr
    assert f"engine: error: {message}" in result.stderr
    assert serving not in result.stderr


def test_secrets_never_show_in_their_repr() -> None:
    engine_secrets = EngineSecrets(serving="s" * 32, admin="a" * 32)
    assert repr(engine_secrets) == "EngineSecrets(serving=***, admin=***)"
