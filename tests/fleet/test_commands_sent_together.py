"""Commands sent together (`agent_commands_send`, as a reconcile pass sends a deployment's
loads): each recorded, audited, signed for its own agent and queued on its own stream, in
one transaction whose statements do not grow with the number of commands."""

import pytest
import redis
from django.db import connection
from django.test.utils import CaptureQueriesContext
from redis.backoff import NoBackoff
from redis.retry import Retry

from contracts.commands import command_signature_verify, commands_stream, parse_command
from controlplane.audit.models import AuditEvent
from controlplane.core.errors import Unavailable
from controlplane.fleet.command_signing import command_public_key_b64
from controlplane.fleet.models import Agent, AgentCommand
from controlplane.fleet.services import CommandOrder, agent_commands_send
from tests.fleet.support import register

pytestmark = pytest.mark.django_db


@pytest.fixture
def agents(users) -> list[Agent]:
    return [register(f"agent-{index}") for index in (1, 2, 3)]


def load(agent: str, version_id: int | None) -> CommandOrder:
    return CommandOrder(agent_name=agent, kind="load", version_id=version_id, reason="place")


def test_each_command_is_recorded_audited_signed_for_its_agent_and_queued_on_its_stream(
    agents, signed_version, redis_client
) -> None:
    orders = [
        load("agent-1", signed_version.pk),
        load("agent-2", signed_version.pk),
        CommandOrder(agent_name="agent-3", kind="drain", version_id=signed_version.pk),
    ]
    sent = agent_commands_send(actor=None, orders=orders)
    assert sent.refused == []
    assert [(c.agent.name, c.kind) for c in sent.commands] == [
        ("agent-1", "load"),
        ("agent-2", "load"),
        ("agent-3", "drain"),
    ]
    for command in sent.commands:
        [(entry_id, fields)] = redis_client.xrange(commands_stream(command.agent.name))
        wire = parse_command(fields)
        assert wire.command_id == command.command_id
        command_signature_verify(
            wire, agent=command.agent.name, public_key_b64=command_public_key_b64()
        )
        stored = AgentCommand.objects.get(command_id=command.command_id)
        assert (stored.stream_entry_id, stored.version_id) == (entry_id, signed_version.pk)
        event = AuditEvent.objects.get(after__command_id=command.command_id)
        assert (event.action, event.object_id) == (
            f"agent.command.{command.kind}",
            stored.agent.name,
        )


def test_a_refused_order_comes_back_with_its_reason_and_the_others_are_sent(
    agents, signed_version, make_version, redis_client
) -> None:
    Agent.objects.filter(name="agent-2").update(state="lost")
    unsigned = make_version("v2")
    orders = [
        load("agent-1", signed_version.pk),
        load("agent-2", signed_version.pk),
        load("agent-9", signed_version.pk),
        load("agent-3", unsigned.pk),
        CommandOrder(agent_name="agent-3", kind="reboot"),
        load("agent-3", None),
    ]
    sent = agent_commands_send(actor=None, orders=orders)
    assert [c.agent.name for c in sent.commands] == ["agent-1"]
    assert [(order.agent_name, why.code) for order, why in sent.refused] == [
        ("agent-2", "agent_lost"),
        ("agent-9", "not_found"),
        ("agent-3", "version_not_loadable"),
        ("agent-3", "invalid"),
        ("agent-3", "invalid"),
    ]
    assert AgentCommand.objects.count() == 1
    assert AuditEvent.objects.filter(action__startswith="agent.command.").count() == 1
    assert [redis_client.xlen(commands_stream(f"agent-{i}")) for i in (1, 2, 3)] == [1, 0, 0]


def test_when_redis_refuses_the_entries_nothing_is_recorded(agents, signed_version) -> None:
    unreachable = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    orders = [load("agent-1", signed_version.pk), load("agent-2", signed_version.pk)]
    with pytest.raises(Unavailable) as refused:
        agent_commands_send(actor=None, orders=orders, redis_client=unreachable)
    assert refused.value.code == "redis_unavailable"
    assert AgentCommand.objects.count() == 0
    assert not AuditEvent.objects.filter(action__startswith="agent.command.").exists()


def test_the_statements_do_not_grow_with_the_number_of_commands(
    agents, signed_version, redis_client
) -> None:
    def statements(names: list[str]) -> int:
        with CaptureQueriesContext(connection) as queries:
            sent = agent_commands_send(
                actor=None, orders=[load(name, signed_version.pk) for name in names]
            )
        assert len(sent.commands) == len(names)
        return len(queries)

    assert statements(["agent-1"]) == statements(["agent-1", "agent-2", "agent-3"])
