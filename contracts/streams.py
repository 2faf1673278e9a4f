"""The Redis stream contracts between agents and the control plane.

Streams (all trimmed with approximate MAXLEN, so none grows without bound):

- `telemetry:heartbeats`: one entry per agent per second (`Heartbeat`). Read by
  `manage.py ingest` through the consumer group `ingest`.
- `agent:<name>:commands`: commands to one agent (`Command`). Written by the control
  plane's fleet services; read by that agent through the consumer group `agent`. Each
  carries `signature`: Ed25519, by the control plane's command key, over the canonical
  JSON of the command and the target agent's name (`command_signed_message`), so a
  command copied to another agent's stream, or written by anyone else, is refused
  (`command_signature_verify`).
- `agent:results`: the outcome of each command (`CommandResult`), first `accepted`,
  then one final status. Read by ingest, which updates the command's row. A command the
  agent refuses unread is `rejected` with a detail led by one of COMMAND_REFUSAL_REASONS.

Heartbeats and results carry `mac`: HMAC-SHA256 under the sending agent's own stream key
over every other field (`agent_fields_sign`, contracts.fields_mac's encoding, labelled by
stream); ingest refuses an entry whose `mac` does not verify under the key of the agent
it names (`agent_fields_verify`).

Every entry is a flat map of strings (Redis stream fields). A heartbeat keeps its
identity and state in fields of their own and its numbers in one JSON object, `figures`
(reading a stream costs per field, and ingest reads thousands of entries a second).
`Heartbeat.to_fields` writes one; `parse_heartbeat` reads one and raises `ContractError`
with a message that names the field (`figures.kv_cache_usage: must be <= 1.0, got 1.5`).
Both sides use these functions, so a field changes in one place.

Counters come in two kinds. Interval figures (`generated_tokens`, `requests_failed`,
the latency summaries) cover the last heartbeat interval, for live display. Totals
(`generated_tokens_total`, `energy_joules`, ...) are cumulative over the agent
process's life, so rollups can be computed with min/max, which stays correct when an
entry is delivered twice or two ingest processes apply a batch each in any order.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Annotated, Any, Literal

import msgspec
from cryptography.exceptions import InvalidSignature
from msgspec import Meta, defstruct

from contracts.fields_mac import fields_sign, fields_verify
from contracts.signing import SignatureError, load_public_key

SCHEMA_VERSION = "1"

HEARTBEATS_STREAM = "telemetry:heartbeats"
RESULTS_STREAM = "agent:results"
INGEST_GROUP = "ingest"
AGENT_COMMANDS_GROUP = "agent"

# Approximate MAXLEN for each stream (XADD ... MAXLEN ~ N).
HEARTBEATS_MAXLEN = 100_000
COMMANDS_MAXLEN = 1_000
RESULTS_MAXLEN = 10_000

HEARTBEAT_INTERVAL_S = 1.0
# An agent is `lost` after this many heartbeat intervals without one.
MISSED_HEARTBEATS_FOR_LOST = 3

# A command older than this when the agent reads it is refused as expired.
COMMAND_TTL_S = 300.0

AGENT_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
DIGEST_PATTERN = re.compile(r"^[0-9a-f]{64}$")
# An engine secret as the control plane derives it: an HMAC-SHA256, in hex.
ENGINE_SECRET_PATTERN = re.compile(r"^[0-9a-f]{64}$")
# The serving engines an agent can start for a version (agent/engines/ has one adapter each);
# a load command without `engine` is for our own.
ENGINE_NAMES = ("builtin", "vllm", "sglang", "llama.cpp", "openai")
DEFAULT_ENGINE = "builtin"
ENDPOINT_PATTERN = re.compile(r"https?://[^\s/]+(:\d+)?/?")

# Upper bounds that keep every accepted value storable (PostgreSQL bigint and integer
# columns, datetimes before the year 10000): an entry the database would refuse is
# malformed here, so it is dropped instead of failing its whole batch again and again.
MAX_BIGINT = 2**63 - 1
MAX_INTEGER = 2**31 - 1
MAX_SENT_AT = 253_402_300_799.0  # 9999-12-31T23:59:59Z


def commands_stream(agent_name: str) -> str:
    return f"agent:{agent_name}:commands"


def command_record_key(agent_name: str, command_id: str) -> str:
    """The final result of one command (JSON, with a TTL): how an agent knows a redelivery."""
    return f"agent:{agent_name}:completed:{command_id}"


class ContractError(ValueError):
    """An entry or payload does not follow the contract; the message names the field."""


# Heartbeats and command results: signed by the agent under its own stream key.


def _stream_label(stream: str) -> bytes:
    if stream not in (HEARTBEATS_STREAM, RESULTS_STREAM):
        raise ValueError(f"{stream!r} entries are not signed by agents")
    return f"{stream}.v1\n".encode()


def agent_fields_sign(stream: str, fields: Mapping[str, str], stream_key: str) -> dict[str, str]:
    """A heartbeat's or result's fields with `mac` set under the agent's stream key (hex)."""
    return fields_sign(fields, stream_key.encode(), label=_stream_label(stream))


def agent_fields_verify(stream: str, fields: Mapping[str, str], stream_key: str) -> None:
    """Raise contracts.fields_mac.FieldsMacError (`missing_mac`, `bad_mac`) unless it matches."""
    fields_verify(fields, stream_key.encode(), label=_stream_label(stream))


class AgentState(StrEnum):
    """What an agent reports. `lost` is never reported: ingest decides it."""

    IDLE = "idle"  # no engine
    LOADING = "loading"  # downloading and verifying an artifact
    WARMING = "warming"  # a new engine is starting and warming up
    READY = "ready"  # an engine serves
    DRAINING = "draining"  # finishing in-flight requests, taking no new ones
    FAILED = "failed"  # nothing serves and the last attempt failed (see `detail`)


class EnergySource(StrEnum):
    NVML = "nvml"  # the GPU's total energy counter
    RAPL = "rapl"  # Linux powercap (CPU package) counters
    ESTIMATE = "estimate"  # CPU time of the engine process tree x watts per core


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


def _required(data: Mapping[str, str], name: str) -> str:
    value = data.get(name)
    if value is None:
        raise ContractError(f"{name}: missing")
    if not isinstance(value, str):
        raise ContractError(f"{name}: must be a string, got {type(value).__name__}")
    return value


def _int(data: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int = MAX_BIGINT) -> int:
    raw = _required(data, name)
    try:
        value = int(raw)
    except ValueError as exc:
        raise ContractError(f"{name}: not an integer: {raw[:40]!r}") from exc
    if value < minimum:
        raise ContractError(f"{name}: must be >= {minimum}, got {value}")
    if value > maximum:
        raise ContractError(f"{name}: must be <= {maximum}, got {value}")
    return value


def _float(
    data: Mapping[str, str], name: str, *, minimum: float = 0.0, maximum: float | None = None
) -> float:
    raw = _required(data, name)
    try:
        value = float(raw)
    except ValueError as exc:
        raise ContractError(f"{name}: not a number: {raw[:40]!r}") from exc
    if not math.isfinite(value):
        raise ContractError(f"{name}: must be finite, got {raw[:40]!r}")
    if value < minimum:
        raise ContractError(f"{name}: must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ContractError(f"{name}: must be <= {maximum}, got {value}")
    return value


def _optional_float(data: Mapping[str, str], name: str) -> float | None:
    if _required(data, name) == "":
        return None
    return _float(data, name)


def _choice(data: Mapping[str, str], name: str, enum: type[StrEnum]) -> Any:
    raw = _required(data, name)
    try:
        return enum(raw)
    except ValueError as exc:
        allowed = ", ".join(member.value for member in enum)
        raise ContractError(f"{name}: {raw[:40]!r} is not one of {allowed}") from exc


def _text(data: Mapping[str, str], name: str, *, max_length: int) -> str:
    value = _required(data, name)
    if len(value) > max_length:
        raise ContractError(f"{name}: longer than {max_length} characters")
    if "\x00" in value:  # PostgreSQL text cannot hold it
        raise ContractError(f"{name}: contains a NUL character")
    return value


def _format_float(value: float | None) -> str:
    if value is None:
        return ""
    return repr(float(value))  # exact: what is read back is what was written


def validate_agent_name(name: str) -> str:
    if not AGENT_NAME_PATTERN.fullmatch(name):
        raise ContractError(
            f"agent: {name[:70]!r} must be 1-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit"
        )
    return name


def validate_endpoint(endpoint: str) -> str:
    if endpoint and not ENDPOINT_PATTERN.fullmatch(endpoint):
        raise ContractError(f"endpoint: {endpoint[:80]!r} is not an http(s) URL of a host")
    return endpoint


@dataclass(slots=True, frozen=True)
class Heartbeat:
    # Identity and state: fields of their own on the stream.
    agent: str
    seq: int
    sent_at: float
    host: str
    endpoint: str
    state: AgentState
    version_id: int | None
    version_digest: str
    detail: str
    energy_source: EnergySource
    # Figures: one JSON object on the stream (`figures`); `_Figures` has them in this order.
    running: int
    waiting: int
    prompt_tokens: int
    generated_tokens: int
    requests_ok: int
    requests_failed: int
    requests_aborted: int
    prompt_tokens_total: int
    generated_tokens_total: int
    requests_ok_total: int
    requests_failed_total: int
    kv_cache_usage: float
    interval_s: float
    tokens_per_second: float
    power_watts: float
    energy_joules: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_mean_s: float | None
    itl_p95_s: float | None
    joules_per_token: float | None
    fault_latency_ms: float = 0.0
    fault_error_rate: float = 0.0

    def to_fields(self) -> dict[str, str]:
        out = {
            "v": SCHEMA_VERSION,
            "agent": self.agent,
            "seq": str(self.seq),
            "sent_at": _format_float(self.sent_at),
            "host": self.host,
            "endpoint": self.endpoint,
            "state": self.state.value,
            "version_id": "" if self.version_id is None else str(self.version_id),
            "version_digest": self.version_digest,
            "energy_source": self.energy_source.value,
            "detail": self.detail,
        }
        figures: dict[str, Any] = {name: getattr(self, name) for name in INT_FIGURES}
        for name in (*FLOAT_FIGURES, *OPTIONAL_FIGURES):
            value = getattr(self, name)
            figures[name] = None if value is None else float(value)
        out[FIGURES_FIELD] = json.dumps(figures, separators=(",", ":"))
        return out

    def figures(self) -> dict[str, Any]:
        """The JSON-ready figures (everything but identity), for the database and events."""
        # Not dataclasses.asdict: it deep-copies every value, and ingest calls this per entry.
        data = {name: getattr(self, name) for name in _FIGURE_NAMES}
        data["state"] = self.state.value
        data["energy_source"] = self.energy_source.value
        return data


# The numbers travel in one JSON field (`figures`): the stream's reader pays per field
# (Redis protocol parsing in Python), and ingest reads thousands of entries a second.
FIGURES_FIELD = "figures"
# name -> maximum; all are integers >= 0 (the maximum is what the rollup column holds).
INT_FIGURES: dict[str, int] = {
    "running": MAX_INTEGER,
    "waiting": MAX_INTEGER,
    "prompt_tokens": MAX_BIGINT,
    "generated_tokens": MAX_BIGINT,
    "requests_ok": MAX_BIGINT,
    "requests_failed": MAX_BIGINT,
    "requests_aborted": MAX_BIGINT,
    "prompt_tokens_total": MAX_BIGINT,
    "generated_tokens_total": MAX_BIGINT,
    "requests_ok_total": MAX_BIGINT,
    "requests_failed_total": MAX_BIGINT,
}
# name -> maximum (None: unbounded); all must be finite and >= 0.
FLOAT_FIGURES: dict[str, float | None] = {
    "kv_cache_usage": 1.0,
    "interval_s": None,
    "tokens_per_second": None,
    "power_watts": None,
    "energy_joules": None,
    "fault_latency_ms": None,
    "fault_error_rate": 1.0,
}
# May be null: no request finished in the interval, or no token was generated.
OPTIONAL_FIGURES = ("ttft_p50_s", "ttft_p95_s", "itl_mean_s", "itl_p95_s", "joules_per_token")
_IDENTITY = (
    "agent", "seq", "sent_at", "host", "endpoint", "state", "version_id", "version_digest",
    "detail", "energy_source",
)  # fmt: skip
_FIGURE_NAMES = tuple(item.name for item in fields(Heartbeat) if item.name not in _IDENTITY)
_FINITE = sys.float_info.max  # a bound that also refuses infinity (and NaN: no comparison holds)


def _figure_type(name: str) -> Any:
    if name in INT_FIGURES:
        return Annotated[int, Meta(ge=0, le=INT_FIGURES[name])]
    if name in FLOAT_FIGURES:
        maximum = FLOAT_FIGURES[name]
        return Annotated[float, Meta(ge=0, le=_FINITE if maximum is None else maximum)]
    return Annotated[float, Meta(ge=0, le=_FINITE)] | None


# The figures object, its fields in Heartbeat's order, each with its bounds: decoded and
# checked in C (msgspec), about three times faster than json.loads and Python checks.
_Figures = defstruct("_Figures", [(name, _figure_type(name)) for name in _FIGURE_NAMES])
_FIGURES_DECODER = msgspec.json.Decoder(_Figures)
# msgspec searches with these patterns: anchored with \A and \Z (`$` would also match
# before a final newline, which fullmatch does not allow).
_NO_NUL = r"\A[^\x00]*\Z"  # PostgreSQL text cannot hold NUL
_AGENT_NAME = rf"\A{AGENT_NAME_PATTERN.pattern.strip('^$')}\Z"
_ENDPOINT = r"\A(|https?://[^\s/\x00]+(:\d+)?/?)\Z"  # ENDPOINT_PATTERN, or none, without NUL
_DIGEST = r"\A([0-9a-f]{64})?\Z"


class _IdentityFields(msgspec.Struct):
    """A heartbeat's own stream fields (strings on the stream: converted, not strict)."""

    v: Literal["1"]
    agent: Annotated[str, Meta(pattern=_AGENT_NAME)]
    seq: Annotated[int, Meta(ge=0, le=MAX_BIGINT)]
    sent_at: Annotated[float, Meta(ge=0, le=MAX_SENT_AT)]
    host: Annotated[str, Meta(max_length=255, pattern=_NO_NUL)]
    endpoint: Annotated[str, Meta(max_length=255, pattern=_ENDPOINT)]
    state: AgentState
    version_id: Annotated[int, Meta(ge=1, le=MAX_BIGINT)] | Literal[""]
    version_digest: Annotated[str, Meta(pattern=_DIGEST)]
    detail: Annotated[str, Meta(max_length=1000, pattern=_NO_NUL)]
    energy_source: EnergySource
    figures: str


# What a pattern means, for the messages (msgspec's would quote the regex).
_TEXT_RULES = {
    "agent": "must be 1-63 characters of a-z, 0-9, '.', '_', '-', starting with one of a-z, 0-9",
    "endpoint": "must be an http(s) URL of a host, or empty",
    "version_digest": "must be 64 lowercase hex characters, or empty",
    "host": "must not contain NUL",
    "detail": "must not contain NUL",
}
_ENUMS: dict[str, type[StrEnum]] = {"state": AgentState, "energy_source": EnergySource}
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def _contract_error(
    error: msgspec.MsgspecError, prefix: str, values: Mapping[str, Any]
) -> ContractError:
    """msgspec's message, led by the field it names and ended by the value it got:
    `figures.running: Expected `int` >= 0, got -1`."""
    message = str(error)
    missing = _MISSING.search(message)
    if missing:
        return ContractError(f"{prefix + '.' if prefix else ''}{missing.group(1)}: missing")
    match = _PATH.search(message)
    name = match.group(1) if match else ""
    if match:
        message = message[: match.start()]
    if name in _ENUMS and message.startswith("Invalid enum value"):
        allowed = ", ".join(member.value for member in _ENUMS[name])
        message = f"{_show(values.get(name))} is not one of {allowed}"
    elif name in _TEXT_RULES and message.startswith("Expected `str` matching"):
        message = f"{_TEXT_RULES[name]}, got {_show(values.get(name))}"
    elif name and not name.startswith("[") and name in values and ", got" not in message:
        message = f"{message}, got {_show(values[name])}"
    if name.startswith("[") or not name:
        name = prefix or "entry"
    elif prefix:
        name = f"{prefix}.{name}"
    return ContractError(f"{name}: {message}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_heartbeat(data: Mapping[str, str]) -> Heartbeat:
    """Validate one heartbeat entry; raises ContractError naming the first bad field.

    Ingest reads thousands a second: the identity fields are converted and the figures
    decoded by msgspec against typed structures with their bounds (in C), and the
    Heartbeat is built positionally, in the structures' field order.
    """
    if data.get("v") != SCHEMA_VERSION:
        raise ContractError(f"v: unsupported schema version {_show(data.get('v'))}")
    try:
        own = msgspec.convert(data, _IdentityFields, strict=False)
    except msgspec.ValidationError as error:
        raise _contract_error(error, "", data) from None
    try:
        figures = _FIGURES_DECODER.decode(own.figures)
    except msgspec.ValidationError as error:
        try:  # to say which value was wrong
            decoded = msgspec.json.decode(own.figures)
        except (msgspec.DecodeError, RecursionError):
            decoded = None
        values = decoded if isinstance(decoded, dict) else {}
        raise _contract_error(error, FIGURES_FIELD, values) from None
    except msgspec.DecodeError as error:
        raise ContractError(f"{FIGURES_FIELD}: not JSON ({error})") from None
    return Heartbeat(
        own.agent,
        own.seq,
        own.sent_at,
        own.host,
        own.endpoint,
        own.state,
        None if own.version_id == "" else own.version_id,
        own.version_digest,
        own.detail,
        own.energy_source,
        *msgspec.structs.astuple(figures),
    )


# Commands.


@dataclass(slots=True, frozen=True)
class LoadPayload:
    """Everything an agent needs to fetch, verify and start a version.

    The signature covers (digest, serving_config); the agent checks the artifact's
    SHA-256 against `digest`, that `key_id` is one of its pinned release keys with this
    `public_key`, and the signature with it, before anything is loaded.
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
    engine: str = DEFAULT_ENGINE  # which engine serves it (ENGINE_NAMES)


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
            "issued_at": _format_float(self.issued_at),
            "expires_at": _format_float(self.expires_at),
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
    digest = _payload_value(payload, "digest", str)
    if not DIGEST_PATTERN.fullmatch(digest):
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
    engine = DEFAULT_ENGINE
    if "engine" in payload:
        engine = _payload_value(payload, "engine", str)
        if engine not in ENGINE_NAMES:
            raise ContractError(f"payload.engine: must be one of {', '.join(ENGINE_NAMES)}")
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
            "finished_at": _format_float(self.finished_at),
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
