"""Make Redis routing and the agents' loaded versions match each deployment's desired routing.

Level-triggered: every pass reads the database as it is now and repairs whatever differs
(a crash between a transition's commit and its routing write, a lost command, an agent
that went away), so running it twice, or after any half-done step, is safe. Passes for
one deployment are serialized by a Redis lock. A pass over the fleet takes deployments
RECONCILE_BATCH at a time: their locks, then their rows read together, each deployment's
routing published and its replicas placed, the batch's loads sent together, and the
fleet's surplus agents drained once. The table routes only to ready agents:
state ready, loaded version matching, seen within ROLLOUTS_AGENT_FRESH_S, with a load
of that version accepted or succeeded (each endpoint's serving secret derives from the
latest), at an endpoint the agent registered whose engine proved it holds that load's
admin secret (controlplane.fleet.endpoint_checks). A revoked
version is never routed nor kept loaded, and an active rollout of one is ended first.

The version a promotion or an undo replaced (the deployment's latest revision's previous
version) is kept warm for ROLLOUTS_PREVIOUS_STABLE_WARM_S: loaded on an idle agent, never
drained meanwhile, and given up to any version that needs its agent. While a new stable
version has no ready agent, that previous version keeps the traffic, so an undo to a
version that was not warm switches once it is ready.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import redis
from django.conf import settings
from django.utils import timezone

from contracts import tracing
from contracts.routing import ROLE_SHADOW, RoutingTable, VersionRoute
from controlplane.core.errors import DomainError
from controlplane.core.events import publishing_batched
from controlplane.core.redis_clients import redis_client
from controlplane.fleet import services as fleet_services
from controlplane.fleet.endpoint_checks import endpoints_verify
from controlplane.fleet.models import Agent, AgentState, CommandKind
from controlplane.fleet.services import CommandOrder
from controlplane.rollouts import decisions
from controlplane.rollouts.fleet_view import FleetView
from controlplane.rollouts.models import (
    Deployment,
    DesiredRouting,
    Rollout,
    RolloutState,
)
from controlplane.rollouts.placement import Placement, Unplaced
from controlplane.rollouts.reconcile_reads import (
    InFlight,
    VersionRow,
    deployments_read,
    revoked_candidates,
    versions_read,
)
from controlplane.rollouts.routing import routing_table_publish, routing_tables_read

logger = logging.getLogger(__name__)

# Deployments locked, read and sent for together in a pass over many: fewer statements, and
# locks held no longer than a few deployments' passes.
RECONCILE_BATCH = 20


@dataclass(slots=True)
class ReconcileReport:
    deployment: str
    revision: int
    weights: dict[int, int] = field(default_factory=dict)  # version id -> published weight
    endpoints: dict[int, list[str]] = field(default_factory=dict)
    loads: list[tuple[str, int]] = field(default_factory=list)  # (agent, version id) sent
    drains: list[str] = field(default_factory=list)
    rolled_back: bool = False
    handover: bool = False  # the previous stable version serves until the stable one is ready
    skipped: str = ""
    unplaced: list[str] = field(default_factory=list)  # why a version has no agent


def _is_serving(agent: Agent, version_id: int | None, fresh_after: Any) -> bool:
    return (
        agent.state == AgentState.READY
        and agent.loaded_version_id == version_id
        and bool(agent.endpoint)
        and agent.last_seen is not None
        and agent.last_seen >= fresh_after
    )


_BUSY_STATES = frozenset({AgentState.LOADING, AgentState.WARMING})


def _is_busy(agent: Agent, in_flight: InFlight) -> bool:
    return agent.id in in_flight.agents or agent.state in _BUSY_STATES


def reconcile_deployment(
    *, deployment_id: int, client: redis.Redis | None = None
) -> ReconcileReport:
    """One pass for one deployment (a batch of one, reading the fleet afresh); raises
    what the pass raised."""
    outcome = _reconcile_batch([deployment_id], client, FleetView())[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def reconcile_deployments(
    *, deployment_ids: Sequence[int], client: redis.Redis | None = None
) -> list[ReconcileReport]:
    """A pass over many deployments, RECONCILE_BATCH at a time, reading the fleet once
    (`FleetView`). A deployment whose pass fails is logged; the others still run. Live
    events go out together at the end of the pass."""
    own_client = client is None
    client = client or redis_client(decode_responses=True)
    view = FleetView()
    reports = []
    try:
        with publishing_batched():
            for start in range(0, len(deployment_ids), RECONCILE_BATCH):
                batch = deployment_ids[start : start + RECONCILE_BATCH]
                for deployment_id, outcome in zip(
                    batch, _reconcile_batch(batch, client, view), strict=True
                ):
                    if isinstance(outcome, Exception):
                        logger.error(
                            "reconcile failed",
                            exc_info=outcome,
                            extra={"deployment_id": deployment_id},
                        )
                    else:
                        reports.append(outcome)
    finally:
        if own_client:
            client.close()
    return reports


def _reconcile_batch(
    deployment_ids: Sequence[int], client: redis.Redis | None, view: FleetView
) -> list[ReconcileReport | Exception]:
    """The passes of a few deployments, each report or what its pass raised (in the order
    of `deployment_ids`). Their locks are held from before their rows are read until their
    loads are sent, so that no other pass places their replicas meanwhile."""
    own_client = client is None
    client = client or redis_client(decode_responses=True)
    outcomes: dict[int, ReconcileReport | Exception] = {}
    locks = []
    try:
        held = []
        # Taken in one order by every pass, so that no two passes wait on each other.
        for deployment_id in sorted(set(deployment_ids)):
            name = view.deployment_name(deployment_id)
            if name is None:
                outcomes[deployment_id] = _skipped(str(deployment_id), "gone")
                continue
            lock = client.lock(
                f"rollouts:reconcile:{name}",
                timeout=settings.ROLLOUTS_RECONCILE_LOCK_S,
                blocking_timeout=settings.ROLLOUTS_RECONCILE_LOCK_S,
            )
            if not lock.acquire():
                outcomes[deployment_id] = _skipped(name, "another pass holds the lock")
                continue
            locks.append(lock)
            held.append(deployment_id)
        if held:
            outcomes.update(_reconcile_held(held, client, view))
    finally:
        for lock in locks:
            try:
                lock.release()
            except redis.exceptions.LockError:
                logger.warning("reconcile lock expired before release")
        if own_client:
            client.close()
    return [outcomes[deployment_id] for deployment_id in deployment_ids]


def _skipped(deployment: str, why: str) -> ReconcileReport:
    return ReconcileReport(deployment=deployment, revision=0, skipped=why)


def _reconcile_held(
    deployment_ids: list[int], client: redis.Redis, view: FleetView
) -> dict[int, ReconcileReport | Exception]:
    """The passes of deployments whose locks are held: their rows read together (inside
    the locks: the newest committed desired routing wins), each pass run, then the loads
    they decided sent together."""
    try:
        # A revoked candidate's rollout ends before anything is routed (its canary weight goes).
        revoked = revoked_candidates(deployment_ids)
        for version_id in revoked:
            decisions.rollouts_stop_for_revoked_candidate(version_id=version_id)
        if revoked:
            view.invalidate()  # the versions needed changed
        deployments = deployments_read(deployment_ids)
        in_flight = InFlight.read()
        published = routing_tables_read(client, [d.name for d in deployments.values()])
        version_ids: set[int] = set()
        for read in deployments.values():
            # A malformed desired routing fails its own deployment's pass below, alone.
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                version_ids.update(_routable_ids(read, view))
        versions = versions_read(version_ids)
    except Exception as exc:
        return dict.fromkeys(deployment_ids, exc)
    outcomes: dict[int, ReconcileReport | Exception] = {}
    loads: list[tuple[ReconcileReport, CommandOrder]] = []
    applied: dict[int, list[int]] = {}  # routing revision -> the deployments now at it
    for deployment_id in deployment_ids:
        deployment = deployments.get(deployment_id)
        if deployment is None:
            outcomes[deployment_id] = _skipped(str(deployment_id), "gone")
            continue
        try:
            report, placed = _reconcile(
                deployment, versions, in_flight, published.get(deployment.name), client, view
            )
        except Exception as exc:
            outcomes[deployment_id] = exc
            view.invalidate()
            continue
        outcomes[deployment_id] = report
        loads.extend((report, order) for order in placed)
        if deployment.applied_revision < deployment.routing_revision:  # its table is published
            applied.setdefault(deployment.routing_revision, []).append(deployment.pk)
    reports = [outcome for outcome in outcomes.values() if isinstance(outcome, ReconcileReport)]
    try:
        _loads_send(loads, client)
        for revision, applied_ids in applied.items():
            Deployment.objects.filter(pk__in=applied_ids, applied_revision__lt=revision).update(
                applied_revision=revision
            )
        # The fleet's look, once for the batch: its drains in the batch's first report.
        drains = _agents_retire(view, in_flight, client)
        if reports:
            reports[0].drains.extend(drains)
    except Exception as exc:
        return dict.fromkeys(deployment_ids, exc)
    return outcomes


def _routable_ids(deployment: Deployment, view: FleetView) -> list[int]:
    """The versions the deployment's routing may name: stable, canary, previous stable."""
    desired = deployment.desired_routing
    stable_id = desired.get("stable_version_id") or deployment.stable_version_id
    candidates = [
        stable_id,
        desired.get("canary_version_id"),
        view.previous_stable(deployment.pk, stable_id),
    ]
    return [version_id for version_id in dict.fromkeys(candidates) if version_id is not None]


@tracing.traced(__name__, "rollouts.reconcile")
def _reconcile(
    deployment: Deployment,
    version_rows: dict[int, VersionRow],
    in_flight: InFlight,
    published: RoutingTable | None,
    client: redis.Redis,
    view: FleetView,
) -> tuple[ReconcileReport, list[CommandOrder]]:
    """One deployment's pass, its lock held and its rows read: its routing table published
    (unless `published`, the one in Redis, says the same), its loads chosen and returned
    (the batch sends them with its others)."""
    desired: DesiredRouting = deployment.desired_routing
    report = ReconcileReport(deployment=deployment.name, revision=deployment.routing_revision)
    now = timezone.now()
    fresh_after = now - timedelta(seconds=settings.ROLLOUTS_AGENT_FRESH_S)
    stable_id = desired.get("stable_version_id") or deployment.stable_version_id
    canary_id = desired.get("canary_version_id")
    previous_id = view.previous_stable(deployment.pk, stable_id)
    weight = int(desired.get("canary_weight") or 0)
    tenants = desired.get("canary_tenants") or []
    is_shadow = bool(desired.get("canary_shadow", False))  # absent in rows from before
    loads, secrets = view.loads, view.secrets
    routable = _routable_ids(deployment, view)
    serving = [
        a
        for version_id in routable
        for a in view.loaded_with(version_id)
        if a.pk in secrets  # the gateway could not authenticate to its engine otherwise
        and (
            _is_serving(a, stable_id, fresh_after)
            or _is_serving(a, canary_id, fresh_after)
            # Proved ahead of an undo (or a handover) that routes to it.
            or (previous_id is not None and _is_serving(a, previous_id, fresh_after))
        )
    ]
    verified = endpoints_verify(agents=serving, loads=loads, client=client)
    serving_ids = {a.pk for a in serving}
    needed = view.needed

    def ready_agents(version_id: int) -> list[Agent]:
        fresh = [
            a
            for a in view.loaded_with(version_id)
            if a.last_seen is not None and a.last_seen >= fresh_after
        ]
        kept = kept_replicas(fresh, version_id, needed.get(version_id, 1))
        ready = [a for a in kept if a.pk in serving_ids and a.pk in verified]
        return sorted(ready, key=lambda agent: agent.endpoint)

    def ready_endpoints(version_id: int) -> list[str]:
        return [agent.endpoint for agent in ready_agents(version_id)]

    def endpoint_secrets(version_id: int) -> dict[str, str]:
        return {agent.endpoint: secrets[agent.pk] for agent in ready_agents(version_id)}

    view_changed = False  # this pass changed what the view holds: the next one reads it again
    # Fast path: every agent that served the canary is lost.
    if canary_id is not None and weight > 0:
        lost = [a for a in view.loaded_with(canary_id) if a.state == AgentState.LOST]
        if lost and not ready_endpoints(canary_id):
            rollout = Rollout.objects.filter(
                deployment=deployment, candidate_id=canary_id, state=RolloutState.RUNNING
            ).first()
            if rollout is not None:
                report.rolled_back = decisions.rollback_when_canary_lost(
                    rollout_id=rollout.pk, lost_agents=[a.name for a in lost]
                )
                view_changed = True
                deployment.refresh_from_db()
                desired = deployment.desired_routing
                report.revision = deployment.routing_revision
                canary_id, weight, tenants, is_shadow = None, 0, [], False

    # Routing: only ready agents; a canary without one gets no weight and the stable
    # version keeps every request. A tenant-scoped stage keeps the table's weights on the
    # stable version and gives the named tenants their own split. In a shadow stage the
    # stable version answers everything and the canary's weight is its mirror share.
    stable_endpoints = ready_endpoints(stable_id)
    canary_endpoints = ready_endpoints(canary_id) if canary_id is not None else []
    effective = weight if canary_endpoints else 0
    shared = 0 if tenants or is_shadow else effective  # the canary's answering weight
    missing = set(routable) - set(version_rows)  # a version the batch's read did not foresee
    if missing:
        version_rows.update(versions_read(missing))
    rows = {pk: version_rows[pk] for pk in routable if pk in version_rows}
    labels = {pk: row.label for pk, row in rows.items()}
    context_lengths = {pk: row.context_length for pk, row in rows.items()}
    revoked = {pk for pk, row in rows.items() if row.is_revoked}
    if canary_id in revoked:  # its rollout could not be ended this pass: no weight anyway
        canary_endpoints, effective, shared = [], 0, 0
    # Handover: a stable version with no ready agent yet (just restored by an undo, or its
    # agents gone) is covered by the version it replaced, when that one still serves.
    routed_stable_id = stable_id
    if (
        not stable_endpoints
        and (not canary_endpoints or is_shadow)  # a shadow canary answers nothing
        and previous_id is not None
        and previous_id not in revoked
        and ready_endpoints(previous_id)
    ):
        routed_stable_id = previous_id
        stable_endpoints = ready_endpoints(previous_id)
        report.handover = True
    versions = []
    # A revoked stable version leaves the table: its share goes to the canary if there is
    # one, else the model has no route (the gateway answers 503) until a new stable one.
    is_stable_routed = routed_stable_id not in revoked and (
        100 - shared > 0 or not canary_endpoints
    )
    if is_stable_routed:
        versions.append(
            VersionRoute(
                version_id=routed_stable_id,
                label=labels.get(routed_stable_id, str(routed_stable_id)),
                weight=max(100 - shared, 0) or 100,
                endpoints=tuple(stable_endpoints),
                max_model_len=context_lengths.get(routed_stable_id, 0),
                endpoint_secrets=endpoint_secrets(routed_stable_id),
                role="stable",
            )
        )
    # A shadow is mirrored only beside a version that answers (a revoked stable version
    # leaves the model without a route; a shadow never takes its share).
    if canary_id is not None and effective > 0 and (is_stable_routed or not is_shadow):
        versions.append(
            VersionRoute(
                version_id=canary_id,
                label=labels.get(canary_id, str(canary_id)),
                # the mirror share for every tenant, or 0 when only the stage's tenants'
                weight=(0 if tenants else effective) if is_shadow else shared,
                endpoints=tuple(canary_endpoints),
                max_model_len=context_lengths.get(canary_id, 0),
                endpoint_secrets=endpoint_secrets(canary_id),
                role=ROLE_SHADOW if is_shadow else "canary",
            )
        )
    tenant_weights: dict[str, dict[int, int]] = {}
    if tenants and canary_id is not None and effective > 0:
        if is_shadow:  # the stage's tenants answered by the stable version, mirrored at `effective`
            if is_stable_routed:
                tenant_weights = {
                    slug: {routed_stable_id: 100, canary_id: effective} for slug in tenants
                }
        else:
            tenant_weights = {
                slug: {canary_id: effective}
                | ({} if stable_id in revoked else {stable_id: 100 - effective})
                for slug in tenants
            }
    routing_table_publish(
        client=client,
        deployment=deployment.name,
        model=deployment.stable_version.model.name,
        versions=versions,
        tenant_weights=tenant_weights,
        published=published,
    )
    report.weights = {v.version_id: v.weight for v in versions}
    report.endpoints = {v.version_id: list(v.endpoints) for v in versions}

    try:
        placed = _replicas_place(deployment, desired, view, fresh_after, in_flight, report)
    finally:
        if view_changed:
            view.invalidate()
    tracing.span_attributes_set(
        deployment=report.deployment,
        routing_revision=report.revision,
        weights=",".join(f"{version}:{weight}" for version, weight in report.weights.items()),
        loads=len(placed),
        rolled_back=report.rolled_back,
    )
    return report, placed


def kept_replicas(agents: Sequence[Agent], version_id: int, count: int) -> list[Agent]:
    """The ready agents of `version_id` that stay (by name, the first `count`): the routing
    table lists only these, and the reconciler drains the rest once the gateways dropped
    them. Replicas beyond the count exist after a scale-down or a replacement's return."""
    ready = [a for a in agents if a.loaded_version_id == version_id and a.state == AgentState.READY]
    return sorted(ready, key=lambda agent: agent.name)[:count]


def _placement(
    alive: list[Agent],
    in_flight_commands: Sequence[tuple[int, str, int | None]],
    view: FleetView,
) -> Placement:
    """The fleet's memory: each live agent's loaded version and the loads sent to it."""
    engines: dict[int, set[int]] = {}
    for agent in alive:
        if agent.loaded_version_id is not None:
            engines.setdefault(agent.id, set()).add(agent.loaded_version_id)
    for agent_id, kind, version_id in in_flight_commands:
        if kind == CommandKind.LOAD and version_id is not None:
            engines.setdefault(agent_id, set()).add(version_id)
    version_ids = {version_id for ids in engines.values() for version_id in ids}
    version_ids |= set(view.needed)
    return Placement(
        agents=alive,
        footprints=view.footprints(version_ids),
        engines=engines,
        memory=view.agent_memory(alive),
    )


class _LazyPlacement:
    """The pass's Placement, built when a version first needs an agent: in a fleet that has
    converged, never."""

    def __init__(
        self,
        alive: list[Agent],
        in_flight_commands: Sequence[tuple[int, str, int | None]],
        view: FleetView,
    ) -> None:
        self._arguments = (alive, in_flight_commands, view)
        self._placement: Placement | None = None

    def get(self) -> Placement:
        if self._placement is None:
            self._placement = _placement(*self._arguments)
        return self._placement


def _unplaced_record(deployment: Deployment, unplaced: list[Unplaced]) -> None:
    """Keep the deployment's reasons current (the API and dashboard show them); written
    and logged only when they change, so a version that waits for room is said once."""
    recorded = [why.to_dict() for why in unplaced]
    if recorded == deployment.unplaced_versions:
        return
    Deployment.objects.filter(pk=deployment.pk).update(unplaced_versions=recorded)
    deployment.unplaced_versions = recorded
    for why in unplaced:
        logger.warning(
            "version not placed: %s",
            why.message,
            extra={"deployment": deployment.name, "version_id": why.version_id},
        )
    if not unplaced:
        logger.info("every version placed", extra={"deployment": deployment.name})


def _replicas_place(
    deployment: Deployment,
    desired: DesiredRouting,
    view: FleetView,
    fresh_after: Any,
    in_flight: InFlight,
    report: ReconcileReport,
) -> list[CommandOrder]:
    """Choose agents to load each needed version on, as many as its replicas (hosts spread
    first), and one to keep the previous stable version warm: the loads, to be sent (each
    added to `in_flight`)."""
    needed, warm = view.needed, view.warm

    alive, alive_ids = view.alive(fresh_after)

    def is_alive(agent: Agent) -> bool:
        return agent.id in alive_ids  # `id`, not `pk`: a property, slow over a fleet

    # An agent's version as read, not as this pass changes it below: an agent given a load
    # here is LOADING, neither a replica of its old version nor a ready one of the new.
    def alive_with(version_id: int) -> list[Agent]:
        return [a for a in view.loaded_with(version_id) if is_alive(a)]

    loading = in_flight.loading

    def busy(agent: Agent) -> bool:
        return _is_busy(agent, in_flight)

    placement = _LazyPlacement(alive, in_flight.commands, view)
    # Agents given a load by this pass, as read: they are put back as the view holds them
    # (the database has them so until their agents report).
    taken: list[tuple[Agent, int | None, str]] = []
    unplaced: list[Unplaced] = []
    loads: list[CommandOrder] = []  # sent together once every version is placed
    for version_id in desired.get("preload_version_ids") or []:
        if version_id not in needed:  # revoked
            continue
        replicas = {
            a.pk
            for a in alive_with(version_id)
            if a.loaded_version_id == version_id and a.state != AgentState.DRAINING
        } | loading.get(version_id, set())
        hosts = _hosts_of([a for a in view.with_ids(replicas) if is_alive(a)], replicas)
        if len(replicas) >= needed[version_id]:
            continue
        # Placing a replica changes no other agent: the one chosen leaves the spare ones.
        spare = [
            a
            for a in alive
            if a.id not in in_flight.agents  # not busy, nor draining
            and a.state not in _BUSY_STATES
            and a.state != AgentState.DRAINING
            and a.id not in replicas
            and (a.state == AgentState.IDLE or a.loaded_version_id not in needed)
        ]
        failed_loads = view.failed_loads()
        keeping_warm = {a.id for a in spare if a.loaded_version_id in warm}
        while len(replicas) < needed[version_id]:
            untried = [a for a in spare if (a.id, version_id) not in failed_loads]
            agent, why = _choose_spread(placement.get(), version_id, untried, keeping_warm, hosts)
            if agent is None and len(untried) < len(spare):
                agent, why = _choose_spread(placement.get(), version_id, spare, keeping_warm, hosts)
            if agent is None:
                if why is not None:
                    unplaced.append(why)
                break
            reason = f"reconcile {deployment.name} revision {deployment.routing_revision}"
            loads.append(_load_order(deployment, agent, version_id, reason))
            in_flight.command_added(agent.id, CommandKind.LOAD, version_id)
            replicas.add(agent.id)
            spare = [a for a in spare if a is not agent]  # `remove` compares models: slow
            hosts[agent.host] = hosts.get(agent.host, 0) + 1
            taken.append((agent, agent.loaded_version_id, agent.state))
            agent.loaded_version_id = version_id  # not spare for the next version of this pass
            agent.state = AgentState.LOADING
    report.unplaced = [why.message for why in unplaced]
    _unplaced_record(deployment, unplaced)

    previous_id = view.previous_stable(deployment.pk, deployment.stable_version_id)
    if (
        previous_id in warm
        and previous_id not in loading
        and not any(
            a.loaded_version_id == previous_id and a.state != AgentState.DRAINING
            for a in alive_with(previous_id)
        )
    ):
        agent = _warm_agent(previous_id, alive, busy, placement.get())
        if agent is not None:
            reason = f"keep {deployment.name}'s previous stable version warm"
            loads.append(_load_order(deployment, agent, previous_id, reason))
            in_flight.command_added(agent.id, CommandKind.LOAD, previous_id)

    for agent, loaded_version_id, state in taken:
        agent.loaded_version_id, agent.state = loaded_version_id, state
    return loads


def _agents_retire(view: FleetView, in_flight: InFlight, client: redis.Redis) -> list[str]:
    """Drain agents whose version nobody needs, and replicas beyond the count, once the
    gateways have dropped them: the agents drained. The whole fleet's look, once a batch."""
    needed, warm = view.needed, view.warm
    fresh_after = timezone.now() - timedelta(seconds=settings.ROLLOUTS_AGENT_FRESH_S)
    _, alive_ids = view.alive(fresh_after)

    def is_alive(agent: Agent) -> bool:
        return agent.id in alive_ids  # `id`, not `pk`: a property, slow over a fleet

    def busy(agent: Agent) -> bool:
        return _is_busy(agent, in_flight)

    # Each version's replicas that stay; an agent serving a version beyond them is retired.
    # The agents as read: the same for every batch of the pass.
    if view.kept is None:
        view.kept = {
            agent.pk
            for version_id in {*needed, *warm}
            for agent in kept_replicas(
                [a for a in view.loaded_with(version_id) if is_alive(a)],
                version_id,
                needed.get(version_id, 1),
            )
        }
    kept = view.kept
    drained: list[str] = []
    grace = settings.ROLLOUTS_DRAIN_GRACE_S
    retirable = [
        agent
        for agent in view.loaded  # as read: one given a load by this pass is not READY
        if agent.state == AgentState.READY
        and agent.loaded_version_id is not None
        and is_alive(agent)
        and not busy(agent)
        and agent.pk not in in_flight.settling
    ]
    # A kept agent's retirement mark goes: one round trip for all the fleet's kept agents,
    # in the pass's first batch (they are the same in every other).
    unmark = client.pipeline(transaction=False)
    for agent in retirable:
        retire_key = f"rollouts:retire:{agent.name}:{agent.loaded_version_id}"
        if agent.pk in kept and retire_key not in view.unmarked:
            unmark.delete(retire_key)
            view.unmarked.add(retire_key)
    unmark.execute()
    for agent in retirable:
        if agent.pk in kept:
            continue
        retire_key = f"rollouts:retire:{agent.name}:{agent.loaded_version_id}"
        # First seen unneeded now; drained after the gateways have dropped it from their tables.
        client.set(retire_key, str(time.time()), nx=True, ex=3600)
        since = float(client.get(retire_key) or time.time())
        if time.time() - since < grace:
            continue
        surplus = agent.loaded_version_id in needed or agent.loaded_version_id in warm
        try:
            fleet_services.agent_command_send(
                actor=None,
                agent_name=agent.name,
                kind=CommandKind.DRAIN,
                version_id=agent.loaded_version_id,
                reason=f"version {agent.loaded_version_id} has more replicas than asked"
                if surplus
                else f"version {agent.loaded_version_id} is no longer routed",
                redis_client=client,
            )
            drained.append(agent.name)
            in_flight.command_added(agent.id, CommandKind.DRAIN, agent.loaded_version_id)
            client.delete(retire_key)
        except DomainError as exc:
            logger.warning("drain not sent", extra={"agent": agent.name, "error": exc.message})
    return drained


def _hosts_of(alive: Sequence[Agent], agent_ids: set[int]) -> dict[str, int]:
    """How many of `agent_ids` run on each host."""
    hosts: dict[str, int] = {}
    for agent in alive:
        if agent.pk in agent_ids:
            hosts[agent.host] = hosts.get(agent.host, 0) + 1
    return hosts


def _choose_spread(
    placement: Placement,
    version_id: int,
    spare: list[Agent],
    keeping_warm: set[int],
    hosts: Mapping[str, int],
) -> tuple[Agent | None, Unplaced | None]:
    """A spare agent for one more replica of `version_id` where it fits: on the hosts with
    fewest of its replicas first, and an agent keeping a previous stable version warm (its
    id in `keeping_warm`) last. The reason, when none fits, is the one for every spare
    agent."""
    return placement.choose(
        version_id,
        spare,
        preference=lambda agent: (agent.id in keeping_warm, hosts.get(agent.host, 0)),
    )


def _warm_agent(
    version_id: int,
    alive: list[Agent],
    busy: Any,
    placement: Placement,
) -> Agent | None:
    """An idle agent whose memory holds the previous stable version, to keep it warm; None
    when nothing fits (it is simply not warm). Only an idle one: an agent still holding a
    version nobody needs is drained first (a revoked one must stop at once, not after a
    load)."""
    spare = [a for a in alive if not busy(a) and a.state == AgentState.IDLE]
    agent, _ = placement.choose(version_id, spare)
    return agent


def _load_order(deployment: Deployment, agent: Agent, version_id: int, reason: str) -> CommandOrder:
    return CommandOrder(
        agent_name=agent.name,
        kind=CommandKind.LOAD,
        version_id=version_id,
        # The name tenants send: the routing table's model, which the engine checks every
        # request against.
        served_model_name=deployment.stable_version.model.name,
        reason=reason,
    )


def _loads_send(loads: list[tuple[ReconcileReport, CommandOrder]], client: redis.Redis) -> None:
    """Send a batch's loads together, on the pass's Redis connection, each in the report of
    the deployment that decided it; those the fleet refuses are logged (the next pass
    places their replicas again)."""
    if not loads:
        return
    orders = [order for _, order in loads]
    try:
        sent = fleet_services.agent_commands_send(actor=None, orders=orders, redis_client=client)
    except DomainError as exc:
        logger.warning(
            "loads not sent",
            extra={"agents": [order.agent_name for order in orders], "error": exc.message},
        )
        return
    refused = {id(order) for order, _ in sent.refused}
    for order, why in sent.refused:
        logger.warning("load not sent", extra={"agent": order.agent_name, "error": why.message})
    accepted = [report for report, order in loads if id(order) not in refused]
    for report, command in zip(accepted, sent.commands, strict=True):
        if command.version_id is not None:  # a load names its version
            report.loads.append((command.agent.name, command.version_id))
