"""Who may call an engine: its two bearer secrets, and the proof of whose engine it is.

/admin/* takes the admin secret, every other path the serving secret; neither secret
opens the other's paths. A request without the right one is refused (401,
`invalid_engine_credentials`) before anything else runs, and counted by the secret it
needed. The identity path (contracts.engine_identity) takes no credential: it answers a
caller's nonce with an HMAC under the admin secret, and opens nothing.
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, Counter

from contracts.engine_identity import INVALID_NONCE_CODE, identity_proof, is_valid_nonce
from engine.config import EngineSecrets
from engine.protocol import ApiError

ADMIN_PREFIX = "/admin"


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "missing or invalid engine credentials",
        type="authentication_error",
        code="invalid_engine_credentials",
        headers={"www-authenticate": "Bearer"},
    )


class EngineAuth:
    """One engine's secrets, the agent it serves for ("" when started by hand), and the
    count of requests refused (in `registry`, the server's own)."""

    def __init__(
        self, secrets: EngineSecrets, *, agent_name: str, registry: CollectorRegistry
    ) -> None:
        self._secrets = {"serving": secrets.serving.encode(), "admin": secrets.admin.encode()}
        self._admin_secret = secrets.admin
        self.agent_name = agent_name
        self.refused = Counter(
            "engine:unauthorized_requests",
            "Requests refused for a missing or wrong bearer secret, by the secret required.",
            ["scope"],
            registry=registry,
        )
        for scope in self._secrets:
            self.refused.labels(scope=scope)

    def authenticate(self, path: str, authorization: str | None) -> None:
        """Raise `unauthorized()` unless `authorization` bears the secret `path` takes."""
        is_admin = path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")
        scope = "admin" if is_admin else "serving"
        header = authorization or ""
        scheme, _, presented = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode("latin-1"), self._secrets[scope]
        ):
            return
        self.refused.labels(scope=scope).inc()
        raise unauthorized()

    def identity(self, query_string: bytes) -> dict[str, str]:
        """{"agent", "proof"}: the agent this engine serves for, and an HMAC of it and the
        caller's nonce (the query's `nonce`) under the admin secret."""
        nonces = parse_qs(query_string.decode("latin-1")).get("nonce", [])
        if len(nonces) != 1 or not is_valid_nonce(nonces[0]):
            raise ApiError(
                400, "nonce must be 32 to 128 hex characters", param="nonce",
                code=INVALID_NONCE_CODE,
            )  # fmt: skip
        proof = identity_proof(admin_secret=self._admin_secret, agent=self.agent_name,
                               nonce=nonces[0])  # fmt: skip
        return {"agent": self.agent_name, "proof": proof}
