"""Rollout writes: deployments, the state machine, analysis decisions, webhooks.

Every transition is one function that locks the rollout row (select_for_update),
checks the expected state (and, when the caller names them, the expected stage and
revision: compare-and-set), then in the same transaction writes the new state, the
deployment's desired routing (with a bumped revision), one audit event and the
webhook outbox rows. After commit it enqueues the reconciler and the webhook
deliveries and publishes a live event. A refused call changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from contracts.routing import DEPLOYMENT_PATTERN
from controlplane.audit.services import audit_event_record
from controlplane.core.errors import Conflict, DomainError, NotFound
from controlplane.core.events import ROLLOUTS_LIVE_GROUP, publish_event_after_commit
from controlplane.registry.models import (
    DEPLOYABLE_STATUSES,
    EvalSuite,
    Evaluation,
    ModelVersion,
)
from controlplane.rollouts import analysis
from controlplane.rollouts.models import (
    ACTIVE_STATES,
    AnalysisRun,
    Deployment,
    Rollout,
    RolloutState,
    WebhookDelivery,
    WebhookEndpoint,
)

logger = logging.getLogger(__name__)

LIVE_GROUP = ROLLOUTS_LIVE_GROUP

DEFAULT_STAGES: tuple[dict[str, Any], ...] = (
    {"weight": 5, "min_duration_s": 60, "min_requests": 50, "tenants": []},
    {"weight": 25, "min_duration_s": 60, "min_requests": 100, "tenants": []},
    {"weight": 50, "min_duration_s": 60, "min_requests": 100, "tenants": []},
    {"weight": 100, "min_duration_s": 60, "min_requests": 100, "tenants": []},
)

# Test-only fault injection: a worker started with this variable sleeps inside the
# transition's transaction (after the change, before commit) so a test can SIGKILL it there.
_PAUSE_ENV = "ROLLOUTS_PAUSE_IN_TRANSITION_S"


# Validation.


def stages_validate(stages: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Normalize a stage plan; raise DomainError("invalid_stages") naming the bad stage."""
    if stages is None:
        return [dict(stage) for stage in DEFAULT_STAGES]
    if not isinstance(stages, list | tuple) or not stages:
        raise DomainError("invalid_stages", "A stage plan is a non-empty list of stages.")
    normalized: list[dict[str, Any]] = []
    known = {"weight", "min_duration_s", "min_requests", "tenants"}
    for index, stage in enumerate(stages):

        def refuse(message: str, index: int = index) -> DomainError:
            return DomainError(
                "invalid_stages", f"Stage {index}: {message}", fields={"stages": {index: message}}
            )

        if not isinstance(stage, dict):
            raise refuse("must be an object.")
        unknown = sorted(set(stage) - known)
        if unknown:
            raise refuse(f"unknown fields {', '.join(unknown)}.")
        weight = stage.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
            raise refuse("weight must be an integer from 1 to 100.")
        duration = stage.get("min_duration_s", 60)
        if isinstance(duration, bool) or not isinstance(duration, int | float) or duration < 0:
            raise refuse("min_duration_s must be a number >= 0.")
        requests = stage.get("min_requests", 0)
        if isinstance(requests, bool) or not isinstance(requests, int) or requests < 0:
            raise refuse("min_requests must be an integer >= 0.")
        tenants = stage.get("tenants", [])
        if not isinstance(tenants, list) or not all(isinstance(t, str) and t for t in tenants):
            raise refuse("tenants must be a list of tenant slugs.")
        normalized.append(
            {
                "weight": weight,
                "min_duration_s": duration,
                "min_requests": requests,
                "tenants": sorted(set(tenants)),
            }
        )
    if normalized[-1]["tenants"]:
        raise DomainError(
            "invalid_stages", "The last stage must serve every tenant (no tenant list)."
        )
    named = {slug for stage in normalized for slug in stage["tenants"]}
    if named:
        from controlplane.tenants.models import Tenant

        unknown_slugs = named - set(
            Tenant.objects.filter(slug__in=named).values_list("slug", flat=True)
        )
        if unknown_slugs:
            raise DomainError(
                "invalid_stages", f"Unknown tenants in stages: {', '.join(sorted(unknown_slugs))}."
            )
    return normalized


def policy_validate(policy: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return analysis.AnalysisPolicy.from_dict(policy).to_dict()
    except (TypeError, ValueError) as exc:
        raise DomainError("invalid_policy", str(exc), fields={"policy": [str(exc)]}) from exc


def rollout_policy(rollout: Rollout) -> analysis.AnalysisPolicy:
    return analysis.AnalysisPolicy.from_dict(rollout.policy)


# Deployments.


@transaction.atomic
def deployment_create(
    *, actor: Any, name: str, stable_version: ModelVersion, reason: str = ""
) -> Deployment:
    if not DEPLOYMENT_PATTERN.fullmatch(name):
        raise DomainError(
            "invalid_name",
            "A deployment name is 1-100 of a-z, 0-9, '.', '_', '-'.",
            fields={"name": [name]},
        )
    if Deployment.objects.filter(name=name).exists():
        raise Conflict("deployment_exists", f"A deployment named {name!r} exists.")
    _check_deployable(stable_version, field="stable_version")
    deployment = Deployment.objects.create(name=name, stable_version=stable_version)
    _routing_write(deployment, rollout=None)
    audit_event_record(
        actor=actor,
        action="deployment.create",
        object_type="deployment",
        object_id=deployment.pk,
        object_repr=name,
        after={"stable_version_id": stable_version.pk, "routing": deployment.desired_routing},
        reason=reason,
    )
    _after_commit_reconcile(deployment.pk)
    return deployment


def _check_deployable(version: ModelVersion, *, field: str) -> None:
    if version.status not in DEPLOYABLE_STATUSES:
        raise DomainError(
            "version_not_deployable",
            f"Version {version} is {version.status}; it must be verified, evaluated or approved.",
            fields={field: [version.status]},
        )


def _desired_routing(deployment: Deployment, rollout: Rollout | None) -> dict[str, Any]:
    canary_id = None
    weight = 0
    tenants: list[str] = []
    preload = [deployment.stable_version_id]
    if rollout is not None:
        live = rollout.state == RolloutState.RUNNING or (
            rollout.state == RolloutState.PAUSED and rollout.paused_from == RolloutState.RUNNING
        )
        stage = rollout.current_stage
        if live and stage is not None:
            canary_id = rollout.candidate_id
            weight = stage["weight"]
            tenants = list(stage["tenants"])
        # Evaluations run against an agent serving the candidate, before any traffic.
        serving_states = {RolloutState.GATING, RolloutState.RUNNING, RolloutState.PAUSED}
        if rollout.state in serving_states and rollout.candidate_id not in preload:
            preload.append(rollout.candidate_id)
    return {
        "stable_version_id": deployment.stable_version_id,
        "canary_version_id": canary_id,
        "canary_weight": weight,
        "canary_tenants": tenants,
        "preload_version_ids": preload,
    }


def _routing_write(deployment: Deployment, *, rollout: Rollout | None) -> bool:
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


# Rollout creation.


@transaction.atomic
def rollout_create(
    *,
    actor: Any,
    deployment: Deployment,
    candidate: ModelVersion,
    stages: list[dict[str, Any]] | None = None,
    policy: dict[str, Any] | None = None,
    required_suites: Sequence[EvalSuite] = (),
    reason: str = "",
) -> Rollout:
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
    _check_deployable(candidate, field="candidate")
    normalized_stages = stages_validate(stages)
    normalized_policy = policy_validate(policy)
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
                state=RolloutState.PENDING,
                state_reason=reason,
                created_by=actor if getattr(actor, "is_authenticated", False) else None,
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
        object_repr=_repr(rollout),
        after={
            **rollout.snapshot(),
            "baseline_id": baseline.pk,
            "candidate_id": candidate.pk,
            "stages": normalized_stages,
            "required_suites": sorted(suite.name for suite in required_suites),
        },
        reason=reason,
    )
    _emit(rollout, "rollout.create", reason=reason)
    _after_commit_gate(rollout.pk)
    return rollout


# The transition machinery.


def _repr(rollout: Rollout) -> str:
    return f"{rollout.deployment.name}: {rollout.baseline_id} -> {rollout.candidate_id}"


def _lock(rollout_id: int) -> Rollout:
    rollout = (
        Rollout.objects.select_for_update(of=("self",))
        .select_related("deployment", "candidate", "baseline")
        .filter(pk=rollout_id)
        .first()
    )
    if rollout is None:
        raise NotFound("No such rollout.")
    return rollout


def _check(
    rollout: Rollout,
    *,
    action: str,
    allowed: Collection[str],
    expected_state: str | None,
    expected_stage: int | None,
    expected_revision: int | None,
) -> None:
    stale = (
        (expected_state is not None and rollout.state != expected_state)
        or (expected_stage is not None and rollout.stage_index != expected_stage)
        or (expected_revision is not None and rollout.revision != expected_revision)
    )
    current = {"state": rollout.state, "stage": rollout.stage_index, "revision": rollout.revision}
    if stale:
        raise Conflict(
            "stale_state",
            f"The rollout moved on: it is {rollout.state} at stage {rollout.stage_index}"
            f" (revision {rollout.revision}).",
            fields={"current": current},
        )
    if rollout.state not in allowed:
        raise Conflict(
            "invalid_transition",
            f"Cannot {action} a rollout that is {rollout.state}.",
            fields={"current": current, "allowed_from": sorted(allowed)},
        )


def _apply(
    rollout: Rollout,
    *,
    actor: Any,
    action: str,
    reason: str,
    change: Callable[[Rollout, datetime], None],
    extra: dict[str, Any] | None = None,
) -> Rollout:
    """Inside the caller's transaction and lock: change, bump, route, audit, outbox."""
    now = timezone.now()
    before = rollout.snapshot()
    change(rollout, now)
    rollout.revision += 1
    rollout.state_reason = reason
    if rollout.state not in ACTIVE_STATES and rollout.finished_at is None:
        rollout.finished_at = now
    rollout.save()
    deployment = Deployment.objects.select_for_update().get(pk=rollout.deployment_id)
    if rollout.state == RolloutState.PROMOTED:
        deployment.stable_version_id = rollout.candidate_id
    _routing_write(deployment, rollout=rollout)
    rollout.deployment = deployment
    audit_event_record(
        actor=actor,
        action=action,
        object_type="rollout",
        object_id=rollout.pk,
        object_repr=_repr(rollout),
        before=before,
        after={
            **rollout.snapshot(),
            "routing_revision": deployment.routing_revision,
            **(extra or {}),
        },
        reason=reason,
    )
    _emit(rollout, action, reason=reason, extra=extra)
    _after_commit_reconcile(deployment.pk)
    pause = float(os.environ.get(_PAUSE_ENV, "0") or 0)
    if pause > 0:
        logger.warning("transition paused for a crash test", extra={"action": action})
        time.sleep(pause)
    return rollout


def _require_reason(reason: str) -> str:
    reason = (reason or "").strip()
    if not reason:
        raise DomainError(
            "reason_required", "A reason is required.", fields={"reason": ["Required."]}
        )
    return reason


def _enter_stage(rollout: Rollout, index: int, now: datetime) -> None:
    rollout.state = RolloutState.RUNNING
    rollout.stage_index = index
    rollout.stage_started_at = now
    rollout.stage_extensions = 0


# Gating.


def _gate_reasons(rollout: Rollout) -> list[str]:
    reasons = []
    for suite in rollout.required_suites.order_by("name"):
        latest = (
            Evaluation.objects.filter(version_id=rollout.candidate_id, suite=suite)
            .order_by("-created_at", "-id")
            .first()
        )
        if latest is None:
            reasons.append(f"{suite.name}: no evaluation of the candidate yet")
        elif not latest.passed:
            reasons.append(f"{suite.name}: failed (evaluation {latest.pk}: {latest.metrics})")
    return reasons


@transaction.atomic
def rollout_gate_check(*, rollout_id: int) -> Rollout:
    """pending -> gating -> running (stage 0) once every required suite has passed.

    Level-triggered and idempotent: the gate task, the beat tick and a new evaluation all
    call it; in any other state it changes nothing. A failing gate stays in gating with
    its reasons (a candidate that fails evaluation never receives traffic).
    """
    rollout = _lock(rollout_id)
    if rollout.state == RolloutState.PENDING:

        def start_gating(r: Rollout, now: datetime) -> None:
            r.state = RolloutState.GATING

        _apply(
            rollout,
            actor=None,
            action="rollout.start_gating",
            reason="required evaluations are checked",
            change=start_gating,
        )
    if rollout.state != RolloutState.GATING:
        return rollout
    reasons = _gate_reasons(rollout)
    if reasons:
        if reasons != rollout.gate_reasons:
            rollout.gate_reasons = reasons
            rollout.save(update_fields=["gate_reasons", "updated_at"])
            audit_event_record(
                actor=None,
                action="rollout.gate_blocked",
                object_type="rollout",
                object_id=rollout.pk,
                object_repr=_repr(rollout),
                after={"gate_reasons": reasons},
                reason="; ".join(reasons),
            )
            _publish_after_commit(rollout, "rollout.gate_blocked", {"gate_reasons": reasons})
        return rollout
    rollout.gate_reasons = []

    def gate_pass(r: Rollout, now: datetime) -> None:
        _enter_stage(r, 0, now)

    return _apply(
        rollout,
        actor=None,
        action="rollout.stage_start",
        reason="required evaluations passed",
        change=gate_pass,
    )


# Manual and automatic transitions.


@transaction.atomic
def rollout_advance(
    *,
    actor: Any,
    rollout_id: int,
    reason: str,
    full: bool = False,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
) -> Rollout:
    """Running stage k -> stage k+1, or promoted after the last stage (or at once if full)."""
    reason = _require_reason(reason)
    rollout = _lock(rollout_id)
    allowed = {RolloutState.RUNNING, RolloutState.PAUSED} if full else {RolloutState.RUNNING}
    _check(
        rollout,
        action="promote",
        allowed=allowed,
        expected_state=expected_state,
        expected_stage=expected_stage,
        expected_revision=expected_revision,
    )
    if full or rollout.stage_index + 1 >= len(rollout.stages):
        return _promote(rollout, actor=actor, reason=reason)

    def advance(r: Rollout, now: datetime) -> None:
        _enter_stage(r, r.stage_index + 1, now)

    return _apply(rollout, actor=actor, action="rollout.stage_start", reason=reason, change=advance)


def _promote(rollout: Rollout, *, actor: Any, reason: str) -> Rollout:
    def promote(r: Rollout, now: datetime) -> None:
        r.state = RolloutState.PROMOTED
        r.paused_from = ""

    return _apply(rollout, actor=actor, action="rollout.promote", reason=reason, change=promote)


@transaction.atomic
def rollout_pause(
    *,
    actor: Any,
    rollout_id: int,
    reason: str,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
) -> Rollout:
    """Freeze where it is: the canary keeps its weight; analysis stops deciding."""
    reason = _require_reason(reason)
    rollout = _lock(rollout_id)
    _check(
        rollout,
        action="pause",
        allowed={RolloutState.PENDING, RolloutState.GATING, RolloutState.RUNNING},
        expected_state=expected_state,
        expected_stage=expected_stage,
        expected_revision=expected_revision,
    )

    def pause(r: Rollout, now: datetime) -> None:
        r.paused_from = r.state
        r.state = RolloutState.PAUSED

    return _apply(rollout, actor=actor, action="rollout.pause", reason=reason, change=pause)


@transaction.atomic
def rollout_resume(
    *,
    actor: Any,
    rollout_id: int,
    reason: str,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
) -> Rollout:
    """Back to the state it was paused from; a running stage starts its clock again."""
    reason = _require_reason(reason)
    rollout = _lock(rollout_id)
    _check(
        rollout,
        action="resume",
        allowed={RolloutState.PAUSED},
        expected_state=expected_state,
        expected_stage=expected_stage,
        expected_revision=expected_revision,
    )

    def resume(r: Rollout, now: datetime) -> None:
        r.state = r.paused_from or RolloutState.PENDING
        r.paused_from = ""
        if r.state == RolloutState.RUNNING:
            r.stage_started_at = now
            r.stage_extensions = 0

    rollout = _apply(rollout, actor=actor, action="rollout.resume", reason=reason, change=resume)
    if rollout.state in {RolloutState.PENDING, RolloutState.GATING}:
        _after_commit_gate(rollout.pk)
    return rollout


@transaction.atomic
def rollout_rollback(
    *,
    actor: Any,
    rollout_id: int,
    reason: str,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Rollout:
    """Canary weight 0 at once; the stable version keeps every request."""
    reason = _require_reason(reason)
    rollout = _lock(rollout_id)
    _check(
        rollout,
        action="roll back",
        allowed={RolloutState.RUNNING, RolloutState.PAUSED},
        expected_state=expected_state,
        expected_stage=expected_stage,
        expected_revision=expected_revision,
    )

    def rollback(r: Rollout, now: datetime) -> None:
        r.state = RolloutState.ROLLED_BACK
        r.paused_from = ""

    return _apply(
        rollout, actor=actor, action="rollout.rollback", reason=reason, change=rollback, extra=extra
    )


@transaction.atomic
def rollout_abort(
    *,
    actor: Any,
    rollout_id: int,
    reason: str,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
) -> Rollout:
    """Stop for good without judging the candidate; the stable version keeps every request."""
    reason = _require_reason(reason)
    rollout = _lock(rollout_id)
    _check(
        rollout,
        action="abort",
        allowed=ACTIVE_STATES,
        expected_state=expected_state,
        expected_stage=expected_stage,
        expected_revision=expected_revision,
    )

    def abort(r: Rollout, now: datetime) -> None:
        r.state = RolloutState.ABORTED
        r.paused_from = ""

    return _apply(rollout, actor=actor, action="rollout.abort", reason=reason, change=abort)


@transaction.atomic
def rollout_fail(
    *,
    actor: Any,
    rollout_id: int,
    reason: str,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
) -> Rollout:
    """No verdict could be reached (or the candidate could not be served): stop, stable only."""
    reason = _require_reason(reason)
    rollout = _lock(rollout_id)
    _check(
        rollout,
        action="fail",
        allowed={RolloutState.GATING, RolloutState.RUNNING, RolloutState.PAUSED},
        expected_state=expected_state,
        expected_stage=expected_stage,
        expected_revision=expected_revision,
    )

    def fail(r: Rollout, now: datetime) -> None:
        r.state = RolloutState.FAILED
        r.paused_from = ""

    return _apply(rollout, actor=actor, action="rollout.fail", reason=reason, change=fail)


@transaction.atomic
def rollout_retry(
    *,
    actor: Any,
    rollout_id: int,
    reason: str,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
) -> Rollout:
    """A failed or rolled-back rollout starts again from pending (gating, then stage 0)."""
    reason = _require_reason(reason)
    rollout = _lock(rollout_id)
    _check(
        rollout,
        action="retry",
        allowed={RolloutState.FAILED, RolloutState.ROLLED_BACK},
        expected_state=expected_state,
        expected_stage=expected_stage,
        expected_revision=expected_revision,
    )
    deployment = Deployment.objects.select_for_update().get(pk=rollout.deployment_id)
    if deployment.stable_version_id != rollout.baseline_id:
        raise Conflict(
            "baseline_changed",
            "The deployment's stable version is no longer this rollout's baseline;"
            " start a new rollout.",
        )
    if (
        Rollout.objects.filter(deployment_id=rollout.deployment_id, state__in=ACTIVE_STATES)
        .exclude(pk=rollout.pk)
        .exists()
    ):
        raise Conflict(
            "rollout_in_progress", f"Deployment {deployment.name!r} already has an active rollout."
        )

    def retry(r: Rollout, now: datetime) -> None:
        r.state = RolloutState.PENDING
        r.stage_index = 0
        r.stage_started_at = None
        r.stage_extensions = 0
        r.gate_reasons = []
        r.attempt += 1
        r.finished_at = None

    rollout = _apply(rollout, actor=actor, action="rollout.retry", reason=reason, change=retry)
    _after_commit_gate(rollout.pk)
    return rollout


# Analysis.


@transaction.atomic
def rollout_analyze(*, rollout_id: int, window_end: datetime) -> AnalysisRun | None:
    """One analysis tick for a running rollout: record the run, then act on its verdict.

    Idempotent per (rollout, attempt, window_end): a tick delivered twice finds its run
    and changes nothing. Not running (paused, finished): nothing is recorded.
    """
    from controlplane.rollouts import selectors

    rollout = _lock(rollout_id)
    if rollout.state != RolloutState.RUNNING or rollout.stage_started_at is None:
        return None
    existing = AnalysisRun.objects.filter(
        rollout=rollout, attempt=rollout.attempt, window_end=window_end
    ).first()
    if existing is not None:
        return existing
    policy = rollout_policy(rollout)
    stage = rollout.current_stage or {}
    window_start = max(rollout.stage_started_at, window_end - timedelta(seconds=policy.window_s))
    tenants = stage.get("tenants") or None
    # A full-weight stage sends the baseline nothing: its reference is its last window
    # before the stage, and latency is judged by the absolute limits only (the canary now
    # carries the baseline's share too, so a rank test would compare unequal loads).
    full_weight = stage.get("weight") == 100
    baseline_end = rollout.stage_started_at if full_weight else window_end
    baseline_start = (
        baseline_end - timedelta(seconds=policy.window_s) if full_weight else window_start
    )
    baseline = selectors.request_samples_window(
        version_id=rollout.baseline_id, start=baseline_start, end=baseline_end, tenant_slugs=tenants
    )
    canary = selectors.request_samples_window(
        version_id=rollout.candidate_id, start=window_start, end=window_end, tenant_slugs=tenants
    )
    canary_in_stage = selectors.request_count(
        version_id=rollout.candidate_id, start=rollout.stage_started_at, end=window_end
    )
    result = analysis.analyze(
        baseline=baseline, canary=canary, policy=policy, compare_latency=not full_weight
    )
    elapsed = (window_end - rollout.stage_started_at).total_seconds()
    action = analysis.stage_decide(
        verdict=result.verdict,
        elapsed_s=elapsed,
        canary_requests_in_stage=canary_in_stage,
        min_duration_s=stage.get("min_duration_s", 0),
        min_requests=stage.get("min_requests", 0),
        extensions=rollout.stage_extensions,
        policy=policy,
    )
    run = AnalysisRun.objects.create(
        rollout=rollout,
        stage_index=rollout.stage_index,
        attempt=rollout.attempt,
        window_start=window_start,
        window_end=window_end,
        baseline=result.baseline,
        canary={**result.canary, "requests_in_stage": canary_in_stage},
        tests=result.tests,
        verdict=result.verdict.value,
        reasons=result.reasons,
        action=action.value,
    )
    summary = f"analysis {run.pk}: {result.verdict.value}: {'; '.join(result.reasons)}"
    extra = {"analysis_run_id": run.pk, "verdict": result.verdict.value}
    state, revision = RolloutState.RUNNING, rollout.revision  # as analyzed, or nothing
    if action == analysis.Action.ROLLBACK:
        rollout_rollback(
            actor=None,
            rollout_id=rollout.pk,
            reason=summary,
            extra=extra,
            expected_state=state,
            expected_revision=revision,
        )
    elif action == analysis.Action.ADVANCE:
        rollout_advance(
            actor=None,
            rollout_id=rollout.pk,
            reason=summary,
            expected_state=state,
            expected_revision=revision,
        )
    elif action == analysis.Action.FAIL:
        rollout_fail(
            actor=None,
            rollout_id=rollout.pk,
            reason=summary,
            expected_state=state,
            expected_revision=revision,
        )
    elif action == analysis.Action.HOLD:
        rollout_pause(
            actor=None,
            rollout_id=rollout.pk,
            reason=summary,
            expected_state=state,
            expected_revision=revision,
        )
    elif action == analysis.Action.EXTEND:
        _extend(rollout, reason=summary)
    else:
        _publish_after_commit(rollout, "rollout.analysis", {"analysis_run_id": run.pk})
    return run


def _extend(rollout: Rollout, *, reason: str) -> None:
    def extend(r: Rollout, now: datetime) -> None:
        r.stage_extensions += 1

    _apply(rollout, actor=None, action="rollout.extend", reason=reason, change=extend)


def rollout_check_hard_breach(
    *, version_id: int, recent_errors: Sequence[bool] | None = None
) -> Rollout | None:
    """The fast path: roll back at once when the canary's last N requests breach the limit.

    Ingest calls it after writing a batch of request samples, once per version in the
    batch. Cheap when `version_id` is no running canary (one indexed query). Pass
    `recent_errors` (oldest first) to judge those flags instead of reading the database.
    Returns the rolled-back rollout, or None.
    """
    from controlplane.rollouts import selectors

    rollout = (
        Rollout.objects.filter(candidate_id=version_id, state=RolloutState.RUNNING)
        .only("id", "policy", "stage_started_at", "revision")
        .first()
    )
    if rollout is None or rollout.stage_started_at is None:
        return None
    policy = rollout_policy(rollout)
    if recent_errors is None:
        recent_errors = selectors.recent_error_flags(
            version_id=version_id, since=rollout.stage_started_at, limit=policy.hard_breach_window
        )
    breach = analysis.hard_breach(recent_errors=recent_errors, policy=policy)
    if breach is None:
        return None
    try:
        return rollout_rollback(
            actor=None,
            rollout_id=rollout.pk,
            reason=breach,
            expected_state=RolloutState.RUNNING,
            extra={"hard_breach": True},
        )
    except Conflict:  # another caller rolled it back (or it moved on) first
        return None


# Webhooks.


WEBHOOK_EVENTS = (
    "rollout.create",
    "rollout.start_gating",
    "rollout.gate_blocked",
    "rollout.stage_start",
    "rollout.extend",
    "rollout.promote",
    "rollout.pause",
    "rollout.resume",
    "rollout.rollback",
    "rollout.abort",
    "rollout.fail",
    "rollout.retry",
)


@transaction.atomic
def webhook_endpoint_create(
    *, actor: Any, name: str, url: str, secret: str, events: list[str]
) -> WebhookEndpoint:
    unknown = sorted(set(events) - set(WEBHOOK_EVENTS) - {"*"})
    if not events or unknown:
        raise DomainError(
            "invalid_events",
            f"Events must be '*' or among: {', '.join(WEBHOOK_EVENTS)}.",
            fields={"events": unknown or ["Required."]},
        )
    if WebhookEndpoint.objects.filter(name=name).exists():
        raise Conflict("webhook_exists", f"A webhook named {name!r} exists.")
    endpoint = WebhookEndpoint.objects.create(
        name=name,
        url=url,
        secret=secret,
        events=sorted(set(events)),
        created_by=actor if getattr(actor, "is_authenticated", False) else None,
    )
    audit_event_record(
        actor=actor,
        action="webhook.create",
        object_type="webhook",
        object_id=endpoint.pk,
        object_repr=name,
        after={"url": url, "events": endpoint.events},
    )
    return endpoint


@transaction.atomic
def webhook_endpoint_delete(*, actor: Any, endpoint: WebhookEndpoint) -> None:
    audit_event_record(
        actor=actor,
        action="webhook.delete",
        object_type="webhook",
        object_id=endpoint.pk,
        object_repr=endpoint.name,
        before={"url": endpoint.url, "events": endpoint.events},
    )
    endpoint.delete()


def rollout_event_payload(rollout: Rollout, event: str, **extra: Any) -> dict[str, Any]:
    deployment = rollout.deployment
    return {
        "event": event,
        "rollout_id": rollout.pk,
        "deployment": deployment.name,
        "state": rollout.state,
        "stage_index": rollout.stage_index,
        "canary_weight": deployment.desired_routing.get("canary_weight", 0),
        "routing_revision": deployment.routing_revision,
        "revision": rollout.revision,
        "attempt": rollout.attempt,
        "baseline_id": rollout.baseline_id,
        "candidate_id": rollout.candidate_id,
        "reason": rollout.state_reason,
        "at": timezone.now().isoformat(),
        **extra,
    }


def _emit(
    rollout: Rollout, event: str, *, reason: str, extra: dict[str, Any] | None = None
) -> None:
    """Outbox rows for matching webhooks (same transaction) and a live event after commit."""
    payload = rollout_event_payload(rollout, event, **(extra or {}))
    event_id = uuid.uuid4()
    payload["event_id"] = str(event_id)
    deliveries = [
        WebhookDelivery.objects.create(
            endpoint=endpoint, event_id=event_id, event=event, payload=payload
        )
        for endpoint in WebhookEndpoint.objects.filter(is_active=True)
        if endpoint.wants(event)
    ]
    if deliveries:
        from controlplane.rollouts.tasks import webhook_deliver

        for delivery in deliveries:
            webhook_deliver.delay_on_commit(delivery.pk)
    publish_event_after_commit(LIVE_GROUP, event, payload)


def _publish_after_commit(rollout: Rollout, event: str, extra: dict[str, Any]) -> None:
    publish_event_after_commit(LIVE_GROUP, event, rollout_event_payload(rollout, event, **extra))


def _after_commit_reconcile(deployment_id: int) -> None:
    from controlplane.rollouts.tasks import reconcile_deployment

    reconcile_deployment.delay_on_commit(deployment_id)


def _after_commit_gate(rollout_id: int) -> None:
    from controlplane.rollouts.tasks import rollout_gate

    rollout_gate.delay_on_commit(rollout_id)


# Evaluation jobs.


def evaluations_due(*, rollout_id: int) -> list[int]:
    """Required suites of a gating rollout with no evaluation of the candidate since it began."""
    rollout = Rollout.objects.filter(pk=rollout_id, state=RolloutState.GATING).first()
    if rollout is None:
        return []
    due = []
    for suite in rollout.required_suites.order_by("name"):
        done = Evaluation.objects.filter(
            version_id=rollout.candidate_id, suite=suite, created_at__gte=rollout.created_at
        ).exists()
        if not done:
            due.append(suite.pk)
    return due


def _ready_endpoint(version_id: int) -> str | None:
    from django.conf import settings

    from controlplane.fleet.models import Agent, AgentState

    fresh_after = timezone.now() - timedelta(seconds=settings.ROLLOUTS_AGENT_FRESH_S)
    agent = (
        Agent.objects.filter(
            state=AgentState.READY, loaded_version_id=version_id, last_seen__gte=fresh_after
        )
        .exclude(endpoint="")
        .order_by("name")
        .first()
    )
    return agent.endpoint if agent is not None else None


def _agent_figures_after(endpoint: str, *, after: float, timeout_s: float = 30.0) -> dict[str, Any]:
    """The figures of the agent serving `endpoint` from a heartbeat sent after `after`."""
    from controlplane.fleet.models import Agent

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        agent = Agent.objects.filter(endpoint=endpoint).first()
        if agent is not None and agent.last_sent_at and agent.last_sent_at.timestamp() > after:
            return dict(agent.figures)
        time.sleep(0.25)
    raise DomainError("no_heartbeat", f"No heartbeat from the agent at {endpoint}.")


def evaluation_run(*, rollout_id: int, suite_id: int) -> Evaluation | None:
    """Run one required suite against the agent serving the candidate and record it.

    No transaction is held during the HTTP calls. Returns None (nothing recorded) when the
    rollout is no longer gating, the suite is already evaluated, or no agent serves the
    candidate yet (the next gate tick asks again). The gate is re-checked afterwards.
    """
    import httpx

    from controlplane.registry import store
    from controlplane.registry.services import evaluation_record
    from controlplane.rollouts import evaluation

    if suite_id not in evaluations_due(rollout_id=rollout_id):
        return None
    rollout = Rollout.objects.select_related("candidate", "baseline").get(pk=rollout_id)
    suite = EvalSuite.objects.get(pk=suite_id)
    names = {definition["name"] for definition in suite.metrics}
    unknown = sorted(names - evaluation.KNOWN_METRICS)
    if unknown:
        raise DomainError(
            "unknown_metrics",
            f"Suite {suite.name} names metrics no job computes: {', '.join(unknown)}.",
        )
    endpoint = _ready_endpoint(rollout.candidate_id)
    if endpoint is None:
        return None
    baseline_endpoint = _ready_endpoint(rollout.baseline_id) if "agreement" in names else None
    if "agreement" in names and baseline_endpoint is None:
        return None
    figures: dict[str, float] = {}
    details: dict[str, Any] = {"endpoint": endpoint}
    questions = evaluation.questions()
    prompts = [q.question for q in questions]
    with httpx.Client() as client:
        if "perplexity" in names:
            tokenizer = evaluation.tokenizer_for(
                str(store.artifact_path(rollout.candidate.artifact_id))
            )
            result = evaluation.perplexity(
                client=client,
                endpoint=endpoint,
                tokenizer=tokenizer,
                text=evaluation.heldout_text(),
            )
            figures["perplexity"] = result["perplexity"]
            details["perplexity"] = result
        if names & {"exact_match", "agreement"}:
            answers = evaluation.greedy_answers(client=client, endpoint=endpoint, prompts=prompts)
            details["answers"] = answers
            if "exact_match" in names:
                figures["exact_match"] = evaluation.exact_match(
                    answers, [q.answer for q in questions]
                )
            if baseline_endpoint is not None:
                baseline_answers = evaluation.greedy_answers(
                    client=client, endpoint=baseline_endpoint, prompts=prompts
                )
                details["baseline_answers"] = baseline_answers
                figures["agreement"] = evaluation.agreement(answers, baseline_answers)
        if names & (evaluation.LATENCY_METRICS | evaluation.ENERGY_METRICS):
            before = _agent_figures_after(endpoint, after=time.time() - 5)
            result = evaluation.latency(client=client, endpoint=endpoint, prompts=prompts * 2)
            details["latency"] = result
            figures["ttft_p95_ms"] = result["ttft_p95_ms"]
            figures["itl_p95_ms"] = result["itl_p95_ms"]
            if "joules_per_token" in names:
                after = _agent_figures_after(endpoint, after=time.time() + 0.5)
                per_token = evaluation.joules_per_token(before, after)
                if per_token is None:
                    raise DomainError("no_energy", "The agent reported no energy or no tokens.")
                figures["joules_per_token"] = per_token
    evaluation_row = evaluation_record(
        actor=None,
        version=rollout.candidate,
        suite=suite,
        metrics={name: figures[name] for name in sorted(names)},
        baseline_version=rollout.baseline,
        notes=json.dumps(details, sort_keys=True)[:10000],
    )
    rollout_gate_check(rollout_id=rollout_id)
    return evaluation_row
