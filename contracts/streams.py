"""The Redis stream contract for telemetry, and the encoding every stream entry shares.

`telemetry:heartbeats`: one entry per agent per second (`Heartbeat`), trimmed with an
approximate MAXLEN so it never grows without bound. Read by `manage.py ingest` through
the consumer group `ingest`. The commands the control plane sends agents, and their
results, are contracts/commands.py's; the MAC agents put on heartbeats and results is
contracts/agent_mac.py's.

A heartbeat also carries its engine's last failure until an engine next serves there:
`engine_error` (an EngineFailure reason code, or "") and `engine_error_message` (at most
ENGINE_ERROR_MESSAGE_MAX_LENGTH characters); an entry without them (an older agent) has none.

Every entry is a flat map of strings (Redis stream fields), led by the schema version
`v`; a malformed one raises `ContractError`, whose message names the field. A heartbeat
keeps its identity and state in fields of their own and its numbers in one JSON object,
`figures` (reading a stream costs per field, and ingest reads thousands of entries a
second). `Heartbeat.to_fields` writes one; `parse_heartbeat` reads one and raises
`ContractError` with a message that names the field
(`figures.kv_cache_usage: must be <= 1.0, got 1.5`). Both sides use these functions, so a
field changes in one place.

Counters come in two kinds. Interval figures (`generated_tokens`, `requests_failed`,
the latency summaries) cover the last heartbeat interval, for live display. Totals
(`generated_tokens_total`, `energy_joules`, ...) are cumulative over the agent
process's life, so rollups can be computed with min/max, which stays correct when an
entry is delivered twice or two ingest processes apply a batch each in any order.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, defstruct

SCHEMA_VERSION = "1"

HEARTBEATS_STREAM = "telemetry:heartbeats"
# The consumer group of `manage.py ingest`, on heartbeats and on command results.
INGEST_GROUP = "ingest"

# Approximate MAXLEN (XADD ... MAXLEN ~ N).
HEARTBEATS_MAXLEN = 100_000

HEARTBEAT_INTERVAL_S = 1.0
# An agent is `lost` after this many heartbeat intervals without one.
MISSED_HEARTBEATS_FOR_LOST = 3

AGENT_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
ENDPOINT_PATTERN = re.compile(r"https?://[^\s/]+(:\d+)?/?")

# Upper bounds that keep every accepted value storable (PostgreSQL bigint and integer
# columns, datetimes before the year 10000): an entry the database would refuse is
# malformed here, so it is dropped instead of failing its whole batch again and again.
MAX_BIGINT = 2**63 - 1
MAX_INTEGER = 2**31 - 1
MAX_SENT_AT = 253_402_300_799.0  # 9999-12-31T23:59:59Z


class ContractError(ValueError):
    """An entry or payload does not follow the contract; the message names the field."""


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


class EngineFailure(StrEnum):
    """Why an agent's engine stopped serving or never started: the reason code of a
    heartbeat's `engine_error` (the one list of them; metrics count by it)."""

    SPAWN_FAILED = "spawn_failed"  # its command could not be run at all
    EXITED = "exited"  # it exited by itself (the exit code and its last lines say why)
    KILLED = "killed"  # a signal ended it (SIGKILL: the OOM killer, an operator)
    NOT_READY = "not_ready"  # it did not become ready within the agent's timeout
    STEP_FAILED = "step_failed"  # it runs, but its step loop failed (its /health says so)


ENGINE_ERROR_MESSAGE_MAX_LENGTH = 500


@dataclass(slots=True, frozen=True)
class EngineError:
    """An engine's last failure, as a heartbeat carries it until an engine next serves."""

    reason: EngineFailure
    message: str  # at most ENGINE_ERROR_MESSAGE_MAX_LENGTH characters, no NUL

    def __post_init__(self) -> None:
        if len(self.message) > ENGINE_ERROR_MESSAGE_MAX_LENGTH:
            raise ValueError(f"engine error message over {ENGINE_ERROR_MESSAGE_MAX_LENGTH} chars")
        if "\x00" in self.message:
            raise ValueError("engine error message contains NUL")


def format_float(value: float | None) -> str:
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
    # Fields of their own on the stream (`engine_error`, `engine_error_message`; both empty
    # without one), optional so that agents older than them still read.
    engine_error: EngineError | None = None

    def to_fields(self) -> dict[str, str]:
        out = {
            "v": SCHEMA_VERSION,
            "agent": self.agent,
            "seq": str(self.seq),
            "sent_at": format_float(self.sent_at),
            "host": self.host,
            "endpoint": self.endpoint,
            "state": self.state.value,
            "version_id": "" if self.version_id is None else str(self.version_id),
            "version_digest": self.version_digest,
            "energy_source": self.energy_source.value,
            "detail": self.detail,
            "engine_error": self.engine_error.reason.value if self.engine_error else "",
            "engine_error_message": self.engine_error.message if self.engine_error else "",
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
    "detail", "energy_source", "engine_error",
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
_ENGINE_FAILURE = rf"\A({'|'.join(reason.value for reason in EngineFailure)})?\Z"


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
    engine_error: Annotated[str, Meta(pattern=_ENGINE_FAILURE)] = ""
    engine_error_message: Annotated[
        str, Meta(max_length=ENGINE_ERROR_MESSAGE_MAX_LENGTH, pattern=_NO_NUL)
    ] = ""


# What a pattern means, for the messages (msgspec's would quote the regex).
_TEXT_RULES = {
    "agent": "must be 1-63 characters of a-z, 0-9, '.', '_', '-', starting with one of a-z, 0-9",
    "endpoint": "must be an http(s) URL of a host, or empty",
    "version_digest": "must be 64 lowercase hex characters, or empty",
    "host": "must not contain NUL",
    "detail": "must not contain NUL",
    "engine_error_message": "must not contain NUL",
    "engine_error": f"must be one of {', '.join(EngineFailure)}, or empty",
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
    engine_error = None
    if own.engine_error:
        engine_error = EngineError(EngineFailure(own.engine_error), own.engine_error_message)
    elif own.engine_error_message:
        raise ContractError("engine_error_message: must be empty without an engine_error")
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
        # The figures, then engine_error: every field after the first figures has a default.
        *(*msgspec.structs.astuple(figures), engine_error),
    )
