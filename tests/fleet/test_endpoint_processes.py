"""An agent's endpoint through real processes: a real agent and its engine (SmolLM2), a
real ingest process, the control plane over HTTP, PostgreSQL and Redis; the reconciler runs
here. A capture server (a real HTTP server answering the OpenAI API) never gets routed."""

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings

from contracts.routing import parse_routing_table, routing_key
from contracts.streams import AgentState
from controlplane.audit.models import AuditEvent
from controlplane.rollouts import deployments, reconciler
from tests.agent.test_agent_processes import (
    ENGINE_READY_S,
    MODEL_FILE,
    Fleet,
    agent_args,
    agent_row,
    command_row,
    find_agent,
    free_port_pair,
    ingest_args,
    is_final,
    is_listening,
    logs,
    running,
)
from tests.conftest import wait_until
from tests.fleet.support import StubEngine, heartbeat, publish

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with override_settings(ARTIFACT_ROOT=tmp_path / "store"):
        yield Fleet(tmp_path)


def routed(redis_client) -> tuple[str, ...]:
    [route] = parse_routing_table(redis_client.get(routing_key("smol"))).versions
    return route.endpoints


def audits(action: str) -> list[dict]:
    events = AuditEvent.objects.filter(action=action, object_id="agent-a").order_by("id")
    return [event.after for event in events]


def test_only_the_engine_the_agent_started_is_routed(
    fleet, live_server, redis_client, tmp_path
) -> None:
    stable = fleet.version("f32", MODEL_FILE)
    deployment = deployments.deployment_create(actor=None, name="smol", stable_version=stable)
    port = free_port_pair()
    endpoint, other = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    ingest_log, agent_log = tmp_path / "ingest.log", tmp_path / "agent.log"
    with (
        running(ingest_args(), ingest_log),
        running(
            agent_args("agent-a", port, settings.REDIS_URL, live_server.url, fleet), agent_log
        ) as agent,
        StubEngine(agent="agent-a") as capture,
    ):
        wait_until(
            lambda: (row := find_agent("agent-a")) is not None and row.last_seq > 0,
            timeout=60,
            message=logs(agent_log, ingest_log),
        )
        # It registered its advertise host and both engine ports: these are its endpoints.
        assert agent_row("agent-a").endpoints == [endpoint, other]
        load = fleet.command("agent-a", kind="load", version_id=stable.pk)
        wait_until(
            lambda: is_final(load["command_id"]),
            timeout=ENGINE_READY_S + 30,
            message=logs(agent_log),
        )
        assert command_row(load["command_id"]).status == "succeeded", logs(agent_log)
        wait_until(
            lambda: (
                (row := agent_row("agent-a")).loaded_version_id == stable.pk
                and row.state == "ready"
            ),
            timeout=10,
        )

        # The engine the agent started answers the challenge: routed, and remembered.
        reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert routed(redis_client) == (endpoint,)
        row = agent_row("agent-a")
        assert (row.verified_endpoint, row.verified_load_command_id) == (
            endpoint,
            load["command_id"],
        )

        # A forged heartbeat naming the capture server is refused: nothing changes.
        forged = heartbeat(
            "agent-a", seq=10**9, sent_at=time.time(), endpoint=capture.url,
            version_id=stable.pk, version_digest=stable.artifact_id,
        )  # fmt: skip
        publish(redis_client, forged)
        wait_until(
            lambda: audits("agent.heartbeat_refused") != [],
            timeout=10,
            message=logs(ingest_log),
        )
        assert audits("agent.heartbeat_refused") == [
            {"refused": 1, "reason": "unregistered_endpoint", "endpoints": {capture.url: 1}}
        ]
        assert agent_row("agent-a").endpoint == endpoint
        reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert routed(redis_client) == (endpoint,)

        # The agent and its engine are gone; a server without the admin secret takes the
        # engine's registered port, and forged heartbeats say the agent serves there again.
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=10)
        wait_until(lambda: not is_listening(port), timeout=30, message="engine outlived agent")
        with StubEngine(agent="agent-a", port=port) as impostor:
            sent_at = time.time()
            for seq, state in ((10**9 + 1, AgentState.FAILED), (10**9 + 2, AgentState.READY)):
                publish(
                    redis_client,
                    heartbeat(
                        "agent-a", seq=seq, sent_at=sent_at + seq - 10**9, endpoint=endpoint,
                        state=state, version_id=stable.pk, version_digest=stable.artifact_id,
                    ),
                )  # fmt: skip
            wait_until(
                lambda: (
                    (row := agent_row("agent-a")).last_seq == 10**9 + 2 and row.state == "ready"
                ),
                timeout=10,
                message=logs(ingest_log),
            )
            reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
            assert routed(redis_client) == ()
            assert [event["reason"] for event in audits("agent.endpoint_refused")] == ["bad_proof"]
            # Challenged, never sent a prompt.
            assert impostor.requests == ["/identity"]
        assert capture.requests == []
