"""`python -m llama_cpp.server`, with what the agent needs that it does not serve.

llama-cpp-python's server (0.3.36) takes no extra middleware and serves neither a health
route nor /metrics. This launcher reads the same flags with its own parser, builds its app
with its own `create_app`, and runs it under uvicorn as its `__main__` does, wrapped in:

- GET /identity: the identity proof (fleet_engine_identity.IdentityMiddleware);
- GET /health: 200. The model is loaded inside `create_app`, before the server listens,
  so answering at all means ready;
- GET /metrics: counts of the requests passing through, in Prometheus text (below).

The server runs one request at a time (its app holds one lock around the model), so of
the requests in flight one runs and the rest wait. Token counts come from the `usage` of
non-streamed answers; a streamed answer carries none, so it adds no tokens.

Standard library and the engine's own environment only: it runs in llama-cpp-python's
virtual environment, with this folder on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fleet_engine_identity import ASGIApp, IdentityMiddleware, Message, Receive, Scope, Send

METRICS_PREFIX = "fleet_llamacpp"
# The routes that run the model; the others (models list, tokenize) do not queue for it.
MODEL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


class ServerMetrics:
    """What the launcher counts, as Prometheus text."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_ok = 0
        self.requests_failed = 0

    def count_usage(self, body: bytes) -> None:
        try:
            usage = json.loads(body).get("usage") or {}
        except (ValueError, AttributeError):
            return
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.generation_tokens += int(usage.get("completion_tokens") or 0)

    def text(self) -> str:
        gauges = {
            "requests_running": min(self.in_flight, 1),
            "requests_waiting": max(self.in_flight - 1, 0),
        }
        counters = {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "requests_ok": self.requests_ok,
            "requests_failed": self.requests_failed,
        }
        lines: list[str] = []
        for name, value in gauges.items():
            lines += [f"# TYPE {METRICS_PREFIX}:{name} gauge", f"{METRICS_PREFIX}:{name} {value}"]
        for name, value in counters.items():
            lines += [
                f"# TYPE {METRICS_PREFIX}:{name} counter",
                f"{METRICS_PREFIX}:{name}_total {value}",
            ]
        return "\n".join(lines) + "\n"


class FleetMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = IdentityMiddleware(app)
        self.metrics = ServerMetrics()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/health":
            await respond(send, 200, "application/json", b'{"status":"ok"}')
        elif method == "GET" and path == "/metrics":
            await respond(send, 200, "text/plain; version=0.0.4", self.metrics.text().encode())
        elif method == "POST" and path in MODEL_ROUTES:
            await self.counted(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.metrics
        status = 500
        is_json = False
        body = bytearray()

        async def watch(message: Message) -> None:
            nonlocal status, is_json
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = dict(message.get("headers") or [])
                is_json = headers.get(b"content-type", b"").startswith(b"application/json")
            elif message["type"] == "http.response.body" and is_json and status == 200:
                body.extend(message.get("body", b""))
            await send(message)

        metrics.in_flight += 1
        try:
            await self.app(scope, receive, watch)
        finally:
            metrics.in_flight -= 1
            if status == 200:
                metrics.requests_ok += 1
                metrics.count_usage(bytes(body))
            elif status >= 500:
                metrics.requests_failed += 1


async def respond(send: Send, status: int, content_type: str, body: bytes) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    """As llama_cpp.server.__main__.main, with the app wrapped (no config file: flags only)."""
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    parser = argparse.ArgumentParser(description="llama_cpp.server for the fleet agent")
    add_args_from_model(parser, Settings)
    args = parser.parse_args(argv)
    server_settings: Any = parse_model_from_args(ServerSettings, args)
    model_settings = [parse_model_from_args(ModelSettings, args)]
    app = create_app(server_settings=server_settings, model_settings=model_settings)
    print(f"model loaded: {model_settings[0].model}", file=sys.stderr, flush=True)
    uvicorn.run(
        FleetMiddleware(app),
        host=server_settings.host,
        port=server_settings.port,
        access_log=False,
    )


if __name__ == "__main__":
    main()
