"""Evaluation jobs: run a gating rollout's required suites against the agents serving it.

A job measures the candidate through a ready agent's engine (and, for agreement, the
baseline's), records the evaluation in the registry and re-checks the gate. No
transaction is held during the HTTP calls.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone

from controlplane.core.errors import DomainError
from controlplane.fleet.models import Agent, AgentState
from controlplane.registry import store
from controlplane.registry.models import EvalSuite, Evaluation
from controlplane.registry.services import evaluation_record
from controlplane.rollouts import evaluation, transitions
from controlplane.rollouts.models import Rollout, RolloutState


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
    transitions.rollout_gate_check(rollout_id=rollout_id)
    return evaluation_row
