"""The autoscaler's pass: each deployment with a policy, its stable version and its
running canary, measured on their ready replicas' latest heartbeats and scaled within
their bounds (the decision itself is controlplane/rollouts/autoscaling.py; the change,
with its reason, controlplane/rollouts/replicas.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from controlplane.core.errors import DomainError
from controlplane.fleet.models import Agent, AgentState
from controlplane.rollouts.autoscaling import (
    AutoscalingPolicy,
    ReplicaSignals,
    ScalingDecision,
    autoscaling_policy_validate,
    replica_signals,
    scaling_decide,
)
from controlplane.rollouts.models import (
    Deployment,
    ReplicaRole,
    Rollout,
    RolloutState,
)
from controlplane.rollouts.models import (
    ScalingDecision as ScalingDecisionRow,
)
from controlplane.rollouts.replicas import active_rollout, replicas_scale

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScalingOutcome:
    deployment: str
    role: str
    decision: ScalingDecision
    applied: bool


def autoscale_all() -> list[ScalingOutcome]:
    """One pass over every deployment whose policy is enabled."""
    outcomes: list[ScalingOutcome] = []
    for deployment in Deployment.objects.exclude(autoscaling={}):
        try:
            policy = autoscaling_policy_validate(deployment.autoscaling)
        except DomainError:  # stored before a rule tightened: say so, scale nothing
            logger.warning("autoscaling policy invalid", extra={"deployment": deployment.name})
            continue
        if not policy.enabled:
            continue
        outcomes += autoscale_deployment(deployment, policy)
    return outcomes


def _ready_signals(version_id: int) -> list[ReplicaSignals]:
    """The latest figures of each fresh, ready agent serving `version_id`."""
    fresh_after = timezone.now() - timedelta(seconds=settings.ROLLOUTS_AGENT_FRESH_S)
    rows = Agent.objects.filter(
        state=AgentState.READY, loaded_version_id=version_id, last_seen__gte=fresh_after
    ).values_list("figures", flat=True)
    return [signals for figures in rows if (signals := replica_signals(figures)) is not None]


def _last_scaled_at(deployment: Deployment, role: ReplicaRole, rollout: Rollout | None) -> float:
    """When this role's count last changed (or its rollout started, or the deployment was
    created): the cooldowns count from there."""
    decisions = ScalingDecisionRow.objects.filter(deployment=deployment, role=role)
    if rollout is not None:
        decisions = decisions.filter(rollout=rollout)
    latest = decisions.order_by("-id").values_list("created_at", flat=True).first()
    since = latest or (rollout.created_at if rollout is not None else deployment.created_at)
    return since.timestamp()


def autoscale_deployment(deployment: Deployment, policy: AutoscalingPolicy) -> list[ScalingOutcome]:
    outcomes = []
    now = time.time()
    roles: list[tuple[ReplicaRole, int, int, int, int, Rollout | None]] = [
        (
            ReplicaRole.STABLE,
            deployment.stable_version_id,
            deployment.stable_replicas,
            deployment.stable_replicas_min,
            deployment.stable_replicas_max,
            None,
        )
    ]
    rollout = active_rollout(deployment)
    if rollout is not None and rollout.state == RolloutState.RUNNING:
        roles.append(
            (
                ReplicaRole.CANARY,
                rollout.candidate_id,
                rollout.canary_replicas,
                rollout.canary_replicas_min,
                rollout.canary_replicas_max,
                rollout,
            )
        )
    for role, version_id, current, minimum, maximum, role_rollout in roles:
        decision = scaling_decide(
            policy=policy,
            role="stable" if role == ReplicaRole.STABLE else "canary",
            current=current,
            minimum=minimum,
            maximum=maximum,
            replicas=_ready_signals(version_id),
            last_scaled_at=_last_scaled_at(deployment, role, role_rollout),
            now=now,
        )
        applied = False
        if decision.desired != current:
            applied = (
                replicas_scale(
                    deployment_id=deployment.pk,
                    role=role,
                    expected=current,
                    replicas=decision.desired,
                    reason=decision.reason,
                    figures=decision.figures,
                )
                is not None
            )
            if applied:
                logger.info(
                    "replicas scaled",
                    extra={
                        "deployment": deployment.name,
                        "role": role.value,
                        "replicas": decision.desired,
                        "reason": decision.reason,
                    },
                )
        outcomes.append(ScalingOutcome(deployment.name, role.value, decision, applied))
    return outcomes
