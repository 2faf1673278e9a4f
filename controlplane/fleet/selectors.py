"""Reads of the fleet: agents with their latest figures, one agent's history, commands."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import QuerySet

from controlplane.core.errors import NotFound
from controlplane.fleet.models import ROLLUP_SECONDS, Agent, AgentCommand, AgentSample

MAX_HISTORY_BUCKETS = 8_640  # one day of 10-second buckets


def agent_list() -> QuerySet[Agent]:
    return Agent.objects.select_related("loaded_version", "loaded_version__model").order_by("name")


def agent_get(*, name: str) -> Agent:
    agent = agent_list().filter(name=name).first()
    if agent is None:
        raise NotFound("No such agent.")
    return agent


def agent_command_list(*, agent: Agent) -> QuerySet[AgentCommand]:
    return AgentCommand.objects.filter(agent=agent).select_related("agent", "issued_by")


def command_get(*, command_id: str) -> AgentCommand:
    command = (
        AgentCommand.objects.select_related("agent", "issued_by")
        .filter(command_id=command_id)
        .first()
    )
    if command is None:
        raise NotFound("No such command.")
    return command


def _delta(current_max: float, current_min: float, previous_max: float | None) -> float:
    """A bucket's increase of a cumulative total.

    Measured from the previous bucket's last value when that bucket is adjacent and the
    total did not reset (an agent restart), else from this bucket's first value.
    """
    if previous_max is not None and previous_max <= current_max:
        return current_max - previous_max
    return max(0.0, current_max - current_min)


def agent_history(*, agent: Agent, since: datetime, until: datetime) -> list[dict[str, Any]]:
    """One entry per 10-second bucket in [since, until), oldest first, with sums derived from
    the cumulative totals (energy, tokens, requests) and the bucket's peaks."""
    if until - since > timedelta(seconds=ROLLUP_SECONDS * MAX_HISTORY_BUCKETS):
        since = until - timedelta(seconds=ROLLUP_SECONDS * MAX_HISTORY_BUCKETS)
    # One bucket before `since`, so that the first bucket's sums have a starting point.
    rows = list(
        AgentSample.objects.filter(
            agent=agent,
            bucket_start__gte=since - timedelta(seconds=ROLLUP_SECONDS),
            bucket_start__lt=until,
        ).order_by("bucket_start")
    )
    history = []
    previous: AgentSample | None = None
    for row in rows:
        adjacent = previous is not None and row.bucket_start - previous.bucket_start == timedelta(
            seconds=ROLLUP_SECONDS
        )

        def before(column: str, adjacent: bool = adjacent, previous: Any = previous) -> Any:
            return getattr(previous, column) if adjacent else None

        energy = _delta(row.energy_joules_max, row.energy_joules_min, before("energy_joules_max"))
        tokens = int(
            _delta(
                row.generated_tokens_total_max,
                row.generated_tokens_total_min,
                before("generated_tokens_total_max"),
            )
        )
        prompt_tokens = int(
            _delta(
                row.prompt_tokens_total_max,
                row.prompt_tokens_total_min,
                before("prompt_tokens_total_max"),
            )
        )
        requests_ok = int(
            _delta(
                row.requests_ok_total_max,
                row.requests_ok_total_min,
                before("requests_ok_total_max"),
            )
        )
        requests_failed = int(
            _delta(
                row.requests_failed_total_max,
                row.requests_failed_total_min,
                before("requests_failed_total_max"),
            )
        )
        previous = row
        if row.bucket_start < since:
            continue
        finished = requests_ok + requests_failed
        history.append(
            {
                "bucket_start": row.bucket_start,
                "state": row.state,
                "version_id": row.version_id,
                "energy_source": row.energy_source,
                "energy_joules": energy,
                "generated_tokens": tokens,
                "prompt_tokens": prompt_tokens,
                "tokens_per_second": tokens / ROLLUP_SECONDS,
                "joules_per_token": energy / tokens if tokens else None,
                "average_power_watts": energy / ROLLUP_SECONDS,
                "requests_ok": requests_ok,
                "requests_failed": requests_failed,
                "error_rate": requests_failed / finished if finished else None,
                "running_max": row.running_max,
                "waiting_max": row.waiting_max,
                "kv_cache_usage_max": row.kv_cache_usage_max,
                "power_watts_max": row.power_watts_max,
                "ttft_p95_max_s": row.ttft_p95_max_s,
                "itl_p95_max_s": row.itl_p95_max_s,
            }
        )
    return history
