"""Helpers for fleet tests: heartbeats as agents write them, registered agents, signed versions."""

import time
from dataclasses import replace
from typing import Any

from contracts.streams import (
    HEARTBEATS_STREAM,
    RESULTS_STREAM,
    AgentState,
    CommandResult,
    EnergySource,
    Heartbeat,
    agent_fields_sign,
)
from controlplane.fleet import enrolment, services
from controlplane.fleet.models import Agent
from controlplane.fleet.stream_keys import agent_stream_key


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


def signed_fields(entry: Heartbeat | CommandResult) -> dict[str, str]:
    """The entry's stream fields with the `mac` its agent gives them (its stream key)."""
    stream = HEARTBEATS_STREAM if isinstance(entry, Heartbeat) else RESULTS_STREAM
    return agent_fields_sign(stream, entry.to_fields(), agent_stream_key(entry.agent))


def publish(redis_client, beat: Heartbeat, entry_id: str = "*") -> str:
    return redis_client.xadd(HEARTBEATS_STREAM, signed_fields(beat), id=entry_id)


def recent_minute() -> float:
    """The start of a whole minute two to three minutes past. Heartbeats dated from it
    fall into known rollup buckets, and ingest takes them: it refuses any dated ahead of
    its clock, or long before their entry's time (so give them `entry_id_at`)."""
    return float((int(time.time()) // 60 - 2) * 60)


def entry_id_at(sent_at: float) -> str:
    """A stream entry id of the moment a heartbeat was sent."""
    return f"{int(sent_at * 1000)}-0"


def enrol(name: str = "agent-1") -> dict[str, Any]:
    """Enrol `name` as an admin would and the agent does: its credentials (and Redis user)."""
    created = enrolment.agent_enrolment_create(actor=None, agent_name=name)
    return enrolment.agent_enrol(token=created.raw_token)


def register(name: str = "agent-1", *, host: str = "host-a") -> Agent:
    """An enrolled agent registered with its own account, as the agent process does."""
    row = Agent.objects.filter(name=name, enrolled_at__isnull=False).first()
    if row is None:
        enrol(name)
        row = Agent.objects.get(name=name)
    agent, _ = services.agent_register(
        actor=row.account,
        name=name,
        host=host,
        endpoint="",
        ports=[9100, 9101],
        inventory={"kind": "cpu", "accelerator": "Test CPU", "cpu_cores": 2},
        energy_source="estimate",
    )
    return agent
