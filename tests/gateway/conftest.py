"""Gateway fixtures: real engines, real gateway processes (uvicorn), real Redis and PostgreSQL.

Two `python -m engine serve --model smollm2 --threads 1` processes start once per session
(they are the agents, each with its own serving and admin secrets, `engine_secrets`);
two gateway processes (`controlplane.asgi`, the /v1/ mount) start
once per session too. Tests commit their rows (`transactional_db`) so the gateways, which
are other processes, can read them.
"""

import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from django.conf import settings
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from contracts.routing import (
    REQUESTS_STREAM,
    RequestRecord,
    parse_request_record,
    request_fields_sign,
    request_fields_verify,
)
from controlplane.registry.models import Artifact, Model, ModelVersion
from controlplane.rollouts.routing import routing_table_publish
from controlplane.telemetry.requests import RequestsStreamHandler
from controlplane.telemetry.streams import StreamIngestor
from controlplane.tenants.models import Tenant
from controlplane.tenants.services import api_key_create, tenant_create
from engine.config import EngineSecrets
from tests.conftest import PYTHON, start_process, stop_process, wait_until

SERVING_CONFIG = {
    "dtype": "float32",
    "max_model_len": 2048,
    "kv_block_size": 16,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 2048,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# base URL -> the secrets of the engine serving there (filled by the `engines` fixture)
ENGINE_SECRETS: dict[str, EngineSecrets] = {}


def endpoint_secrets(endpoints: list[str]) -> dict[str, str]:
    """A routing table's `endpoint_secrets` for these test engines: their serving secrets."""
    return {e: ENGINE_SECRETS[e].serving for e in endpoints if e in ENGINE_SECRETS}


def serving_headers(endpoint: str) -> dict[str, str]:
    """What opens the engine's /v1/* routes (as the gateway does)."""
    return {"Authorization": f"Bearer {ENGINE_SECRETS[endpoint].serving}"}


def admin_headers(endpoint: str) -> dict[str, str]:
    """What opens the engine's /admin/* routes (as the agent does)."""
    return {"Authorization": f"Bearer {ENGINE_SECRETS[endpoint].admin}"}


def _is_ready(url: str) -> bool:
    try:
        health = httpx.get(f"{url}/health", headers=serving_headers(url), timeout=1)
        return health.status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> Iterator[list[str]]:
    """Two real engines serving SmolLM2 (one torch thread each); their base URLs."""
    logs = tmp_path_factory.mktemp("engines")
    processes = []
    urls = []
    for index in range(2):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        ENGINE_SECRETS[url] = EngineSecrets.generate()
        processes.append(
            start_process(
                [
                    PYTHON,
                    "-m",
                    "engine",
                    "serve",
                    "--model",
                    "smollm2",
                    "--threads",
                    "1",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--served-model-name",
                    "smollm2",
                    "--device",
                    "cpu",
                    "--log-level",
                    "warning",
                ],
                logs / f"engine-{index}.log",
                **ENGINE_SECRETS[url].environment(),
            )
        )
        urls.append(url)
    try:
        for url, process in zip(urls, processes, strict=True):
            wait_until(
                lambda url=url, process=process: process.poll() is not None or _is_ready(url),
                timeout=240,
                interval=0.5,
                message=f"engine at {url} not ready",
            )
            assert process.poll() is None, (logs / "engine-0.log").read_text()[-2000:]
        yield urls
    finally:
        for process in processes:
            stop_process(process)


@dataclass
class GatewayProcess:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def start_gateway(
    log_dir: Path,
    spool_dir: Path,
    application: str = "controlplane.asgi:application",
    **env: str,
) -> GatewayProcess:
    """A gateway process: by default `web` (the /v1/ mount), or `application` (the
    standalone gateway, `controlplane.gateway.asgi:application`)."""
    port = free_port()
    log = log_dir / f"gateway-{port}.log"
    process = start_process(
        [
            PYTHON,
            "-m",
            "uvicorn",
            application,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        log,
        **{
            "GATEWAY_SPOOL_DIR": str(spool_dir),
            "GATEWAY_SPOOL_RETRY_S": "0.2",
            "GATEWAY_ROUTING_REFRESH_S": "1",
            "GATEWAY_KEY_CACHE_TTL_S": "2",
            "PYTHONFAULTHANDLER": "1",  # SIGABRT prints every thread's stack (stop_gateway)
            **env,  # the test's own settings win
        },
    )
    url = f"http://127.0.0.1:{port}"

    def is_up() -> bool:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            httpx.get(f"{url}/v1/models", timeout=1)
            return True
        except httpx.HTTPError:
            return False

    wait_until(is_up, timeout=60, interval=0.2, message=f"gateway at {url} not up")
    return GatewayProcess(url=url, process=process, log=log)


def stop_gateway(gateway: GatewayProcess, timeout: float = 60) -> None:
    """SIGTERM, and the gateway's exit within `timeout` (its stop bounds each step, 40 s in
    all at worst); if it hangs, its threads' stacks (faulthandler, on SIGABRT) and log go
    into the failure."""
    process = gateway.process
    assert isinstance(process, subprocess.Popen)
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
        return
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        process.wait(timeout=10)
    raise AssertionError(
        f"gateway did not stop within {timeout} s of SIGTERM:\n"
        + gateway.log.read_text(errors="replace")[-6000:]
    )


@pytest.fixture(scope="session")
def gateways(
    tmp_path_factory, django_db_setup, django_db_blocker
) -> Iterator[list[GatewayProcess]]:
    """Two gateway processes sharing Redis and the database (they need the test database)."""
    log_dir = tmp_path_factory.mktemp("gateways")
    started = []
    try:
        for index in range(2):
            started.append(start_gateway(log_dir, tmp_path_factory.mktemp(f"spool{index}")))
        yield started
    finally:
        for gateway in started:
            stop_process(gateway.process)


@dataclass
class Setup:
    tenant: Tenant
    raw_key: str
    model: Model
    versions: list[ModelVersion]


def make_setup(
    *,
    model_name: str = "smollm2",
    allowed: bool = True,
    requests_per_minute: int = 100_000,
    tokens_per_minute: int = 10_000_000,
    prompt_logging: str = "off",
    version_count: int = 2,
) -> Setup:
    model = Model.objects.filter(name=model_name).first() or Model.objects.create(
        name=model_name, task="chat"
    )
    versions = list(ModelVersion.objects.filter(model=model).order_by("pk"))
    while len(versions) < version_count:
        artifact = Artifact.objects.create(
            digest=uuid.uuid4().hex + uuid.uuid4().hex, format="gguf", size_bytes=1
        )
        versions.append(
            ModelVersion.objects.create(
                model=model,
                label=f"v{len(versions) + 1}",
                artifact=artifact,
                serving_config=SERVING_CONFIG,
            )
        )
    tenant = tenant_create(
        actor=None,
        slug=f"t-{uuid.uuid4().hex[:12]}",
        name="Tenant",
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        allowed_models=[model] if allowed else [],
        prompt_logging=prompt_logging,
    )
    created = api_key_create(actor=None, tenant=tenant, name="test")
    return Setup(tenant=tenant, raw_key=created.raw_key, model=model, versions=versions)


def route_wholly(version: ModelVersion, endpoint: str, client: redis.Redis | None = None) -> None:
    """The smollm2 deployment's every request to one version on one engine."""
    routing_table_publish(
        deployment="smollm2",
        model="smollm2",
        versions=[
            {
                "version_id": version.pk,
                "label": version.label,
                "weight": 100,
                "endpoints": [endpoint],
                "endpoint_secrets": endpoint_secrets([endpoint]),
                "max_model_len": version.serving_config["max_model_len"],
            }
        ],
        client=client,
    )


def client_for(gateway: GatewayProcess, raw_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=raw_key, max_retries=0, timeout=60)


def usage_of(response: ChatCompletion | ChatCompletionChunk | Completion) -> CompletionUsage:
    """The usage the response reports, which the caller expects it to carry."""
    assert response.usage is not None
    return response.usage


def error_body(error: openai.APIStatusError) -> dict[str, Any]:
    """The OpenAI-shaped error object the gateway or engine answered with."""
    assert isinstance(error.body, dict)
    return error.body


def wait_for_model(gateway: GatewayProcess, raw_key: str, model: str, present: bool = True) -> None:
    """Until the gateway's routing cache (fed by pub/sub) lists the model for this key."""

    def listed() -> bool:
        response = httpx.get(
            f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {raw_key}"}, timeout=5
        )
        names = [item["id"] for item in response.json().get("data", [])]
        return (model in names) == present

    wait_until(listed, timeout=15, interval=0.05, message=f"{model} not routed by {gateway.url}")


def signed_entry(record: RequestRecord) -> dict[str, str]:
    """A record's stream fields signed as a gateway signs them: what ingest accepts."""
    return request_fields_sign(record.to_fields(), settings.TELEMETRY_RECORD_KEY)


def stream_records(client: redis.Redis) -> list[RequestRecord]:
    """The stream's records, each checked to carry the gateway's valid signature."""
    # The client decodes responses, so the fields are str; redis types them bytes | str.
    entries: Any = client.xrange(REQUESTS_STREAM)
    for _, fields in entries:
        request_fields_verify(fields, settings.TELEMETRY_RECORD_KEY)
    return [parse_request_record(fields) for _, fields in entries]


def wait_for_records(client: redis.Redis, count: int) -> list[RequestRecord]:
    wait_until(
        lambda: client.xlen(REQUESTS_STREAM) >= count,
        timeout=30,
        message=f"fewer than {count} request entries",
    )
    return stream_records(client)


def ingest_all(client: redis.Redis) -> None:
    """Run the real ingest loop over the requests stream until it has nothing left."""
    ingestor = StreamIngestor(
        client=client,
        group="ingest",
        consumer="test",
        handlers={REQUESTS_STREAM: RequestsStreamHandler()},
        block_ms=10,
    )
    ingestor.ensure_groups()
    for _ in range(100):
        if ingestor.run_once() == 0 and ingestor.run_once() == 0:
            return
    raise AssertionError("ingest did not drain")


@pytest.fixture
def stores(redis_client, transactional_db) -> redis.Redis:
    """Committed rows and an empty Redis (routing tables included) for each test."""
    return redis_client


def redis_window_seconds_left(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return 60 - (seconds % 60) - micros / 1e6


def wait_for_fresh_window(client: redis.Redis, needed_s: float = 20) -> None:
    """Start a rate-limit test early in a window (the windows are Redis minutes)."""
    left = redis_window_seconds_left(client)
    if left < needed_s:
        time.sleep(left + 0.2)


REDIS_URL = settings.REDIS_URL
