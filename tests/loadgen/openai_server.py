"""A small, real OpenAI-compatible ASGI server for the load generator's own tests.

It streams `max_tokens` one-word chunks `token_delay_s` apart, checks bearer keys when
`keys` is set (401 otherwise), can leave out the usage chunk, and exposes an agent's energy
counter on /metrics that grows by `joules_per_token` per streamed token.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from typing import Any

import uvicorn


class OpenAIServer:
    def __init__(
        self,
        *,
        keys: set[str] | None = None,
        token_delay_s: float = 0.001,
        send_usage: bool = True,
        joules_per_token: float = 0.5,
        models: list[str] | None = None,
    ) -> None:
        self.models = models if models is not None else []  # what GET /v1/models lists
        self.keys = keys
        self.token_delay_s = token_delay_s
        self.send_usage = send_usage
        self.joules_per_token = joules_per_token
        self.joules = 0.0
        self.requests_by_key: Counter[str] = Counter()
        self.completion_tokens = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"].endswith("/models"):
            listed = {"object": "list", "data": [{"id": name} for name in self.models]}
            await self._respond(send, 200, json.dumps(listed).encode(), b"application/json")
            return
        if scope["path"] == "/metrics":
            text = (
                "# TYPE agent_energy_joules_total counter\n"
                f'agent_energy_joules_total{{version="1"}} {self.joules}\n'
            )
            await self._respond(send, 200, text.encode(), b"text/plain")
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = dict(scope["headers"])
        key = headers.get(b"authorization", b"").decode().removeprefix("Bearer ")
        if self.keys is not None and key not in self.keys:
            error = {"error": {"message": "invalid api key", "code": "invalid_api_key"}}
            await self._respond(send, 401, json.dumps(error).encode(), b"application/json")
            return
        self.requests_by_key[key] += 1
        request = json.loads(body)
        is_chat = scope["path"].endswith("/chat/completions")
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"x-request-id", f"req{time.monotonic_ns()}".encode()),
                ],
            }
        )

        async def event(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {data}\n\n".encode(),
                    "more_body": True,
                }
            )

        if is_chat:
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        count = int(request["max_tokens"])
        for index in range(count):
            await asyncio.sleep(self.token_delay_s)
            text = f" word{index}"
            choice = {"index": 0, "delta": {"content": text}} if is_chat else {"text": text}
            await event({"choices": [choice], "usage": None})
            self.joules += self.joules_per_token
            self.completion_tokens += 1
        if self.send_usage and (request.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": count, "total_tokens": 7 + count}
            await event({"choices": [], "usage": usage})
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _respond(send: Any, status: int, body: bytes, content_type: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type)],
            }
        )
        await send({"type": "http.response.body", "body": body})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerThread:
    """Serves an ASGI app with uvicorn on a free port in a background thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
