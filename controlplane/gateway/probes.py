"""The standalone gateway's own routes for orchestrators: `/healthz` (the process answers),
`/readyz` (started and its Redis answers: 503 otherwise) and `/metrics` (Prometheus).

Inside `web` these come from Django; a gateway process alone (controlplane/gateway/asgi.py)
has no Django views, so it answers them here, ahead of the tenant API.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controlplane.gateway.app import Gateway
from controlplane.gateway.http_io import send_json

PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def with_probes(gateway: Gateway):
    async def application(scope: dict[str, Any], receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in PROBE_PATHS:
            await _answer(gateway, scope, send)
            return
        await gateway(scope, receive, send)

    return application


async def _answer(gateway: Gateway, scope: dict[str, Any], send) -> None:
    if scope["method"] not in ("GET", "HEAD"):
        await send_json(send, 405, json.dumps({"error": "method_not_allowed"}).encode())
        return
    path = scope["path"]
    if path == "/healthz":
        await send_json(send, 200, b'{"status": "ok"}')
    elif path == "/readyz":
        problem = await _not_ready(gateway)
        body = {"status": "unready", "reason": problem} if problem else {"status": "ready"}
        await send_json(send, 503 if problem else 200, json.dumps(body).encode())
    else:
        payload = generate_latest()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})


async def _not_ready(gateway: Gateway) -> str:
    if not gateway.is_started:
        return "starting"
    try:
        await gateway.redis.ping()
    except (aioredis.RedisError, OSError) as exc:
        return f"redis: {type(exc).__name__}"
    return ""
