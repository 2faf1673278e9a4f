"""`python -m llama_cpp.server`, with what the agent needs that it does not serve.

llama-cpp-python's server (0.3.36) takes no extra middleware and serves neither a health
route nor /metrics. This launcher reads the same flags with its own parser, builds its app
with its own `create_app`, and runs it under uvicorn as its `__main__` does, wrapped in:

- GET /identity: the identity proof (fleet_engine_identity.IdentityMiddleware);
- /admin/faults: the drill's injected errors and latency (fleet_engine_faults);
- GET /health: 200. The model is loaded inside `create_app`, before the server listens,
  so answering at all means ready;
- GET /metrics: counts of the requests passing through, in Prometheus text (below);
- streamed usage: its streamed answers carry no `usage`, even when asked with
  `stream_options.include_usage`. The launcher counts what `Llama.generate` is given and
  yields for the request (as its non-streamed usage counts them: the prompt's tokens, and
  every token but the end-of-generation one) and, when the request asked, adds the usage
  chunk before `data: [DONE]` as OpenAI's API does.

The server runs one request at a time (its app holds one lock around the model), so of
the requests in flight one runs and the rest wait.

Standard library and the engine's own environment only: it runs in llama-cpp-python's
virtual environment, with this folder on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import contextvars
import functools
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fleet_engine_faults import FaultMiddleware, read_body
from fleet_engine_identity import (
    ASGIApp,
    IdentityMiddleware,
    Message,
    Receive,
    Scope,
    Send,
    respond,
)

METRICS_PREFIX = "fleet_llamacpp"
# The routes that run the model; the others (models list, tokenize) do not queue for it.
MODEL_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
STREAMED_ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_REQUEST_BYTES = 8 * 1024 * 1024  # read whole to see `stream`; the server's own limit is larger
DONE_EVENT = b"data: [DONE]"


@dataclass
class StreamUsage:
    """What `Llama.generate` was given and yielded for one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


# The request's counter. The server calls the model in worker threads, which run in a copy
# of the request's context: the copy holds the same counter.
CURRENT_USAGE: contextvars.ContextVar[StreamUsage | None] = contextvars.ContextVar(
    "fleet_stream_usage", default=None
)


def counting_generate(
    generate: Callable[..., Iterator[int]], is_end: Callable[[Any, int], bool]
) -> Callable[..., Iterator[int]]:
    """`Llama.generate`, counting into the request's StreamUsage when there is one."""

    @functools.wraps(generate)
    def counted(self: Any, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:
        usage = CURRENT_USAGE.get()
        if usage is not None:
            usage.prompt_tokens, usage.completion_tokens = len(tokens), 0
        for token in generate(self, tokens, *args, **kwargs):
            if usage is not None and not is_end(self, token):
                usage.completion_tokens += 1
            yield token

    return counted


def wants_stream_usage(body: bytes) -> bool:
    try:
        request = json.loads(body)
    except ValueError:
        return False
    if not isinstance(request, dict) or request.get("stream") is not True:
        return False
    options = request.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def usage_event(last_chunk: bytes, usage: StreamUsage, separator: bytes) -> bytes:
    """The usage chunk, with the stream's id, object, created and model, ended as the
    server ends its events."""
    try:
        chunk = json.loads(last_chunk.removeprefix(b"data:"))
    except ValueError:
        chunk = {}
    fields = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
    counts = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    return b"data: " + json.dumps({**fields, "choices": [], "usage": counts}).encode() + separator


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

    def count_stream(self, usage: StreamUsage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.generation_tokens += usage.completion_tokens

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
        self.app = FaultMiddleware(IdentityMiddleware(app))
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
        is_json = is_stream = False
        body = bytearray()
        request = await read_body(receive, MAX_REQUEST_BYTES)
        if request is None:
            error = b'{"error":{"message":"the request body is too large","code":"body_too_large"}}'
            await respond(send, 413, "application/json", error)
            return
        is_usage_asked = scope["path"] in STREAMED_ROUTES and wants_stream_usage(request)
        usage = StreamUsage()
        last_chunk = b""
        token = CURRENT_USAGE.set(usage)

        is_replayed = False

        async def replay() -> Message:
            """The body read above, then the client's own messages (its disconnect)."""
            nonlocal is_replayed
            if is_replayed:
                return await receive()
            is_replayed = True
            return {"type": "http.request", "body": request, "more_body": False}

        async def watch(message: Message) -> None:
            nonlocal status, is_json, is_stream, last_chunk
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = dict(message.get("headers") or [])
                content_type = headers.get(b"content-type", b"")
                is_json = content_type.startswith(b"application/json")
                is_stream = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and is_json and status == 200:
                body.extend(message.get("body", b""))
            elif message["type"] == "http.response.body" and is_stream and is_usage_asked:
                chunk = message.get("body", b"")
                if chunk.lstrip().startswith(DONE_EVENT):
                    separator = b"\r\n\r\n" if chunk.endswith(b"\r\n\r\n") else b"\n\n"
                    event = usage_event(last_chunk, usage, separator)
                    message = {**message, "body": event + chunk}
                elif chunk.lstrip().startswith(b"data:"):
                    last_chunk = chunk.strip()
            await send(message)

        metrics.in_flight += 1
        try:
            await self.app(scope, replay, watch)
        finally:
            CURRENT_USAGE.reset(token)
            metrics.in_flight -= 1
            if status == 200:
                metrics.requests_ok += 1
                if is_stream:
                    metrics.count_stream(usage)
                else:
                    metrics.count_usage(bytes(body))
            elif status >= 500:
                metrics.requests_failed += 1


def main(argv: list[str] | None = None) -> None:
    """As llama_cpp.server.__main__.main, with the app wrapped (no config file: flags only)."""
    import llama_cpp
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    parser = argparse.ArgumentParser(description="llama_cpp.server for the fleet agent")
    add_args_from_model(parser, Settings)
    args = parser.parse_args(argv)
    llama_cpp.Llama.generate = counting_generate(
        llama_cpp.Llama.generate,
        lambda llama, token: llama_cpp.llama_vocab_is_eog(llama._model.vocab, token),
    )
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
