"""The rollout state machine: a table of allowed transitions and one function that runs them.

A transition locks the rollout row (select_for_update), checks the expected state (and,
when the caller names them, the expected stage and revision: compare-and-set), then in
the same transaction writes the new state, the deployment's desired routing (with a
bumped revision), one audit event and the webhook outbox rows. After commit the hooks
enqueue the reconciler and the webhook deliveries and publish a live event. A refused
call changes nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from contracts import tracing
from controlplane.audit.services import Actor, audit_event_record
from controlplane.core.errors import Conflict, DomainError, NotFound
from controlplane.registry.models import DEPLOYABLE_STATUSES, Evaluation, ModelVersion
from controlplane.rollouts import hooks
from controlplane.rollouts.deployments import rollout_repr, routing_write
from controlplane.rollouts.models import (
    ACTIVE_STATES,
    Deployment,
    RevisionSource,
    Rollout,
    RolloutState,
)
from controlplane.rollouts.revisions import revision_record

logger = logging.getLogger(__name__)

# Test-only fault injection: a worker started with this variable sleeps inside the
# transition's transaction (after the change, before commit) so a test can SIGKILL it there.
_PAUSE_ENV = "ROLLOUTS_PAUSE_IN_TRANSITION_S"


@dataclass(frozen=True, slots=True)
class Expected:
    """What the caller saw: a transition is refused as stale when the rollout moved on."""

    state: str | None = None
    stage: int | None = None
    revision: int | None = None


@dataclass(frozen=True, slots=True)
class Transition:
    verb: str  # in the refusal: "Cannot <verb> a rollout that is <state>."
    action: str  # the audit action, webhook event and live event
    allowed: frozenset[str]  # the states it may start from
    change: Callable[[Rollout, datetime], None]
    precondition: Callable[[Rollout], None] | None = None  # raises a Conflict to refuse
    recheck_gate: bool = False  # enqueue the gate check when it lands in pending or gating
    gives_traffic: bool = False  # the candidate may get more traffic: it must be deployable


def _enter_stage(rollout: Rollout, index: int, now: datetime) -> None:
    rollout.state = RolloutState.RUNNING
    rollout.stage_index = index
    rollout.stage_started_at = now
    rollout.stage_extensions = 0


def _finish_as(state: str) -> Callable[[Rollout, datetime], None]:
    def finish(rollout: Rollout, now: datetime) -> None:
        rollout.state = state
        rollout.paused_from = ""

    return finish


def _pause(rollout: Rollout, now: datetime) -> None:
    rollout.paused_from = rollout.state
    rollout.state = RolloutState.PAUSED


def _resume(rollout: Rollout, now: datetime) -> None:
    rollout.state = rollout.paused_from or RolloutState.PENDING
    rollout.paused_from = ""
    if rollout.state == RolloutState.RUNNING:
        rollout.stage_started_at = now
        rollout.stage_extensions = 0


def _retry(rollout: Rollout, now: datetime) -> None:
    rollout.state = RolloutState.PENDING
    rollout.stage_index = 0
    rollout.stage_started_at = None
    rollout.stage_extensions = 0
    rollout.gate_reasons = []
    rollout.attempt += 1
    rollout.finished_at = None


def _retry_precondition(rollout: Rollout) -> None:
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


def _extend(rollout: Rollout, now: datetime) -> None:
    rollout.stage_extensions += 1


def _start_gating(rollout: Rollout, now: datetime) -> None:
    rollout.state = RolloutState.GATING


S = RolloutState
TRANSITIONS: dict[str, Transition] = {
    # Running stage k -> stage k+1 (after the last stage: "promote").
    "advance": Transition(
        "promote",
        "rollout.stage_start",
        frozenset({S.RUNNING}),
        lambda r, now: _enter_stage(r, r.stage_index + 1, now),
        gives_traffic=True,
    ),
    "promote": Transition(
        "promote",
        "rollout.promote",
        frozenset({S.RUNNING, S.PAUSED}),
        _finish_as(S.PROMOTED),
        gives_traffic=True,
    ),
    # Freeze where it is: the canary keeps its weight; analysis stops deciding.
    "pause": Transition(
        "pause", "rollout.pause", frozenset({S.PENDING, S.GATING, S.RUNNING}), _pause
    ),
    # Back to the state it was paused from; a running stage starts its clock again.
    "resume": Transition(
        "resume",
        "rollout.resume",
        frozenset({S.PAUSED}),
        _resume,
        recheck_gate=True,
        gives_traffic=True,
    ),
    # Canary weight 0 at once; the stable version keeps every request.
    "rollback": Transition(
        "roll back", "rollout.rollback", frozenset({S.RUNNING, S.PAUSED}), _finish_as(S.ROLLED_BACK)
    ),
    # Stop for good without judging the candidate.
    "abort": Transition("abort", "rollout.abort", frozenset(ACTIVE_STATES), _finish_as(S.ABORTED)),
    # No verdict could be reached (or the candidate could not be served).
    "fail": Transition(
        "fail", "rollout.fail", frozenset({S.GATING, S.RUNNING, S.PAUSED}), _finish_as(S.FAILED)
    ),
    # A failed or rolled-back rollout starts again from pending (gating, then stage 0).
    "retry": Transition(
        "retry",
        "rollout.retry",
        frozenset({S.FAILED, S.ROLLED_BACK}),
        _retry,
        precondition=_retry_precondition,
        recheck_gate=True,
        gives_traffic=True,
    ),
    # The analysis could not decide yet: the stage runs longer.
    "extend": Transition("extend", "rollout.extend", frozenset({S.RUNNING}), _extend),
    # The gate: pending -> gating -> running (stage 0).
    "start_gating": Transition(
        "start gating", "rollout.start_gating", frozenset({S.PENDING}), _start_gating
    ),
    "pass_gate": Transition(
        "pass the gate of",
        "rollout.stage_start",
        frozenset({S.GATING}),
        lambda r, now: _enter_stage(r, 0, now),
        gives_traffic=True,
    ),
}


def lock(rollout_id: int) -> Rollout:
    rollout = (
        Rollout.objects.select_for_update(of=("self",))
        .select_related("deployment", "candidate", "baseline")
        .filter(pk=rollout_id)
        .first()
    )
    if rollout is None:
        raise NotFound("No such rollout.")
    return rollout


def _check(rollout: Rollout, spec: Transition, expected: Expected) -> None:
    stale = (
        (expected.state is not None and rollout.state != expected.state)
        or (expected.stage is not None and rollout.stage_index != expected.stage)
        or (expected.revision is not None and rollout.revision != expected.revision)
    )
    current = {"state": rollout.state, "stage": rollout.stage_index, "revision": rollout.revision}
    if stale:
        raise Conflict(
            "stale_state",
            f"The rollout moved on: it is {rollout.state} at stage {rollout.stage_index}"
            f" (revision {rollout.revision}).",
            fields={"current": current},
        )
    if rollout.state not in spec.allowed:
        raise Conflict(
            "invalid_transition",
            f"Cannot {spec.verb} a rollout that is {rollout.state}.",
            fields={"current": current, "allowed_from": sorted(spec.allowed)},
        )


@tracing.traced(__name__, "rollouts.transition")
def _apply(
    rollout: Rollout,
    spec: Transition,
    *,
    actor: Actor,
    reason: str,
    extra: dict[str, Any] | None = None,
) -> Rollout:
    """Inside the caller's transaction and lock: change, bump, route, audit, outbox."""
    now = timezone.now()
    before = rollout.snapshot()
    spec.change(rollout, now)
    rollout.revision += 1
    rollout.state_reason = reason
    if rollout.state not in ACTIVE_STATES and rollout.finished_at is None:
        rollout.finished_at = now
    rollout.save()
    deployment = Deployment.objects.select_for_update().get(pk=rollout.deployment_id)
    promoted_from = None
    if rollout.state == RolloutState.PROMOTED:
        promoted_from = deployment.stable_version_id
        deployment.stable_version_id = rollout.candidate_id
    routing_write(deployment, rollout=rollout)
    if promoted_from is not None:
        revision_record(
            deployment=deployment,
            previous_version_id=promoted_from,
            source=RevisionSource.PROMOTE,
            actor=actor,
            reason=reason,
            rollout=rollout,
        )
    rollout.deployment = deployment
    tracing.span_attributes_set(
        rollout_id=rollout.pk,
        action=spec.action,
        state_from=before["state"],
        state_to=rollout.state,
        revision=rollout.revision,
        routing_revision=deployment.routing_revision,
        canary_weight=deployment.desired_routing.get("canary_weight", 0),
        actor="system" if actor is None else str(actor),
        reason=reason[:500],
    )
    audit_event_record(
        actor=actor,
        action=spec.action,
        object_type="rollout",
        object_id=rollout.pk,
        object_repr=rollout_repr(rollout),
        before=before,
        after={
            **rollout.snapshot(),
            "routing_revision": deployment.routing_revision,
            **(extra or {}),
        },
        reason=reason,
    )
    hooks.emit(rollout, spec.action, extra=extra)
    hooks.reconcile_after_commit(deployment.pk)
    pause = float(os.environ.get(_PAUSE_ENV, "0") or 0)
    if pause > 0:
        logger.warning("transition paused for a crash test", extra={"action": spec.action})
        time.sleep(pause)
    return rollout


def _check_candidate_deployable(rollout: Rollout) -> None:
    """Refuse more traffic for a candidate that was revoked (or deprecated) meanwhile. The
    version row is locked: a revocation commits either before (refused here) or after
    (and then ends the rollout, decisions.rollouts_stop_for_revoked_candidate)."""
    status = (
        ModelVersion.objects.select_for_update()
        .values_list("status", flat=True)
        .get(pk=rollout.candidate_id)
    )
    if status not in DEPLOYABLE_STATUSES:
        raise Conflict(
            "candidate_not_deployable",
            f"The candidate {rollout.candidate} is {status}; it may not receive traffic.",
            fields={"candidate_status": status},
        )


# What an audited reason may hold (the audit log's and the revision history's).
REASON_MAX_LENGTH = 2000


def require_reason(reason: str) -> str:
    """The reason an operator gave, stripped; refused when empty or too long."""
    reason = (reason or "").strip()
    if not reason:
        raise DomainError(
            "reason_required", "A reason is required.", fields={"reason": ["Required."]}
        )
    if len(reason) > REASON_MAX_LENGTH:
        raise DomainError(
            "reason_too_long",
            f"A reason is at most {REASON_MAX_LENGTH} characters.",
            fields={"reason": [f"At most {REASON_MAX_LENGTH} characters."]},
        )
    return reason


@transaction.atomic
def transition(
    name: str,
    *,
    actor: Actor,
    rollout_id: int,
    reason: str,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Rollout:
    """Run the transition `name` of TRANSITIONS, or refuse it and change nothing."""
    spec = TRANSITIONS[name]
    reason = require_reason(reason)
    rollout = lock(rollout_id)
    _check(rollout, spec, Expected(expected_state, expected_stage, expected_revision))
    if spec.precondition is not None:
        spec.precondition(rollout)
    if spec.gives_traffic:
        _check_candidate_deployable(rollout)
    if name == "advance" and rollout.stage_index + 1 >= len(rollout.stages):
        spec = TRANSITIONS["promote"]  # the last stage done: the candidate is the stable one
    rollout = _apply(rollout, spec, actor=actor, reason=reason, extra=extra)
    if spec.recheck_gate and rollout.state in {RolloutState.PENDING, RolloutState.GATING}:
        hooks.gate_after_commit(rollout.pk)
    return rollout


# The named transitions the API, the dashboard and the decisions call.


def rollout_advance(
    *,
    actor: Actor,
    rollout_id: int,
    reason: str,
    full: bool = False,
    expected_state: str | None = None,
    expected_stage: int | None = None,
    expected_revision: int | None = None,
) -> Rollout:
    """Running stage k -> stage k+1, or promoted after the last stage (or at once if full)."""
    return transition(
        "promote" if full else "advance",
        actor=actor,
        rollout_id=rollout_id,
        reason=reason,
        expected_state=expected_state,
        expected_stage=expected_stage,
        expected_revision=expected_revision,
    )


# Each takes actor, rollout_id, reason and optionally expected_state, expected_stage,
# expected_revision and extra; what each does is its entry in TRANSITIONS.
rollout_pause = functools.partial(transition, "pause")
rollout_resume = functools.partial(transition, "resume")
rollout_rollback = functools.partial(transition, "rollback")
rollout_abort = functools.partial(transition, "abort")
rollout_fail = functools.partial(transition, "fail")
rollout_retry = functools.partial(transition, "retry")


# The gate.


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
    rollout = lock(rollout_id)
    if rollout.state == RolloutState.PENDING:
        reason = "required evaluations are checked"
        _apply(rollout, TRANSITIONS["start_gating"], actor=None, reason=reason)
    if rollout.state != RolloutState.GATING:
        return rollout
    reasons = _gate_reasons(rollout)
    if rollout.candidate.status not in DEPLOYABLE_STATUSES:
        reasons.append(f"the candidate is {rollout.candidate.status}")
    if reasons:
        if reasons != rollout.gate_reasons:
            rollout.gate_reasons = reasons
            rollout.save(update_fields=["gate_reasons", "updated_at"])
            audit_event_record(
                actor=None,
                action="rollout.gate_blocked",
                object_type="rollout",
                object_id=rollout.pk,
                object_repr=rollout_repr(rollout),
                after={"gate_reasons": reasons},
                reason="; ".join(reasons),
            )
            hooks.publish_after_commit(rollout, "rollout.gate_blocked", {"gate_reasons": reasons})
        return rollout
    rollout.gate_reasons = []
    reason = "required evaluations passed"
    return _apply(rollout, TRANSITIONS["pass_gate"], actor=None, reason=reason)
