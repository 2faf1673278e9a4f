"""The history of a deployment's stable version: one row per change, written in the change's
transaction (creation, a rollout's promotion, an undo)."""

from __future__ import annotations

from controlplane.audit.services import SYSTEM_ACTOR, Actor, acting_user
from controlplane.rollouts.models import Deployment, DeploymentRevision, RevisionSource, Rollout


def revision_record(
    *,
    deployment: Deployment,
    previous_version_id: int | None,
    source: RevisionSource,
    actor: Actor,
    reason: str,
    rollout: Rollout | None = None,
) -> DeploymentRevision:
    """Append the deployment's new stable version (already set on `deployment`)."""
    user = acting_user(actor)
    return DeploymentRevision.objects.create(
        deployment=deployment,
        version_id=deployment.stable_version_id,
        previous_version_id=previous_version_id,
        source=source,
        rollout=rollout,
        actor=user,
        actor_name=user.get_username() if user is not None else SYSTEM_ACTOR,
        reason=reason,
    )


def revision_latest(deployment_id: int) -> DeploymentRevision | None:
    """The revision that made the current stable version; None for a deployment without one."""
    return DeploymentRevision.objects.filter(deployment_id=deployment_id).order_by("-id").first()
