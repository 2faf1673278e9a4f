"""Helpers for fleet tests: heartbeats as agents write them, registered agents, signed versions."""

import time
from dataclasses import replace
from typing import Any

from contracts.streams import (
    HEARTBEATS_STREAM,
    AgentState,
    EnergySource,
    Heartbeat,
)
from controlplane.fleet import services
from controlplane.fleet.models import Agent, AgentCommand


def heartbeat(agent: str = "agent-1", seq: int = 1, **changes: Any) -> Heartbeat:
    base = Heartbeat(
        agent=agent,
        seq=seq,
        sent_at=time.time(),
        host="host-a",
        endpoint="http://127.0.0.1:9100",
        state=AgentState.READY,
        version_id=None,
        version_digest="",
        detail="",
        running=1,
        waiting=0,
        kv_cache_usage=0.25,
        interval_s=1.0,
        tokens_per_second=20.0,
        prompt_tokens=10,
        generated_tokens=20,
        requests_ok=2,
        requests_failed=0,
        requests_aborted=0,
        ttft_p50_s=0.05,
        ttft_p95_s=0.08,
        itl_mean_s=0.02,
        itl_p95_s=0.03,
        prompt_tokens_total=10 * seq,
        generated_tokens_total=20 * seq,
        requests_ok_total=2 * seq,
        requests_failed_total=0,
        power_watts=40.0,
        energy_joules=40.0 * seq,
        energy_source=EnergySource.ESTIMATE,
        joules_per_token=2.0,
    )
    return replace(base, **changes)


def publish(redis_client, beat: Heartbeat, entry_id: str = "*") -> str:
    return redis_client.xadd(HEARTBEATS_STREAM, beat.to_fields(), id=entry_id)


def recent_minute() -> float:
    """The start of a whole minute two to three minutes past. Heartbeats dated from it
    fall into known rollup buckets, and ingest takes them: it refuses any dated ahead of
    its clock, or long before their entry's time (so give them `entry_id_at`)."""
    return float((int(time.time()) // 60 - 2) * 60)


def entry_id_at(sent_at: float) -> str:
    """A stream entry id of the moment a heartbeat was sent."""
    return f"{int(sent_at * 1000)}-0"


def register(name: str = "agent-1", *, actor: Any, host: str = "host-a") -> Agent:
    agent, _ = services.agent_register(
        actor=actor,
        name=name,
        host=host,
        endpoint="",
        advertise_host="127.0.0.1",
        ports=[9100, 9101],
        inventory={"kind": "cpu", "accelerator": "Test CPU", "cpu_cores": 2},
        energy_source="estimate",
    )
    return agent


def mark_endpoint_verified(agent: Agent, command: AgentCommand) -> None:
    """Record what the reconciler records once the engine at the agent's endpoint proved
    it holds this load's admin secret (GET /identity): for agents without an engine."""
    services.agent_endpoint_mark_verified(
        agent_id=agent.pk, command_id=command.command_id, endpoint=agent.endpoint
    )
