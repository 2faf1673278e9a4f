"""The ASGI middleware the agent gives engines that are not ours (agent/engines/plugins/),
imported as those engines import them, from their own folder: the identity proof, the
drill's faults, and llama.cpp's launcher (its counts and the streamed usage it adds)."""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.engines.base import PLUGINS_DIR
from agent.engines.llamacpp import LlamaCppAdapter
from contracts.engine_identity import is_identity_proof_valid, new_nonce
from engine.config import EngineSecrets

SECRETS = EngineSecrets(serving="5e" * 32, admin="ad" * 32)
ADMIN = [(b"authorization", f"Bearer {SECRETS.admin}".encode())]


def plugin(name: str) -> Any:
    """A plugin module as the engine's environment imports it: from its own folder."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(PLUGINS_DIR))
    try:
        return importlib.import_module(name)
    finally:
        monkeypatch.undo()


def request(
    app: Any,
    path: str,
    *,
    method: str = "GET",
    query: str = "",
    body: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[int, list[bytes]]:
    """One request through an ASGI app: its status and its body messages."""
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query.encode(),
        "headers": headers or [],
    }
    messages: list[dict[str, Any]] = []
    received: list[str] = []

    async def receive() -> dict[str, Any]:
        """The body once, then the client's disconnect (what a server listens for)."""
        received.append("body" if not received else "disconnect")
        if received[-1] == "body":
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    asyncio.run(app(scope, receive, send))
    bodies = [m.get("body", b"") for m in messages if m["type"] == "http.response.body"]
    return messages[0]["status"], bodies


def call(app: Any, path: str, **kwargs: Any) -> tuple[int, Any]:
    """Its status and its body (JSON, else text)."""
    status, bodies = request(app, path, **kwargs)
    body = b"".join(bodies)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode()


async def engine_app(scope: Any, receive: Any, send: Any) -> None:
    """What the engine would answer (the middleware passes everything else on)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": f"engine {scope['path']}".encode()})


def test_an_engine_answers_for_its_agent_as_ours_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_ADMIN_SECRET", SECRETS.admin)
    monkeypatch.setenv("ENGINE_AGENT_NAME", "agent-1")
    identity = plugin("fleet_engine_identity")
    app = identity.IdentityMiddleware(engine_app)
    nonce = new_nonce()
    status, body = call(app, "/identity", query=f"nonce={nonce}")
    assert status == 200 and body["agent"] == "agent-1"
    assert is_identity_proof_valid(
        admin_secret=SECRETS.admin, agent="agent-1", nonce=nonce, proof=body["proof"]
    )
    status, body = call(app, "/identity", query="nonce=xyz")
    assert (status, body["error"]["code"]) == (400, "invalid_nonce")
    assert call(app, "/v1/models") == (200, "engine /v1/models")
    monkeypatch.delenv("ENGINE_ADMIN_SECRET")
    assert (
        call(identity.IdentityMiddleware(engine_app), "/identity", query=f"nonce={nonce}")[0] == 503
    )


def stream_app(events: int) -> Any:
    """An engine streaming `events` token events, then [DONE]; it counts its calls."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        app.calls += 1  # type: ignore[attr-defined]
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for index in range(events):
            chunk = {"choices": [{"delta": {"content": f"t{index}"}}]}
            body = b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\r\n\r\n"})

    app.calls = 0  # type: ignore[attr-defined]
    return app


def test_faults_take_the_admin_secret_and_fail_or_slow_model_requests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ENGINE_ADMIN_SECRET", SECRETS.admin)
    engine = stream_app(3)
    app = plugin("fleet_engine_faults").FaultMiddleware(engine)
    zero = {"latency_ms_per_token": 0.0, "error_rate": 0.0}
    assert call(app, "/admin/faults", headers=ADMIN) == (200, zero)
    serving = [(b"authorization", f"Bearer {SECRETS.serving}".encode())]
    for headers in ([], serving):
        status, body = call(app, "/admin/faults", method="POST", headers=headers,
                            body=b'{"error_rate": 1}')  # fmt: skip
        assert (status, body["error"]["code"]) == (401, "invalid_api_key")
    for bad, param in (
        (b'{"error_rate": 1.5}', "error_rate"),
        (b'{"error_rate": true}', "error_rate"),
        (b'{"latency_ms_per_token": -1}', "latency_ms_per_token"),
        (b'{"latency_ms_per_token": 1e9}', "latency_ms_per_token"),
        (b'{"latency": 5}', "latency"),
        (b"[1]", "body"),
        (b"not json", "body"),
        (b"{" + b" " * 5000 + b"}", "body"),
    ):
        status, body = call(app, "/admin/faults", method="POST", headers=ADMIN, body=bad)
        assert (status, body["error"]["code"], body["error"]["param"]) == (
            400,
            "invalid_value",
            param,
        )
    assert call(app, "/admin/faults", headers=ADMIN) == (200, zero)  # nothing changed

    # Every model request fails before the engine sees it; other routes pass.
    status, body = call(app, "/admin/faults", method="POST", headers=ADMIN,
                        body=b'{"error_rate": 1}')  # fmt: skip
    assert (status, body) == (200, {"latency_ms_per_token": 0.0, "error_rate": 1.0})
    status, body = call(app, "/v1/chat/completions", method="POST")
    assert (status, body["error"]["code"]) == (500, "injected_fault")
    assert engine.calls == 0
    assert call(app, "/v1/models")[0] == 200 and engine.calls == 1

    # Latency: each streamed token event is held, [DONE] is not.
    call(app, "/admin/faults", method="POST", headers=ADMIN,
         body=b'{"error_rate": 0, "latency_ms_per_token": 60}')  # fmt: skip
    started = time.monotonic()
    status, bodies = request(app, "/v1/chat/completions", method="POST")
    assert status == 200 and len(bodies) == 4 and bodies[-1].startswith(b"data: [DONE]")
    assert time.monotonic() - started >= 3 * 0.060


def test_llama_cpp_launcher_counts_what_passes_through_as_the_adapter_reads_it() -> None:
    launcher = plugin("fleet_llama_cpp_server")
    answer = {"usage": {"prompt_tokens": 31, "completion_tokens": 12, "total_tokens": 43}}

    async def llama_app(scope: Any, receive: Any, send: Any) -> None:
        status = 200 if scope["path"] == "/v1/chat/completions" else 500
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    app = launcher.FleetMiddleware(llama_app)
    for path in ("/v1/chat/completions", "/v1/chat/completions", "/v1/completions"):
        request(app, path, method="POST", body=b"{}")
    assert call(app, "/health")[0] == 200
    status, text = call(app, "/metrics")
    assert status == 200
    snapshot = LlamaCppAdapter().read_metrics(text)
    assert (snapshot.prompt_tokens, snapshot.generation_tokens) == (62, 24)
    assert (snapshot.requests_ok, snapshot.requests_failed) == (2, 1)
    assert (snapshot.running, snapshot.waiting, snapshot.kv_cache_usage) == (0, 0, 0)
    assert snapshot.ttft is None and snapshot.itl is None  # it times nothing
    app.metrics.in_flight = 3  # one runs, two wait for the model's lock
    snapshot = LlamaCppAdapter().read_metrics(call(app, "/metrics")[1])
    assert (snapshot.running, snapshot.waiting) == (1, 2)


END_TOKEN = 2


class FakeLlama:
    """Llama.generate's shape: given the prompt's tokens, yields tokens until stopped."""

    def generate(self, tokens: list[int], **kwargs: Any) -> Iterator[int]:
        yield from [7, 8, 9, END_TOKEN, 11]


def test_llama_cpp_launcher_adds_the_streamed_usage_it_counted() -> None:
    launcher = plugin("fleet_llama_cpp_server")
    generate = launcher.counting_generate(FakeLlama.generate, lambda _, t: t == END_TOKEN)

    async def llama_app(scope: Any, receive: Any, send: Any) -> None:
        """Streams a chat as llama_cpp.server does: the model runs in a worker thread, and
        the caller stops at the end-of-generation token, as its completion loop does."""
        assert (await receive())["type"] == "http.request"
        # Then it listens for the client leaving: the launcher passes that on, not the
        # body again (which would never let the stream end).
        assert (await receive())["type"] == "http.disconnect"

        def run_model() -> list[int]:
            out = []
            for token in generate(FakeLlama(), [1, 5, 6, 4]):
                if token == END_TOKEN:
                    break
                out.append(token)
            return out

        tokens = await asyncio.to_thread(run_model)
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for token in tokens:
            chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "smol",
                     "choices": [{"index": 0, "delta": {"content": f"t{token}"}}]}  # fmt: skip
            body = b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\r\n\r\n"})

    app = launcher.FleetMiddleware(llama_app)
    asked = {"stream": True, "stream_options": {"include_usage": True}, "messages": []}
    status, bodies = request(app, "/v1/chat/completions", method="POST",
                             body=json.dumps(asked).encode())  # fmt: skip
    assert status == 200 and len(bodies) == 4
    usage_event, done = bodies[-1].split(b"\r\n\r\n")[:2]
    assert done == b"data: [DONE]"
    chunk = json.loads(usage_event.removeprefix(b"data: "))
    assert chunk == {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "smol",
        "choices": [],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    }
    # Not asked: the stream is the server's own; counted either way.
    plain = {**asked, "stream_options": {"include_usage": False}}
    status, bodies = request(app, "/v1/chat/completions", method="POST",
                             body=json.dumps(plain).encode())  # fmt: skip
    assert bodies[-1] == b"data: [DONE]\r\n\r\n"
    snapshot = LlamaCppAdapter().read_metrics(call(app, "/metrics")[1])
    assert (snapshot.prompt_tokens, snapshot.generation_tokens) == (8, 6)
    # Outside a request (the server's own warm-up), nothing is counted.
    assert list(generate(FakeLlama(), [1])) == [7, 8, 9, END_TOKEN, 11]
