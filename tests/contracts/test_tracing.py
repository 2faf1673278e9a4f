"""Tracing is set up from the standard OTEL_* variables, off unless they ask for it."""

from __future__ import annotations

import json
import subprocess

import pytest

from contracts.tracing import (
    TracingConfigError,
    carrier_from_context,
    context_from_carrier,
    exporters_from,
    is_enabled,
    tracer,
)
from tests.conftest import PYTHON, REPO_ROOT
from tests.tracing_support import in_memory_tracing

ENDPOINT = "http://collector:4318"


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, ()),  # off by default: no collector is assumed
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{ENDPOINT}/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),  # the SDK's default endpoint
        ({"OTEL_TRACES_EXPORTER": " Console , otlp,console"}, ("console", "otlp")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ()),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, ("otlp",)),
    ],
)
def test_the_environment_names_the_exporters(environ: dict[str, str], exporters) -> None:
    assert exporters_from(environ) == exporters


@pytest.mark.parametrize("value", ["zipkin", "otlp,jaeger", "none,otlp"])
def test_an_unknown_exporter_is_refused_by_name(value: str) -> None:
    with pytest.raises(TracingConfigError, match=r"^OTEL_TRACES_EXPORTER: .* is not one of"):
        exporters_from({"OTEL_TRACES_EXPORTER": value})


def test_a_process_refuses_to_start_on_an_unknown_exporter(tmp_path) -> None:
    agent = subprocess.run(
        [PYTHON, "-m", "agent", "--name", "a1", "--port", "9000", "--state-dir", str(tmp_path)],
        cwd=REPO_ROOT,
        env={"PATH": "/usr/bin:/bin", "OTEL_TRACES_EXPORTER": "zipkin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert agent.returncode == 2
    line = json.loads(agent.stderr.strip().splitlines()[-1])  # logs are JSON by default
    assert (line["level"], line["message"]) == (
        "ERROR",
        "agent: OTEL_TRACES_EXPORTER: zipkin is not one of otlp, console or none",
    )


def test_off_means_the_no_op_tracer_and_no_context() -> None:
    assert not is_enabled()
    with tracer("tests").start_as_current_span("nothing") as span:
        assert not span.is_recording()
        assert carrier_from_context() == {}


def test_a_span_context_crosses_as_traceparent() -> None:
    with in_memory_tracing(), tracer("tests").start_as_current_span("sender") as span:
        carrier = carrier_from_context()
        context = span.get_span_context()
    flags = int(context.trace_flags)
    assert flags & 1  # sampled
    assert carrier == {
        "traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}"
    }
    received = context_from_carrier(carrier)
    assert received is not None
    with in_memory_tracing() as spans:
        with tracer("tests").start_as_current_span("receiver", context=received):
            pass
        (receiver,) = spans.get_finished_spans()
    assert receiver.parent is not None
    assert (receiver.parent.trace_id, receiver.parent.span_id) == (
        context.trace_id,
        context.span_id,
    )
    assert context_from_carrier({"traceparent": "00-abc-def-01"}) is None
