"""The gateway's Redis contracts: the live routing table and the requests stream.

Routing (written by the rollouts reconciler, today by
`controlplane.gateway.services.routing_table_publish`; read by every gateway process):

- `routing:<deployment>`: a string holding one JSON `RoutingTable`. Its versions' weights
  apply to every tenant, except the tenants named in `tenant_weights`, whose own weights
  replace them (a tenant-scoped canary stage: the named tenants split between baseline
  and canary, everyone else stays on the baseline).
- `routing:deployments`: a set of the deployment names that have a table.
- `routing:changed`: a pub/sub channel; each message is the name of a deployment
  whose table changed (or was deleted). Gateways also re-read every table every few
  seconds, so a lost message only delays a change. Each version's `endpoint_secrets`
  maps its endpoints to the serving secret the gateway presents to that engine
  (`Authorization: Bearer`); an endpoint without one is sent no credentials, which the
  engine refuses. The engines' admin secrets are never in a table. Each version's `role`
  says whether it is the deployment's stable version or its canary (traces name it), or
  a shadow: a version that never answers. A shadow route's `weight` (or a tenant's own
  weight for it in `tenant_weights`) is the percent of the requests the other versions
  answer that the gateway mirrors to it and whose answers it discards
  (`RoutingTable.shadow_shares_for`); `weights_for`, and so every choice of the version
  that answers, leaves shadow routes out.

Requests (written by the gateway after every routed request and every mirrored one, read
by ingest):

- `telemetry:requests`: one flat entry per finished request (`RequestRecord`). Ingest is
  idempotent on `request_id`. The gateway adds entries without MAXLEN: an entry leaves the
  stream only when ingest trims it (`XTRIM ... MINID`), below what every consumer group has
  been given and acknowledged, so an ingest outage delays usage but never drops it. While
  the stream holds `GATEWAY_REQUESTS_STREAM_MAX_LENGTH` entries, gateways spool new ones
  to disk instead.
  Every entry carries `mac`: HMAC-SHA256, keyed by the gateway's and ingest's shared
  record key, over all its other fields (`request_fields_sign`, contracts.fields_mac);
  ingest refuses an entry without a valid one (`request_fields_verify`), so only a
  gateway can bill a tenant.
- `{telemetry:requests}:lost` (on the stream's cluster slot): a hash ingest writes when
  entries left the stream before its group read them (trimmed by hand, or by a gateway
  still adding with MAXLEN): `total`, `last_count` and `last_at` (unix seconds). The
  dashboard shows it as an alert.

Pure Python on purpose: the gateway, the reconciler and tests share it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from contracts.commands import ENGINE_SECRET_PATTERN
from contracts.fields import FieldReader
from contracts.fields_mac import MAC_FIELD, FieldsMacError, fields_mac, fields_sign, fields_verify
from contracts.streams import MAX_BIGINT, MAX_INTEGER
from contracts.streams import MAX_SENT_AT as MAX_UNIX_TIME

SCHEMA_VERSION = "1"

ROUTING_KEY_PREFIX = "routing:"
ROUTING_INDEX_KEY = "routing:deployments"
ROUTING_CHANNEL = "routing:changed"

REQUESTS_STREAM = "telemetry:requests"

DEPLOYMENT_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,99}$")
REQUEST_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")
ENDPOINT_PATTERN = re.compile(r"^https?://[^\s/]+(:\d+)?/?$")
TENANT_SLUG_PATTERN = re.compile(r"^[-a-zA-Z0-9_]{1,50}$")
# What a version is to its deployment: "" where the publisher did not say (older tables).
# A shadow version is sent copies of requests and never answers one.
ROLE_SHADOW = "shadow"
VERSION_ROLES = ("stable", "canary", ROLE_SHADOW, "")


class RoutingContractError(ValueError):
    """A routing table or a request entry breaks the contract; the message names the field."""


class RequestMacError(RoutingContractError, FieldsMacError):
    """A request entry's `mac` is missing or does not match its fields."""


class Affinity(StrEnum):
    """How a deployment keeps a caller on one version while weights stay the same."""

    NONE = "none"  # every request draws a version by weight
    TENANT = "tenant"  # one tenant always lands on the same version
    SESSION = "session"  # one X-Session-Id value lands on the same version (else random)


def routing_key(deployment: str) -> str:
    return f"{ROUTING_KEY_PREFIX}{deployment}"


@dataclass(slots=True, frozen=True)
class VersionRoute:
    version_id: int
    label: str
    weight: int  # 0..100; the shares are weight / sum(weights)
    endpoints: tuple[str, ...] = ()  # base URLs of ready agents serving this version
    # The version's context (prompt plus completion, in tokens): a request can use no
    # more, so the gateway's token reservation need be no larger. 0: not known.
    max_model_len: int = 0
    # endpoint -> the serving secret of the engine behind it (64 hex characters)
    endpoint_secrets: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)
    role: str = ""  # one of VERSION_ROLES: the deployment's stable version, its canary, a shadow

    @property
    def is_shadow(self) -> bool:
        return self.role == ROLE_SHADOW

    def to_json(self) -> dict[str, Any]:
        return {
            "version_id": self.version_id,
            "label": self.label,
            "weight": self.weight,
            "endpoints": list(self.endpoints),
            "max_model_len": self.max_model_len,
            "endpoint_secrets": dict(sorted(self.endpoint_secrets.items())),
            "role": self.role,
        }


@dataclass(slots=True, frozen=True)
class RoutingTable:
    deployment: str
    model: str  # the public model name tenants send (registry Model.name)
    versions: tuple[VersionRoute, ...]
    affinity: Affinity = Affinity.NONE
    generation: int = 0  # increases with each publish; a reader keeps the newest
    published_at: float = 0.0
    # tenant slug -> {version_id: weight}: these tenants' weights instead of the versions'
    tenant_weights: Mapping[str, Mapping[int, int]] = field(default_factory=dict)

    def weights_for(self, tenant_slug: str | None) -> dict[int, int]:
        """{version_id: weight} of the versions that may answer, as they apply to this
        tenant; shadow routes are never among them."""
        own = self.tenant_weights.get(tenant_slug) if tenant_slug is not None else None
        answering = [v for v in self.versions if not v.is_shadow]
        if own is not None:
            return {v.version_id: own.get(v.version_id, 0) for v in answering}
        return {v.version_id: v.weight for v in answering}

    def shadow_shares_for(self, tenant_slug: str | None) -> list[tuple[VersionRoute, int]]:
        """(shadow route, percent of this tenant's requests mirrored to it), for each
        shadow route with ready endpoints and a share above 0."""
        own = self.tenant_weights.get(tenant_slug) if tenant_slug is not None else None
        shares = []
        for version in self.versions:
            if not version.is_shadow or not version.endpoints:
                continue
            share = own.get(version.version_id, 0) if own is not None else version.weight
            if share > 0:
                shares.append((version, share))
        return shares

    def to_json(self) -> str:
        return json.dumps(
            {
                "v": SCHEMA_VERSION,
                "deployment": self.deployment,
                "model": self.model,
                "affinity": self.affinity.value,
                "generation": self.generation,
                "published_at": self.published_at,
                "versions": [version.to_json() for version in self.versions],
                "tenant_weights": {
                    slug: {str(version_id): weight for version_id, weight in weights.items()}
                    for slug, weights in self.tenant_weights.items()
                },
            },
            sort_keys=True,
            separators=(",", ":"),
        )


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in data:
        raise RoutingContractError(f"{name}: missing")
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RoutingContractError(f"{name}: wrong type {type(value).__name__}")
    return value


def routing_table_build(
    *,
    deployment: str,
    model: str,
    versions: list[VersionRoute] | tuple[VersionRoute, ...],
    affinity: Affinity | str = Affinity.NONE,
    generation: int = 0,
    published_at: float = 0.0,
    tenant_weights: Mapping[str, Mapping[int, int]] | None = None,
) -> RoutingTable:
    """A validated table; raises RoutingContractError naming the first bad field."""
    if not DEPLOYMENT_PATTERN.fullmatch(deployment):
        raise RoutingContractError(
            f"deployment: {deployment[:40]!r} must be 1-100 of a-z, 0-9, '.', '_', '-'"
        )
    if not model or len(model) > 100:
        raise RoutingContractError("model: must be 1-100 characters")
    try:
        affinity = Affinity(affinity)
    except ValueError as exc:
        raise RoutingContractError(
            f"affinity: {affinity!r} is not one of none, tenant, session"
        ) from exc
    seen: set[int] = set()
    for index, version in enumerate(versions):
        where = f"versions[{index}]"
        if isinstance(version.version_id, bool) or not isinstance(version.version_id, int):
            raise RoutingContractError(f"{where}.version_id: must be an integer")
        if version.version_id < 1:
            raise RoutingContractError(f"{where}.version_id: must be >= 1")
        if version.version_id in seen:
            raise RoutingContractError(f"{where}.version_id: {version.version_id} appears twice")
        seen.add(version.version_id)
        if isinstance(version.weight, bool) or not isinstance(version.weight, int):
            raise RoutingContractError(f"{where}.weight: must be an integer")
        if not 0 <= version.weight <= 100:
            raise RoutingContractError(f"{where}.weight: must be within 0..100")
        if isinstance(version.max_model_len, bool) or not isinstance(version.max_model_len, int):
            raise RoutingContractError(f"{where}.max_model_len: must be an integer")
        if not 0 <= version.max_model_len <= MAX_INTEGER:
            raise RoutingContractError(f"{where}.max_model_len: must be within 0..{MAX_INTEGER}")
        if version.role not in VERSION_ROLES:
            raise RoutingContractError(f"{where}.role: must be stable, canary, shadow or empty")
        for endpoint in version.endpoints:
            if not isinstance(endpoint, str) or not ENDPOINT_PATTERN.fullmatch(endpoint):
                raise RoutingContractError(f"{where}.endpoints: {endpoint!r} is not an http(s) URL")
        endpoints = {endpoint.rstrip("/") for endpoint in version.endpoints}
        if not isinstance(version.endpoint_secrets, Mapping):
            raise RoutingContractError(f"{where}.endpoint_secrets: must map endpoints to secrets")
        for endpoint, secret in version.endpoint_secrets.items():
            if not isinstance(endpoint, str) or endpoint.rstrip("/") not in endpoints:
                raise RoutingContractError(
                    f"{where}.endpoint_secrets: {str(endpoint)[:80]!r} is not one of its endpoints"
                )
            # The message never quotes the secret.
            if not isinstance(secret, str) or not ENGINE_SECRET_PATTERN.fullmatch(secret):
                raise RoutingContractError(
                    f"{where}.endpoint_secrets[{endpoint[:80]!r}]: must be 64 lowercase hex"
                    " characters"
                )
    roles = {version.version_id: version.role for version in versions}
    if versions and not any(v.weight for v in versions if v.role != ROLE_SHADOW):
        raise RoutingContractError(
            "versions: at least one weight must be positive (a shadow's does not count)"
        )
    checked: dict[str, dict[int, int]] = {}
    for slug, weights in (tenant_weights or {}).items():
        where = f"tenant_weights[{str(slug)[:50]!r}]"
        if not isinstance(slug, str) or not TENANT_SLUG_PATTERN.fullmatch(slug):
            raise RoutingContractError(f"{where}: not a tenant slug")
        if not isinstance(weights, Mapping) or not weights:
            raise RoutingContractError(f"{where}: must map version ids to weights")
        for version_id, weight in weights.items():
            if isinstance(version_id, bool) or version_id not in seen:
                raise RoutingContractError(f"{where}: version {version_id!r} is not in versions")
            if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 100:
                raise RoutingContractError(f"{where}.{version_id}: weight must be within 0..100")
        if not any(w for v, w in weights.items() if roles.get(v) != ROLE_SHADOW):
            raise RoutingContractError(
                f"{where}: at least one weight must be positive (a shadow's does not count)"
            )
        checked[slug] = dict(weights)
    return RoutingTable(
        deployment=deployment,
        model=model,
        versions=tuple(
            VersionRoute(
                version_id=version.version_id,
                label=version.label,
                weight=version.weight,
                endpoints=tuple(endpoint.rstrip("/") for endpoint in version.endpoints),
                max_model_len=version.max_model_len,
                endpoint_secrets={
                    endpoint.rstrip("/"): secret
                    for endpoint, secret in version.endpoint_secrets.items()
                },
                role=version.role,
            )
            for version in versions
        ),
        affinity=affinity,
        generation=generation,
        published_at=published_at,
        tenant_weights=checked,
    )


def parse_routing_table(raw: str | bytes) -> RoutingTable:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the limit
        raise RoutingContractError(f"table: not JSON ({type(exc).__name__})") from exc
    if not isinstance(data, dict):
        raise RoutingContractError("table: must be a JSON object")
    if data.get("v") != SCHEMA_VERSION:
        raise RoutingContractError(f"v: unsupported schema version {data.get('v')!r}")
    raw_versions = _field(data, "versions", list)
    versions = []
    for index, item in enumerate(raw_versions):
        if not isinstance(item, dict):
            raise RoutingContractError(f"versions[{index}]: must be an object")
        endpoints = _field(item, "endpoints", list)
        versions.append(
            VersionRoute(
                version_id=_field(item, "version_id", int),
                label=str(_field(item, "label", str)),
                weight=_field(item, "weight", int),
                endpoints=tuple(endpoints),
                # absent in tables published before it existed
                max_model_len=_field(item, "max_model_len", int) if "max_model_len" in item else 0,
                # absent in tables published before it existed; checked by the build below
                endpoint_secrets=(
                    _field(item, "endpoint_secrets", dict) if "endpoint_secrets" in item else {}
                ),
                role=_field(item, "role", str) if "role" in item else "",  # absent before it
            )
        )
    raw_tenant_weights = data.get("tenant_weights", {})  # absent in tables before it existed
    if not isinstance(raw_tenant_weights, dict):
        raise RoutingContractError("tenant_weights: must be an object")
    tenant_weights: dict[str, dict[int, int]] = {}
    for slug, weights in raw_tenant_weights.items():
        if not isinstance(weights, dict):
            raise RoutingContractError(f"tenant_weights[{slug[:50]!r}]: must be an object")
        try:
            tenant_weights[slug] = {
                int(version_id): weight for version_id, weight in weights.items()
            }
        except ValueError as exc:
            raise RoutingContractError(
                f"tenant_weights[{slug[:50]!r}]: version ids must be integers"
            ) from exc
    return routing_table_build(
        tenant_weights=tenant_weights,
        deployment=_field(data, "deployment", str),
        model=_field(data, "model", str),
        versions=versions,
        affinity=_field(data, "affinity", str),
        generation=_field(data, "generation", int),
        published_at=float(_field(data, "published_at", (int, float))),
    )


# The requests stream.


@dataclass(slots=True, frozen=True)
class RequestRecord:
    """One finished, routed gateway request. Times are seconds; `None` when not measured.

    `ttft_s` and the inter-token figures exist for streamed responses only.
    `usage_source` is `engine` when the tokens come from the engine's usage, `gateway`
    when the gateway counted them (streamed chunks; prompt estimated from its length).
    `prompt` and `completion` are set only when the tenant's policy keeps prompts.
    """

    request_id: str
    tenant_id: int
    api_key_id: int
    deployment: str
    version_id: int
    agent: str  # the endpoint that served it ("" when none answered)
    endpoint_kind: str  # chat, completions, embeddings
    status: int  # the HTTP status the client got (499: the client went away)
    is_stream: bool
    started_at: float  # unix time
    finished_at: float  # unix time
    e2e_s: float
    ttft_s: float | None
    itl_mean_s: float | None
    itl_p95_s: float | None
    prompt_tokens: int
    completion_tokens: int
    usage_source: str
    attempts: int = 1
    prompt: str | None = None
    completion: str | None = None
    # The `code` of the error the client got ("" when it succeeded): the cause, which
    # `is_server_fault` needs no more than the status to judge.
    error_code: str = ""
    # A copy mirrored to a shadow version: its answer went to no one, so it is never
    # usage (no UsageRecord, no energy share, no prompt record); `status` is the engine's.
    is_shadow: bool = False

    @property
    def is_server_fault(self) -> bool:
        return is_server_fault(self.status)

    def to_fields(self) -> dict[str, str]:
        out = {
            "v": SCHEMA_VERSION,
            "request_id": self.request_id,
            "tenant_id": str(self.tenant_id),
            "api_key_id": str(self.api_key_id),
            "deployment": self.deployment,
            "version_id": str(self.version_id),
            "agent": self.agent,
            "endpoint_kind": self.endpoint_kind,
            "status": str(self.status),
            "is_stream": "1" if self.is_stream else "0",
            "started_at": _format(self.started_at),
            "finished_at": _format(self.finished_at),
            "e2e_s": _format(self.e2e_s),
            "ttft_s": _format(self.ttft_s),
            "itl_mean_s": _format(self.itl_mean_s),
            "itl_p95_s": _format(self.itl_p95_s),
            "prompt_tokens": str(self.prompt_tokens),
            "completion_tokens": str(self.completion_tokens),
            "usage_source": self.usage_source,
            "attempts": str(self.attempts),
        }
        if self.error_code:
            out["error_code"] = self.error_code
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.completion is not None:
            out["completion"] = self.completion
        if self.is_shadow:  # absent when false: every other entry reads as it always did
            out["is_shadow"] = "1"
        return out


# The request entry's signature (contracts.fields_mac, under its own label).
REQUEST_MAC_FIELD = MAC_FIELD
REQUEST_MAC_LABEL = b"controlplane.telemetry.requests.v1\n"


def request_mac(fields: Mapping[str, str], key: bytes) -> str:
    """HMAC-SHA256 (hex) of every field but `mac` (contracts.fields_mac's encoding)."""
    try:
        return fields_mac(fields, key, label=REQUEST_MAC_LABEL)
    except FieldsMacError as exc:
        raise RequestMacError(exc.reason, str(exc)) from exc


def request_fields_sign(fields: Mapping[str, str], key: bytes) -> dict[str, str]:
    """The entry's fields with `mac` set (an existing `mac` is replaced)."""
    try:
        return fields_sign(fields, key, label=REQUEST_MAC_LABEL)
    except FieldsMacError as exc:
        raise RequestMacError(exc.reason, str(exc)) from exc


def request_fields_verify(fields: Mapping[str, str], key: bytes) -> None:
    """Raise RequestMacError (reason `missing_mac` or `bad_mac`) unless `mac` matches."""
    try:
        fields_verify(fields, key, label=REQUEST_MAC_LABEL)
    except FieldsMacError as exc:
        raise RequestMacError(exc.reason, str(exc)) from exc


def is_server_fault(status: int) -> bool:
    """Whether a request's failure counts against the version that served it: the
    server's own (5xx: the engine failed, no agent answered, a timeout), never one the
    request caused (4xx: a bad body, a limit) or a client that went away (499). The
    canary analysis and ingest's fast path both read this, through RequestSample.is_error.
    """
    return status >= 500


ERROR_CODE_PATTERN = re.compile(r"^[a-z0-9_]{1,64}$")


def error_code_of(body: object) -> str:
    """The `error.code` of an OpenAI-style error body, if it is a plain short code."""
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and ERROR_CODE_PATTERN.fullmatch(code) else ""


def _format(value: float | None) -> str:
    if value is None:
        return ""
    return repr(round(float(value), 6))


# Bounds that keep every accepted value storable (gateway.RequestSample, tenants.UsageRecord,
# gateway.PromptRecord): an entry the database would refuse is malformed here, so ingest
# drops it instead of failing its batch.
TEXT_FIELD_LENGTHS = {"deployment": 100, "agent": 255, "endpoint_kind": 20}  # CharField max_length
OPTIONAL_TEXT_FIELDS = ("prompt", "completion")  # TextField, only when the tenant keeps prompts


_FIELDS = FieldReader(RoutingContractError)
_required, _int, _float, _no_nul = _FIELDS.required, _FIELDS.integer, _FIELDS.number, _FIELDS.no_nul


def _optional_float(data: Mapping[str, str], name: str) -> float | None:
    return None if _required(data, name) == "" else _float(data, name)


def _text(data: Mapping[str, str], name: str) -> str:
    return _FIELDS.text(data, name, max_length=TEXT_FIELD_LENGTHS[name])


def _optional_text(data: Mapping[str, str], name: str) -> str | None:
    return None if data.get(name) is None else _no_nul(name, _required(data, name))


def parse_request_record(data: Mapping[str, str]) -> RequestRecord:
    """Validate one requests-stream entry; raises RoutingContractError naming the bad field.

    Accepts only what the database can store: ids within bigint, token counts within
    integer columns, times before the year 10000, text within its column and without NUL.
    """
    if data.get("v") != SCHEMA_VERSION:
        raise RoutingContractError(f"v: unsupported schema version {data.get('v')!r}")
    request_id = _required(data, "request_id")
    if not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise RoutingContractError("request_id: must be 32 lowercase hex characters")
    is_stream = _required(data, "is_stream")
    if is_stream not in {"0", "1"}:
        raise RoutingContractError("is_stream: must be 0 or 1")
    usage_source = _required(data, "usage_source")
    if usage_source not in {"engine", "gateway"}:
        raise RoutingContractError("usage_source: must be engine or gateway")
    return RequestRecord(
        request_id=request_id,
        tenant_id=_int(data, "tenant_id", minimum=1, maximum=MAX_BIGINT),
        api_key_id=_int(data, "api_key_id", minimum=0, maximum=MAX_BIGINT),
        deployment=_text(data, "deployment"),
        version_id=_int(data, "version_id", minimum=1, maximum=MAX_BIGINT),
        agent=_text(data, "agent"),
        endpoint_kind=_text(data, "endpoint_kind"),
        status=_int(data, "status", minimum=100, maximum=599),  # an HTTP status
        is_stream=is_stream == "1",
        started_at=_float(data, "started_at", maximum=MAX_UNIX_TIME),
        finished_at=_float(data, "finished_at", maximum=MAX_UNIX_TIME),
        e2e_s=_float(data, "e2e_s"),
        ttft_s=_optional_float(data, "ttft_s"),
        itl_mean_s=_optional_float(data, "itl_mean_s"),
        itl_p95_s=_optional_float(data, "itl_p95_s"),
        prompt_tokens=_int(data, "prompt_tokens", maximum=MAX_INTEGER),
        completion_tokens=_int(data, "completion_tokens", maximum=MAX_INTEGER),
        usage_source=usage_source,
        attempts=_int(data, "attempts", minimum=1, maximum=MAX_INTEGER),  # not stored
        prompt=_optional_text(data, "prompt"),
        completion=_optional_text(data, "completion"),
        error_code=_error_code(data),
        is_shadow=_is_shadow(data),
    )


def _is_shadow(data: Mapping[str, str]) -> bool:
    value = data.get("is_shadow")
    if value is None:  # absent: a request a tenant was answered, or an entry from before
        return False
    if value not in {"0", "1"}:
        raise RoutingContractError("is_shadow: must be 0 or 1")
    return value == "1"


def _error_code(data: Mapping[str, str]) -> str:
    value = data.get("error_code")
    if value is None:  # absent: no error, or an entry written before the field existed
        return ""
    if not isinstance(value, str) or not ERROR_CODE_PATTERN.fullmatch(value):
        raise RoutingContractError("error_code: must be 1-64 of a-z, 0-9, '_'")
    return value
