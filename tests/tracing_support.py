"""Recording this process's spans with the SDK's in-memory exporter, and serving ASGI apps
on threads of the test process so that their spans are recorded too."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts.tracing import tracing_install
from tests.conftest import wait_until


@contextmanager
def in_memory_tracing() -> Iterator[InMemorySpanExporter]:
    """Tracing on for this process while inside; every ended span lands in the exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing_install(provider)
    try:
        yield exporter
    finally:
        tracing_install(None)
        provider.shutdown()


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def one_span(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = spans_named(exporter, name)
    assert len(found) == 1, f"{len(found)} spans named {name}: {names(exporter)}"
    return found[0]


def names(exporter: InMemorySpanExporter) -> list[str]:
    return [span.name for span in exporter.get_finished_spans()]


def wait_for_span(exporter: InMemorySpanExporter, name: str, timeout: float = 30) -> ReadableSpan:
    wait_until(
        lambda: bool(spans_named(exporter, name)),
        timeout=timeout,
        interval=0.02,
        message=lambda: f"no span {name}; spans: {names(exporter)}",
    )
    return one_span(exporter, name)


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def served(app: Any) -> Iterator[str]:
    """`app` under uvicorn (lifespan on) on a thread of this process; its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_level="warning")
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: server.started or not thread.is_alive(),
            timeout=30,
            interval=0.01,
            message="server did not start",
        )
        assert server.started, "the server thread ended before it started"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
