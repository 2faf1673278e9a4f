"""Heartbeat writes: each agent's latest state and figures, and its 10-second rollups.

Heartbeats arrive at least once and in any order across several ingest processes, so
every write here is idempotent and order-safe: an agent's row only moves forward (by the
heartbeat's send time) and rollup columns merge with min/max.

Per batch, everything is coalesced before the database sees it: one UPDATE row per agent
(its newest heartbeat) and one rollup row per (agent, bucket), written by one statement
each. On PostgreSQL the rows travel as one JSON document (`json_to_recordset`): encoding
it is one call into C, where binding arrays or a VALUES list costs a Python call per
value. Times travel as whole microseconds since the epoch (exact, and JSON has no dates).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from contracts.streams import Heartbeat
from controlplane.fleet.models import ROLLUP_SECONDS, Agent, AgentSample, AgentState
from controlplane.registry.models import ModelVersion

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ONE_MICROSECOND = timedelta(microseconds=1)
ROLLUP_MICROSECONDS = ROLLUP_SECONDS * 1_000_000


def _micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


def _micros_of(moment: datetime) -> int:
    return (_aware(moment) - EPOCH) // ONE_MICROSECOND


def _moment(micros: int) -> datetime:
    return EPOCH + timedelta(microseconds=micros)


def _aware(moment: datetime) -> datetime:
    # A raw SQLite cursor hands back naive datetimes (UTC); PostgreSQL aware ones.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass
class HeartbeatBatchOutcome:
    applied: int = 0
    unknown_agents: set[str] = field(default_factory=set)
    state_events: list[dict[str, Any]] = field(default_factory=list)
    # Each agent's newest heartbeat applied in the batch (the live figures are made from it).
    latest: dict[str, Heartbeat] = field(default_factory=dict)
    # Refused, changing nothing: agent -> the endpoints its heartbeats named that it never
    # registered, and how many heartbeats named each.
    unregistered_endpoints: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def refused(self) -> int:
        return sum(sum(named.values()) for named in self.unregistered_endpoints.values())


@dataclass(slots=True)
class ReceivedHeartbeat:
    heartbeat: Heartbeat
    received_at: datetime  # the Redis entry id's time


@dataclass(slots=True)
class LockedAgent:
    id: int
    state: str
    detail: str
    last_seen_micros: int | None
    last_sent_micros: int | None
    endpoints: frozenset[str]  # registered; a heartbeat may name one of them or none
    verified_endpoint: str


def compact_figures(heartbeat: Heartbeat) -> dict[str, Any]:
    """The few figures the live fleet view shows."""
    return {
        "state": heartbeat.state.value,
        "running": heartbeat.running,
        "waiting": heartbeat.waiting,
        "kv_cache_usage": heartbeat.kv_cache_usage,
        "tokens_per_second": heartbeat.tokens_per_second,
        "power_watts": heartbeat.power_watts,
        "energy_joules": heartbeat.energy_joules,
        "energy_source": heartbeat.energy_source.value,
        "joules_per_token": heartbeat.joules_per_token,
        "ttft_p95_s": heartbeat.ttft_p95_s,
    }


SAMPLE_GREATEST = (
    "running_max",
    "waiting_max",
    "kv_cache_usage_max",
    "tokens_per_second_max",
    "power_watts_max",
    "ttft_p95_max_s",
    "itl_p95_max_s",
    "energy_joules_max",
    "generated_tokens_total_max",
    "prompt_tokens_total_max",
    "requests_ok_total_max",
    "requests_failed_total_max",
    "last_sent_at",
)
SAMPLE_LEAST = (
    "energy_joules_min",
    "generated_tokens_total_min",
    "prompt_tokens_total_min",
    "requests_ok_total_min",
    "requests_failed_total_min",
    "first_sent_at",
)
SAMPLE_LATEST = ("state", "version_id", "energy_source")
SAMPLE_COLUMNS = ("agent_id", "bucket_start", *SAMPLE_GREATEST, *SAMPLE_LEAST, *SAMPLE_LATEST)
SAMPLE_TIMES = frozenset({"bucket_start", "first_sent_at", "last_sent_at"})
# How each column travels in the JSON rows (times as bigint microseconds).
SAMPLE_TYPES = {
    "agent_id": "bigint",
    "bucket_start": "bigint",
    "first_sent_at": "bigint",
    "last_sent_at": "bigint",
    "state": "varchar",
    "version_id": "bigint",
    "energy_source": "varchar",
    "running_max": "integer",
    "waiting_max": "integer",
    **{
        column: "double precision"
        for column in (
            "kv_cache_usage_max",
            "tokens_per_second_max",
            "power_watts_max",
            "ttft_p95_max_s",
            "itl_p95_max_s",
            "energy_joules_min",
            "energy_joules_max",
        )
    },
    **{
        column: "bigint"
        for column in (
            "generated_tokens_total_min",
            "generated_tokens_total_max",
            "prompt_tokens_total_min",
            "prompt_tokens_total_max",
            "requests_ok_total_min",
            "requests_ok_total_max",
            "requests_failed_total_min",
            "requests_failed_total_max",
        )
    },
}


def _sample_row(agent_id: int, heartbeat: Heartbeat, sent_micros: int) -> dict[str, Any]:
    """One heartbeat as a rollup row (keys SAMPLE_COLUMNS, times in microseconds)."""
    return {
        "agent_id": agent_id,
        "bucket_start": sent_micros - sent_micros % ROLLUP_MICROSECONDS,
        "running_max": heartbeat.running,
        "waiting_max": heartbeat.waiting,
        "kv_cache_usage_max": heartbeat.kv_cache_usage,
        "tokens_per_second_max": heartbeat.tokens_per_second,
        "power_watts_max": heartbeat.power_watts,
        "ttft_p95_max_s": heartbeat.ttft_p95_s,
        "itl_p95_max_s": heartbeat.itl_p95_s,
        "energy_joules_max": heartbeat.energy_joules,
        "generated_tokens_total_max": heartbeat.generated_tokens_total,
        "prompt_tokens_total_max": heartbeat.prompt_tokens_total,
        "requests_ok_total_max": heartbeat.requests_ok_total,
        "requests_failed_total_max": heartbeat.requests_failed_total,
        "last_sent_at": sent_micros,
        "energy_joules_min": heartbeat.energy_joules,
        "generated_tokens_total_min": heartbeat.generated_tokens_total,
        "prompt_tokens_total_min": heartbeat.prompt_tokens_total,
        "requests_ok_total_min": heartbeat.requests_ok_total,
        "requests_failed_total_min": heartbeat.requests_failed_total,
        "first_sent_at": sent_micros,
        "state": heartbeat.state.value,
        "version_id": heartbeat.version_id,
        "energy_source": heartbeat.energy_source.value,
    }


def _merge_sample(row: dict[str, Any], other: dict[str, Any]) -> None:
    """Fold `other` (same agent and bucket) into `row` the way the upsert folds a row into
    the table's, so a batch writes each (agent, bucket) once with the same result."""
    is_latest = other["last_sent_at"] >= row["last_sent_at"]
    for name in SAMPLE_GREATEST:
        value = other[name]
        if value is not None and (row[name] is None or value > row[name]):
            row[name] = value
    for name in SAMPLE_LEAST:  # never null
        row[name] = min(row[name], other[name])
    if is_latest:
        for name in SAMPLE_LATEST:
            row[name] = other[name]


def _greatest(column: str, table: str) -> str:
    # COALESCE on both sides: PostgreSQL's GREATEST skips NULLs, SQLite's max() does not.
    function = "GREATEST" if connection.vendor == "postgresql" else "MAX"
    return (
        f"{column} = {function}(COALESCE({table}.{column}, EXCLUDED.{column}), "
        f"COALESCE(EXCLUDED.{column}, {table}.{column}))"
    )


def _least(column: str, table: str) -> str:
    function = "LEAST" if connection.vendor == "postgresql" else "MIN"
    return f"{column} = {function}({table}.{column}, EXCLUDED.{column})"


def _server_binding_cursor() -> Any:
    """A psycopg cursor on Django's connection (same transaction) that sends parameters
    apart from the statement: Django's client-side binding would quote the rows' JSON
    document into the SQL text."""
    import psycopg

    connection.ensure_connection()
    return psycopg.Cursor(connection.connection)


def _from_micros_sql(expression: str) -> str:
    return f"(TIMESTAMPTZ 'epoch' + {expression} * INTERVAL '1 microsecond')"


def _upsert_samples(rows: list[dict[str, Any]]) -> None:
    table = AgentSample._meta.db_table
    latest = [
        f"{column} = CASE WHEN EXCLUDED.last_sent_at >= {table}.last_sent_at "
        f"THEN EXCLUDED.{column} ELSE {table}.{column} END"
        for column in SAMPLE_LATEST
    ]
    # Every expression reads the row as it was before this statement (SQL semantics).
    assignments = ", ".join(
        [
            *latest,
            *(_greatest(column, table) for column in SAMPLE_GREATEST),
            *(_least(column, table) for column in SAMPLE_LEAST),
        ]
    )
    insert = f"INSERT INTO {table} ({', '.join(SAMPLE_COLUMNS)})"
    on_conflict = f"ON CONFLICT (agent_id, bucket_start) DO UPDATE SET {assignments}"
    if connection.vendor == "postgresql":
        record = ", ".join(f"{column} {SAMPLE_TYPES[column]}" for column in SAMPLE_COLUMNS)
        values = ", ".join(
            _from_micros_sql(f"v.{column}") if column in SAMPLE_TIMES else f"v.{column}"
            for column in SAMPLE_COLUMNS
        )
        with _server_binding_cursor() as cursor:
            cursor.execute(
                f"{insert} SELECT {values} FROM json_to_recordset(%s::json) AS v({record}) "  # noqa: S608
                f"{on_conflict}",
                [json.dumps(rows, separators=(",", ":"))],
            )
        return
    placeholders = "(" + ", ".join(["%s"] * len(SAMPLE_COLUMNS)) + ")"
    chunk_rows = 500
    with connection.cursor() as cursor:
        for start in range(0, len(rows), chunk_rows):
            chunk = rows[start : start + chunk_rows]
            # Only constant identifiers are formatted in; every value is a parameter.
            sql = f"{insert} VALUES {', '.join([placeholders] * len(chunk))} {on_conflict}"
            params = [
                _moment(row[column]) if column in SAMPLE_TIMES else row[column]
                for row in chunk
                for column in SAMPLE_COLUMNS
            ]
            cursor.execute(sql, params)


# The agent columns a heartbeat sets, and how each travels in the JSON rows.
AGENT_UPDATE_TYPES = {
    "state": "varchar",
    "detail": "text",
    "engine_error": "varchar",
    "engine_error_message": "varchar",
    "endpoint": "varchar",
    "verified_endpoint": "varchar",
    "loaded_version_id": "bigint",
    "loaded_digest": "varchar",
    "figures": "jsonb",
    "last_seen": "bigint",
    "last_sent_at": "bigint",
    "last_seq": "bigint",
    "updated_at": "bigint",
}
AGENT_UPDATE_TIMES = frozenset({"last_seen", "last_sent_at", "updated_at"})


def _update_agents(rows: list[dict[str, Any]]) -> None:
    """Write the agents' new state (rows keyed by `id` and AGENT_UPDATE_TYPES) in one
    statement on PostgreSQL, one parametrised UPDATE per agent elsewhere (the demo's
    SQLite). The ORM's bulk_update builds CASE expressions that cost seconds per 500 rows."""
    table = Agent._meta.db_table
    if connection.vendor == "postgresql":
        record = ", ".join(f"{column} {kind}" for column, kind in AGENT_UPDATE_TYPES.items())
        assignments = ", ".join(
            f"{column} = "
            + (_from_micros_sql(f"v.{column}") if column in AGENT_UPDATE_TIMES else f"v.{column}")
            for column in AGENT_UPDATE_TYPES
        )
        with _server_binding_cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} AS a SET {assignments} "  # noqa: S608
                f"FROM json_to_recordset(%s::json) AS v(id bigint, {record}) WHERE a.id = v.id",
                [json.dumps(rows, separators=(",", ":"))],
            )
        return

    def parameter(column: str, value: Any) -> Any:
        if column in AGENT_UPDATE_TIMES:
            return _moment(value)
        return json.dumps(value) if column == "figures" else value

    params = [
        [*(parameter(column, row[column]) for column in AGENT_UPDATE_TYPES), row["id"]]
        for row in rows
    ]
    assignments = ", ".join(f"{column} = %s" for column in AGENT_UPDATE_TYPES)
    with connection.cursor() as cursor:
        cursor.executemany(f"UPDATE {table} SET {assignments} WHERE id = %s", params)  # noqa: S608


def _lock_agents(names: set[str]) -> dict[str, LockedAgent]:
    """The named agents, locked in id order (so concurrent ingest processes cannot deadlock),
    with only the columns decided on: this runs for every batch."""
    table = Agent._meta.db_table
    if connection.vendor == "postgresql":
        # Times as microseconds (EXTRACT gives an exact numeric): loading timestamps
        # through Django's time-zone aware loader costs more than the query.
        times = ", ".join(
            f"(EXTRACT(EPOCH FROM {column}) * 1000000)::bigint"
            for column in ("last_seen", "last_sent_at")
        )
        listed = "SELECT json_array_elements_text(%s::json)"
        for_update = " FOR UPDATE"
    else:  # SQLite: no row locks (writes are serialised by the database lock instead)
        times, listed, for_update = "last_seen, last_sent_at", "SELECT value FROM json_each(%s)", ""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, name, state, detail, {times}, endpoints, verified_endpoint FROM {table} "  # noqa: S608
            f"WHERE name IN ({listed}) ORDER BY id{for_update}",
            [json.dumps(sorted(names))],
        )
        rows = cursor.fetchall()
    return {
        name: LockedAgent(
            id=agent_id,
            state=state,
            detail=detail,
            last_seen_micros=_as_micros(last_seen),
            last_sent_micros=_as_micros(last_sent_at),
            endpoints=frozenset(json.loads(endpoints) if isinstance(endpoints, str) else endpoints),
            verified_endpoint=verified,
        )
        for agent_id, name, state, detail, last_seen, last_sent_at, endpoints, verified in rows
    }


def _as_micros(value: int | datetime | None) -> int | None:
    return value if value is None or isinstance(value, int) else _micros_of(value)


@transaction.atomic
def heartbeats_apply(
    *, received: Sequence[ReceivedHeartbeat], now: datetime | None = None
) -> HeartbeatBatchOutcome:
    """Apply a batch of heartbeats: each agent's latest state and figures, and the rollups.

    Idempotent and order-safe (see the module docstring), and the same whether heartbeats
    come in one batch or several. Heartbeats of agents that never registered are skipped
    and reported in `unknown_agents`; a heartbeat naming an endpoint its agent did not
    register is refused, changing nothing, and reported in `unregistered_endpoints`.
    """
    now = now or timezone.now()
    stale_before = now - timedelta(seconds=settings.FLEET_LOST_AFTER_S)
    outcome = HeartbeatBatchOutcome()
    agents = _lock_agents({item.heartbeat.agent for item in received})
    samples: dict[tuple[int, int], dict[str, Any]] = {}
    latest: dict[str, tuple[int, ReceivedHeartbeat]] = {}
    for item in received:
        heartbeat = item.heartbeat
        agent = agents.get(heartbeat.agent)
        if agent is None:
            outcome.unknown_agents.add(heartbeat.agent)
            continue
        if heartbeat.endpoint and heartbeat.endpoint not in agent.endpoints:
            named = outcome.unregistered_endpoints.setdefault(heartbeat.agent, {})
            named[heartbeat.endpoint] = named.get(heartbeat.endpoint, 0) + 1
            continue
        outcome.applied += 1
        sent_micros = _micros(heartbeat.sent_at)
        row = _sample_row(agent.id, heartbeat, sent_micros)
        key = (agent.id, row["bucket_start"])
        merged = samples.get(key)
        if merged is None:
            samples[key] = row
        else:
            _merge_sample(merged, row)
        best = latest.get(heartbeat.agent)
        if best is None or sent_micros > best[0]:
            latest[heartbeat.agent] = (sent_micros, item)
    version_ids = {
        item.heartbeat.version_id for _, item in latest.values() if item.heartbeat.version_id
    }
    existing_versions = (
        set(ModelVersion.objects.filter(pk__in=version_ids).values_list("pk", flat=True))
        if version_ids
        else set()
    )
    now_micros = _micros_of(now)
    updates: list[dict[str, Any]] = []
    for name, (sent_micros, item) in latest.items():
        agent, heartbeat = agents[name], item.heartbeat
        if agent.last_sent_micros is not None and sent_micros <= agent.last_sent_micros:
            continue  # an older heartbeat than the one applied already
        received_at = min(item.received_at, now)
        state, detail = heartbeat.state.value, heartbeat.detail
        engine_error = heartbeat.engine_error
        if agent.state == AgentState.LOST and received_at < stale_before:
            state, detail = agent.state, agent.detail  # a late heartbeat does not revive it
        received_micros = _micros_of(received_at)
        last_seen = (
            received_micros
            if agent.last_seen_micros is None
            else max(agent.last_seen_micros, received_micros)
        )
        version_id = heartbeat.version_id if heartbeat.version_id in existing_versions else None
        # An engine proved itself only while it keeps serving there: once the agent reports
        # anything else (it failed, restarted, moved) the next one is challenged afresh.
        is_same_engine = state == AgentState.READY and heartbeat.endpoint == agent.verified_endpoint
        updates.append(
            {
                "id": agent.id,
                "state": state,
                "detail": detail,
                "engine_error": engine_error.reason.value if engine_error else "",
                "engine_error_message": engine_error.message if engine_error else "",
                "endpoint": heartbeat.endpoint,
                "verified_endpoint": agent.verified_endpoint if is_same_engine else "",
                "loaded_version_id": version_id,
                "loaded_digest": heartbeat.version_digest,
                "figures": heartbeat.figures(),
                "last_seen": last_seen,
                "last_sent_at": sent_micros,
                "last_seq": heartbeat.seq,
                "updated_at": now_micros,
            }
        )
        outcome.latest[name] = heartbeat
        if state != agent.state:
            outcome.state_events.append(
                {
                    "agent": name,
                    "state": state,
                    "detail": detail,
                    "engine_error": engine_error.reason.value if engine_error else "",
                    "endpoint": heartbeat.endpoint,
                    "loaded_version_id": version_id,
                    "last_seen": _moment(last_seen).isoformat(),
                    "previous": agent.state,
                }
            )
    if updates:
        _update_agents(updates)
    if samples:
        _upsert_samples([samples[key] for key in sorted(samples)])
    return outcome


# Lost agents and retention.
