"""Evaluation jobs: run a gating rollout's required suites against the agents serving it.

A job measures the candidate through a ready agent's engine (and, for agreement, the
baseline's), records the evaluation in the registry and re-checks the gate. No
transaction is held during the HTTP calls, and no step sleeps: joules per token waits for
the agent's next heartbeat in a task that is retried (tasks.rollout_evaluate_energy).
Each engine is called with its serving secret (derived from the agent's load command);
the secrets are never part of what is measured, recorded or passed between tasks.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone

from controlplane.core.errors import DomainError
from controlplane.core.redis_clients import redis_client
from controlplane.fleet.endpoint_checks import endpoints_verify
from controlplane.fleet.engine_secrets import serving_loads, serving_secrets
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


@dataclass(frozen=True)
class EngineTarget:
    endpoint: str
    serving_secret: str = field(repr=False)

    def client(self) -> httpx.Client:
        return httpx.Client(headers={"Authorization": f"Bearer {self.serving_secret}"})


def _ready_engine(version_id: int) -> EngineTarget | None:
    """The first ready agent serving the version whose engine's serving secret is known and
    whose endpoint proved itself (challenged here when the reconciler has not yet: a
    candidate is evaluated before it is routed); the serving secret goes to no other."""
    fresh_after = timezone.now() - timedelta(seconds=settings.ROLLOUTS_AGENT_FRESH_S)
    agents = list(
        Agent.objects.filter(
            state=AgentState.READY, loaded_version_id=version_id, last_seen__gte=fresh_after
        )
        .exclude(endpoint="")
        .order_by("name")
    )
    loads = serving_loads(agents)
    secrets = serving_secrets(agents, loads)
    candidates = [agent for agent in agents if agent.pk in secrets]
    client = redis_client()
    try:
        verified = endpoints_verify(agents=candidates, loads=loads, client=client)
    finally:
        client.close()
    for agent in candidates:
        if agent.pk in verified:
            return EngineTarget(endpoint=agent.endpoint, serving_secret=secrets[agent.pk])
    return None


def agent_figures_after(endpoint: str, *, after: float) -> dict[str, Any] | None:
    """The latest figures of the agent serving `endpoint`, if its heartbeat was sent after
    `after` (a Unix time); None while no such heartbeat has been ingested."""
    agent = Agent.objects.filter(endpoint=endpoint).first()
    if agent is None or agent.last_sent_at is None:
        return None
    if agent.last_sent_at.timestamp() <= after:
        return None
    return dict(agent.figures)


@dataclass
class Measured:
    """A job's figures so far; JSON-safe, so the energy step can carry it as a task argument.

    `energy_before` and `workload_ended_at` are set when the suite asks for joules per
    token: the figure needs a heartbeat sent after the workload, which the energy step
    waits for by being retried, not by sleeping.
    """

    endpoint: str
    figures: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    energy_before: dict[str, Any] | None = None
    workload_ended_at: float | None = None

    @property
    def needs_energy(self) -> bool:
        return self.workload_ended_at is not None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measured:
        return cls(**data)


def evaluation_measure(*, rollout_id: int, suite_id: int) -> Measured | None:
    """Run one required suite's workloads against the agent serving the candidate.

    No transaction is held during the HTTP calls. Returns None (nothing to record) when the
    rollout is no longer gating, the suite is already evaluated, or no agent serves the
    candidate yet (the next gate tick asks again).
    """
    if suite_id not in evaluations_due(rollout_id=rollout_id):
        return None
    rollout = Rollout.objects.select_related("candidate", "baseline").get(pk=rollout_id)
    suite = EvalSuite.objects.get(pk=suite_id)
    names = _metric_names(suite)
    unknown = sorted(names - evaluation.KNOWN_METRICS)
    if unknown:
        raise DomainError(
            "unknown_metrics",
            f"Suite {suite.name} names metrics no job computes: {', '.join(unknown)}.",
        )
    target = _ready_engine(rollout.candidate_id)
    if target is None:
        return None
    baseline = _ready_engine(rollout.baseline_id) if "agreement" in names else None
    if "agreement" in names and baseline is None:
        return None
    endpoint = target.endpoint
    measured = Measured(endpoint=endpoint, details={"endpoint": endpoint})
    figures, details = measured.figures, measured.details
    questions = evaluation.questions()
    prompts = [q.question for q in questions]
    with target.client() as client:
        if "perplexity" in names:
            tokenizer = evaluation.tokenizer_for(
                str(store.artifact_path(rollout.candidate.artifact_digest))
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
            if baseline is not None:
                with baseline.client() as baseline_client:
                    baseline_answers = evaluation.greedy_answers(
                        client=baseline_client, endpoint=baseline.endpoint, prompts=prompts
                    )
                details["baseline_answers"] = baseline_answers
                figures["agreement"] = evaluation.agreement(answers, baseline_answers)
        if names & (evaluation.LATENCY_METRICS | evaluation.ENERGY_METRICS):
            if "joules_per_token" in names:
                # The latest heartbeat: its cumulative counters are the workload's start.
                # Whatever ran between it and the workload counts in both energy and
                # tokens, so the ratio stays consistent.
                measured.energy_before = agent_figures_after(endpoint, after=time.time() - 5)
                if measured.energy_before is None:
                    raise DomainError("no_heartbeat", f"No recent heartbeat from {endpoint}.")
            result = evaluation.latency(client=client, endpoint=endpoint, prompts=prompts * 2)
            details["latency"] = result
            figures["ttft_p95_ms"] = result["ttft_p95_ms"]
            figures["itl_p95_ms"] = result["itl_p95_ms"]
            if "joules_per_token" in names:
                measured.workload_ended_at = time.time()
    return measured


def evaluation_energy_add(measured: Measured, after: dict[str, Any]) -> None:
    """Add joules per token from the figures of a heartbeat sent after the workload."""
    assert measured.energy_before is not None
    per_token = evaluation.joules_per_token(measured.energy_before, after)
    if per_token is None:
        raise DomainError("no_energy", "The agent reported no energy or no tokens.")
    measured.figures["joules_per_token"] = per_token


def evaluation_finish(*, rollout_id: int, suite_id: int, measured: Measured) -> Evaluation:
    """Record the suite's evaluation of the candidate and re-check the gate."""
    rollout = Rollout.objects.select_related("candidate", "baseline").get(pk=rollout_id)
    suite = EvalSuite.objects.get(pk=suite_id)
    evaluation_row = evaluation_record(
        actor=None,
        version=rollout.candidate,
        suite=suite,
        metrics={name: measured.figures[name] for name in sorted(_metric_names(suite))},
        baseline_version=rollout.baseline,
        notes=json.dumps(measured.details, sort_keys=True)[:10000],
    )
    transitions.rollout_gate_check(rollout_id=rollout_id)
    return evaluation_row


def _metric_names(suite: EvalSuite) -> set[str]:
    return {definition["name"] for definition in suite.metrics}
