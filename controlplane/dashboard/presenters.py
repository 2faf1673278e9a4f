"""Shaping domain objects for the pages: stage plans, chart series, comparisons, totals.

Pure functions over what the selectors return; no writes and no permission decisions
beyond asking `controlplane.core.access`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django import forms
from django.db.models import QuerySet

from contracts.capacity import footprint_total
from controlplane.core import access
from controlplane.fleet.inventory import memory_offered
from controlplane.fleet.models import Agent
from controlplane.rollouts.analysis import AnalysisPolicy
from controlplane.rollouts.models import ACTIVE_STATES, AnalysisRun, Rollout, RolloutState, Stage

# Rollouts.

# Which access check allows which transition, and from which states it is offered.
TRANSITION_RULES: dict[str, tuple[Any, frozenset[str]]] = {
    "promote": (access.can_steer_rollouts, frozenset({RolloutState.RUNNING})),
    "pause": (
        access.can_pause_or_rollback,
        frozenset({RolloutState.PENDING, RolloutState.GATING, RolloutState.RUNNING}),
    ),
    "resume": (access.can_steer_rollouts, frozenset({RolloutState.PAUSED})),
    "abort": (access.can_steer_rollouts, ACTIVE_STATES),
    "rollback": (
        access.can_pause_or_rollback,
        frozenset({RolloutState.RUNNING, RolloutState.PAUSED}),
    ),
}

TRANSITION_LABELS = {
    "promote": "Promote",
    "pause": "Pause",
    "resume": "Resume",
    "abort": "Abort",
    "rollback": "Roll back",
}


def may_transition(user: Any, action: str) -> bool:
    check, _ = TRANSITION_RULES[action]
    return bool(check(user))


def rollout_actions(user: Any, rollout: Rollout) -> list[dict[str, Any]]:
    """The transitions this user may ask for on this rollout in its current state."""
    actions = []
    for action, (check, states) in TRANSITION_RULES.items():
        if not check(user):
            continue
        if rollout.state not in states:
            continue
        actions.append(
            {
                "name": action,
                "label": TRANSITION_LABELS[action],
                "is_danger": action in {"rollback", "abort"},
            }
        )
    return actions


def stage_label(rollout: Rollout) -> str:
    stage = rollout.current_stage
    if rollout.state in {RolloutState.RUNNING, RolloutState.PAUSED} and stage is not None:
        shadow = " shadow" if stage.get("shadow") else ""  # mirrored, not answered
        return f"{rollout.stage_index + 1}/{len(rollout.stages)} at {stage['weight']}%{shadow}"
    return f"0/{len(rollout.stages)}" if rollout.state in ACTIVE_STATES else "-"


def stage_plan(rollout: Rollout) -> list[dict[str, Any]]:
    is_on_stages = rollout.state in {RolloutState.RUNNING, RolloutState.PAUSED}
    plan = []
    stages: list[Stage] = rollout.stages
    for index, stage in enumerate(stages):
        is_passed = is_on_stages and index < rollout.stage_index
        if rollout.state == RolloutState.PROMOTED or is_passed:
            position = "done"
        elif is_on_stages and index == rollout.stage_index:
            position = "current"
        else:
            position = "next"
        plan.append(
            {
                "index": index,
                "number": index + 1,
                **stage,
                "position": position,
            }
        )
    return plan


# The four signals charted on the rollout page: (key, title, unit, scale to the unit).
SIGNALS = (
    ("ttft_p95_ms", "TTFT p95", "ms", 1.0),
    ("itl_p95_ms", "Inter-token latency p95", "ms", 1.0),
    ("error_rate", "Error rate", "%", 100.0),
    ("joules_per_token", "Energy per token", "J/token", 1.0),
)


def _scaled(figures: dict[str, Any], key: str, scale: float) -> float | None:
    value = (figures or {}).get(key)
    return None if value is None else float(value) * scale


def analysis_series(runs: Iterable[AnalysisRun], rollout: Rollout) -> dict[str, Any]:
    """Chart data: one point per run (oldest first, at its window's end) for canary and
    baseline of each signal, and the limits of the rollout's policy (defaults included)."""
    points = list(runs)
    policy = AnalysisPolicy.from_dict(rollout.policy)
    limits = {
        "ttft_p95_ms": policy.ttft_p95_max_ms,
        "itl_p95_ms": policy.itl_p95_max_ms,
        "error_rate": policy.error_rate_max * 100.0,
        "joules_per_token": None,
    }
    return {
        "rollout_id": rollout.pk,
        "state": rollout.state,
        "stage_index": rollout.stage_index,
        "versions": {"baseline": rollout.baseline.label, "canary": rollout.candidate.label},
        "times": [run.window_end.isoformat() for run in points],
        "verdicts": [run.verdict for run in points],
        "signals": [
            {
                "key": key,
                "title": title,
                "unit": unit,
                "limit": limits[key],
                "canary": [_scaled(run.canary, key, scale) for run in points],
                "baseline": [_scaled(run.baseline, key, scale) for run in points],
            }
            for key, title, unit, scale in SIGNALS
        ],
    }


def version_roles(rollouts: Iterable[Rollout]) -> dict[int, str]:
    """Version id -> "canary" or "baseline" for the rollouts given (those under way), so
    that charts colour a version by its role; a candidate anywhere is a canary."""
    roles: dict[int, str] = {}
    for rollout in rollouts:
        roles[rollout.candidate_id] = "canary"
        roles.setdefault(rollout.baseline_id, "baseline")
    return roles


# Registry.


def evaluations_by_version(evaluations: QuerySet) -> dict[int, list[Any]]:
    grouped: dict[int, list[Any]] = defaultdict(list)
    for evaluation in evaluations:
        grouped[evaluation.version_id].append(evaluation)
    return dict(grouped)


def version_fits(version: Any, agents: Iterable[Any]) -> list[dict[str, Any]]:
    """Each agent with the memory it offers and whether the version's footprint fits it
    (an empty agent: the reconciler also counts the engines already there)."""
    needed = footprint_total(version.footprint)
    rows = []
    for agent in agents:
        offered = memory_offered(agent.inventory)
        rows.append(
            {"agent": agent, "offered": offered, "is_fit": needed is not None and needed <= offered}
        )
    return rows


def deployment_replicas(deployment: Any) -> list[dict[str, Any]]:
    """Each role's version with its desired replicas, bounds and the agents serving it."""
    rows = [
        {
            "role": "stable",
            "version": deployment.stable_version,
            "replicas": deployment.stable_replicas,
            "minimum": deployment.stable_replicas_min,
            "maximum": deployment.stable_replicas_max,
        }
    ]
    rollout = Rollout.objects.filter(deployment=deployment, state__in=ACTIVE_STATES).first()
    if rollout is not None and rollout.state != RolloutState.PENDING:
        rows.append(
            {
                "role": "canary",
                "version": rollout.candidate,
                "replicas": rollout.canary_replicas,
                "minimum": rollout.canary_replicas_min,
                "maximum": rollout.canary_replicas_max,
            }
        )
    for row in rows:
        row["agents"] = list(
            Agent.objects.filter(loaded_version=row["version"])
            .order_by("name")
            .values("name", "host", "state")
        )
    return rows


def signature_status(version: Any) -> str:
    if version.is_verification_override:
        return "override"
    if version.signature and version.signing_key_id:
        return "trusted" if version.signing_key.is_trusted else "untrusted key"
    return "unsigned"


def version_comparison(left: Any, right: Any) -> list[dict[str, Any]]:
    """Rows of (field, left value, right value, differs) for the side-by-side view."""

    def facts(version: Any) -> dict[str, Any]:
        row = {
            "Model": version.model.name,
            "Label": version.label,
            "Status": version.get_status_display(),
            "Digest": f"sha256:{version.artifact_id}" if version.artifact_id else "",
            "Format": version.artifact.format if version.artifact else "",
            "Size (bytes)": version.artifact.size_bytes if version.artifact else "",
            "Files": len(version.artifact.manifest)
            if version.artifact and version.artifact.manifest
            else "",
            "Engine": version.get_engine_display(),
            "Signature": signature_status(version),
            "Signing key": version.signing_key.key_id if version.signing_key_id else "",
            "Source": version.source,
            "Base version": str(version.base_version) if version.base_version_id else "",
            "Created": version.created_at.strftime("%Y-%m-%d %H:%M UTC"),
        }
        for key, value in sorted((version.serving_config or {}).items()):
            row[f"serving: {key}"] = value
        for key, value in sorted((version.engine_args or {}).items()):
            row[f"engine: {key}"] = value
        return row

    left_facts, right_facts = facts(left), facts(right)
    names = list(dict.fromkeys([*left_facts, *right_facts]))
    return [
        {
            "name": name,
            "left": left_facts.get(name, ""),
            "right": right_facts.get(name, ""),
            "differs": left_facts.get(name, "") != right_facts.get(name, ""),
        }
        for name in names
    ]


def evaluation_comparison(left: list[Any], right: list[Any]) -> list[dict[str, Any]]:
    """The newest result of each suite and metric for both versions."""

    def newest(evaluations: list[Any]) -> dict[tuple[str, str], Any]:
        values: dict[tuple[str, str], Any] = {}
        for evaluation in sorted(evaluations, key=lambda item: item.created_at):
            for metric, value in (evaluation.metrics or {}).items():
                values[(evaluation.suite.name, metric)] = (value, evaluation.passed)
        return values

    left_values, right_values = newest(left), newest(right)
    keys = sorted(set(left_values) | set(right_values))
    return [
        {
            "suite": suite,
            "metric": metric,
            "left": left_values.get((suite, metric)),
            "right": right_values.get((suite, metric)),
        }
        for suite, metric in keys
    ]


# Tenants.

USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "errors", "energy_joules")


def usage_totals(rows: Iterable[dict[str, Any]]) -> dict[str, float]:
    totals = dict.fromkeys(USAGE_FIELDS, 0.0)
    for row in rows:
        for field in USAGE_FIELDS:
            totals[field] += row.get(field) or 0
    totals["tokens"] = totals["prompt_tokens"] + totals["completion_tokens"]
    return totals


# Usage buckets: their length, and how far back the page looks.
USAGE_BUCKETS: dict[str, tuple[timedelta, timedelta]] = {
    "minute": (timedelta(minutes=1), timedelta(hours=2)),
    "hour": (timedelta(hours=1), timedelta(days=2)),
    "day": (timedelta(days=1), timedelta(days=30)),
}
USAGE_MEASURES = ("tokens", "requests", "errors", "energy_joules")


def usage_buckets(*, granularity: str, until: datetime) -> list[datetime]:
    """The start of every bucket of the page's span, oldest first, the current one last."""
    step, span = USAGE_BUCKETS[granularity]
    last = datetime.fromtimestamp(
        until.timestamp() // step.total_seconds() * step.total_seconds(), UTC
    )
    count = int(span / step)
    return [last - step * position for position in range(count, -1, -1)]


def usage_series(
    rows: list[dict[str, Any]],
    *,
    granularity: str,
    buckets: list[datetime],
    roles: dict[int, str],
) -> dict[str, Any]:
    """Per model and version, a value for every bucket given (0 where nothing was used),
    oldest first, for each usage measure; with the version's role in a rollout."""
    index = {bucket: position for position, bucket in enumerate(buckets)}
    series: dict[str, dict[str, Any]] = {}
    for row in rows:
        position = index.get(row["bucket"])
        if position is None:  # outside the buckets asked for
            continue
        name = f"{row['model_name']}:{row['version_label']}"
        entry = series.setdefault(
            name,
            {
                "role": roles.get(row["version_id"]),
                **{measure: [0.0] * len(buckets) for measure in USAGE_MEASURES},
            },
        )
        entry["tokens"][position] += (row["prompt_tokens"] or 0) + (row["completion_tokens"] or 0)
        entry["requests"][position] += row["requests"] or 0
        entry["errors"][position] += row["errors"] or 0
        entry["energy_joules"][position] += row["energy_joules"] or 0.0
    return {
        "granularity": granularity,
        "step_s": int(USAGE_BUCKETS[granularity][0].total_seconds()),
        "times": [bucket.isoformat() for bucket in buckets],
        "series": [{"name": name, **entry} for name, entry in sorted(series.items())],
    }


# Audit and forms.


def audit_filter(
    events: QuerySet, *, actor: str, object_type: str, object_id: str, action: str
) -> QuerySet:
    if actor:
        events = events.filter(actor_name=actor)
    if object_type:
        events = events.filter(object_type=object_type)
    if object_id:
        events = events.filter(object_id=object_id)
    if action.endswith("."):
        events = events.filter(action__startswith=action)
    elif action:
        events = events.filter(action=action)
    return events


def form_errors(form: forms.Form) -> str:
    return "; ".join(
        f"{field}: {' '.join(str(error) for error in errors)}"
        if field != "__all__"
        else " ".join(str(error) for error in errors)
        for field, errors in form.errors.items()
    )
