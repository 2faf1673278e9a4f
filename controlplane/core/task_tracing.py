"""Traces across Celery: a task runs in a span whose parent is the span that sent it.

Sending a task puts the sender's trace context in the message's headers (`traceparent`,
`tracestate`); the worker runs the task in a `celery.task <name>` span under that
context, so an analysis, the transition it decides and the reconcile pass sent after
commit make one trace. A sender with tracing off sends no header; a worker with tracing
off makes no span. The worker sets its tracing up from the environment when it starts.
"""

from __future__ import annotations

from typing import Any

from celery import Task, signals
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from contracts import tracing

TRACER = "controlplane.tasks"

# task id -> its span and the context token to detach (prerun and postrun share a thread)
_running: dict[str, tuple[Span, object]] = {}


def _inject(headers: dict[str, Any] | None = None, **_: Any) -> None:
    # A context the sender put in the headers itself (hooks.py) is kept.
    if headers is not None and tracing.TRACEPARENT not in headers and tracing.is_enabled():
        headers.update(tracing.carrier_from_context())


def _start(task_id: str = "", task: Task | None = None, **_: Any) -> None:
    if task is None or not tracing.is_enabled():
        return
    request = task.request
    carrier = {
        name: value
        for name in (tracing.TRACEPARENT, tracing.TRACESTATE)
        if isinstance(value := getattr(request, name, None), str)
    }
    parent = tracing.context_from_carrier(carrier) if carrier else None
    span = tracing.tracer(TRACER).start_span(
        f"celery.task {task.name}",
        context=parent,
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.system": "celery",
            "messaging.message.id": task_id,
            "celery.task_name": task.name,
            "celery.retries": int(getattr(request, "retries", 0) or 0),
        },
    )
    _running[task_id] = (span, otel_context.attach(trace.set_span_in_context(span)))


def _failed(task_id: str = "", exception: BaseException | None = None, **_: Any) -> None:
    running = _running.get(task_id)
    if running is not None and exception is not None:
        running[0].record_exception(exception)
        running[0].set_status(Status(StatusCode.ERROR, type(exception).__name__))


def _end(task_id: str = "", state: str | None = None, **_: Any) -> None:
    running = _running.pop(task_id, None)
    if running is None:
        return
    span, token = running
    otel_context.detach(token)  # type: ignore[arg-type]
    if state:
        span.set_attribute("celery.state", state)
    span.end()


def _configure_worker(**_: Any) -> None:
    try:
        tracing.tracing_configure("worker")
    except tracing.TracingConfigError as exc:
        # Celery logs a handler's Exception and goes on; the worker must not start.
        raise SystemExit(f"worker: {exc}") from exc


def task_tracing_connect() -> None:
    """Connect the handlers (once per process; connecting again changes nothing)."""
    signals.before_task_publish.connect(_inject, weak=False, dispatch_uid="trace-publish")
    signals.task_prerun.connect(_start, weak=False, dispatch_uid="trace-task-start")
    signals.task_failure.connect(_failed, weak=False, dispatch_uid="trace-task-failure")
    signals.task_postrun.connect(_end, weak=False, dispatch_uid="trace-task-end")
    # Before the pool forks: the SDK's exporter thread starts again in each child.
    signals.worker_init.connect(_configure_worker, weak=False, dispatch_uid="trace-worker")
