"""Undo: put a deployment's previous stable version back in one action.

The version before the current stable one was stable already, so there is no evaluation
gate and no stages: like a rollback, the desired routing changes in one transaction with
the revision and the audit event, and the reconciler runs as soon as it commits. The
reconciler keeps that version loaded on a spare agent for ROLLOUTS_PREVIOUS_STABLE_WARM_S
after each change (reconciler.py), so the switch is usually immediate; otherwise the
restored version is loaded and the demoted one serves until it is ready.

Refused, changing nothing: a missing or overlong reason, a deployment with an active rollout
(roll that back or abort it instead), one without a previous stable version, a previous
version that was revoked or is no longer deployable.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.audit.services import Actor, audit_event_record
from controlplane.core.errors import Conflict, NotFound
from controlplane.fleet.models import Agent, AgentState
from controlplane.registry.models import DEPLOYABLE_STATUSES, ModelVersion, VersionStatus
from controlplane.rollouts import hooks, transitions
from controlplane.rollouts.deployments import routing_write
from controlplane.rollouts.models import (
    ACTIVE_STATES,
    Deployment,
    DeploymentRevision,
    RevisionSource,
    Rollout,
)
from controlplane.rollouts.revisions import revision_latest, revision_record


class Switch(StrEnum):
    """When the restored version takes the traffic."""

    IMMEDIATE = "immediate"  # an agent serves it already: the next routing table routes to it
    AFTER_LOAD = "after_load"  # it is loaded first; the demoted version serves meanwhile


@dataclass(frozen=True, slots=True)
class UndoResult:
    deployment: Deployment
    revision: DeploymentRevision
    switch: Switch


def undo_target(deployment: Deployment) -> int | None:
    """The version an undo would restore: the one the current stable version replaced."""
    latest = revision_latest(deployment.pk)
    if latest is None or latest.version_id != deployment.stable_version_id:
        return None
    return latest.previous_version_id


def is_warm(version_id: int) -> bool:
    """An agent has the version loaded and ready, and was heard from recently."""
    fresh_after = timezone.now() - timedelta(seconds=settings.ROLLOUTS_AGENT_FRESH_S)
    return Agent.objects.filter(
        loaded_version_id=version_id, state=AgentState.READY, last_seen__gte=fresh_after
    ).exists()


@transaction.atomic
def deployment_undo(*, actor: Actor, deployment_name: str, reason: str) -> UndoResult:
    """Make the previous stable version the stable one again, or refuse and change nothing."""
    reason = transitions.require_reason(reason)
    # The deployment's lock orders this against rollout_create and a promotion's commit.
    deployment = Deployment.objects.select_for_update().filter(name=deployment_name).first()
    if deployment is None:
        raise NotFound("No such deployment.")
    active = Rollout.objects.filter(deployment=deployment, state__in=ACTIVE_STATES).first()
    if active is not None:
        raise Conflict(
            "rollout_in_progress",
            f"Rollout {active.pk} is {active.state} on {deployment.name!r}:"
            " roll it back or abort it instead.",
            fields={"rollout_id": active.pk, "rollout_state": active.state},
        )
    target_id = undo_target(deployment)
    if target_id is None:
        raise Conflict(
            "no_previous_stable",
            f"Deployment {deployment.name!r} has no previous stable version to go back to.",
        )
    # Locked: a revocation commits either before (refused here) or after (then the
    # reconciler stops routing it, as for any revoked stable version).
    target = ModelVersion.objects.select_for_update().get(pk=target_id)
    if target.status == VersionStatus.REVOKED:
        raise Conflict(
            "previous_version_revoked",
            f"The previous stable version {target} was revoked; it may not serve again.",
            fields={"previous_version": target.pk},
        )
    if target.status not in DEPLOYABLE_STATUSES:
        raise Conflict(
            "previous_version_not_deployable",
            f"The previous stable version {target} is {target.status}.",
            fields={"previous_version": target.pk, "previous_version_status": target.status},
        )
    demoted_id = deployment.stable_version_id
    before = {"stable_version_id": demoted_id, "routing_revision": deployment.routing_revision}
    deployment.stable_version_id = target.pk
    routing_write(deployment, rollout=None)
    revision = revision_record(
        deployment=deployment,
        previous_version_id=demoted_id,
        source=RevisionSource.UNDO,
        actor=actor,
        reason=reason,
    )
    switch = Switch.IMMEDIATE if is_warm(target.pk) else Switch.AFTER_LOAD
    after = {
        "stable_version_id": target.pk,
        "routing_revision": deployment.routing_revision,
        "revision_id": revision.pk,
        "switch": switch.value,
    }
    audit_event_record(
        actor=actor,
        action="deployment.undo",
        object_type="deployment",
        object_id=deployment.pk,
        object_repr=deployment.name,
        before=before,
        after=after,
        reason=reason,
    )
    hooks.emit_deployment(
        deployment,
        "deployment.undo",
        {
            "previous_version_id": demoted_id,
            "revision_id": revision.pk,
            "switch": switch.value,
            "reason": reason,
        },
    )
    hooks.reconcile_after_commit(deployment.pk)
    return UndoResult(deployment=deployment, revision=revision, switch=switch)
