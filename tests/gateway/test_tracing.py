"""A tenant's request makes one trace across the gateway and the engine.

The real gateway app and a real engine (the tiny random Llama) are served by uvicorn on
threads of the test process, so the SDK's in-memory exporter sees the spans of both; the
request goes over TCP from the OpenAI client to the gateway and from the gateway to the
engine, the trace context in the engine request's `traceparent` header. Last, a gateway
process configured by OTEL_EXPORTER_OTLP_ENDPOINT exports its spans to a collector.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest
from django.test import override_settings
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from controlplane.gateway.app import Gateway
from controlplane.rollouts.routing import routing_table_publish
from engine.config import EngineConfig, EngineSecrets
from engine.server import EngineApp
from tests.conftest import wait_until
from tests.engine.conftest import build_tiny_llama
from tests.gateway.conftest import Setup, make_setup, start_gateway, stop_gateway
from tests.tracing_support import (
    in_memory_tracing,
    one_span,
    parent_id,
    served,
    span_id,
    trace_id,
    wait_for_span,
)

pytestmark = pytest.mark.slow

MODEL = "smollm2"  # make_setup's model: the engine serves it under this name
MAX_MODEL_LEN = 256
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A real engine on a thread of this process: its URL and serving secret."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(folder)
    secrets = EngineSecrets.generate()
    app = EngineApp(
        EngineConfig(
            model=str(folder),
            served_model_name=MODEL,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            num_blocks=64,
            device="cpu",
            threads=1,
        ),
        secrets=secrets,
    )
    with served(app) as url:
        app.wait_loaded(120)
        assert app.status == "ready", app.failure
        yield url, secrets.serving


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with in_memory_tracing() as exporter:
        yield exporter


@pytest.fixture
def gateway(engine_url, redis_client, transactional_db, tmp_path) -> Iterator[tuple[str, Setup]]:
    """The gateway app on a thread, routing the tenant's model to the engine (stable)."""
    url, serving_secret = engine_url
    setup = make_setup()
    version = setup.versions[0]
    routing_table_publish(
        deployment=MODEL,
        model=MODEL,
        versions=[
            {
                "version_id": version.pk,
                "label": version.label,
                "weight": 100,
                "endpoints": [url],
                "endpoint_secrets": {url: serving_secret},
                "max_model_len": MAX_MODEL_LEN,
                "role": "stable",
            }
        ],
    )
    with override_settings(GATEWAY_SPOOL_DIR=tmp_path / "spool"), served(Gateway()) as gateway_url:
        yield gateway_url, setup


def stream_chat(gateway_url: str, raw_key: str, headers: dict[str, str] | None = None):
    """A streamed chat completion through the gateway: its x-request-id and its chunks."""
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=raw_key, max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers=headers or {},
    )
    chunks = list(raw.parse())
    client.close()
    return raw.headers["x-request-id"], chunks


def children(parent: ReadableSpan, spans: InMemorySpanExporter) -> set[str]:
    return {s.name for s in spans.get_finished_spans() if parent_id(s) == span_id(parent)}


def test_a_tenant_request_is_one_trace_across_gateway_and_engine(gateway, spans) -> None:
    gateway_url, setup = gateway
    request_id, chunks = stream_chat(gateway_url, setup.raw_key)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    request = wait_for_span(spans, "gateway.request")
    engine = wait_for_span(spans, "engine.request")
    upstream = one_span(spans, "gateway.upstream")
    # One trace; the gateway's request is its root.
    assert {trace_id(s) for s in spans.get_finished_spans()} == {trace_id(request)}
    assert request.parent is None
    assert children(request, spans) == {
        "gateway.admission.auth",
        "gateway.route",
        "gateway.admission.rate_limit",
        "gateway.upstream",
    }
    # The engine continues the trace under the gateway's attempt.
    assert parent_id(engine) == span_id(upstream)
    assert engine.parent is not None and engine.parent.is_remote
    assert children(engine, spans) == {"engine.queue", "engine.prefill", "engine.decode"}
    assert children(upstream, spans) == {"engine.request"}

    route = one_span(spans, "gateway.route")
    version = setup.versions[0]
    assert route.attributes is not None
    assert (
        route.attributes["gen_ai.request.model"],
        route.attributes["fleet.version.id"],
        route.attributes["fleet.version.label"],
        route.attributes["fleet.version.role"],
    ) == (MODEL, version.pk, version.label, "stable")
    auth = one_span(spans, "gateway.admission.auth")
    assert auth.attributes is not None
    assert auth.attributes["fleet.tenant.id"] == setup.tenant.pk
    rate_limit = one_span(spans, "gateway.admission.rate_limit")
    assert rate_limit.attributes is not None
    assert rate_limit.attributes["fleet.admission.is_allowed"] is True
    assert upstream.attributes is not None
    assert upstream.attributes["http.response.status_code"] == 200

    # The request's figures, its first and last tokens in order, and the engine's phases
    # in order inside its span.
    assert request.attributes is not None
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["fleet.request_id"] == request_id
    assert request.attributes["gen_ai.usage.output_tokens"] == 5
    first, last = (event for event in request.events if event.name.endswith("_token"))
    assert (first.name, last.name) == ("first_token", "last_token")
    assert last.attributes is not None
    assert (last.attributes["fleet.tokens"], last.attributes["fleet.status"]) == (5, 200)
    assert request.start_time is not None and request.end_time is not None
    assert request.start_time <= first.timestamp <= last.timestamp <= request.end_time
    assert engine.attributes is not None
    assert engine.attributes["fleet.request_id"] == request_id
    assert engine.attributes["gen_ai.usage.output_tokens"] == 5
    queue, prefill, decode = (
        one_span(spans, name) for name in ("engine.queue", "engine.prefill", "engine.decode")
    )
    assert queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time
    assert [event.name for event in engine.events] == ["first_token"]


def test_a_client_traceparent_is_continued(gateway, spans) -> None:
    gateway_url, setup = gateway
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    stream_chat(gateway_url, setup.raw_key, {"traceparent": traceparent})

    request = wait_for_span(spans, "gateway.request")
    engine = wait_for_span(spans, "engine.request")
    assert f"{trace_id(request):032x}" == CLIENT_TRACE_ID
    assert request.parent is not None and f"{request.parent.span_id:016x}" == CLIENT_SPAN_ID
    assert trace_id(engine) == trace_id(request)
    assert request.attributes is not None
    assert "fleet.traceparent_refused" not in request.attributes


@pytest.mark.parametrize(
    "traceparent",
    [
        "not a traceparent",
        f"00-{'0' * 32}-{CLIENT_SPAN_ID}-01",  # the all-zero trace id
        f"ff-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01",  # a forbidden version
        f"00-{CLIENT_TRACE_ID.upper()}-{CLIENT_SPAN_ID}-01",  # upper-case hex
    ],
)
def test_a_malformed_traceparent_starts_a_new_trace_and_the_request_succeeds(
    gateway, spans, traceparent: str
) -> None:
    gateway_url, setup = gateway
    _, chunks = stream_chat(gateway_url, setup.raw_key, {"traceparent": traceparent})
    assert chunks

    request = wait_for_span(spans, "gateway.request")
    assert request.parent is None
    assert f"{trace_id(request):032x}" != CLIENT_TRACE_ID
    assert request.attributes is not None
    assert request.attributes["fleet.traceparent_refused"] is True
    assert request.attributes["http.response.status_code"] == 200
    assert trace_id(wait_for_span(spans, "engine.request")) == trace_id(request)


def test_a_refused_key_is_traced_as_the_clients_error(gateway, spans) -> None:
    gateway_url, _ = gateway
    with pytest.raises(openai.AuthenticationError):
        stream_chat(gateway_url, "not-a-key")

    request = wait_for_span(spans, "gateway.request")
    auth = one_span(spans, "gateway.admission.auth")
    assert request.attributes is not None and auth.attributes is not None
    assert (request.attributes["http.response.status_code"], auth.attributes["error.type"]) == (
        401,
        "invalid_api_key",
    )
    assert not [s for s in spans.get_finished_spans() if s.name.startswith("engine.")]


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps each export request it is sent."""

    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        if self.path == "/v1/traces":
            self.received.append(ExportTraceServiceRequest.FromString(body))
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def exported(received: list[ExportTraceServiceRequest]) -> dict[str, set[str]]:
    """service name -> the names of the spans it exported."""
    found: dict[str, set[str]] = {}
    for request in received:
        for resource_spans in request.resource_spans:
            service = next(
                attribute.value.string_value
                for attribute in resource_spans.resource.attributes
                if attribute.key == "service.name"
            )
            for scope_spans in resource_spans.scope_spans:
                found.setdefault(service, set()).update(span.name for span in scope_spans.spans)
    return found


def test_a_configured_gateway_process_exports_its_spans_over_otlp(
    transactional_db, tmp_path
) -> None:
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    Collector.received = []
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    gateway_process = start_gateway(
        tmp_path,
        tmp_path / "spool",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.server_address[1]}",
        OTEL_BSP_SCHEDULE_DELAY="50",  # milliseconds between the exporter's batches
    )
    try:
        answer = httpx.post(f"{gateway_process.url}/v1/chat/completions", json={}, timeout=10)
        assert answer.status_code == 401
        wait_until(
            lambda: "gateway.request" in exported(Collector.received).get("web", set()),
            timeout=30,
            message=lambda: f"exported: {exported(Collector.received)}",
        )
    finally:
        stop_gateway(gateway_process)
        collector.shutdown()
        collector.server_close()
    assert exported(Collector.received) == {"web": {"gateway.request", "gateway.admission.auth"}}
