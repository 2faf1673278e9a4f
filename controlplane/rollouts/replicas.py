"""How many agents serve a deployment's versions, and every change of that number.

A deployment's stable version runs `stable_replicas` agents, between the bounds an operator
sets (`deployment_replicas_set`); a rollout's candidate runs `canary_replicas`, between the
bounds given when the rollout was created. The autoscaler (controlplane/rollouts/scaling.py)
moves the counts within the bounds through `replicas_scale`. Each change writes the
desired routing (the reconciler places the replicas), a ScalingDecision with its reason
and figures, and an audit event, in one transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import transaction

from controlplane.audit.services import Actor, acting_user, audit_event_record
from controlplane.rollouts import hooks
from controlplane.rollouts.autoscaling import autoscaling_policy_validate
from controlplane.rollouts.deployments import routing_write
from controlplane.rollouts.models import (
    ACTIVE_STATES,
    Deployment,
    ReplicaRole,
    Rollout,
    ScalingDecision,
)
from controlplane.rollouts.stages import replicas_validate
from controlplane.rollouts.transitions import require_reason


def active_rollout(deployment: Deployment) -> Rollout | None:
    return Rollout.objects.filter(deployment=deployment, state__in=ACTIVE_STATES).first()


@transaction.atomic
def deployment_replicas_set(
    *,
    actor: Actor,
    deployment: Deployment,
    stable_min: object,
    stable_max: object,
    autoscaling: Mapping[str, Any] | None = None,
    reason: str,
) -> Deployment:
    """Set the stable version's bounds (and the autoscaling policy when given); the count
    moves into the new bounds at once, recorded as a decision of the actor's."""
    reason = require_reason(reason)
    minimum, maximum = replicas_validate(stable_min, stable_max, field="stable_replicas")
    policy = autoscaling_policy_validate(autoscaling) if autoscaling is not None else None
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    before = replicas_snapshot(deployment)
    previous = deployment.stable_replicas
    deployment.stable_replicas_min, deployment.stable_replicas_max = minimum, maximum
    deployment.stable_replicas = min(max(previous, minimum), maximum)
    if policy is not None:
        deployment.autoscaling = policy.to_dict()
    deployment.save(
        update_fields=[
            "stable_replicas_min",
            "stable_replicas_max",
            "stable_replicas",
            "autoscaling",
            "updated_at",
        ]
    )
    if deployment.stable_replicas != previous:
        ScalingDecision.objects.create(
            deployment=deployment,
            role=ReplicaRole.STABLE,
            version_id=deployment.stable_version_id,
            previous_replicas=previous,
            replicas=deployment.stable_replicas,
            reason=f"bounds set to {minimum}..{maximum}: {reason}",
            actor=acting_user(actor),
        )
    routing_write(deployment, rollout=active_rollout(deployment))
    audit_event_record(
        actor=actor,
        action="deployment.replicas",
        object_type="deployment",
        object_id=deployment.pk,
        object_repr=deployment.name,
        before=before,
        after=replicas_snapshot(deployment),
        reason=reason,
    )
    hooks.reconcile_after_commit(deployment.pk)
    return deployment


def replicas_snapshot(deployment: Deployment) -> dict[str, Any]:
    return {
        "stable_replicas_min": deployment.stable_replicas_min,
        "stable_replicas_max": deployment.stable_replicas_max,
        "stable_replicas": deployment.stable_replicas,
        "autoscaling": deployment.autoscaling,
    }


@transaction.atomic
def replicas_scale(
    *,
    deployment_id: int,
    role: ReplicaRole,
    expected: int,
    replicas: int,
    reason: str,
    figures: Mapping[str, float],
) -> ScalingDecision | None:
    """The autoscaler's change of one role's count from `expected` to `replicas`; None
    (nothing written) when the count moved meanwhile or the rollout ended."""
    deployment = Deployment.objects.select_for_update().get(pk=deployment_id)
    rollout = active_rollout(deployment)
    if role == ReplicaRole.STABLE:
        if deployment.stable_replicas != expected:
            return None
        deployment.stable_replicas = replicas
        deployment.save(update_fields=["stable_replicas", "updated_at"])
        version_id = deployment.stable_version_id
    else:
        if rollout is None or rollout.canary_replicas != expected:
            return None
        rollout.canary_replicas = replicas
        rollout.save(update_fields=["canary_replicas", "updated_at"])
        version_id = rollout.candidate_id
    decision = ScalingDecision.objects.create(
        deployment=deployment,
        rollout=rollout if role == ReplicaRole.CANARY else None,
        role=role,
        version_id=version_id,
        previous_replicas=expected,
        replicas=replicas,
        reason=reason,
        figures=dict(figures),
    )
    routing_write(deployment, rollout=rollout)
    audit_event_record(
        actor=None,
        action="deployment.scale",
        object_type="deployment",
        object_id=deployment.pk,
        object_repr=deployment.name,
        before={"role": role.value, "replicas": expected},
        after={"role": role.value, "replicas": replicas, "figures": dict(figures)},
        reason=reason,
    )
    hooks.reconcile_after_commit(deployment.pk)
    return decision
