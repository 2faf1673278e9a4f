"""docker-compose.yml kept honest without Docker: every service's command goes through the
real argument parser, then the whole stack runs as local processes with each service's own
environment (tests/deploy/compose_local.py), and an operator's first steps work: the
migration makes the Redis users, two agents enrol and register, and a tenant's chat
request through the gateway service is served and its usage recorded.

PostgreSQL is the test database rather than the compose `postgres` service (the
image's own), and the agents' engines are the local engine command.
"""

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from django.conf import settings
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from controlplane.fleet.models import Agent
from controlplane.registry import services as registry_services
from controlplane.registry.models import Model, SigningKey
from controlplane.rollouts import deployments
from controlplane.tenants.models import UsageRecord
from controlplane.tenants.services import api_key_create, tenant_create
from tests.agent.test_agent_processes import MODEL_FILE, SERVING_CONFIG, free_port_pair
from tests.api.support import Signer
from tests.conftest import REPO_ROOT, stop_process, wait_until
from tests.deploy import compose_local
from tests.deploy.compose_local import AGENT_ENGINE_PORT, AGENT_HTTP_PORT, CONTAINER_PORTS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PRODUCT = ["web", "gateway", "worker", "beat", "ingest", "agent1", "agent2"]


def compose_variables() -> dict[str, str]:
    """`.env.example` filled in as the operator is told to: a fresh secret for each blank."""
    variables = compose_local.example_variables()
    return {
        name: value or (secrets.token_hex(32) if "TOKEN" not in name else "")
        for name, value in variables.items()
    }


def test_every_command_parses_with_its_programs_own_parser() -> None:
    compose = compose_local.load(compose_variables())
    checked = 0
    for service in compose["services"].values():
        if "build" not in service:  # postgres and redis: their images' own programs
            continue
        for args in compose_local.shell_steps(service.get("command", [])):
            parse(args)
            checked += 1
    assert checked >= len(PRODUCT) + 2  # migrate's two steps and the GPU agent too


def parse(args: list[str]) -> None:
    """Parse `args` as the program they name would, failing on anything it would refuse."""
    if args[:3] == ["python", "-m", "agent"]:
        from agent.__main__ import build_parser

        build_parser().parse_args(args[3:])
    elif args[:2] == ["python", "manage.py"]:
        from django.core.management import get_commands, load_command_class

        command = args[2]
        app = get_commands()[command]
        load_command_class(app, command).create_parser("manage.py", command).parse_args(args[3:])
    elif args[0] in {"uvicorn", "celery"}:
        from celery.bin.celery import celery
        from uvicorn.main import main as uvicorn

        program = uvicorn if args[0] == "uvicorn" else celery
        with program.make_context(args[0], args[1:], resilient_parsing=False) as context:
            if args[0] == "uvicorn":
                assert context.params["app"], args
    else:
        raise AssertionError(f"no parser known for {args}")
    # celery's group parses its subcommand's options when it runs it: a worker or beat
    # with an option it does not know exits at once in the stack test below.


@pytest.fixture
def stack(committed_db, django_db_blocker, tmp_path: Path) -> Iterator[dict]:
    variables = compose_variables()
    compose = compose_local.load(variables)
    ports: dict[str, dict[int, int]] = {
        name: {inside: free_port_pair() for inside in inside_ports}
        for name, inside_ports in CONTAINER_PORTS.items()
    }
    for name in ("agent1", "agent2"):
        ports[name] = {AGENT_ENGINE_PORT: free_port_pair(), AGENT_HTTP_PORT: free_port_pair()}
    db = settings.DATABASES["default"]
    database_url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    base = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": "INFO",
    }
    services = compose_local.local_services(
        compose, ports=ports, volume_root=tmp_path / "volumes", base_environment=base
    )
    for service in services.values():
        if "DATABASE_URL" in service.environment:
            service.environment["DATABASE_URL"] = database_url
    processes: list[subprocess.Popen[bytes]] = []
    logs: dict[str, Path] = {}

    def start(name: str) -> subprocess.Popen[bytes]:
        service = services[name]
        logs[name] = tmp_path / f"{name}.log"
        process = subprocess.Popen(
            service.args,
            cwd=REPO_ROOT,
            env=service.environment,
            stdout=open(logs[name], "wb"),  # noqa: SIM115 - the child keeps it
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        processes.append(process)
        return process

    def tail() -> str:
        return "\n".join(
            f"--- {name}\n{path.read_text(errors='replace')[-2500:]}" for name, path in logs.items()
        )

    admin = redis.Redis(
        port=ports["redis"][6379], username="admin", password=variables["REDIS_ADMIN_PASSWORD"]
    )
    artifact_root = tmp_path / "volumes" / "artifacts" / "artifacts"
    try:
        start("redis")
        wait_until(lambda: _pings(admin), timeout=20, message=tail)
        migrate = start("migrate")
        assert migrate.wait(timeout=120) == 0, tail()
        with django_db_blocker.unblock(), override_settings(ARTIFACT_ROOT=artifact_root):
            signer = Signer("release-key", _new_private_key())
            # Before the agents enrol: they pin the trusted release keys then.
            SigningKey.objects.create(
                key_id=signer.key_id, public_key=signer.public_key_b64, is_trusted=True
            )
            for name, agent in (("agent1", "agent-1"), ("agent2", "agent-2")):
                token = subprocess.run(
                    [sys.executable, "manage.py", "agent_enrol", agent],
                    cwd=REPO_ROOT,
                    env=services["migrate"].environment,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
                services[name].environment["AGENT_ENROLMENT_TOKEN"] = token
            for name in PRODUCT:
                start(name)
            wait_until(
                lambda: Agent.objects.filter(host__gt="", enrolled_at__isnull=False).count() == 2,
                timeout=120,
                message=tail,
            )
            model = Model.objects.create(name="smol", task="chat")
            artifact, _ = registry_services.artifact_store_file(actor=None, path=MODEL_FILE)
            version = registry_services.version_register(
                actor=None,
                model=model,
                label="f32",
                artifact_digest=artifact.digest,
                serving_config=SERVING_CONFIG,
            )
            version = registry_services.version_verify(
                actor=None,
                version=version,
                key_id=signer.key_id,
                signature=signer.sign(artifact.digest, SERVING_CONFIG),
            )
            deployments.deployment_create(actor=None, name="smol", stable_version=version)
            tenant = tenant_create(
                actor=None,
                slug="compose",
                name="Compose",
                requests_per_minute=1000,
                tokens_per_minute=1_000_000,
                allowed_models=[model],
                prompt_logging="off",
            )
            key = api_key_create(actor=None, tenant=tenant, name="compose").raw_key
            yield {
                "gateway": f"http://127.0.0.1:{ports['gateway'][8001]}",
                "web": f"http://127.0.0.1:{ports['web'][8000]}",
                "agents_http": [ports[name][AGENT_HTTP_PORT] for name in ("agent1", "agent2")],
                "key": key,
                "tenant": tenant,
                "tail": tail,
                "ports": ports,
                "logs": logs,
            }
    finally:
        for process in reversed(processes):
            stop_process(process, timeout=30)
        admin.close()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _new_private_key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


def test_the_compose_stack_serves_a_tenant_and_records_its_usage(stack, django_db_blocker) -> None:
    # Both agents answer their own probes; one serves the stable version once it is warm.
    for port in stack["agents_http"]:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200

    def answered() -> httpx.Response | None:
        response = httpx.post(
            f"{stack['gateway']}/v1/chat/completions",
            headers={"Authorization": f"Bearer {stack['key']}"},
            json={
                "model": "smol",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=60,
        )
        return response if response.status_code == 200 else None

    wait_until(lambda: answered() is not None, timeout=180, interval=1.0, message=stack["tail"])
    served = answered()
    assert served is not None
    # The engine's line for it, in its agent's output (LOG_FORMAT=json), names the request id
    # the gateway answered with.
    request_id = served.headers["x-request-id"]

    def engine_lines() -> list[dict]:
        # Whole lines only: the agents are still writing.
        lines = [
            json.loads(line)
            for name in ("agent1", "agent2")
            for line in stack["logs"][name].read_text().split("\n")[:-1]
        ]
        return [line for line in lines if line.get("request_id") == request_id]

    wait_until(lambda: engine_lines(), timeout=10, message=stack["tail"])
    [line] = engine_lines()
    assert (line["logger"], line["path"], line["status"]) == (
        "engine.server",
        "/v1/chat/completions",
        200,
    )
    readiness = [
        httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code
        for port in stack["agents_http"]
    ]
    assert sorted(readiness) == [200, 503]  # the serving agent is ready, the spare is not
    with django_db_blocker.unblock():
        wait_until(
            lambda: (
                sum(r.requests for r in UsageRecord.objects.filter(tenant=stack["tenant"])) >= 1
            ),
            timeout=60,
            message=stack["tail"],
        )
    assert httpx.get(f"{stack['gateway']}/readyz", timeout=5).status_code == 200
    assert httpx.get(f"{stack['web']}/readyz", timeout=5).status_code == 200
    # What Prometheus scrapes in compose (deploy/observability/prometheus.yml) answers.
    scrape_targets(stack["ports"], stack["tail"])


def scrape_targets(ports: dict[str, dict[int, int]], tail) -> None:
    """Every static target of the compose scrape configuration whose service runs here (the
    GPU agent's profile does not) serves Prometheus text on its metrics path."""
    config = yaml.safe_load((REPO_ROOT / "deploy" / "observability" / "prometheus.yml").read_text())
    scraped = set()
    for job in config["scrape_configs"]:
        path = job.get("metrics_path", "/metrics")
        for static in job["static_configs"]:
            for target in static["targets"]:
                service, _, port = target.partition(":")
                if service not in ports:
                    continue
                response = httpx.get(
                    f"http://127.0.0.1:{ports[service][int(port)]}{path}", timeout=10
                )
                assert response.status_code == 200, (target, tail())
                assert list(text_string_to_metric_families(response.text)), target
                scraped.add(service)
    assert scraped == {"web", "gateway", "ingest", "agent1", "agent2"}
