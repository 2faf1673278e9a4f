"""Traces for every process: OpenTelemetry, set up from the standard OTEL_* variables.

Off unless the environment asks for it: with no exporter configured, `tracer()` is the
API's no-op tracer and `is_enabled()` is False, which the request paths check first so
that a process without tracing pays a function call per request and nothing more.

On when `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`; `none` is off), or,
when it is unset, when `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set. `OTEL_SDK_DISABLED=true` turns it off
whatever else is set. The SDK reads the rest itself: the exporter's endpoint, headers and
timeout, the sampler (`OTEL_TRACES_SAMPLER`, parent-based always-on by default), the batch
processor's limits and `OTEL_RESOURCE_ATTRIBUTES`; `OTEL_SERVICE_NAME` names the process
(default: the role passed to `tracing_configure`).

Trace context crosses processes as the W3C `traceparent` (and `tracestate`) header, and
only those: a caller's baggage is never taken in. Pure Python on the OpenTelemetry API and
SDK, no Django and no PyTorch: every role imports it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
EXPORTERS = ("otlp", "console")
_TRUE = ("true", "1", "yes")

_W3C = TraceContextTextMapPropagator()
_NO_OP = trace.NoOpTracer()
_lock = threading.Lock()
_provider: TracerProvider | None = None
_tracers: dict[str, trace.Tracer] = {}

P = ParamSpec("P")
R = TypeVar("R")


class TracingConfigError(ValueError):
    """An OTEL_* variable this module reads holds a value it cannot use; names the variable."""


def exporters_from(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters the environment asks for; () when tracing stays off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return ()
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        has_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip() or (
            environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        )
        return ("otlp",) if has_endpoint else ()
    names = tuple(dict.fromkeys(name.strip() for name in raw.split(",") if name.strip()))
    if names == ("none",):
        return ()
    unknown = [name for name in names if name not in EXPORTERS]
    if unknown:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not one of "
            f"{', '.join(EXPORTERS)} or none"
        )
    return names


def tracing_configure(role: str, environ: Mapping[str, str] | None = None) -> bool:
    """Set up this process's traces from the environment; whether they are on.

    Called once at the start of each process (web, gateway, ingest, the Celery worker,
    the engine, the agent), `role` naming it when OTEL_SERVICE_NAME does not. Raises
    TracingConfigError on an exporter name it does not know.
    """
    environ = os.environ if environ is None else environ
    exporters = exporters_from(environ)
    if not exporters:
        return False
    if _provider is not None:
        return True  # set up already (a second entry point in the same process)
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: role}))
    provider = TracerProvider(resource=resource)
    for name in exporters:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        # Batched, on the processor's own thread: a request never waits for an export.
        provider.add_span_processor(BatchSpanProcessor(exporter))
    tracing_install(provider)
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(provider)  # for any library that asks the API for it
    logger.info("tracing on", extra={"exporters": ",".join(exporters), "service": role})
    return True


def tracing_install(provider: TracerProvider | None) -> None:
    """Use `provider` for this process's spans from now on (None: off again). Tests install
    one with an in-memory exporter; `tracing_configure` installs the configured one."""
    global _provider
    with _lock:
        _provider = provider
        _tracers.clear()


def is_enabled() -> bool:
    """Whether tracing is set up (a sampler may still drop a trace): the request paths
    skip all tracing work when not."""
    return _provider is not None


def tracer(name: str) -> trace.Tracer:
    """The tracer of one component (`controlplane.gateway`, `engine.server`, ...); the
    API's no-op tracer when tracing is off."""
    provider = _provider
    if provider is None:
        return _NO_OP
    found = _tracers.get(name)
    if found is None:
        found = _tracers[name] = provider.get_tracer(name)
    return found


def context_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
    """The trace context an ASGI request carries in `traceparent` (and `tracestate`);
    None when it carries none, or one that is malformed (the caller starts a new trace)."""
    carrier: dict[str, str] = {}
    for name, value in headers:
        if name == b"traceparent" or name == b"tracestate":
            carrier.setdefault(name.decode(), bytes(value).decode("latin-1"))
    if TRACEPARENT not in carrier:
        return None
    return context_from_carrier(carrier)


def context_from_carrier(carrier: Mapping[str, str]) -> Context | None:
    """The trace context in a mapping holding `traceparent` (and `tracestate`); None when
    there is none or it is malformed."""
    context = _W3C.extract(carrier)
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


def carrier_from_context(context: Context | None = None) -> dict[str, str]:
    """`traceparent` (and `tracestate`) for the current span, or the span of `context`;
    empty when there is no valid span."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context)
    return carrier


def traced(component: str, name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the function in a span `name` of `component`'s tracer (current while it runs,
    so that spans it starts are its children and `span_attributes_set` writes on it)."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if _provider is None:
                return function(*args, **kwargs)
            with tracer(component).start_as_current_span(name):
                return function(*args, **kwargs)

        return wrapper

    return decorate


def span_attributes_set(**attributes: Any) -> None:
    """Attributes on the current span (`fleet.` is put before each name); nothing when
    tracing is off. Values that are None are left out."""
    if _provider is None:
        return
    trace.get_current_span().set_attributes(
        {f"fleet.{name}": value for name, value in attributes.items() if value is not None}
    )
