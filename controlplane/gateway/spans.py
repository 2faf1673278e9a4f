"""The gateway's spans: one trace per tenant request, continued by the engine.

    gateway.request (server; continues the client's `traceparent` when it is valid)
    ├── gateway.admission.auth         the API key: fleet.tenant.id
    ├── gateway.route                  the version chosen: model, version, role
    ├── gateway.admission.rate_limit   the tenant's limits: allowed or the limit refused
    └── gateway.upstream               one per attempt, until the agent's response head;
        └── engine.request ...         its `traceparent` goes to the engine
    events on gateway.request: first_token, last_token (streams)

Only called when `contracts.tracing.is_enabled()`: with tracing off the gateway makes no
span and reads no trace header.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from contracts import tracing
from contracts.routing import RequestRecord, RoutingTable, VersionRoute
from controlplane.gateway.metering import StreamMeter
from controlplane.gateway.ratelimit import Admission
from controlplane.gateway.upstream import UpstreamPool, UpstreamResponse

TRACER = "controlplane.gateway"


@contextmanager
def request_span(scope) -> Iterator[Span]:
    """The request's span, current for everything the request does; a client's valid
    `traceparent` is its parent, a malformed one is refused (a new trace, marked)."""
    traceparent = None
    for name, value in scope["headers"]:
        if name == b"traceparent":
            traceparent = value
            break
    parent = None if traceparent is None else tracing.context_from_headers(scope["headers"])
    with tracing.tracer(TRACER).start_as_current_span(
        "gateway.request",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"http.request.method": scope["method"], "url.path": scope["path"]},
    ) as span:
        if traceparent is not None and parent is None:
            span.set_attribute("fleet.traceparent_refused", True)
        yield span


def refused(status: int, code: str) -> None:
    """The gateway answered the request itself with an error."""
    span = trace.get_current_span()
    span.set_attribute("http.response.status_code", status)
    span.set_attribute("error.type", code)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, code))


@contextmanager
def auth_span() -> Iterator[Span]:
    # A refused key is the client's error, not the gateway's: no error status here.
    with tracing.tracer(TRACER).start_as_current_span(
        "gateway.admission.auth", record_exception=False, set_status_on_exception=False
    ) as span:
        yield span


def route_chosen(
    started_ns: int, table: RoutingTable, version: VersionRoute | None, tenant_slug: str
) -> None:
    """A span for the choice of version (it took from `started_ns` until now)."""
    span = tracing.tracer(TRACER).start_span(
        "gateway.route",
        start_time=started_ns,
        attributes={
            "gen_ai.request.model": table.model,
            "fleet.deployment": table.deployment,
            "fleet.routing.generation": table.generation,
            "fleet.tenant.slug": tenant_slug,
        },
    )
    if version is None:
        span.set_attribute("fleet.version.id", 0)
        span.set_status(Status(StatusCode.ERROR, "no_ready_agent"))
    else:
        span.set_attribute("fleet.version.id", version.version_id)
        span.set_attribute("fleet.version.label", version.label)
        span.set_attribute("fleet.version.role", version.role or "unknown")
    span.end()


@contextmanager
def rate_limit_span(*, is_early: bool) -> Iterator[Span]:
    """The limit check; `is_early`: it runs alongside the request to the agent."""
    with tracing.tracer(TRACER).start_as_current_span(
        "gateway.admission.rate_limit",
        attributes={"fleet.admission.is_early": is_early},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        yield span


def rate_limit_result(span: Span, admission: Admission | None) -> None:
    if admission is None:  # Redis unavailable: admitted unchecked
        span.set_attribute("fleet.admission.is_checked", False)
        span.set_attribute("fleet.admission.is_allowed", True)
        return
    span.set_attribute("fleet.admission.is_checked", True)
    span.set_attribute("fleet.admission.is_allowed", admission.is_allowed)
    if not admission.is_allowed:
        span.set_attribute("fleet.admission.limit", str(admission.limit))


async def upstream_post(
    pool: UpstreamPool,
    endpoint: str,
    path: str,
    body: bytes,
    headers: list[tuple[str, str]],
    attempt: int,
) -> UpstreamResponse:
    """`pool.post` in a span of its own, whose context the engine receives."""
    span = tracing.tracer(TRACER).start_span(
        "gateway.upstream",
        kind=SpanKind.CLIENT,
        attributes={"url.full": endpoint + path, "fleet.attempt": attempt},
    )
    carrier = tracing.carrier_from_context(trace.set_span_in_context(span))
    try:
        response = await pool.post(endpoint, path, body, [*headers, *carrier.items()])
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        span.end()
        raise
    span.set_attribute("http.response.status_code", response.status)
    if response.status >= 500 or response.status == 401:
        span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
    span.end()
    return response


def request_finished(
    record: RequestRecord, meter: StreamMeter | None, started_wall: float, started: float
) -> None:
    """The request's figures on its span; a stream's first and last tokens as events.

    `started_wall` (time.time) and `started` (time.perf_counter) are the same moment, so
    the meter's perf_counter readings become wall-clock event times.
    """
    span = trace.get_current_span()
    span.set_attributes(
        {
            "http.response.status_code": record.status,
            "fleet.request_id": record.request_id,
            "fleet.tenant.id": record.tenant_id,
            "fleet.version.id": record.version_id,
            "fleet.agent": record.agent,
            "fleet.attempts": record.attempts,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
        }
    )
    if record.error_code:
        span.set_attribute("error.type", record.error_code)
    if record.status >= 500:
        span.set_status(Status(StatusCode.ERROR, record.error_code or f"HTTP {record.status}"))
    if meter is None:
        return

    def wall_ns(perf: float) -> int:
        return int((started_wall + perf - started) * 1e9)

    if meter.first_token_at is not None:
        span.add_event(
            "first_token",
            {"fleet.ttft_s": meter.first_token_at - started},
            timestamp=wall_ns(meter.first_token_at),
        )
    if meter.last_token_at is not None:
        span.add_event(
            "last_token",
            {"fleet.tokens": record.completion_tokens, "fleet.status": record.status},
            timestamp=wall_ns(meter.last_token_at),
        )
