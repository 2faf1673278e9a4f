"""`/admin/faults` for an engine that is not ours: the drill's injected errors and latency.

Our engine fails a share of requests and slows each token when the agent asks it to
(POST /admin/faults, the admin secret); a rollout's fault drill does the same to any
engine through this ASGI middleware, loaded like fleet_engine_identity (vLLM by
`--middleware`, llama.cpp by its launcher). Same body, same answers, same limits:

- `error_rate`: that share of model requests is answered 500 `injected_fault` before the
  engine sees it (the engine's own counters never see it; the gateway's samples do);
- `latency_ms_per_token`: each streamed event that carries a token is held that long; a
  whole JSON answer is held that long per completion token of its usage.

Standard library only: it runs in the engine's own environment.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import random

from fleet_engine_identity import (
    ADMIN_SECRET_VARIABLE,
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    respond_json,
)

FAULTS_PATH = "/admin/faults"
MODEL_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
MAX_BODY_BYTES = 4096
# A held token longer than this is a stuck engine, not a slow one: refused.
MAX_LATENCY_MS = 60_000.0

logger = logging.getLogger("fleet.faults")


class FaultError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def parse_faults(body: bytes, current: dict[str, float]) -> dict[str, float]:
    """The new values from a POST body; a missing one keeps its current value."""
    try:
        payload = json.loads(body or b"{}")
    except ValueError:
        raise FaultError("body", "the body must be a JSON object") from None
    if not isinstance(payload, dict):
        raise FaultError("body", "the body must be a JSON object")
    unknown = sorted(set(payload) - set(current))
    if unknown:
        raise FaultError(unknown[0], f"unknown field {unknown[0]!r}")
    values: dict[str, float] = {}
    for name, old in current.items():
        value = payload.get(name, old)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise FaultError(name, f"{name} must be a number, got {value!r}")
        values[name] = float(value)
    if not 0 <= values["latency_ms_per_token"] <= MAX_LATENCY_MS:
        raise FaultError(
            "latency_ms_per_token", f"latency_ms_per_token must be in [0, {MAX_LATENCY_MS:g}]"
        )
    if not 0 <= values["error_rate"] <= 1:
        raise FaultError("error_rate", "error_rate must be in [0, 1]")
    return values


def completion_tokens(body: bytes) -> int:
    try:
        usage = json.loads(body).get("usage") or {}
        tokens = usage.get("completion_tokens") or 0
    except (ValueError, AttributeError):
        return 0
    return tokens if isinstance(tokens, int) and tokens > 0 else 0


class FaultMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.admin_secret = os.environ.get(ADMIN_SECRET_VARIABLE, "")
        self.faults = {"latency_ms_per_token": 0.0, "error_rate": 0.0}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif scope["path"] == FAULTS_PATH:
            await self.admin(scope, receive, send)
        elif scope["method"] == "POST" and scope["path"] in MODEL_ROUTES:
            await self.model_request(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.is_admin(scope):
            error = {"message": "the admin secret is required", "code": "invalid_api_key"}
            await respond_json(send, 401, {"error": {**error, "type": "authentication_error"}})
            return
        if scope["method"] == "POST":
            body = await read_body(receive)
            try:
                if body is None:
                    raise FaultError("body", f"the body is larger than {MAX_BODY_BYTES} bytes")
                self.faults = parse_faults(body, self.faults)
            except FaultError as exc:
                error = {"message": str(exc), "type": "invalid_request_error", "param": exc.param}
                await respond_json(send, 400, {"error": {**error, "code": "invalid_value"}})
                return
            logger.warning("faults set: %s", self.faults)
        elif scope["method"] != "GET":
            await respond_json(send, 405, {"error": {"message": "GET or POST only"}})
            return
        await respond_json(send, 200, self.faults)

    def is_admin(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        expected = f"Bearer {self.admin_secret}".encode()
        return bool(self.admin_secret) and hmac.compare_digest(given, expected)

    async def model_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        error_rate, latency_s = self.faults["error_rate"], self.faults["latency_ms_per_token"] / 1e3
        if error_rate > 0 and random.random() < error_rate:
            error = {"message": "injected fault", "type": "server_error", "code": "injected_fault"}
            await respond_json(send, 500, {"error": error})
            return
        if latency_s <= 0:
            await self.app(scope, receive, send)
            return
        is_stream = False

        async def held(message: Message) -> None:
            nonlocal is_stream
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                is_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if is_stream:
                    tokens = body.count(b"data:") - body.count(b"data: [DONE]")
                else:
                    tokens = completion_tokens(body)
                if tokens > 0:
                    await asyncio.sleep(latency_s * tokens)
            await send(message)

        await self.app(scope, receive, held)


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The request's whole body; None when it passes `limit` bytes."""
    body = bytearray()
    while True:
        message = await receive()
        body.extend(message.get("body", b""))
        if len(body) > limit:
            return None
        if not message.get("more_body"):
            return bytes(body)
