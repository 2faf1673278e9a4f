"""The agent's own credentials: received once at enrolment, kept in its state directory.

`<state-dir>/credentials.json` (mode 0600) holds what the control plane gave this agent
and nothing else does: its API token, its Redis user, the key that authenticates its
heartbeats and results, the public key every command must be signed with, and the
release keys a version's signature must verify against.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from agent.control_plane import ControlPlaneError, EnrolmentRefused, enrol

logger = logging.getLogger("agent")

CREDENTIALS_FILE = "credentials.json"
ENROL_PATIENCE_S = 300.0  # the control plane may still be starting
_HEX_KEY = re.compile(r"^[0-9a-f]{64}$")


class CredentialsError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class AgentCredentials:
    agent: str
    api_token: str
    redis_username: str
    redis_password: str
    stream_key: str  # 64 hex: HMAC key of this agent's heartbeats and command results
    command_public_key: str  # base64 Ed25519: the control plane signs every command with it
    trusted_keys: dict[str, str] = field(default_factory=dict)  # key id -> base64 public key
    enrolment_digest: str = ""  # SHA-256 of the enrolment token these came from

    def __post_init__(self) -> None:
        for name in ("agent", "api_token", "redis_username", "redis_password"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise CredentialsError(f"{name}: must be a non-empty string")
        if not isinstance(self.stream_key, str) or not _HEX_KEY.match(self.stream_key):
            raise CredentialsError("stream_key: must be 64 lowercase hex characters")
        if not isinstance(self.command_public_key, str) or not self.command_public_key:
            raise CredentialsError("command_public_key: must be a non-empty string")
        if not isinstance(self.trusted_keys, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and v
            for k, v in self.trusted_keys.items()
        ):
            raise CredentialsError("trusted_keys: must map key ids to public keys")

    @classmethod
    def from_json(cls, data: Any) -> AgentCredentials:
        if not isinstance(data, dict):
            raise CredentialsError("credentials must be a JSON object")
        known = set(cls.__dataclass_fields__)
        missing = known - set(data) - {"trusted_keys", "enrolment_digest"}
        if missing:
            raise CredentialsError(f"missing: {', '.join(sorted(missing))}")
        return cls(**{key: value for key, value in data.items() if key in known})

    def redis_url(self, base_url: str) -> str:
        """`base_url` (scheme, host, port, database) with this agent's Redis user in it."""
        parts = urlsplit(base_url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{quote(self.redis_username, safe='')}:{quote(self.redis_password, safe='')}@"
        netloc += host + (f":{parts.port}" if parts.port else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def credentials_path(state_dir: Path) -> Path:
    return state_dir / CREDENTIALS_FILE


def credentials_load(state_dir: Path) -> AgentCredentials | None:
    """The saved credentials, or None when this agent has not enrolled yet."""
    path = credentials_path(state_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return AgentCredentials.from_json(json.loads(text))
    except (json.JSONDecodeError, CredentialsError) as exc:
        raise CredentialsError(f"{path}: {exc}") from exc


def credentials_save(state_dir: Path, credentials: AgentCredentials) -> Path:
    """Write the file readable by this user only, atomically (a crash leaves the old one)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = credentials_path(state_dir)
    partial = path.with_suffix(".tmp")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump(asdict(credentials), file, indent=2, sort_keys=True)
    os.replace(partial, path)
    return path


def credentials_obtain(
    *, state_dir: Path, agent_name: str, enrolment_token: str, control_plane_url: str
) -> AgentCredentials:
    """This agent's credentials: the saved ones, unless an enrolment token they did not come
    from is given (a first enrolment, or a rotation), which is traded for new ones."""
    saved = credentials_load(state_dir)
    if saved is not None and saved.agent != agent_name:
        raise CredentialsError(
            f"{credentials_path(state_dir)} holds agent {saved.agent!r}'s credentials"
        )
    if not enrolment_token or (saved and saved.enrolment_digest == token_digest(enrolment_token)):
        if saved is None:
            raise CredentialsError(
                "not enrolled: give --enrolment-token-file (or AGENT_ENROLMENT_TOKEN) from "
                "`manage.py agent_enrol NAME` or POST /api/v1/fleet/enrolments/"
            )
        return saved
    deadline = time.monotonic() + ENROL_PATIENCE_S
    delay = 1.0
    while True:
        try:
            answer = enrol(base_url=control_plane_url, token=enrolment_token, timeout_s=10.0)
            break
        except EnrolmentRefused as exc:
            raise CredentialsError(str(exc)) from exc
        except ControlPlaneError as exc:
            if time.monotonic() + delay > deadline:
                raise CredentialsError(f"could not enrol: {exc}") from exc
            logger.warning("enrolment: %s (retrying in %.0fs)", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 15.0)
    if answer.get("agent") != agent_name:
        raise CredentialsError(
            f"the enrolment token is for agent {answer.get('agent')!r}, not {agent_name!r}"
        )
    credentials = AgentCredentials.from_json(
        {**answer, "enrolment_digest": token_digest(enrolment_token)}
    )
    path = credentials_save(state_dir, credentials)
    logger.info("enrolled as %s; credentials in %s", agent_name, path)
    return credentials
