"""The reconciler routes an agent's endpoint only once the engine there proved, on
GET /identity, that it holds the admin secret of the load that started it. Real HTTP
servers stand where the engines would (tests.fleet.support.StubEngine)."""

import socket
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY

from contracts.routing import parse_routing_table, routing_key
from controlplane.audit.models import AuditEvent
from controlplane.fleet.engine_secrets import engine_secrets_payload
from controlplane.fleet.models import Agent, AgentCommand
from controlplane.rollouts import reconciler
from tests.fleet.support import StubEngine


def checks(result: str) -> float:
    return REGISTRY.get_sample_value("fleet_endpoint_checks_total", {"result": result}) or 0.0


def serving_agent(version, endpoint: str, name: str = "gpu-0") -> tuple[Agent, AgentCommand]:
    """A ready agent at `endpoint` (registered), serving `version` since a load an hour ago."""
    now = timezone.now()
    agent = Agent.objects.create(
        name=name,
        host="localhost",
        endpoint=endpoint,
        endpoints=[endpoint],
        state="ready",
        loaded_version=version,
        last_seen=now,
        registered_at=now,
    )
    command = AgentCommand.objects.create(
        command_id=uuid.uuid4().hex,
        agent=agent,
        kind="load",
        version=version,
        status="succeeded",
        finished_at=now - timedelta(hours=1),
    )
    return agent, command


def admin_secret(command: AgentCommand) -> str:
    return engine_secrets_payload(agent_name=command.agent.name, command_id=command.command_id)[
        "admin_secret"
    ]


def routed(redis_client) -> tuple[str, ...]:
    [route] = parse_routing_table(redis_client.get(routing_key("smollm2"))).versions
    return route.endpoints


def refusals(name: str = "gpu-0") -> list[dict]:
    events = AuditEvent.objects.filter(action="agent.endpoint_refused", object_id=name)
    return [event.after for event in events.order_by("id")]


@pytest.fixture
def closed_port() -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield probe.getsockname()[1]  # bound, not listening: connections are refused


def test_an_engine_that_proves_itself_is_routed_and_challenged_once(
    deployment, versions, redis_client
) -> None:
    stable, _ = versions
    with StubEngine(agent="gpu-0") as engine:
        agent, command = serving_agent(stable, engine.url)
        engine.admin_secret = admin_secret(command)
        ok_before = checks("ok")
        for _ in range(3):
            reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert routed(redis_client) == (engine.url,)
        assert engine.requests == ["/identity"]
    assert checks("ok") == ok_before + 1
    agent.refresh_from_db()
    assert (agent.verified_endpoint, agent.verified_load_command_id) == (
        engine.url,
        command.command_id,
    )
    assert refusals() == []


@pytest.mark.parametrize(
    ("answering_agent", "has_secret", "result"),
    [("gpu-0", False, "bad_proof"), ("gpu-9", True, "wrong_agent")],
)
def test_a_server_that_cannot_prove_itself_is_never_routed(
    deployment, versions, redis_client, answering_agent, has_secret, result
) -> None:
    stable, _ = versions
    with StubEngine(agent=answering_agent) as capture:
        agent, command = serving_agent(stable, capture.url)
        if has_secret:  # another agent's engine: its own proof, for its own name
            capture.admin_secret = admin_secret(command)
        before = checks(result)
        for _ in range(2):
            reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
            assert routed(redis_client) == ()
        # Challenged on every pass; no prompt ever reached it.
        assert capture.requests == ["/identity", "/identity"]
        assert checks(result) == before + 2
        # Audited once a minute, however many passes fail.
        assert refusals() == [
            {"endpoint": capture.url, "load_command_id": command.command_id, "reason": result}
        ]
        agent.refresh_from_db()
        assert (agent.verified_endpoint, agent.verified_load_command_id) == ("", "")

        # The engine comes right (its own name, its load's secret): the next pass routes it.
        capture.agent, capture.admin_secret = "gpu-0", admin_secret(command)
        reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert routed(redis_client) == (capture.url,)


def test_an_unreachable_endpoint_is_not_routed(
    deployment, versions, redis_client, closed_port
) -> None:
    stable, _ = versions
    serving_agent(stable, f"http://127.0.0.1:{closed_port}")
    before = checks("unreachable")
    reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
    assert routed(redis_client) == ()
    assert checks("unreachable") == before + 1
    assert [event["reason"] for event in refusals()] == ["unreachable"]


def test_a_new_load_is_challenged_again_with_its_own_secret(
    deployment, versions, redis_client
) -> None:
    stable, _ = versions
    with StubEngine(agent="gpu-0") as engine:
        agent, first = serving_agent(stable, engine.url)
        engine.admin_secret = admin_secret(first)
        reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert routed(redis_client) == (engine.url,)
        # The agent loads the version again: a new engine must hold the new load's secret.
        AgentCommand.objects.create(
            command_id=uuid.uuid4().hex,
            agent=agent,
            kind="load",
            version=stable,
            status="succeeded",
            finished_at=timezone.now(),
        )
        reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert routed(redis_client) == ()
        assert engine.requests == ["/identity", "/identity"]


def test_an_endpoint_the_agent_did_not_register_is_not_challenged_nor_routed(
    deployment, versions, redis_client
) -> None:
    stable, _ = versions
    with StubEngine(agent="gpu-0") as engine:
        agent, command = serving_agent(stable, engine.url)
        engine.admin_secret = admin_secret(command)
        Agent.objects.filter(pk=agent.pk).update(endpoints=["http://127.0.0.1:1"])
        reconciler.reconcile_deployment(deployment_id=deployment.pk, client=redis_client)
        assert routed(redis_client) == ()
        assert engine.requests == []
