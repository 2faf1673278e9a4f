"""Every automatic decision on a running rollout, and the one place a rollback is decided.

Four signals may end a canary without a person: the analysis tick (a verdict on a
window of request samples), the hard-breach fast path (ingest sees the canary's last N
requests fail), the reconciler (every agent that served the canary is lost) and the
revocation of the candidate version (seen by the reconciler and the analysis tick). Each
decision here goes through the state machine with the revision it judged
(compare-and-set), so two deciders racing change the rollout once.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from django.db import transaction

from contracts import tracing
from controlplane.audit.models import AuditEvent
from controlplane.core.errors import Conflict
from controlplane.registry.models import ModelVersion, VersionStatus
from controlplane.rollouts import analysis, hooks, selectors, transitions
from controlplane.rollouts.models import ACTIVE_STATES, AnalysisRun, Rollout, RolloutState
from controlplane.rollouts.stages import rollout_policy

# The transition each stage decision runs (wait runs none).
TRANSITION_OF = {
    analysis.Action.ADVANCE: "advance",
    analysis.Action.ROLLBACK: "rollback",
    analysis.Action.EXTEND: "extend",
    analysis.Action.FAIL: "fail",
    analysis.Action.HOLD: "pause",
}


@tracing.traced(__name__, "rollouts.analysis")
@transaction.atomic
def rollout_analyze(*, rollout_id: int, window_end: datetime) -> AnalysisRun | None:
    """One analysis tick for a running rollout: record the run, then act on its verdict.

    Idempotent per (rollout, attempt, window_end): a tick delivered twice finds its run
    and changes nothing. Not running (paused, finished): nothing is recorded.
    """
    tracing.span_attributes_set(rollout_id=rollout_id, window_end=window_end.isoformat())
    rollout = transitions.lock(rollout_id)
    stage = rollout.current_stage
    if rollout.state != RolloutState.RUNNING or rollout.stage_started_at is None or stage is None:
        return None
    if rollout.candidate.status == VersionStatus.REVOKED:
        rollouts_stop_for_revoked_candidate(version_id=rollout.candidate_id)
        return None
    existing = AnalysisRun.objects.filter(
        rollout=rollout, attempt=rollout.attempt, window_end=window_end
    ).first()
    if existing is not None:
        return existing
    policy = rollout_policy(rollout)
    window_start = max(rollout.stage_started_at, window_end - timedelta(seconds=policy.window_s))
    tenants = stage["tenants"] or None
    # In a shadow stage the canary's samples are the requests mirrored to it; the
    # baseline's are always the requests it answered.
    is_shadow = bool(stage.get("shadow", False))
    # A full-weight stage sends the baseline nothing: its reference is its last window
    # before the stage, and latency is judged by the absolute limits only (the canary now
    # carries the baseline's share too, so a rank test would compare unequal loads). A
    # shadow stage leaves the baseline every request, whatever its weight.
    full_weight = stage["weight"] == 100 and not is_shadow
    baseline_end = rollout.stage_started_at if full_weight else window_end
    baseline_start = (
        baseline_end - timedelta(seconds=policy.window_s) if full_weight else window_start
    )
    baseline = selectors.request_samples_window(
        version_id=rollout.baseline_id, start=baseline_start, end=baseline_end, tenant_slugs=tenants
    )
    canary = selectors.request_samples_window(
        version_id=rollout.candidate_id,
        start=window_start,
        end=window_end,
        tenant_slugs=tenants,
        is_shadow=is_shadow,
    )
    canary_in_stage = selectors.request_count(
        version_id=rollout.candidate_id,
        start=rollout.stage_started_at,
        end=window_end,
        is_shadow=is_shadow,
    )
    result = analysis.analyze(
        baseline=baseline, canary=canary, policy=policy, compare_latency=not full_weight
    )
    elapsed = (window_end - rollout.stage_started_at).total_seconds()
    action = analysis.stage_decide(
        verdict=result.verdict,
        elapsed_s=elapsed,
        canary_requests_in_stage=canary_in_stage,
        min_duration_s=stage["min_duration_s"],
        min_requests=stage["min_requests"],
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
        signals=result.signals,
        verdict=result.verdict.value,
        reasons=result.reasons,
        action=action.value,
    )
    summary = f"analysis {run.pk}: {result.verdict.value}: {'; '.join(result.reasons)}"
    tracing.span_attributes_set(
        analysis_run_id=run.pk,
        stage_index=run.stage_index,
        verdict=run.verdict,
        action=run.action,
        reasons=summary[:500],
    )
    extra = {"analysis_run_id": run.pk, "verdict": result.verdict.value}
    name = TRANSITION_OF.get(action)
    if name is None:  # wait: nothing changes but the charts
        hooks.publish_after_commit(rollout, "rollout.analysis", {"analysis_run_id": run.pk})
        return run
    transitions.transition(
        name,
        actor=None,
        rollout_id=rollout.pk,
        reason=summary,
        # As analyzed, or nothing: a person's action in between wins.
        expected_state=RolloutState.RUNNING,
        expected_revision=rollout.revision,
        extra=extra if action == analysis.Action.ROLLBACK else None,
    )
    return run


def rollout_check_hard_breach(
    *, version_id: int, recent_errors: Sequence[bool] | None = None
) -> Rollout | None:
    """The fast path: roll back at once when the canary's last N requests breach the limit.

    Ingest calls it after writing a batch of request samples, once per version in the
    batch. Cheap when `version_id` is no running canary (one indexed query). Pass
    `recent_errors` (oldest first) to judge those flags instead of reading the database.
    Returns the rolled-back rollout, or None.
    """
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
        return transitions.rollout_rollback(
            actor=None,
            rollout_id=rollout.pk,
            reason=breach,
            expected_state=RolloutState.RUNNING,
            extra={"hard_breach": True},
        )
    except Conflict:  # another caller rolled it back (or it moved on) first
        return None


def rollback_when_canary_lost(*, rollout_id: int, lost_agents: Sequence[str]) -> bool:
    """The reconciler found no ready agent for the canary and every one that served it
    lost: roll back now rather than wait for the analysis to see no traffic. Returns
    whether this call rolled it back."""
    try:
        transitions.rollout_rollback(
            actor=None,
            rollout_id=rollout_id,
            reason="hard breach: every canary agent is lost: " + ", ".join(lost_agents),
            expected_state=RolloutState.RUNNING,
            extra={"hard_breach": True},
        )
    except Conflict:  # another caller rolled it back (or it moved on) first
        return False
    return True


# How a rollout whose candidate was revoked ends, by the state it is in.
STOP_FOR_REVOKED: dict[str, str] = {
    RolloutState.RUNNING: "rollback",
    RolloutState.PAUSED: "rollback",
    RolloutState.GATING: "fail",
    RolloutState.PENDING: "abort",
}


def rollouts_stop_for_revoked_candidate(*, version_id: int) -> list[int]:
    """End every active rollout of a revoked candidate: its canary leaves the routing at
    once (rolled back, or failed or aborted before it had traffic). Returns the rollouts
    this call ended; nothing when the version is not revoked."""
    version = ModelVersion.objects.filter(pk=version_id, status=VersionStatus.REVOKED).first()
    if version is None:
        return []
    revocation = (
        AuditEvent.objects.filter(
            action="version.revoke", object_type="model_version", object_id=str(version_id)
        )
        .order_by("-id")
        .values_list("reason", flat=True)
        .first()
    )
    reason = f"the candidate {version} was revoked" + (f": {revocation}" if revocation else "")
    ended = []
    active = Rollout.objects.filter(candidate_id=version_id, state__in=ACTIVE_STATES)
    for rollout_id, state in active.values_list("pk", "state"):
        try:
            transitions.transition(
                STOP_FOR_REVOKED[state],
                actor=None,
                rollout_id=rollout_id,
                reason=reason,
                expected_state=state,
                extra={"candidate_revoked": True},
            )
        except Conflict:  # it moved on meanwhile; the next pass looks again
            continue
        ended.append(rollout_id)
    return ended
