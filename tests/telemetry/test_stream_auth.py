"""Ingest takes only what an agent signed with its own stream key, and counts and audits
the commands agents refused (real Redis and PostgreSQL, the real stream consumer)."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from contracts.agent_mac import agent_fields_sign
from contracts.commands import (
    RESULTS_STREAM,
    CommandKind,
    CommandRefused,
    CommandResult,
    CommandStatus,
    command_signature_verify,
    commands_stream,
    parse_command,
)
from contracts.streams import HEARTBEATS_STREAM, AgentState
from controlplane.audit.models import AuditEvent
from controlplane.fleet import services
from controlplane.fleet.command_signing import command_public_key_b64
from controlplane.fleet.models import Agent, AgentCommand
from controlplane.fleet.refusals import agent_refusals_audit
from controlplane.fleet.stream_keys import agent_stream_key
from tests.fleet.support import heartbeat, publish, register, signed_fields
from tests.telemetry.test_heartbeats import drain, make_ingestor, metric, pending

pytestmark = pytest.mark.django_db


def row_of(name: str) -> tuple:
    agent = Agent.objects.get(name=name)
    return (
        agent.state,
        agent.detail,
        agent.last_seen,
        agent.last_sent_at,
        agent.last_seq,
        agent.figures,
    )


def audits(action: str) -> list[tuple[str, dict]]:
    return list(
        AuditEvent.objects.filter(action=action)
        .order_by("id")
        .values_list("object_id", "after__by_reason")
    )


def result(command_id: str, status: CommandStatus, detail: str, agent: str = "agent-a"):
    return CommandResult(
        command_id=command_id,
        agent=agent,
        kind="faults",
        status=status,
        detail=detail,
        finished_at=time.time(),
    )


def test_a_heartbeat_not_signed_by_its_agent_is_refused_and_changes_nothing(
    redis_client, users
) -> None:
    register("agent-a")
    register("agent-b")
    ingestor = make_ingestor(redis_client)
    publish(redis_client, heartbeat(agent="agent-b", seq=1))
    drain(ingestor)
    before = row_of("agent-b")
    bad, missing = (
        metric("fleet_heartbeats_refused_total", reason=reason)
        for reason in ("bad_mac", "missing_mac")
    )
    forged = heartbeat(agent="agent-b", seq=2, state=AgentState.FAILED, detail="forged")
    # Written with agent-a's key, then with no mac at all.
    redis_client.xadd(
        HEARTBEATS_STREAM,
        agent_fields_sign(HEARTBEATS_STREAM, forged.to_fields(), agent_stream_key("agent-a")),
    )
    redis_client.xadd(HEARTBEATS_STREAM, forged.to_fields())
    drain(ingestor)
    assert metric("fleet_heartbeats_refused_total", reason="bad_mac") == bad + 1
    assert metric("fleet_heartbeats_refused_total", reason="missing_mac") == missing + 1
    assert audits("agent.heartbeat.refused") == [("agent-b", {"bad_mac": 1})]
    assert row_of("agent-b") == before
    assert pending(redis_client) == 0


def test_a_result_not_signed_by_its_agent_is_refused_and_changes_nothing(
    redis_client, users
) -> None:
    register("agent-a")
    agent_b = register("agent-b")
    command = AgentCommand.objects.create(command_id="b" * 32, agent=agent_b, kind="drain")
    ingestor = make_ingestor(redis_client)
    before = metric("fleet_command_results_refused_total", reason="bad_mac")
    forged = result(command.command_id, CommandStatus.SUCCEEDED, "drained", agent="agent-b")
    redis_client.xadd(
        RESULTS_STREAM,
        agent_fields_sign(RESULTS_STREAM, forged.to_fields(), agent_stream_key("agent-a")),
    )
    drain(ingestor)
    assert metric("fleet_command_results_refused_total", reason="bad_mac") == before + 1
    assert audits("agent.result.refused") == [("agent-b", {"bad_mac": 1})]
    command.refresh_from_db()
    assert (command.status, command.detail, command.finished_at) == ("pending", "", None)
    assert pending(redis_client, RESULTS_STREAM) == 0


def test_refused_commands_are_counted_and_audited_at_most_once_a_minute(
    redis_client, users
) -> None:
    agent = register("agent-a")
    command = AgentCommand.objects.create(command_id="c" * 32, agent=agent, kind="faults")
    ingestor = make_ingestor(redis_client)
    reasons = ("expired", "bad_command_signature", "unknown_command", "unsigned_command")
    before = {reason: metric("fleet_commands_refused_total", reason=reason) for reason in reasons}
    for entry in (
        result(command.command_id, CommandStatus.REJECTED, "expired: issued 400s ago"),
        # Refusals of forged commands (ids the control plane never sent) ...
        result("d" * 32, CommandStatus.REJECTED, "bad_command_signature: not ours"),
        # ... and a result for a command never sent.
        result("e" * 32, CommandStatus.SUCCEEDED, "faults set"),
    ):
        redis_client.xadd(RESULTS_STREAM, signed_fields(entry))
    drain(ingestor)
    command.refresh_from_db()
    assert (command.status, command.detail) == ("rejected", "expired: issued 400s ago")
    expected = {"expired": 1, "bad_command_signature": 1, "unknown_command": 1}
    assert audits("agent.command.refused") == [("agent-a", expected)]

    # Within the minute: counted, not audited again.
    unsigned = result("f" * 32, CommandStatus.REJECTED, "unsigned_command: no signature")
    redis_client.xadd(RESULTS_STREAM, signed_fields(unsigned))
    drain(ingestor)
    assert {
        reason: metric("fleet_commands_refused_total", reason=reason) for reason in reasons
    } == {reason: before[reason] + 1 for reason in reasons}
    assert audits("agent.command.refused") == [("agent-a", expected)]
    # A minute on, the next refusal is audited.
    assert agent_refusals_audit(
        action="agent.command.refused",
        agent_name="agent-a",
        by_reason={"unsigned_command": 1},
        detail="",
        now=timezone.now() + timedelta(seconds=61),
    )
    assert len(audits("agent.command.refused")) == 2


def test_commands_are_signed_for_their_agent_only(redis_client, users) -> None:
    register("agent-a")
    sent = services.agent_command_send(
        actor=None,
        agent_name="agent-a",
        kind="faults",
        latency_ms_per_token=5,
        error_rate=0.0,
        redis_client=redis_client,
    )
    [(_, fields)] = redis_client.xrange(commands_stream("agent-a"))
    command = parse_command(fields)
    assert (command.command_id, command.kind) == (sent.command_id, CommandKind.FAULTS)
    command_signature_verify(command, agent="agent-a", public_key_b64=command_public_key_b64())
    with pytest.raises(CommandRefused) as refused:
        command_signature_verify(command, agent="agent-b", public_key_b64=command_public_key_b64())
    assert refused.value.reason == "bad_command_signature"
    tampered = parse_command({**fields, "payload": '{"error_rate":1.0,"latency_ms_per_token":5}'})
    with pytest.raises(CommandRefused) as refused:
        command_signature_verify(tampered, agent="agent-a", public_key_b64=command_public_key_b64())
    assert refused.value.reason == "bad_command_signature"
