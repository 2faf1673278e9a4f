"""The command contract: what the control plane sends agents and what they answer.

Streams (both trimmed with approximate MAXLEN, so neither grows without bound):

- `agent:<name>:commands`: commands to one agent (`Command`). Written by the control
  plane's fleet services; read by that agent through the consumer group `agent`. Each
  carries `signature`: Ed25519, by the control plane's command key, over the canonical
  JSON of the command and the target agent's name (`command_signed_message`), so a
  command copied to another agent's stream, or written by anyone else, is refused
  (`command_signature_verify`).
- `agent:results`: the outcome of each command (`CommandResult`), first `accepted`,
  then one final status. Read by ingest (consumer group `ingest`), which updates the
  command's row. A command the agent refuses unread is `rejected` with a detail led by
  one of COMMAND_REFUSAL_REASONS. Each result carries the agent's MAC, like a heartbeat
  (contracts/agent_mac.py).

Entries are flat maps of strings, like every stream's (contracts/streams.py: the schema
version, ContractError); `parse_command` and `parse_command_result` raise ContractError
naming the first bad field, and `parse_command` checks the payload of its kind too.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cryptography.exceptions import InvalidSignature

from contracts import engines
from contracts.fields import FieldReader
from contracts.signing import SignatureError, load_public_key
from contracts.streams import (
    MAX_BIGINT,
    SCHEMA_VERSION,
    ContractError,
    format_float,
    validate_agent_name,
    validate_endpoint,
)

RESULTS_STREAM = "agent:results"
AGENT_COMMANDS_GROUP = "agent"

# Approximate MAXLEN for each stream (XADD ... MAXLEN ~ N).
COMMANDS_MAXLEN = 1_000
RESULTS_MAXLEN = 10_000

# A command older than this when the agent reads it is refused as expired.
COMMAND_TTL_S = 300.0

DIGEST_PATTERN = re.compile(r"^[0-9a-f]{64}$")
# An engine secret as the control plane derives it: an HMAC-SHA256, in hex.
ENGINE_SECRET_PATTERN = re.compile(r"^[0-9a-f]{64}$")


def commands_stream(agent_name: str) -> str:
    return f"agent:{agent_name}:commands"


def command_record_key(agent_name: str, command_id: str) -> str:
    """The final result of one command (JSON, with a TTL): how an agent knows a redelivery."""
    return f"agent:{agent_name}:completed:{command_id}"


class CommandKind(StrEnum):
    LOAD = "load"
    DRAIN = "drain"
    UNLOAD = "unload"
    FAULTS = "faults"


class CommandStatus(StrEnum):
    ACCEPTED = "accepted"  # read by the agent, running
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # attempted and failed; `detail` says why
    REJECTED = "rejected"  # not attempted: malformed, expired or not applicable


FINAL_COMMAND_STATUSES = frozenset(
    {CommandStatus.SUCCEEDED, CommandStatus.FAILED, CommandStatus.REJECTED}
)


# Field readers: each raises ContractError naming the field.
_FIELDS = FieldReader(ContractError)
_required, _float, _choice, _text = _FIELDS.required, _FIELDS.number, _FIELDS.choice, _FIELDS.text


def _int(data: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int = MAX_BIGINT) -> int:
    return _FIELDS.integer(data, name, minimum=minimum, maximum=maximum)


# Commands.


@dataclass(slots=True, frozen=True)
class LoadPayload:
    """Everything an agent needs to fetch, verify and start a version.

    The signature covers (digest, serving_config, engine, engine_args); the agent checks
    that `key_id` is one of its pinned release keys with this `public_key`, the signature
    with it, and the artifact against `digest` (a file's SHA-256, or a folder's manifest's,
    each of whose files it checks too: contracts/manifest.py), before anything is loaded.
    An openai version has no artifact: `digest` and `format` are empty.
    `serving_secret` and `admin_secret` are the bearer secrets the engine it starts
    requires (derived per load command by the control plane; never recorded nor shown).
    """

    version_id: int
    model: str
    label: str
    digest: str
    format: str
    size_bytes: int
    serving_config: dict[str, Any]
    signature: str
    key_id: str
    public_key: str
    served_model_name: str
    serving_secret: str = field(default="", repr=False)
    admin_secret: str = field(default="", repr=False)
    engine: str = engines.BUILTIN
    engine_args: dict[str, Any] = field(default_factory=dict)
    # The memory the version needs (contracts/capacity.py); 0 when unknown. An agent that
    # offers less refuses the load (insufficient_memory).
    footprint_bytes: int = 0


@dataclass(slots=True, frozen=True)
class FaultsPayload:
    latency_ms_per_token: float
    error_rate: float


@dataclass(slots=True, frozen=True)
class DrainPayload:
    # The version the sender believes is loaded; None drains whatever is. An agent serving
    # another version leaves it alone: the sender's view was stale (a load just finished).
    version_id: int | None = None


@dataclass(slots=True, frozen=True)
class Command:
    command_id: str
    kind: CommandKind
    issued_at: float
    expires_at: float
    payload: dict[str, Any] = field(default_factory=dict)
    signature: str = ""  # base64 Ed25519 over command_signed_message; "" when unsigned

    def to_fields(self) -> dict[str, str]:
        out = {
            "v": SCHEMA_VERSION,
            "command_id": self.command_id,
            "kind": self.kind.value,
            "issued_at": format_float(self.issued_at),
            "expires_at": format_float(self.expires_at),
            "payload": json.dumps(self.payload, sort_keys=True, separators=(",", ":")),
        }
        if self.signature:
            out["signature"] = self.signature
        return out

    def is_expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) > self.expires_at


def new_command(
    kind: CommandKind, payload: Mapping[str, Any], *, ttl_s: float = COMMAND_TTL_S
) -> Command:
    now = time.time()
    return Command(
        command_id=uuid.uuid4().hex,
        kind=kind,
        issued_at=now,
        expires_at=now + ttl_s,
        payload=dict(payload),
    )


def parse_command(data: Mapping[str, str]) -> Command:
    if data.get("v") != SCHEMA_VERSION:
        raise ContractError(f"v: unsupported schema version {data.get('v')!r}")
    command_id = _required(data, "command_id")
    if not re.fullmatch(r"[0-9a-f]{32}", command_id):
        raise ContractError("command_id: must be 32 lowercase hex characters")
    try:
        payload = json.loads(_required(data, "payload"))
    except json.JSONDecodeError as exc:
        raise ContractError(f"payload: not JSON ({exc.msg})") from exc
    except RecursionError as exc:
        raise ContractError("payload: nested too deeply") from exc
    if not isinstance(payload, dict):
        raise ContractError("payload: must be a JSON object")
    command = Command(
        command_id=command_id,
        kind=_choice(data, "kind", CommandKind),
        issued_at=_float(data, "issued_at"),
        expires_at=_float(data, "expires_at"),
        payload=payload,
        signature=_text(data, "signature", max_length=200) if "signature" in data else "",
    )
    # Validate the payload now, so a bad command is rejected before anything runs.
    if command.kind is CommandKind.LOAD:
        parse_load_payload(command.payload)
    elif command.kind is CommandKind.FAULTS:
        parse_faults_payload(command.payload)
    elif command.kind is CommandKind.DRAIN:
        parse_drain_payload(command.payload)
    return command


# Why an agent refuses a command without running it: the first word of the `rejected`
# result's detail (`bad_command_signature: ...`), which the control plane counts.
COMMAND_REFUSAL_REASONS = frozenset(
    {
        "unsigned_command",  # no signature
        "bad_command_signature",  # not the control plane's, or signed for another agent
        "no_command_key",  # this agent holds no command key: it trusts no command
        "expired",
        "untrusted_signing_key",  # a load signed by a release key this agent has not pinned
        "insufficient_memory",  # a load whose footprint is more than the agent offers
    }
)


class CommandRefused(ValueError):
    """A command the agent will not run; `reason` is one of COMMAND_REFUSAL_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def command_refusal_reason(detail: str) -> str | None:
    """The refusal reason a `rejected` result's detail starts with, if any."""
    reason = detail.split(":", 1)[0]
    return reason if reason in COMMAND_REFUSAL_REASONS else None


def command_signed_message(command: Command, *, agent: str) -> bytes:
    """What the control plane signs: the canonical JSON (keys sorted, no whitespace, UTF-8)
    of the command and the agent it is for."""
    message = {
        "agent": agent,
        "command_id": command.command_id,
        "kind": command.kind.value,
        "payload": command.payload,
        "issued_at": command.issued_at,
        "expires_at": command.expires_at,
    }
    return json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def command_signature_verify(command: Command, *, agent: str, public_key_b64: str) -> None:
    """Raise CommandRefused unless `command` is signed for `agent` by the command key."""
    if not public_key_b64:
        raise CommandRefused("no_command_key", "this agent holds no command key")
    if not command.signature:
        raise CommandRefused("unsigned_command", "the command carries no signature")
    try:
        key = load_public_key(public_key_b64)
        signature = base64.b64decode(command.signature, validate=True)
        key.verify(signature, command_signed_message(command, agent=agent))
    except (SignatureError, binascii.Error, ValueError, InvalidSignature) as exc:
        raise CommandRefused(
            "bad_command_signature", "the signature is not the control plane's for this agent"
        ) from exc


def _payload_value(payload: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in payload:
        raise ContractError(f"payload.{name}: missing")
    value = payload[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ContractError(f"payload.{name}: wrong type {type(value).__name__}")
    return value


def parse_load_payload(payload: Mapping[str, Any]) -> LoadPayload:
    # Absent from commands sent before versions named their engine: the built-in one.
    engine = payload.get("engine", engines.BUILTIN)
    if engine not in engines.ENGINES:
        raise ContractError(f"payload.engine: must be one of {', '.join(engines.ENGINES)}")
    try:
        engine_args = engines.engine_args_validate(engine, payload.get("engine_args") or {})
    except engines.EngineArgumentError as exc:
        raise ContractError(f"payload.engine_args: {exc}") from exc
    digest = _payload_value(payload, "digest", str)
    if engine == engines.OPENAI:
        if digest:
            raise ContractError("payload.digest: an openai version has no artifact")
    elif not DIGEST_PATTERN.fullmatch(digest):
        raise ContractError("payload.digest: must be 64 lowercase hex characters")
    version_id = _payload_value(payload, "version_id", int)
    if version_id < 1:
        raise ContractError("payload.version_id: must be >= 1")
    size_bytes = _payload_value(payload, "size_bytes", int)
    if size_bytes < 0:
        raise ContractError("payload.size_bytes: must be >= 0")
    secrets = {}
    for name in ("serving_secret", "admin_secret"):
        secrets[name] = _payload_value(payload, name, str)
        if not ENGINE_SECRET_PATTERN.fullmatch(secrets[name]):
            raise ContractError(f"payload.{name}: must be 64 lowercase hex characters")
    if secrets["serving_secret"] == secrets["admin_secret"]:
        raise ContractError("payload.admin_secret: must differ from serving_secret")
    # Absent from commands sent before versions had footprints: unknown.
    footprint_bytes = payload.get("footprint_bytes", 0)
    if isinstance(footprint_bytes, bool) or not isinstance(footprint_bytes, int):
        raise ContractError("payload.footprint_bytes: must be an integer")
    if footprint_bytes < 0:
        raise ContractError("payload.footprint_bytes: must be >= 0")
    return LoadPayload(
        version_id=version_id,
        model=_payload_value(payload, "model", str),
        label=_payload_value(payload, "label", str),
        digest=digest,
        format=_payload_value(payload, "format", str),
        size_bytes=size_bytes,
        serving_config=_payload_value(payload, "serving_config", dict),
        signature=_payload_value(payload, "signature", str),
        key_id=_payload_value(payload, "key_id", str),
        public_key=_payload_value(payload, "public_key", str),
        served_model_name=_payload_value(payload, "served_model_name", str),
        engine=engine,
        engine_args=engine_args,
        footprint_bytes=footprint_bytes,
        **secrets,
    )


def parse_drain_payload(payload: Mapping[str, Any]) -> DrainPayload:
    if "version_id" not in payload or payload["version_id"] is None:
        return DrainPayload()
    version_id = _payload_value(payload, "version_id", int)
    if version_id < 1:
        raise ContractError("payload.version_id: must be >= 1")
    return DrainPayload(version_id=version_id)


def parse_faults_payload(payload: Mapping[str, Any]) -> FaultsPayload:
    latency = float(_payload_value(payload, "latency_ms_per_token", (int, float)))
    error_rate = float(_payload_value(payload, "error_rate", (int, float)))
    if not (math.isfinite(latency) and 0 <= latency <= 60_000):
        raise ContractError("payload.latency_ms_per_token: must be within 0..60000")
    if not (math.isfinite(error_rate) and 0 <= error_rate <= 1):
        raise ContractError("payload.error_rate: must be within 0..1")
    return FaultsPayload(latency_ms_per_token=latency, error_rate=error_rate)


# Command results.


@dataclass(slots=True, frozen=True)
class CommandResult:
    command_id: str
    agent: str
    kind: str
    status: CommandStatus
    detail: str
    finished_at: float
    is_replay: bool = False  # a redelivered command answered from the agent's record
    endpoint: str = ""
    version_id: int | None = None

    def to_fields(self) -> dict[str, str]:
        return {
            "v": SCHEMA_VERSION,
            "command_id": self.command_id,
            "agent": self.agent,
            "kind": self.kind,
            "status": self.status.value,
            "detail": self.detail[:1000],
            "finished_at": format_float(self.finished_at),
            "is_replay": "1" if self.is_replay else "0",
            "endpoint": self.endpoint,
            "version_id": "" if self.version_id is None else str(self.version_id),
        }


def parse_command_result(data: Mapping[str, str]) -> CommandResult:
    if data.get("v") != SCHEMA_VERSION:
        raise ContractError(f"v: unsupported schema version {data.get('v')!r}")
    version_id_raw = _required(data, "version_id")
    is_replay = _required(data, "is_replay")
    if is_replay not in {"0", "1"}:
        raise ContractError("is_replay: must be 0 or 1")
    return CommandResult(
        command_id=_text(data, "command_id", max_length=32),
        agent=validate_agent_name(_required(data, "agent")),
        kind=_choice(data, "kind", CommandKind).value,
        status=_choice(data, "status", CommandStatus),
        detail=_text(data, "detail", max_length=1000),
        finished_at=_float(data, "finished_at"),
        is_replay=is_replay == "1",
        endpoint=validate_endpoint(_text(data, "endpoint", max_length=255)),
        version_id=None if version_id_raw == "" else _int(data, "version_id", minimum=1),
    )
