"""Joules per token: the evaluation's energy step waits for the agent's next heartbeat by
being retried (never sleeping), records the figure once the heartbeat is in, and gives
up with `no_heartbeat` when none comes. Real PostgreSQL and Redis; the task runs in-process
with `apply()`, retries included."""

import time
from datetime import UTC, datetime

import pytest

from controlplane.core.errors import DomainError
from controlplane.core.redis_clients import redis_client
from controlplane.fleet.models import Agent, AgentState
from controlplane.registry.models import EvalKind, EvalSuite, Evaluation
from controlplane.rollouts import deployments, tasks, transitions
from controlplane.rollouts.evaluation_jobs import Measured, agent_figures_after
from controlplane.rollouts.models import RolloutState

ENDPOINT = "http://127.0.0.1:9"


@pytest.fixture
def energy_suite(db) -> EvalSuite:
    return EvalSuite.objects.create(
        name="energy",
        kind=EvalKind.ENERGY,
        dataset="questions-v1",
        metrics=[{"name": "joules_per_token", "threshold": 1.0, "higher_is_better": False}],
    )


@pytest.fixture
def gating(deployment, versions, energy_suite):
    rollout = deployments.rollout_create(
        actor=None,
        deployment=deployment,
        candidate=versions[1],
        required_suites=[energy_suite],
        reason="energy test",
    )
    rollout = transitions.rollout_gate_check(rollout_id=rollout.pk)
    assert rollout.state == RolloutState.GATING
    return rollout


def agent_with_heartbeat(version, *, sent_at: float, energy_joules: float, tokens: int) -> Agent:
    return Agent.objects.create(
        name="agent-energy",
        host="127.0.0.1",
        endpoint=ENDPOINT,
        state=AgentState.READY,
        loaded_version=version,
        figures={"energy_joules": energy_joules, "generated_tokens_total": tokens},
        last_seen=datetime.fromtimestamp(sent_at, UTC),
        last_sent_at=datetime.fromtimestamp(sent_at, UTC),
        registered_at=datetime.fromtimestamp(sent_at, UTC),
    )


def measured_job(workload_ended_at: float) -> Measured:
    return Measured(
        endpoint=ENDPOINT,
        details={"endpoint": ENDPOINT},
        energy_before={"energy_joules": 100.0, "generated_tokens_total": 40},
        workload_ended_at=workload_ended_at,
    )


@pytest.fixture
def lock(gating, energy_suite):
    key = f"rollouts:evaluating:{gating.pk}:{energy_suite.pk}"
    client = redis_client(decode_responses=True)
    client.set(key, "1", ex=60)
    yield lambda: client.exists(key)
    client.delete(key)
    client.close()


def test_figures_count_only_from_a_heartbeat_sent_after_the_workload(versions) -> None:
    ended = time.time()
    agent = agent_with_heartbeat(versions[1], sent_at=ended - 1, energy_joules=1, tokens=1)
    assert agent_figures_after(ENDPOINT, after=ended) is None
    agent.last_sent_at = datetime.fromtimestamp(ended + 1, UTC)
    agent.save()
    assert agent_figures_after(ENDPOINT, after=ended) == {
        "energy_joules": 1,
        "generated_tokens_total": 1,
    }
    assert agent_figures_after("http://elsewhere:1", after=0) is None


def test_energy_step_records_joules_per_token(gating, energy_suite, versions, lock) -> None:
    ended = time.time() - 2
    agent_with_heartbeat(versions[1], sent_at=ended + 1, energy_joules=110.0, tokens=60)
    result = tasks.rollout_evaluate_energy.apply(
        args=(gating.pk, energy_suite.pk, measured_job(ended).to_json())
    )
    assert result.successful(), result.traceback
    evaluation = Evaluation.objects.get(version=versions[1], suite=energy_suite)
    assert evaluation.metrics == {"joules_per_token": pytest.approx(0.5)}  # 10 J / 20 tokens
    assert evaluation.passed is True
    assert not lock(), "the job's in-progress key is released"


def test_energy_step_retries_then_gives_up_without_a_heartbeat(
    gating, energy_suite, versions, lock, monkeypatch
) -> None:
    ended = time.time()
    agent_with_heartbeat(versions[1], sent_at=ended - 1, energy_joules=110.0, tokens=60)
    looks: list[float] = []
    real = tasks.evaluation_jobs.agent_figures_after

    def counted(endpoint: str, *, after: float):
        looks.append(after)
        return real(endpoint, after=after)

    monkeypatch.setattr(tasks.evaluation_jobs, "agent_figures_after", counted)
    result = tasks.rollout_evaluate_energy.apply(
        args=(gating.pk, energy_suite.pk, measured_job(ended).to_json())
    )
    assert result.failed()
    assert result.result.exc_cls_name == DomainError.__name__  # wrapped by Celery's result
    assert "No heartbeat from the agent" in str(result.result)
    assert len(looks) == tasks.ENERGY_LOOKS  # one look per try, none slept through
    assert not Evaluation.objects.filter(suite=energy_suite).exists()
    assert not lock()
