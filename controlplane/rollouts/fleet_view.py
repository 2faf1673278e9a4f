"""The fleet as one reconcile pass reads it: what every deployment's pass reads alike,
read once for a pass over many deployments (the reconciler's `reconcile_deployments`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from controlplane.fleet.engine_secrets import serving_loads, serving_secrets
from controlplane.fleet.models import Agent, AgentCommand, AgentState, CommandKind, CommandStatus
from controlplane.registry.models import DEPLOYABLE_STATUSES, ModelVersion, VersionStatus
from controlplane.rollouts.models import Deployment, DeploymentRevision
from controlplane.rollouts.placement import AgentMemory


class FleetView:
    """What every deployment's pass reads alike, read once for a pass over many: the
    agents, the load serving on each and its secret, the versions needed, those kept warm,
    footprints, the loads that failed lately. The commands in flight are not in it: each
    batch of deployments reads those afresh once it holds their locks
    (`reconcile_reads.InFlight`), so it sees the loads and drains sent before it (by this
    pass or another process).

    A deployment's pass leaves the agents as read (what it changes on them while placing
    is put back); one that changes desired routing (a rollout ended) drops the view, and
    the next deployment reads it again.
    """

    def __init__(self) -> None:
        self.invalidate()

    def invalidate(self) -> None:
        """Forget everything read: the next look reads it again."""
        self._agents: list[Agent] | None = None
        self._by_version: dict[int | None, list[Agent]] = {}
        self._by_id: dict[int, Agent] = {}
        self._loaded: list[Agent] = []
        self._loads: dict[int, str] = {}
        self._secrets: dict[int, str] = {}
        self._needed: dict[int, int] | None = None
        self._latest_revisions: dict[int, DeploymentRevision] | None = None
        self._warm: set[int] | None = None
        self._footprints: dict[int, Any] = {}
        self._alive: list[Agent] | None = None
        self._alive_ids: set[int] = set()
        self._agent_memory: AgentMemory | None = None
        self._failed_loads: set[tuple[int, int]] | None = None
        # The ids of the agents whose replicas stay (the reconciler's retirement step).
        self.kept: set[int] | None = None
        self._deployment_names: dict[int, str] | None = None
        # The retirement marks of kept agents removed: once for all the deployments.
        self.unmarked: set[str] = set()

    def _read_agents(self) -> list[Agent]:
        if self._agents is None:
            agents = list(Agent.objects.all())
            self._by_version = {}
            for agent in agents:
                self._by_version.setdefault(agent.loaded_version_id, []).append(agent)
            self._by_id = {agent.pk: agent for agent in agents}
            self._loaded = [agent for agent in agents if agent.loaded_version_id is not None]
            # Each engine's load command: its serving secret (published) and admin secret
            # (never published: the engine proves it holds it before its endpoint is routed).
            self._loads = serving_loads(agents)
            self._secrets = serving_secrets(agents, self._loads)
            self._agents = agents
        return self._agents

    @property
    def agents(self) -> list[Agent]:
        return self._read_agents()

    def deployment_name(self, deployment_id: int) -> str | None:
        """The deployment's name (its lock's), None when there is no such deployment. A
        name never changes: one read for the pass."""
        if self._deployment_names is None or deployment_id not in self._deployment_names:
            self._deployment_names = dict(Deployment.objects.values_list("pk", "name"))
        return self._deployment_names.get(deployment_id)

    def alive(self, fresh_after: Any) -> tuple[list[Agent], set[int]]:
        """The agents not lost and seen since `fresh_after` (the first deployment's, for the
        whole pass: about a pass old for the last one), and their ids."""
        if self._alive is None:
            self._alive = [
                agent
                for agent in self._read_agents()
                if agent.state != AgentState.LOST
                and agent.last_seen is not None
                and agent.last_seen >= fresh_after
            ]
            self._alive_ids = {agent.pk for agent in self._alive}
        return self._alive, self._alive_ids

    def agent_memory(self, alive: list[Agent]) -> AgentMemory:
        """The memory of the `alive` agents (as `alive` gives them), read once."""
        if self._agent_memory is None:
            self._agent_memory = AgentMemory.of(alive)
        return self._agent_memory

    def loaded_with(self, version_id: int | None) -> list[Agent]:
        """The agents that had `version_id` loaded when read (in the order of `agents`):
        what a pass looks through instead of the whole fleet, for each version."""
        self._read_agents()
        return self._by_version.get(version_id, [])

    @property
    def loaded(self) -> list[Agent]:
        """The agents that had a version loaded when read (in the order of `agents`)."""
        self._read_agents()
        return self._loaded

    def with_ids(self, agent_ids: Iterable[int]) -> list[Agent]:
        """The agents of these ids (those that were there when read)."""
        self._read_agents()
        return [self._by_id[pk] for pk in agent_ids if pk in self._by_id]

    @property
    def loads(self) -> dict[int, str]:
        """Agent id -> the load command its engine serves for."""
        self._read_agents()
        return self._loads

    @property
    def secrets(self) -> dict[int, str]:
        """Agent id -> its engine's serving secret."""
        self._read_agents()
        return self._secrets

    @property
    def needed(self) -> dict[int, int]:
        if self._needed is None:
            self._needed = _needed_versions()
        return self._needed

    def previous_stable(self, deployment_id: int, stable_id: int) -> int | None:
        """The version the deployment's stable one replaced, while it is kept warm."""
        if settings.ROLLOUTS_PREVIOUS_STABLE_WARM_S <= 0:
            return None
        if self._latest_revisions is None:
            self._latest_revisions = _latest_revisions()
        return _kept_warm(self._latest_revisions.get(deployment_id), stable_id)

    @property
    def warm(self) -> set[int]:
        if self._warm is None:
            self._warm = _warm_versions(self.needed, self)
        return self._warm

    def failed_loads(self) -> set[tuple[int, int]]:
        """(agent id, version id) whose load failed lately: another spare agent is tried
        first (the same engine failing on the same agent would fail again, and hold the
        replica back). Read when a pass first places a replica."""
        if self._failed_loads is None:
            since = timezone.now() - timedelta(seconds=settings.ROLLOUTS_LOAD_FAILED_AVOID_S)
            failed = AgentCommand.objects.filter(
                kind=CommandKind.LOAD,
                status__in=(CommandStatus.FAILED, CommandStatus.REJECTED),
                finished_at__gte=since,
            ).values_list("agent_id", "version_id")
            self._failed_loads = {
                (agent_id, version_id) for agent_id, version_id in failed if version_id is not None
            }
        return self._failed_loads

    def footprints(self, version_ids: set[int]) -> dict[int, Any]:
        """Version id -> stored footprint (None: unknown, or no such version)."""
        missing = version_ids - set(self._footprints)
        if missing:
            rows = ModelVersion.objects.filter(pk__in=missing).values_list("pk", "footprint")
            self._footprints.update(dict.fromkeys(missing))
            self._footprints.update(dict(rows))
        return {version_id: self._footprints[version_id] for version_id in version_ids}


def _kept_warm(latest: DeploymentRevision | None, stable_id: int) -> int | None:
    """The previous version the deployment's latest revision names, while it is kept warm."""
    retention = settings.ROLLOUTS_PREVIOUS_STABLE_WARM_S
    if (
        latest is None
        or latest.version_id != stable_id
        or latest.previous_version_id is None
        or latest.created_at < timezone.now() - timedelta(seconds=retention)
    ):
        return None
    return latest.previous_version_id


def _latest_revisions() -> dict[int, DeploymentRevision]:
    """Every deployment's latest revision, in one query."""
    latest_ids = (
        DeploymentRevision.objects.order_by()
        .values("deployment_id")
        .annotate(latest_id=Max("id"))
        .values("latest_id")
    )
    return {
        revision.deployment_id: revision
        for revision in DeploymentRevision.objects.filter(pk__in=latest_ids)
    }


def _warm_versions(needed: Mapping[int, int], view: FleetView) -> set[int]:
    """Every deployment's previous stable version while kept warm, unless needed anyway."""
    warm: set[int] = set()
    for deployment_id, stable_id in Deployment.objects.values_list("pk", "stable_version_id"):
        previous_id = view.previous_stable(deployment_id, stable_id)
        if previous_id is not None:
            warm.add(previous_id)
    deployable = ModelVersion.objects.filter(pk__in=warm, status__in=DEPLOYABLE_STATUSES)
    return set(deployable.values_list("pk", flat=True)) - set(needed)


def _needed_versions() -> dict[int, int]:
    """The versions some deployment routes to or preloads, each with the replicas asked
    for it (the most any deployment asks), revoked ones left out."""
    needed: dict[int, int] = {}
    for routing in Deployment.objects.values_list("desired_routing", flat=True):
        replicas = routing.get("replicas") or {}
        version_ids = list(routing.get("preload_version_ids") or [])
        if routing.get("stable_version_id"):
            version_ids.append(routing["stable_version_id"])
        for version_id in version_ids:
            count = int(replicas.get(str(version_id), 1))
            needed[version_id] = max(needed.get(version_id, 0), count)
    revoked = ModelVersion.objects.filter(pk__in=needed, status=VersionStatus.REVOKED)
    for version_id in revoked.values_list("pk", flat=True):
        needed.pop(version_id, None)
    return needed
