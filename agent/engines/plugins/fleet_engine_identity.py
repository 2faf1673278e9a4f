"""`GET /identity` for an engine that is not ours, as ASGI middleware it loads itself.

The control plane routes tenants to an endpoint only once the engine there proves, with the
load's admin secret, which agent it serves for (contracts/engine_identity.py). vLLM takes
extra ASGI middleware by import path (`--middleware fleet_engine_identity.IdentityMiddleware`);
the agent puts this folder on the engine's PYTHONPATH. Standard library only, as the engine
runs in an environment of its own: the proof is the one contracts.engine_identity makes
(tests/agent/test_engine_adapters.py holds the two to each other).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

IDENTITY_PATH = "/identity"
NONCE_PATTERN = re.compile(r"[0-9a-fA-F]{32,128}")
# The engine's environment, as the agent sets it (engine/config.py names them).
ADMIN_SECRET_VARIABLE = "ENGINE_ADMIN_SECRET"  # noqa: S105 - a variable's name
AGENT_NAME_VARIABLE = "ENGINE_AGENT_NAME"


def identity_proof(*, admin_secret: str, agent: str, nonce: str) -> str:
    message = f"engine-identity\n{agent}\n{nonce}".encode()
    return hmac.new(admin_secret.encode(), message, hashlib.sha256).hexdigest()


class IdentityMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.admin_secret = os.environ.get(ADMIN_SECRET_VARIABLE, "")
        self.agent = os.environ.get(AGENT_NAME_VARIABLE, "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != IDENTITY_PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "GET":
            await respond_json(send, 405, {"error": {"message": "GET only"}})
            return
        query = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
        nonces = query.get("nonce", [])
        if len(nonces) != 1 or not NONCE_PATTERN.fullmatch(nonces[0]):
            error = {
                "message": "nonce must be 32 to 128 hex characters",
                "type": "invalid_request_error",
                "param": "nonce",
                "code": "invalid_nonce",
            }
            await respond_json(send, 400, {"error": error})
            return
        if not self.admin_secret or not self.agent:
            # Started without its agent's secret: it cannot prove anything.
            await respond_json(send, 503, {"error": {"message": "no identity configured"}})
            return
        proof = identity_proof(admin_secret=self.admin_secret, agent=self.agent, nonce=nonces[0])
        await respond_json(send, 200, {"agent": self.agent, "proof": proof})


async def respond(send: Send, status: int, content_type: str, body: bytes) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def respond_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    await respond(send, status, "application/json", json.dumps(payload).encode())
