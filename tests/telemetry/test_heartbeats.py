"""Heartbeats and command results through the real stream consumer into PostgreSQL."""

import json
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone
from prometheus_client import REGISTRY

from contracts.commands import RESULTS_STREAM, CommandResult, CommandStatus
from contracts.streams import (
    HEARTBEATS_STREAM,
    INGEST_GROUP,
    AgentState,
    EngineError,
    EngineFailure,
)
from controlplane.audit.models import AuditEvent
from controlplane.core.redis_clients import stream_reader
from controlplane.fleet import selectors, services
from controlplane.fleet.models import Agent, AgentCommand, AgentSample
from controlplane.telemetry.ingest import FleetTicker, HeartbeatHandler, LiveFleet, stream_handlers
from controlplane.telemetry.streams import StreamIngestor
from tests.fleet.support import (
    entry_id_at,
    heartbeat,
    publish,
    recent_minute,
    register,
    signed_fields,
)

pytestmark = pytest.mark.django_db


def make_ingestor(redis_client, consumer: str = "c1", **options) -> StreamIngestor:
    ingestor = StreamIngestor(
        client=redis_client,
        group=INGEST_GROUP,
        consumer=consumer,
        handlers=stream_handlers(),
        block_ms=10,
        **options,
    )
    ingestor.ensure_groups()
    return ingestor


def drain(ingestor: StreamIngestor) -> None:
    """Run until a read finds nothing (the first read is of the consumer's own pending)."""
    ingestor.run_once()
    while ingestor.run_once():
        pass


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def pending(redis_client, stream: str = HEARTBEATS_STREAM) -> int:
    return redis_client.xpending(stream, INGEST_GROUP)["pending"]


def test_heartbeat_updates_the_agent_and_its_rollup(redis_client, users) -> None:
    register()
    ingestor = make_ingestor(redis_client)
    sent_at = recent_minute() + 3
    publish(redis_client, heartbeat(seq=1, sent_at=sent_at), entry_id_at(sent_at))
    publish(
        redis_client,
        heartbeat(seq=2, sent_at=sent_at + 1, running=3, kv_cache_usage=0.5, ttft_p95_s=None),
        entry_id_at(sent_at + 1),
    )
    drain(ingestor)

    agent = Agent.objects.get(name="agent-1")
    assert agent.state == AgentState.READY
    assert agent.endpoint == "http://127.0.0.1:9100"
    assert agent.last_seq == 2
    assert agent.figures["running"] == 3
    assert agent.figures["energy_joules"] == 80.0
    assert agent.figures["energy_source"] == "estimate"
    assert agent.last_sent_at == datetime.fromtimestamp(sent_at + 1, tz=UTC)
    sample = AgentSample.objects.get(agent=agent)
    assert sample.bucket_start == datetime.fromtimestamp(sent_at - 3, tz=UTC)
    assert (sample.running_max, sample.kv_cache_usage_max) == (3, 0.5)
    assert sample.ttft_p95_max_s == 0.08  # a missing value does not erase a peak
    assert (sample.energy_joules_min, sample.energy_joules_max) == (40.0, 80.0)
    assert (sample.generated_tokens_total_min, sample.generated_tokens_total_max) == (20, 40)
    assert pending(redis_client) == 0


def test_an_engine_error_reaches_the_agent_row_the_api_and_the_fleet_page(
    redis_client, client_for
) -> None:
    register()
    ingestor = make_ingestor(redis_client)
    sent_at = recent_minute()
    failure = EngineError(EngineFailure.KILLED, "killed by SIGKILL: CUDA out of memory")
    publish(
        redis_client,
        heartbeat(
            seq=1,
            sent_at=sent_at,
            endpoint="",
            state=AgentState.FAILED,
            detail="engine exited unexpectedly: killed by SIGKILL",
            engine_error=failure,
        ),
        entry_id_at(sent_at),
    )
    drain(ingestor)
    agent = Agent.objects.get(name="agent-1")
    assert (agent.engine_error, agent.engine_error_message) == ("killed", failure.message)
    client = client_for("viewer")
    [row] = client.get("/api/v1/fleet/agents/").json()["results"]
    assert row["engine_error"] == {"reason": "killed", "message": failure.message}
    page = client.get("/fleet/").content.decode()
    assert f'title="{failure.message}">engine killed</span>' in page

    # An engine serves again: the agent stops reporting it, and so does the control plane.
    publish(redis_client, heartbeat(seq=2, sent_at=sent_at + 1), entry_id_at(sent_at + 1))
    drain(ingestor)
    agent.refresh_from_db()
    assert (agent.engine_error, agent.engine_error_message) == ("", "")
    [row] = client.get("/api/v1/fleet/agents/").json()["results"]
    assert row["engine_error"] is None
    assert 'data-field="engine_error"' not in client.get("/fleet/").content.decode()


def test_redelivered_and_reordered_heartbeats_change_nothing(redis_client, users) -> None:
    agent = register()
    handler = stream_handlers()[HEARTBEATS_STREAM]
    sent_at = recent_minute()
    older = handler.parse(
        entry_id_at(sent_at), signed_fields(heartbeat(seq=1, sent_at=sent_at, running=5))
    )
    newer = handler.parse(
        entry_id_at(sent_at + 1),
        signed_fields(heartbeat(seq=2, sent_at=sent_at + 1, state=AgentState.DRAINING, running=1)),
    )
    handler.apply([newer])
    handler.apply([older])  # late: must not roll the agent back
    handler.apply([older, newer])  # delivered again
    agent.refresh_from_db()
    assert agent.state == AgentState.DRAINING
    assert agent.last_seq == 2
    sample = AgentSample.objects.get(agent=agent)
    assert sample.state == AgentState.DRAINING  # latest by send time
    assert sample.running_max == 5
    assert (sample.energy_joules_min, sample.energy_joules_max) == (40.0, 80.0)
    assert sample.first_sent_at == datetime.fromtimestamp(sent_at, tz=UTC)


def test_malformed_entries_are_counted_and_dropped_without_stopping_ingest(
    redis_client, users
) -> None:
    register()
    ingestor = make_ingestor(redis_client)
    before = metric("ingest_malformed_entries_total", stream=HEARTBEATS_STREAM)
    good = heartbeat(seq=7)
    redis_client.xadd(HEARTBEATS_STREAM, {"v": "1", "agent": "agent-1"})  # fields missing
    figures = json.loads(good.to_fields()["figures"])
    too_full = json.dumps({**figures, "kv_cache_usage": 1.5})
    redis_client.xadd(HEARTBEATS_STREAM, {**good.to_fields(), "figures": too_full})
    redis_client.xadd(HEARTBEATS_STREAM, {**good.to_fields(), "figures": "{not json"})
    redis_client.xadd(HEARTBEATS_STREAM, {**good.to_fields(), "state": "sleeping"})
    redis_client.xadd(HEARTBEATS_STREAM, {**good.to_fields(), "v": "9"})
    publish(redis_client, good)
    drain(ingestor)
    assert metric("ingest_malformed_entries_total", stream=HEARTBEATS_STREAM) == before + 5
    assert Agent.objects.get(name="agent-1").last_seq == 7
    assert pending(redis_client) == 0


def test_heartbeats_of_unregistered_agents_are_dropped(redis_client, users) -> None:
    ingestor = make_ingestor(redis_client)
    before = metric("fleet_heartbeats_unknown_agent_total")
    publish(redis_client, heartbeat(agent="stranger"))
    drain(ingestor)
    assert not Agent.objects.exists()
    assert AgentSample.objects.count() == 0
    assert metric("fleet_heartbeats_unknown_agent_total") == before + 1
    assert pending(redis_client) == 0


def test_entries_left_pending_by_a_dead_consumer_are_claimed(redis_client, users) -> None:
    register()
    make_ingestor(redis_client)  # creates the group
    publish(redis_client, heartbeat(seq=3))
    # A consumer reads the entry and dies before acknowledging it.
    redis_client.xreadgroup(INGEST_GROUP, "dead", {HEARTBEATS_STREAM: ">"}, count=10)
    assert pending(redis_client) == 1
    time.sleep(0.2)
    survivor = make_ingestor(redis_client, consumer="survivor", claim_idle_ms=100)
    drain(survivor)
    assert Agent.objects.get(name="agent-1").last_seq == 3
    assert pending(redis_client) == 0


def test_a_silent_agent_is_marked_lost_audited_and_announced(users, live_group) -> None:
    register()
    register("agent-2")
    now = timezone.now()
    Agent.objects.filter(name="agent-1").update(
        state="ready", last_seen=now - timedelta(seconds=3.5)
    )
    Agent.objects.filter(name="agent-2").update(state="ready", last_seen=now - timedelta(seconds=1))
    live_group.events()  # registration events
    events = services.agents_mark_lost(now=now)
    assert [event["agent"] for event in events] == ["agent-1"]
    assert Agent.objects.get(name="agent-1").state == "lost"
    assert Agent.objects.get(name="agent-2").state == AgentState.READY
    audit = AuditEvent.objects.get(action="agent.lost")
    assert (audit.object_id, audit.actor_name) == ("agent-1", "system")
    assert audit.before["state"] == "ready"
    assert services.agents_mark_lost(now=now) == []  # once
    # The ticker publishes what it marks.
    Agent.objects.filter(name="agent-2").update(last_seen=now - timedelta(seconds=10))
    ticker = FleetTicker(LiveFleet())
    ticker(True)  # starts watching: nothing is judged yet
    assert Agent.objects.get(name="agent-2").state == AgentState.READY
    assert ticker._watching_since is not None
    ticker._watching_since -= 10  # watched long enough
    ticker(True)
    lost = Agent.objects.get(name="agent-2")
    assert lost.state == "lost"
    assert lost.last_seen is not None
    assert live_group.receive() == {
        "event": "agent.state",
        "payload": {
            "agent": "agent-2",
            "state": "lost",
            "previous": "ready",
            "detail": lost.detail,
            "endpoint": "",
            "loaded_version_id": None,
            "last_seen": lost.last_seen.isoformat(),
        },
    }


def test_a_lost_agent_that_heartbeats_again_comes_back(redis_client, users, live_group) -> None:
    register()
    Agent.objects.filter(name="agent-1").update(state="lost")
    live_group.events()
    ingestor = make_ingestor(redis_client)
    publish(redis_client, heartbeat(seq=1))
    drain(ingestor)
    assert Agent.objects.get(name="agent-1").state == AgentState.READY
    event = live_group.receive()
    assert (event["event"], event["payload"]["state"], event["payload"]["previous"]) == (
        "agent.state",
        "ready",
        "lost",
    )


def test_ticker_publishes_live_figures(redis_client, users, live_group) -> None:
    register()
    live = LiveFleet()
    handler = stream_handlers()[HEARTBEATS_STREAM]
    assert isinstance(handler, HeartbeatHandler)
    handler.live = live
    entry_id = publish(redis_client, heartbeat(seq=4, tokens_per_second=33.5))
    handler.apply(
        [handler.parse(entry_id, signed_fields(heartbeat(seq=4, tokens_per_second=33.5)))]
    )
    live_group.events()
    FleetTicker(live)(True)
    event = live_group.receive()
    assert event["event"] == "fleet.figures"
    assert event["payload"]["truncated"] is False
    assert event["payload"]["agents"] == {
        "agent-1": {
            "state": "ready",
            "running": 1,
            "waiting": 0,
            "kv_cache_usage": 0.25,
            "tokens_per_second": 33.5,
            "power_watts": 40.0,
            "energy_joules": 160.0,
            "energy_source": "estimate",
            "joules_per_token": 2.0,
            "ttft_p95_s": 0.08,
        }
    }
    assert live.heartbeats == {}


def test_history_derives_sums_from_cumulative_totals(users) -> None:
    agent = register()
    handler = stream_handlers()[HEARTBEATS_STREAM]
    start = recent_minute()
    items = []
    # 25 heartbeats, one a second: 40 J and 20 tokens each.
    for second in range(25):
        beat = heartbeat(seq=second + 1, sent_at=start + second)
        items.append(handler.parse(entry_id_at(beat.sent_at), signed_fields(beat)))
    handler.apply(items)
    history = selectors.agent_history(
        agent=agent,
        since=datetime.fromtimestamp(start, tz=UTC),
        until=datetime.fromtimestamp(start + 60, tz=UTC),
    )
    assert [bucket["bucket_start"].second for bucket in history] == [0, 10, 20]
    # The first bucket has no predecessor: 10 heartbeats cover 9 intervals.
    assert [bucket["energy_joules"] for bucket in history] == [360.0, 400.0, 200.0]
    assert [bucket["generated_tokens"] for bucket in history] == [180, 200, 100]
    assert history[1]["joules_per_token"] == 2.0
    assert history[1]["tokens_per_second"] == 20.0
    assert history[1]["requests_ok"] == 20


@pytest.mark.django_db(transaction=True)
def test_a_result_that_overtakes_its_commands_commit_is_not_lost(redis_client, users) -> None:
    """The sender writes the stream entry just before it commits; a quick agent can answer
    first. Ingest waits for the commit (the agent row's lock) instead of dropping it."""
    register()
    ingestor = make_ingestor(redis_client)
    sent = threading.Event()
    command_ids: list[str] = []

    def send_and_commit_late() -> None:
        try:
            with transaction.atomic():
                command = services.agent_command_send(
                    actor=None, agent_name="agent-1", kind="drain", redis_client=redis_client
                )
                command_ids.append(command.command_id)
                sent.set()
                time.sleep(0.5)  # still uncommitted while the result arrives
        finally:
            connection.close()

    sender = threading.Thread(target=send_and_commit_late)
    sender.start()
    assert sent.wait(10)
    entry = CommandResult(
        command_id=command_ids[0],
        agent="agent-1",
        kind="drain",
        status=CommandStatus.SUCCEEDED,
        detail="nothing to drain",
        finished_at=time.time(),
    )
    redis_client.xadd(RESULTS_STREAM, signed_fields(entry))
    drain(ingestor)
    sender.join(10)
    command = AgentCommand.objects.get(command_id=command_ids[0])
    assert (command.status, command.detail) == ("succeeded", "nothing to drain")


def test_command_results_move_the_command_forward_only(redis_client, users) -> None:
    agent = register()
    command = AgentCommand.objects.create(command_id="a" * 32, agent=agent, kind="drain")
    ingestor = make_ingestor(redis_client)

    def result(status: CommandStatus, detail: str = "", is_replay: bool = False) -> None:
        entry = CommandResult(
            command_id=command.command_id,
            agent="agent-1",
            kind="drain",
            status=status,
            detail=detail,
            finished_at=time.time(),
            is_replay=is_replay,
        )
        redis_client.xadd(RESULTS_STREAM, signed_fields(entry))

    result(CommandStatus.ACCEPTED)
    result(CommandStatus.SUCCEEDED, "drained")
    result(CommandStatus.ACCEPTED)  # late duplicate
    result(CommandStatus.SUCCEEDED, "drained", is_replay=True)
    drain(ingestor)
    command.refresh_from_db()
    assert (command.status, command.detail) == ("succeeded", "drained")
    assert command.accepted_at is not None
    assert command.finished_at is not None
    assert pending(redis_client, RESULTS_STREAM) == 0


def test_rollups_past_retention_are_pruned(users, settings) -> None:
    agent = register()
    handler = stream_handlers()[HEARTBEATS_STREAM]
    old = time.time() - 3600
    handler.apply(
        [
            handler.parse(entry_id_at(old), signed_fields(heartbeat(seq=1, sent_at=old))),
            handler.parse(entry_id_at(time.time()), signed_fields(heartbeat(seq=2))),
        ]
    )
    settings.FLEET_SAMPLE_RETENTION_S = 1800
    assert services.agent_samples_prune() == 1
    assert AgentSample.objects.filter(agent=agent).count() == 1


def test_heartbeat_fields_are_flat_strings_that_round_trip() -> None:
    beat = heartbeat(seq=9, ttft_p50_s=None, joules_per_token=None)
    fields = signed_fields(beat)
    assert all(isinstance(value, str) for value in fields.values())
    assert json.dumps(fields)  # flat
    handler = stream_handlers()[HEARTBEATS_STREAM]
    received = handler.parse("1700000000000-0", fields)
    assert received.heartbeat == beat
    assert received.received_at == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)


def test_ticks_run_under_load_and_say_whether_ingest_is_caught_up(redis_client, users) -> None:
    register()
    calls: list[bool] = []
    ingestor = make_ingestor(redis_client, batch_size=2, on_tick=calls.append, tick_every_s=0)
    for seq in range(1, 4):
        publish(redis_client, heartbeat(seq=seq))
    ingestor.run_once()  # own pending: nothing
    ingestor.tick()
    ingestor.run_once()  # a full batch: more is waiting
    ingestor.tick()
    ingestor.run_once()  # the last entry
    ingestor.tick()
    assert calls == [False, False, True]
    assert Agent.objects.get(name="agent-1").last_seq == 3


# Coalescing: a batch is written as one row per agent and one per (agent, bucket).


def _coalescing_heartbeats() -> list:
    """Two agents over two rollup buckets, peaks and states out of send order."""
    start = recent_minute() + 4
    beats = [
        heartbeat(seq=1, sent_at=start, running=2, kv_cache_usage=0.1, ttft_p95_s=None),
        heartbeat(seq=2, sent_at=start + 2, running=7, kv_cache_usage=0.3, ttft_p95_s=0.5),
        heartbeat(seq=3, sent_at=start + 4, running=1, kv_cache_usage=0.9, ttft_p95_s=0.2),
        heartbeat(seq=4, sent_at=start + 7, running=4, ttft_p95_s=None),  # next bucket
        heartbeat(seq=5, sent_at=start + 8, state=AgentState.DRAINING, running=0, detail="bye"),
        heartbeat("agent-2", seq=1, sent_at=start + 1, running=3, version_id=None),
        heartbeat("agent-2", seq=2, sent_at=start + 3, running=5, state=AgentState.WARMING),
        heartbeat("agent-2", seq=3, sent_at=start + 5, running=4, requests_failed_total=2),
    ]
    return beats


def _fleet_snapshot() -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
    agents: list[Mapping[str, Any]] = list(
        Agent.objects.order_by("name").values(
            "name",
            "state",
            "detail",
            "endpoint",
            "figures",
            "last_seen",
            "last_sent_at",
            "last_seq",
        )
    )
    columns = [f.name for f in AgentSample._meta.fields if f.name not in {"id", "agent"}]
    samples: list[Mapping[str, Any]] = list(
        AgentSample.objects.order_by("agent__name", "bucket_start").values(*columns)
    )
    return agents, samples


def test_a_batch_gives_the_same_rows_as_its_heartbeats_one_at_a_time(users) -> None:
    import random

    register()
    register("agent-2")
    seen = timezone.now()
    Agent.objects.update(last_seen=seen)
    handler = stream_handlers()[HEARTBEATS_STREAM]
    items = [
        handler.parse(entry_id_at(beat.sent_at), signed_fields(beat))
        for beat in _coalescing_heartbeats()
    ]
    shuffled = items[:]
    random.Random(5).shuffle(shuffled)
    ways = {
        "one at a time": [[item] for item in items],
        "one at a time, newest first": [[item] for item in reversed(items)],
        "one batch": [items],
        "one batch, newest first": [items[::-1]],
        "batches of three, shuffled": [shuffled[i : i + 3] for i in range(0, len(items), 3)],
        "one batch, delivered twice": [items, items],
    }
    snapshots = {}
    for way, batches in ways.items():
        AgentSample.objects.all().delete()
        Agent.objects.update(
            state="idle", detail="", figures={}, last_seen=seen, last_sent_at=None, last_seq=0
        )
        for batch in batches:
            handler.apply(batch)
        snapshots[way] = _fleet_snapshot()
    agents, samples = snapshots["one at a time"]
    for way, snapshot in snapshots.items():
        assert snapshot == (agents, samples), way
    # And the rows are the merge one would write by hand.
    assert [(a["name"], a["state"], a["detail"], a["last_seq"]) for a in agents] == [
        ("agent-1", "draining", "bye", 5),
        ("agent-2", "ready", "", 3),
    ]
    assert [
        (
            s["bucket_start"].second,
            s["state"],
            s["running_max"],
            s["kv_cache_usage_max"],
            s["ttft_p95_max_s"],
            s["energy_joules_min"],
            s["energy_joules_max"],
            s["first_sent_at"].second,
            s["last_sent_at"].second,
        )
        for s in samples
    ] == [
        (0, "ready", 7, 0.9, 0.5, 40.0, 120.0, 4, 8),  # agent-1
        (10, "draining", 4, 0.25, 0.08, 160.0, 200.0, 11, 12),
        (0, "ready", 5, 0.25, 0.08, 40.0, 120.0, 5, 9),  # agent-2
    ]
    assert samples[2]["requests_failed_total_max"] == 2


def _rows_written() -> dict[str, tuple[int, int]]:
    """Rows inserted and updated per fleet table in the current transaction (PostgreSQL)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, n_tup_ins, n_tup_upd FROM pg_stat_xact_user_tables "
            "WHERE relname IN ('fleet_agent', 'fleet_agentsample')"
        )
        rows = {name: (inserted, updated) for name, inserted, updated in cursor.fetchall()}
    return {table: rows.get(table, (0, 0)) for table in ("fleet_agent", "fleet_agentsample")}


def _difference(after: dict, before: dict) -> dict[str, tuple[int, int]]:
    return {
        table: (after[table][0] - before[table][0], after[table][1] - before[table][1])
        for table in after
    }


def test_a_batch_writes_each_agent_once_and_each_rollup_once(users) -> None:
    register()
    register("agent-2")
    handler = stream_handlers()[HEARTBEATS_STREAM]
    beats = _coalescing_heartbeats()
    first = [
        handler.parse(entry_id_at(beat.sent_at), signed_fields(beat))
        for beat in beats[:3] + beats[5:]
    ]
    before = _rows_written()
    handler.apply(first)  # 6 heartbeats, 2 agents, 2 (agent, bucket) pairs
    assert _difference(_rows_written(), before) == {
        "fleet_agent": (0, 2),
        "fleet_agentsample": (2, 0),
    }
    before = _rows_written()
    handler.apply(
        [handler.parse(entry_id_at(beat.sent_at), signed_fields(beat)) for beat in beats[3:5]]
    )
    assert _difference(_rows_written(), before) == {
        "fleet_agent": (0, 1),
        "fleet_agentsample": (1, 0),  # agent-1's second bucket, new
    }
    before = _rows_written()
    handler.apply(first)  # delivered again: the rollups merge, the agents are newer already
    assert _difference(_rows_written(), before) == {
        "fleet_agent": (0, 0),
        "fleet_agentsample": (0, 2),
    }


def test_entries_the_database_would_refuse_are_dropped_as_malformed(redis_client, users) -> None:
    register()
    ingestor = make_ingestor(stream_reader())
    before = metric("ingest_malformed_entries_total", stream=HEARTBEATS_STREAM)
    good = heartbeat(seq=7).to_fields()
    figures = json.loads(good["figures"])
    redis_client.xadd(HEARTBEATS_STREAM, {**good, "detail": "nul \x00 inside"})
    redis_client.xadd(HEARTBEATS_STREAM, {**good, "seq": str(2**63)})
    redis_client.xadd(HEARTBEATS_STREAM, {**good, "sent_at": "1e300"})
    redis_client.xadd(
        HEARTBEATS_STREAM, {**good, "figures": json.dumps({**figures, "running": 2**31})}
    )
    redis_client.xadd(
        HEARTBEATS_STREAM, {**good, "figures": json.dumps({**figures, "power_watts": 10**400})}
    )
    redis_client.xadd(HEARTBEATS_STREAM, {**good, "agent": b"agent-\xff"})  # not UTF-8
    publish(redis_client, heartbeat(seq=7))
    drain(ingestor)
    assert metric("ingest_malformed_entries_total", stream=HEARTBEATS_STREAM) == before + 6
    assert Agent.objects.get(name="agent-1").last_seq == 7
    assert AgentSample.objects.get().running_max == 1
    assert pending(redis_client) == 0


# Send times: heartbeats are ordered by them, so ingest refuses implausible ones.


def test_a_heartbeat_dated_ahead_is_refused_counted_and_changes_nothing(
    redis_client, users
) -> None:
    register()
    ingestor = make_ingestor(redis_client)
    publish(redis_client, heartbeat(seq=1))
    drain(ingestor)
    before = _fleet_snapshot()
    refused = metric("fleet_heartbeats_refused_total", reason="clock_ahead")
    dropped = metric("ingest_dropped_entries_total", stream=HEARTBEATS_STREAM, reason="malformed")
    # Year 9999: had it been applied, every later heartbeat would look older and be
    # skipped, and the agent would turn lost for good.
    forged = heartbeat(seq=2, sent_at=253402300799.0, state=AgentState.DRAINING, running=0)
    publish(redis_client, forged)
    drain(ingestor)
    assert _fleet_snapshot() == before
    assert metric("fleet_heartbeats_refused_total", reason="clock_ahead") == refused + 1
    assert (
        metric("ingest_dropped_entries_total", stream=HEARTBEATS_STREAM, reason="malformed")
        == dropped + 1
    )
    assert pending(redis_client) == 0
    publish(redis_client, heartbeat(seq=3, running=4))
    drain(ingestor)
    agent = Agent.objects.get(name="agent-1")
    assert (agent.last_seq, agent.state, agent.figures["running"]) == (3, AgentState.READY, 4)
    assert services.agents_mark_lost() == []


def test_a_heartbeat_sent_long_before_redis_took_it_is_refused(redis_client, users) -> None:
    register()
    ingestor = make_ingestor(redis_client)
    refused = metric("fleet_heartbeats_refused_total", reason="clock_behind")
    publish(redis_client, heartbeat(seq=1, sent_at=time.time() - 600))
    drain(ingestor)
    assert metric("fleet_heartbeats_refused_total", reason="clock_behind") == refused + 1
    assert Agent.objects.get(name="agent-1").last_seq == 0
    assert not AgentSample.objects.exists()


def test_a_backlog_read_late_is_not_refused_for_its_age(redis_client, users) -> None:
    """An entry's age is judged by when Redis took it, not by when ingest reads it."""
    register()
    ingestor = make_ingestor(redis_client)
    sent_at = time.time() - 600  # ingest was down for ten minutes
    publish(redis_client, heartbeat(seq=1, sent_at=sent_at), entry_id_at(sent_at))
    drain(ingestor)
    assert Agent.objects.get(name="agent-1").last_seq == 1


def test_registering_again_resets_the_order_of_heartbeats(redis_client, users) -> None:
    """A send time applied before (a clock that jumped, or a forged entry) no longer makes
    the new process's heartbeats look older once the agent registers again."""
    register()
    Agent.objects.filter(name="agent-1").update(
        last_sent_at=timezone.now() + timedelta(days=365), last_seq=99
    )
    register()
    ingestor = make_ingestor(redis_client)
    publish(redis_client, heartbeat(seq=1, running=6))
    drain(ingestor)
    agent = Agent.objects.get(name="agent-1")
    assert (agent.last_seq, agent.figures["running"]) == (1, 6)


def refused_audits(agent: str = "agent-1") -> list[dict[str, Any]]:
    events = AuditEvent.objects.filter(action="agent.heartbeat_refused", object_id=agent)
    return [event.after for event in events.order_by("id")]


def test_a_heartbeat_naming_an_unregistered_endpoint_changes_nothing_and_is_audited_once_a_minute(
    users,
) -> None:
    agent = register()  # endpoints http://127.0.0.1:9100 and :9101
    clock = [1000.0]
    handler = HeartbeatHandler(LiveFleet(), clock=lambda: clock[0])
    sent_at = time.time() - 10

    def apply(seq: int, endpoint: str) -> None:
        beat = heartbeat(seq=seq, sent_at=sent_at + seq, endpoint=endpoint)
        handler.apply([handler.parse(entry_id_at(sent_at + seq), signed_fields(beat))])

    apply(1, "http://127.0.0.1:9100")
    agent.refresh_from_db()
    row_before = (agent.state, agent.endpoint, agent.last_seq, agent.last_sent_at, agent.figures)
    samples_before = list(AgentSample.objects.values())
    refused_before = metric("fleet_heartbeats_refused_total", reason="unregistered_endpoint")
    unknown_before = metric("fleet_heartbeats_unknown_agent_total")

    apply(2, "http://capture.example:9100")
    apply(3, "http://127.0.0.1:9102")
    agent.refresh_from_db()
    assert (
        agent.state, agent.endpoint, agent.last_seq, agent.last_sent_at, agent.figures
    ) == row_before  # fmt: skip
    assert list(AgentSample.objects.values()) == samples_before
    assert metric("fleet_heartbeats_refused_total", reason="unregistered_endpoint") == (
        refused_before + 2
    )
    assert metric("fleet_heartbeats_unknown_agent_total") == unknown_before
    # The first refusal is audited at once; the second waits for the minute to end.
    assert refused_audits() == [
        {"refused": 1, "reason": "unregistered_endpoint",
         "endpoints": {"http://capture.example:9100": 1}},
    ]  # fmt: skip

    clock[0] += 60
    apply(4, "http://127.0.0.1:9101")  # the other registered port: applied
    agent.refresh_from_db()
    assert (agent.endpoint, agent.last_seq) == ("http://127.0.0.1:9101", 4)
    assert refused_audits()[1:] == [
        {"refused": 1, "reason": "unregistered_endpoint",
         "endpoints": {"http://127.0.0.1:9102": 1}},
    ]  # fmt: skip
    apply(5, "")  # no engine: applied
    agent.refresh_from_db()
    assert (agent.endpoint, agent.last_seq) == ("", 5)
    assert len(refused_audits()) == 2


def test_endpoints_are_refused_until_the_agent_registers_them(redis_client, users) -> None:
    register()
    ingestor = make_ingestor(redis_client)
    sent_at = time.time() - 5
    moved = heartbeat(seq=1, sent_at=sent_at, endpoint="http://10.0.0.9:9100")
    publish(redis_client, moved, entry_id_at(sent_at))
    drain(ingestor)
    assert Agent.objects.get(name="agent-1").last_seq == 0
    services.agent_register(
        actor=Agent.objects.get(name="agent-1").account,
        name="agent-1",
        host="host-a",
        endpoint="",
        advertise_host="10.0.0.9",
        ports=[9100, 9101],
        inventory={},
        energy_source="estimate",
    )
    again = heartbeat(seq=2, sent_at=sent_at + 1, endpoint="http://10.0.0.9:9100")
    publish(redis_client, again, entry_id_at(sent_at + 1))
    drain(ingestor)
    agent = Agent.objects.get(name="agent-1")
    assert (agent.endpoint, agent.last_seq) == ("http://10.0.0.9:9100", 2)
    assert pending(redis_client) == 0
