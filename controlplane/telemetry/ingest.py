"""The handlers the ingest process runs, one per Redis stream, and its periodic fleet work.

Domain apps add theirs here as their streams come to exist (heartbeats, requests).

- `telemetry:heartbeats` -> HeartbeatHandler: agents' state and figures, 10-second rollups.
- `agent:results` -> CommandResultHandler: the outcome of each command.
  Both refuse an entry whose `mac` does not verify under the stream key of the agent it
  names (`AgentMacCheck`): counted, audited at most once per agent per minute, dropped.
- `telemetry:requests` -> controlplane.telemetry.requests.RequestsStreamHandler (usage, SLO
  samples, the rollout fast path).
- `FleetTicker` (the ingestor's on_tick): marks silent agents `lost`, publishes the live
  figures at most once a second, prunes old rollups.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from django.conf import settings
from django.db import DatabaseError
from prometheus_client import Counter, Gauge

from contracts.agent_mac import agent_fields_verify
from contracts.commands import RESULTS_STREAM, CommandResult, parse_command_result
from contracts.fields_mac import FieldsMacError
from contracts.streams import HEARTBEATS_STREAM, ContractError, Heartbeat, parse_heartbeat
from controlplane.audit.services import audit_event_record
from controlplane.fleet import services
from controlplane.fleet.refusals import MAX_REMEMBERED_AGENTS, StreamRefusals
from controlplane.fleet.stream_keys import agent_stream_key
from controlplane.telemetry.heartbeats import ReceivedHeartbeat, compact_figures, heartbeats_apply
from controlplane.telemetry.streams import MalformedEntry, StreamHandler

logger = logging.getLogger(__name__)

UNKNOWN_AGENT_TOTAL = Counter(
    "fleet_heartbeats_unknown_agent_total", "Heartbeats from agents that never registered"
)
LOST_TOTAL = Counter("fleet_agents_lost_total", "Agents marked lost by ingest")
HEARTBEATS_REFUSED_TOTAL = Counter(
    "fleet_heartbeats_refused_total",
    "Heartbeats refused: no valid mac for their agent (missing_mac, bad_mac), sent_at "
    "ahead of the ingest clock or long before Redis took it, or an endpoint the agent did "
    "not register",
    ["reason"],
)
RESULTS_REFUSED_TOTAL = Counter(
    "fleet_command_results_refused_total",
    "Command results refused: no valid mac for their agent (missing_mac, bad_mac)",
    ["reason"],
)
UNREGISTERED_ENDPOINT = "unregistered_endpoint"
REFUSED_AUDIT_EVERY_S = 60.0
HEARTBEAT_LAG = Gauge(
    "fleet_heartbeat_lag_seconds", "Age of the newest heartbeat in the last batch applied"
)

LIVE_FIGURES_EVERY_S = 1.0
STATE_EVENTS_ONE_BY_ONE = 20
LIVE_FIGURES_MAX_AGENTS = 500
PRUNE_EVERY_S = 60.0
CURRENT_LAG_S = 1.0  # a backlog younger than this still counts as watching the fleet


def entry_time(entry_id: str) -> datetime:
    """When Redis added the entry (the id's millisecond part)."""
    milliseconds = int(entry_id.split("-", 1)[0])
    return datetime.fromtimestamp(milliseconds / 1000, tz=UTC)


@dataclass
class LiveFleet:
    """What ingest has seen since the last live update, shared by the handlers and the ticker.

    The newest heartbeat of each agent is kept as it is; the ticker makes the live figures
    of the few it sends (at most LIVE_FIGURES_MAX_AGENTS a second), not every batch.
    """

    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    lag_s: float = float("inf")


class AgentMacCheck:
    """Checks that an entry was signed by the agent it names, with that agent's stream key
    (derived once per agent and kept: ingest checks thousands of entries a second)."""

    def __init__(self, stream: str, refusals: StreamRefusals) -> None:
        self.stream = stream
        self.refusals = refusals
        self._keys: dict[str, str] = {}

    def __call__(self, agent_name: str, fields: Mapping[str, str]) -> None:
        key = self._keys.get(agent_name)
        if key is None:
            if len(self._keys) >= MAX_REMEMBERED_AGENTS:
                self._keys.clear()
            key = self._keys[agent_name] = agent_stream_key(agent_name)
        try:
            agent_fields_verify(self.stream, fields, key)
        except FieldsMacError as exc:
            logger.warning(
                "refusing an entry not signed by the agent it names",
                extra={"stream": self.stream, "agent": agent_name, "reason": exc.reason},
            )
            self.refusals.refuse(agent_name, exc.reason)
            raise MalformedEntry(f"{self.stream} entry of {agent_name}: {exc}") from exc


class HeartbeatHandler:
    """Applies heartbeats in batches (heartbeats_apply).

    A heartbeat naming an endpoint its agent did not register is refused: counted in
    `fleet_heartbeats_refused_total{reason="unregistered_endpoint"}`, logged, and audited
    (`agent.heartbeat_refused`) at most once per agent per `audit_every_s` for this
    process, one event counting every refusal of that agent since its last.
    """

    def __init__(
        self,
        live: LiveFleet,
        *,
        audit_every_s: float = REFUSED_AUDIT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.live = live
        self.check_mac = AgentMacCheck(
            HEARTBEATS_STREAM,
            StreamRefusals(
                action="agent.heartbeat.refused",
                counter=HEARTBEATS_REFUSED_TOTAL,
                detail="heartbeats without a valid mac of this agent were dropped",
            ),
        )
        self._audit_every_s = audit_every_s
        self._clock = clock
        self._last_audit_at: dict[str, float] = {}  # agent -> when its refusals were audited
        self._unaudited: dict[str, dict[str, int]] = {}  # agent -> endpoint -> heartbeats

    def parse(self, entry_id: str, fields: Mapping[str, str]) -> ReceivedHeartbeat:
        try:
            heartbeat = parse_heartbeat(fields)
        except ContractError as exc:
            raise MalformedEntry(str(exc)) from exc
        self.check_mac(heartbeat.agent, fields)
        received_at = entry_time(entry_id)
        _check_sent_at(heartbeat, received_at)
        return ReceivedHeartbeat(heartbeat=heartbeat, received_at=received_at)

    def apply(self, items: Sequence[ReceivedHeartbeat]) -> None:
        outcome = heartbeats_apply(received=items)
        newest = max(item.received_at for item in items)
        self.live.lag_s = max(0.0, time.time() - newest.timestamp())
        HEARTBEAT_LAG.set(self.live.lag_s)
        if outcome.unregistered_endpoints:
            HEARTBEATS_REFUSED_TOTAL.labels(UNREGISTERED_ENDPOINT).inc(outcome.refused)
            logger.warning(
                "heartbeats naming unregistered endpoints refused: %s",
                ", ".join(sorted(outcome.unregistered_endpoints)[:10]),
            )
            for agent, named in outcome.unregistered_endpoints.items():
                pending = self._unaudited.setdefault(agent, {})
                for endpoint, count in named.items():
                    pending[endpoint] = pending.get(endpoint, 0) + count
        self._audit_refused()
        if outcome.unknown_agents:
            UNKNOWN_AGENT_TOTAL.inc(len(items) - outcome.applied - outcome.refused)
            logger.warning(
                "heartbeats from unregistered agents dropped: %s",
                ", ".join(sorted(outcome.unknown_agents)[:10]),
            )
        changes = outcome.state_events
        if len(changes) <= STATE_EVENTS_ONE_BY_ONE:
            services.fleet_events_publish([("agent.state", event) for event in changes])
        else:  # a fleet-wide change (ingest starting, an outage ending): one summary
            services.fleet_event_publish(
                "fleet.states",
                {
                    "agents": changes[:LIVE_FIGURES_MAX_AGENTS],
                    "truncated": len(changes) > LIVE_FIGURES_MAX_AGENTS,
                },
            )
        self.live.heartbeats.update(outcome.latest)

    def _audit_refused(self) -> None:
        now = self._clock()
        for agent in sorted(self._unaudited):
            last = self._last_audit_at.get(agent)
            if last is not None and now - last < self._audit_every_s:
                continue
            named = dict(sorted(self._unaudited[agent].items())[:10])
            try:
                audit_event_record(
                    actor=None,
                    action="agent.heartbeat_refused",
                    object_type="agent",
                    object_id=agent,
                    object_repr=agent,
                    after={
                        "refused": sum(self._unaudited[agent].values()),
                        "reason": UNREGISTERED_ENDPOINT,
                        "endpoints": named,
                    },
                    reason="heartbeats named an endpoint the agent did not register",
                )
            except DatabaseError as exc:  # kept for the next batch; the heartbeats are dropped
                logger.warning("refused heartbeats not audited", extra={"error": str(exc)})
                return
            self._last_audit_at[agent] = now
            del self._unaudited[agent]


def _check_sent_at(heartbeat: Heartbeat, received_at: datetime) -> None:
    """Refuse a heartbeat whose send time is off by more than the allowed skew.

    Heartbeats are ordered by `sent_at`, so one dated ahead would make every later one
    look older and be skipped (the agent would turn lost). Ahead is judged by ingest's own
    clock (an entry id is chosen by whoever adds it); behind by the entry's Redis time, so
    a backlog read after an outage is not refused for its age.
    """
    skew_s = settings.FLEET_HEARTBEAT_MAX_SKEW_S
    ahead_s = heartbeat.sent_at - time.time()
    if ahead_s > skew_s:
        HEARTBEATS_REFUSED_TOTAL.labels("clock_ahead").inc()
        raise MalformedEntry(
            f"heartbeat of {heartbeat.agent} sent {ahead_s:.1f} s ahead of the ingest clock"
        )
    behind_s = received_at.timestamp() - heartbeat.sent_at
    if behind_s > skew_s:
        HEARTBEATS_REFUSED_TOTAL.labels("clock_behind").inc()
        raise MalformedEntry(
            f"heartbeat of {heartbeat.agent} sent {behind_s:.1f} s before Redis took it"
        )


class CommandResultHandler:
    def __init__(self) -> None:
        self.check_mac = AgentMacCheck(
            RESULTS_STREAM,
            StreamRefusals(
                action="agent.result.refused",
                counter=RESULTS_REFUSED_TOTAL,
                detail="command results without a valid mac of this agent were dropped",
            ),
        )

    def parse(self, entry_id: str, fields: Mapping[str, str]) -> CommandResult:
        try:
            result = parse_command_result(fields)
        except ContractError as exc:
            raise MalformedEntry(str(exc)) from exc
        self.check_mac(result.agent, fields)
        return result

    def apply(self, items: Sequence[CommandResult]) -> None:
        events = services.command_results_apply(results=items)
        services.fleet_events_publish([("agent.command", event) for event in events])


class FleetTicker:
    """The ingestor's on_tick: lost agents, live figures, retention.

    An agent is judged lost only while ingest has been watching the fleet (caught up, or
    behind by under a second) for at least FLEET_LOST_AFTER_S: after a Redis outage, a
    backlog or a restart of ingest itself, agents get that long to be heard again.
    """

    def __init__(self, live: LiveFleet) -> None:
        self.live = live
        self._watching_since: float | None = None
        self._last_tick: float | None = None
        self._last_figures = 0.0
        self._last_prune = 0.0

    def __call__(self, is_caught_up: bool) -> None:
        now = time.monotonic()
        lost_after = settings.FLEET_LOST_AFTER_S
        is_current = is_caught_up or self.live.lag_s < CURRENT_LAG_S
        has_gap = self._last_tick is not None and now - self._last_tick > lost_after / 2
        self._last_tick = now
        if not is_current or has_gap:
            self._watching_since = None
        if is_current and self._watching_since is None:
            self._watching_since = now
        if self._watching_since is not None and now - self._watching_since >= lost_after:
            events = services.agents_mark_lost()
            for event in events:
                LOST_TOTAL.inc()
                logger.warning("agent %s lost: %s", event["agent"], event["detail"])
            services.fleet_events_publish([("agent.state", event) for event in events])
        if self.live.heartbeats and now - self._last_figures >= LIVE_FIGURES_EVERY_S:
            self._last_figures = now
            heartbeats, self.live.heartbeats = self.live.heartbeats, {}
            names = sorted(heartbeats)[:LIVE_FIGURES_MAX_AGENTS]
            services.fleet_event_publish(
                "fleet.figures",
                {
                    "agents": {name: compact_figures(heartbeats[name]) for name in names},
                    "truncated": len(heartbeats) > len(names),
                },
            )
        if now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            deleted = services.agent_samples_prune()
            if deleted:
                logger.info("pruned %d fleet rollups past retention", deleted)


LIVE = LiveFleet()


def stream_handlers() -> dict[str, StreamHandler]:
    # The gateway's handler lives with the gateway; imported here, when ingest starts.
    from contracts.routing import REQUESTS_STREAM
    from controlplane.telemetry.requests import RequestsStreamHandler

    return {
        HEARTBEATS_STREAM: HeartbeatHandler(LIVE),
        RESULTS_STREAM: CommandResultHandler(),
        REQUESTS_STREAM: RequestsStreamHandler(),
    }


def ingest_ticker() -> FleetTicker:
    return FleetTicker(LIVE)
