"""Deployments and the rollouts started on them, and the desired routing a rollout implies.

A deployment names a model's stable version; its `desired_routing` (with a revision
bumped on every change) is what the reconciler makes true in Redis and on the agents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import IntegrityError, transaction

from contracts.routing import DEPLOYMENT_PATTERN
from controlplane.audit.services import Actor, acting_user, audit_event_record
from controlplane.core.errors import Conflict, DomainError
from controlplane.registry.models import DEPLOYABLE_STATUSES, EvalSuite, ModelVersion
from controlplane.rollouts import hooks
from controlplane.rollouts.models import (
    ACTIVE_STATES,
    Deployment,
    DesiredRouting,
    RevisionSource,
    Rollout,
    RolloutState,
)
from controlplane.rollouts.revisions import revision_record
from controlplane.rollouts.stages import policy_validate, replicas_validate, stages_validate


def rollout_repr(rollout: Rollout) -> str:
    return f"{rollout.deployment.name}: {rollout.baseline_id} -> {rollout.candidate_id}"


@transaction.atomic
def deployment_create(
    *, actor: Actor, name: str, stable_version: ModelVersion, reason: str = ""
) -> Deployment:
    if not DEPLOYMENT_PATTERN.fullmatch(name):
        raise DomainError(
            "invalid_name",
            "A deployment name is 1-100 of a-z, 0-9, '.', '_', '-'.",
            fields={"name": [name]},
        )
    if Deployment.objects.filter(name=name).exists():
        raise Conflict("deployment_exists", f"A deployment named {name!r} exists.")
    check_deployable(stable_version, field="stable_version")
    deployment = Deployment.objects.create(name=name, stable_version=stable_version)
    routing_write(deployment, rollout=None)
    revision_record(
        deployment=deployment,
        previous_version_id=None,
        source=RevisionSource.CREATE,
        actor=actor,
        reason=reason,
    )
    audit_event_record(
        actor=actor,
        action="deployment.create",
        object_type="deployment",
        object_id=deployment.pk,
        object_repr=name,
        after={"stable_version_id": stable_version.pk, "routing": deployment.desired_routing},
        reason=reason,
    )
    hooks.reconcile_after_commit(deployment.pk)
    return deployment


def check_deployable(version: ModelVersion, *, field: str) -> None:
    if version.status not in DEPLOYABLE_STATUSES:
        raise DomainError(
            "version_not_deployable",
            f"Version {version} is {version.status}; it must be verified, evaluated or approved.",
            fields={field: [version.status]},
        )


def _desired_routing(deployment: Deployment, rollout: Rollout | None) -> DesiredRouting:
    canary_id = None
    weight = 0
    tenants: list[str] = []
    is_shadow = False
    preload = [deployment.stable_version_id]
    replicas = {str(deployment.stable_version_id): deployment.stable_replicas}
    if rollout is not None:
        live = rollout.state == RolloutState.RUNNING or (
            rollout.state == RolloutState.PAUSED and rollout.paused_from == RolloutState.RUNNING
        )
        stage = rollout.current_stage
        if live and stage is not None:
            canary_id = rollout.candidate_id
            weight = stage["weight"]
            tenants = list(stage["tenants"])
            is_shadow = bool(stage.get("shadow", False))
        # Evaluations run against an agent serving the candidate, before any traffic.
        serving_states = {RolloutState.GATING, RolloutState.RUNNING, RolloutState.PAUSED}
        if rollout.state in serving_states and rollout.candidate_id not in preload:
            preload.append(rollout.candidate_id)
            replicas[str(rollout.candidate_id)] = rollout.canary_replicas
    return {
        "stable_version_id": deployment.stable_version_id,
        "canary_version_id": canary_id,
        "canary_weight": weight,
        "canary_tenants": tenants,
        "canary_shadow": is_shadow,
        "preload_version_ids": preload,
        "replicas": replicas,
    }


def routing_write(deployment: Deployment, *, rollout: Rollout | None) -> bool:
    """Write the desired routing implied by the rollout; bump the revision if it changed."""
    desired = _desired_routing(deployment, rollout)
    if desired == deployment.desired_routing:
        return False
    deployment.desired_routing = desired
    deployment.routing_revision += 1
    deployment.save(
        update_fields=["desired_routing", "routing_revision", "stable_version", "updated_at"]
    )
    return True


@transaction.atomic
def rollout_create(
    *,
    actor: Actor,
    deployment: Deployment,
    candidate: ModelVersion,
    stages: Sequence[Mapping[str, Any]] | None = None,
    policy: dict[str, Any] | None = None,
    required_suites: Sequence[EvalSuite] = (),
    reason: str = "",
    canary_replicas_min: object = 1,
    canary_replicas_max: object = 1,
) -> Rollout:
    """A pending rollout of `candidate`; its canary runs `canary_replicas_min` agents (the
    autoscaler may add up to `canary_replicas_max`)."""
    deployment = Deployment.objects.select_for_update().get(pk=deployment.pk)
    baseline = deployment.stable_version
    if candidate.pk == baseline.pk:
        raise DomainError(
            "candidate_is_stable", "The candidate is already the deployment's stable version."
        )
    if candidate.model_id != baseline.model_id:
        raise DomainError(
            "candidate_wrong_model",
            f"The candidate is a version of another model than {baseline.model.name!r}.",
            fields={"candidate": [str(candidate)]},
        )
    check_deployable(candidate, field="candidate")
    normalized_stages = stages_validate(stages, model_id=candidate.model_id)
    normalized_policy = policy_validate(policy)
    replicas_min, replicas_max = replicas_validate(
        canary_replicas_min, canary_replicas_max, field="canary_replicas"
    )
    if Rollout.objects.filter(deployment=deployment, state__in=ACTIVE_STATES).exists():
        raise Conflict(
            "rollout_in_progress", f"Deployment {deployment.name!r} already has an active rollout."
        )
    try:
        with transaction.atomic():
            rollout = Rollout.objects.create(
                deployment=deployment,
                baseline=baseline,
                candidate=candidate,
                stages=normalized_stages,
                policy=normalized_policy,
                canary_replicas_min=replicas_min,
                canary_replicas_max=replicas_max,
                canary_replicas=replicas_min,
                state=RolloutState.PENDING,
                state_reason=reason,
                created_by=acting_user(actor),
            )
    except IntegrityError as exc:  # a concurrent create won the unique constraint
        raise Conflict(
            "rollout_in_progress", f"Deployment {deployment.name!r} already has an active rollout."
        ) from exc
    rollout.required_suites.set(required_suites)
    audit_event_record(
        actor=actor,
        action="rollout.create",
        object_type="rollout",
        object_id=rollout.pk,
        object_repr=rollout_repr(rollout),
        after={
            **rollout.snapshot(),
            "baseline_id": baseline.pk,
            "candidate_id": candidate.pk,
            "stages": normalized_stages,
            "canary_replicas": [replicas_min, replicas_max],
            "required_suites": sorted(suite.name for suite in required_suites),
        },
        reason=reason,
    )
    hooks.emit(rollout, "rollout.create")
    hooks.gate_after_commit(rollout.pk)
    return rollout
