"""What the reconcile passes of a few deployments read once their locks are held.

A pass over the fleet locks its deployments a batch at a time; the batch's rows, the
versions they route and the commands in flight are then read together, a few statements
for the batch instead of a few for each deployment. Never before the locks: the newest
committed desired routing wins (controlplane.rollouts.reconciler).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from controlplane.fleet.models import AgentCommand, CommandKind, CommandStatus
from controlplane.registry.models import ModelVersion, VersionStatus
from controlplane.registry.serving import context_length
from controlplane.rollouts.models import ACTIVE_STATES, Deployment, Rollout

IN_FLIGHT_COMMANDS = (CommandStatus.PENDING, CommandStatus.ACCEPTED)


@dataclass(frozen=True, slots=True)
class VersionRow:
    label: str
    context_length: int
    is_revoked: bool


def revoked_candidates(deployment_ids: Collection[int]) -> set[int]:
    """The revoked versions that are candidates of these deployments' active rollouts."""
    return set(
        Rollout.objects.filter(
            deployment_id__in=deployment_ids,
            state__in=ACTIVE_STATES,
            candidate__status=VersionStatus.REVOKED,
        ).values_list("candidate_id", flat=True)
    )


def deployments_read(deployment_ids: Collection[int]) -> dict[int, Deployment]:
    """The deployments by id (with their stable version and its model); the gone left out."""
    rows = Deployment.objects.select_related("stable_version__model").filter(pk__in=deployment_ids)
    return {deployment.pk: deployment for deployment in rows}


def versions_read(version_ids: Collection[int]) -> dict[int, VersionRow]:
    """What routing needs of each version: its label, context length, whether revoked."""
    rows = ModelVersion.objects.filter(pk__in=version_ids).values_list(
        "pk", "label", "serving_config", "status"
    )
    return {
        pk: VersionRow(
            label=label,
            context_length=context_length(config),
            is_revoked=status == VersionStatus.REVOKED,
        )
        for pk, label, config, status in rows
    }


@dataclass(slots=True)
class InFlight:
    """The fleet's commands that placement and retirement heed: those under way (sent within
    ROLLOUTS_COMMAND_WAIT_S), and those finished within the agents' freshness window. The
    loads a batch's passes decide join them as they are decided, so the next deployment of
    the batch sees them before they are sent."""

    commands: list[tuple[int, str, int | None]] = field(default_factory=list)  # under way
    agents: set[int] = field(default_factory=set)  # with a command under way
    # Version id -> the agents taking it: loads under way, and loads that just succeeded (a
    # load's result can reach the database before the heartbeat naming the new version).
    loading: dict[int, set[int]] = field(default_factory=dict)
    # Agents whose command finished within the freshness window: a heartbeat sent before it
    # may still describe them, so no drain is decided from their rows.
    settling: set[int] = field(default_factory=set)

    @classmethod
    def read(cls) -> InFlight:
        now = timezone.now()
        wait_after = now - timedelta(seconds=settings.ROLLOUTS_COMMAND_WAIT_S)
        finished_after = now - timedelta(seconds=settings.ROLLOUTS_AGENT_FRESH_S)
        rows: Any = AgentCommand.objects.filter(
            Q(status__in=IN_FLIGHT_COMMANDS, created_at__gte=wait_after)
            | Q(finished_at__gte=finished_after)
        ).values_list("agent_id", "kind", "version_id", "status", "created_at", "finished_at")
        in_flight = cls()
        for agent_id, kind, version_id, status, created_at, finished_at in rows:
            if status in IN_FLIGHT_COMMANDS and created_at >= wait_after:
                in_flight.command_added(agent_id, kind, version_id)
            if finished_at is not None and finished_at >= finished_after:
                in_flight.settling.add(agent_id)
                if kind == CommandKind.LOAD and status == CommandStatus.SUCCEEDED:
                    in_flight.loading.setdefault(version_id, set()).add(agent_id)
        return in_flight

    def command_added(self, agent_id: int, kind: str, version_id: int | None) -> None:
        self.commands.append((agent_id, kind, version_id))
        self.agents.add(agent_id)
        if kind == CommandKind.LOAD and version_id is not None:
            self.loading.setdefault(version_id, set()).add(agent_id)
