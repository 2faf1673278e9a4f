"""The engine's spans: one per generation request, continuing the caller's trace.

    engine.request (server; its parent is the request's `traceparent`, the gateway's
    │               gateway.upstream span, when it carries a valid one)
    ├── engine.queue     arrival -> first scheduled in a step
    ├── engine.prefill   first scheduled -> first token
    └── engine.decode    first token -> finished
    event on engine.request: first_token

The three phases are made when the request ends, from the times the step loop wrote on
its sequence: the engine thread does no tracing work. With tracing off
(`contracts.tracing.is_enabled()` False) nothing here reads a header or makes a span.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from contracts import tracing
from engine.protocol import ApiError
from engine.sequence import Sequence as EngineSequence

TRACER = "engine.server"


@dataclass(slots=True)
class RequestTrace:
    span: Span
    sequence: EngineSequence | None = None


_current: ContextVar[RequestTrace | None] = ContextVar("engine_request_trace", default=None)


@contextlib.contextmanager
def request_span(headers: Sequence[tuple[bytes, bytes]], route: str) -> Iterator[None]:
    """The span of one generation request (`route`: chat or completions); its phases are
    added when it ends, from the sequence `sequence_added` named."""
    if not tracing.is_enabled():
        yield
        return
    parent = tracing.context_from_headers(headers)
    request_id = ""
    for name, value in headers:
        if name == b"x-request-id":
            request_id = bytes(value).decode("latin-1")[:64]
            break
    with tracing.tracer(TRACER).start_as_current_span(
        "engine.request",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"fleet.route": route, "fleet.request_id": request_id},
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        request_trace = RequestTrace(span)
        token = _current.set(request_trace)
        try:
            yield
        except ApiError as error:
            span.set_attribute("http.response.status_code", error.status)
            span.set_attribute("error.type", error.code or error.type)
            if error.status >= 500:
                span.set_status(Status(StatusCode.ERROR, error.message))
            raise
        except BaseException as error:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            raise
        else:
            span.set_attribute("http.response.status_code", 200)
        finally:
            _current.reset(token)
            if request_trace.sequence is not None:
                _phases(span, request_trace.sequence)


def sequence_added(sequence: EngineSequence) -> None:
    """The request's sequence is in the engine: its times make the phases."""
    request_trace = _current.get()
    if request_trace is not None:
        request_trace.sequence = sequence


def _phases(span: Span, seq: EngineSequence) -> None:
    now = time.monotonic()
    offset_ns = time.time_ns() - int(now * 1e9)  # monotonic -> wall clock

    def wall(monotonic: float) -> int:
        return int(monotonic * 1e9) + offset_ns

    finished = seq.last_token_time if seq.is_finished and seq.last_token_time else now
    attributes: dict[str, Any] = {
        "gen_ai.usage.input_tokens": seq.num_prompt_tokens,
        "gen_ai.usage.output_tokens": seq.num_output_tokens,
        "fleet.cached_tokens": seq.num_cached_tokens,
        "fleet.preemptions": seq.num_preemptions,
    }
    if seq.finish_reason:
        attributes["gen_ai.response.finish_reasons"] = (seq.finish_reason,)
        if seq.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, "generation failed"))
    span.set_attributes(attributes)
    parent = trace.set_span_in_context(span)
    engine_tracer = tracing.tracer(TRACER)
    scheduled = seq.first_scheduled_time
    first_token = seq.first_token_time
    phases = [("engine.queue", seq.arrival_time, scheduled if scheduled is not None else now)]
    if scheduled is not None:
        phases.append(("engine.prefill", scheduled, first_token if first_token else finished))
    if first_token is not None:
        phases.append(("engine.decode", first_token, finished))
        span.add_event(
            "first_token",
            {"fleet.ttft_s": first_token - seq.arrival_time},
            timestamp=wall(first_token),
        )
    for name, start, end in phases:
        engine_tracer.start_span(name, context=parent, start_time=wall(start)).end(
            end_time=wall(max(start, end))
        )
