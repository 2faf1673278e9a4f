"""Rollout fixtures: two versions of one model, a deployment, users of every role."""

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.accounts.services import access_token_create, user_create
from controlplane.core.roles import Role
from controlplane.registry.models import Artifact, EvalKind, EvalSuite, Model, ModelVersion
from controlplane.rollouts import deployments, transitions
from controlplane.rollouts.models import Deployment, Rollout
from controlplane.telemetry.models import RequestSample
from controlplane.tenants.models import Tenant

SERVING_CONFIG = {"dtype": "float32", "max_model_len": 2048, "kv_block_size": 16}


def make_version(model: Model, label: str, digest_char: str) -> ModelVersion:
    artifact = Artifact.objects.create(digest=digest_char * 64, format="gguf", size_bytes=1024)
    return ModelVersion.objects.create(
        model=model,
        label=label,
        artifact=artifact,
        serving_config=SERVING_CONFIG,
        status="verified",
    )


@pytest.fixture
def versions(db) -> tuple[ModelVersion, ModelVersion]:
    model = Model.objects.create(name="smollm2", task="chat")
    return make_version(model, "f32", "a"), make_version(model, "bf16", "b")


@pytest.fixture
def deployment(versions) -> Deployment:
    return deployments.deployment_create(actor=None, name="smollm2", stable_version=versions[0])


@pytest.fixture
def suite(db) -> EvalSuite:
    return EvalSuite.objects.create(
        name="exact-match",
        kind=EvalKind.QUALITY,
        dataset="questions-v1",
        metrics=[{"name": "exact_match", "threshold": 0.8, "higher_is_better": True}],
    )


@pytest.fixture
def tenant(db) -> Tenant:
    return Tenant.objects.create(slug="acme", name="Acme")


@pytest.fixture
def api(db) -> Callable[[str], APIClient]:
    """api(role) -> an APIClient authenticated with a Bearer token of a user with that role."""
    made: dict[str, APIClient] = {}

    def client_for(role: str) -> APIClient:
        if role not in made:
            user = user_create(actor=None, username=f"user-{role}", password=None, role=role)
            token = access_token_create(user=user, name="tests").raw_token
            client = APIClient()
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
            made[role] = client
        return made[role]

    return client_for


ROLES = [Role.ADMIN, Role.RELEASE_MANAGER, Role.ON_CALL, Role.VIEWER]


def running_rollout(deployment: Deployment, candidate: ModelVersion, **kwargs: Any) -> Rollout:
    """A rollout moved to stage 0 through the gate (no required suites)."""
    rollout = deployments.rollout_create(
        actor=None, deployment=deployment, candidate=candidate, reason="test", **kwargs
    )
    return transitions.rollout_gate_check(rollout_id=rollout.pk)


def add_samples(
    *,
    version: ModelVersion,
    tenant: Tenant,
    start: datetime,
    ttft_ms: list[float],
    itl_ms: list[float] | None = None,
    errors: list[bool] | None = None,
    step_s: float = 0.1,
    is_shadow: bool = False,
) -> None:
    itl_ms = itl_ms or [20.0] * len(ttft_ms)
    errors = errors or [False] * len(ttft_ms)
    RequestSample.objects.bulk_create(
        RequestSample(
            request_id=f"{version.pk:04x}{int(start.timestamp()):012x}{int(is_shadow)}{index:015x}",
            tenant=tenant,
            version=version,
            deployment="smollm2",
            agent="http://127.0.0.1:9000",
            endpoint_kind="chat",
            status=500 if is_error else 200,
            is_error=is_error,
            is_stream=True,
            ttft_s=ttft / 1000.0,
            itl_mean_s=itl / 1000.0,
            itl_p95_s=itl / 1000.0,
            e2e_s=1.0,
            prompt_tokens=10,
            completion_tokens=20,
            finished_at=start + timedelta(seconds=step_s * (index + 1)),
            is_shadow=is_shadow,
        )
        for index, (ttft, itl, is_error) in enumerate(zip(ttft_ms, itl_ms, errors, strict=True))
    )


def backdate_stage(rollout: Rollout, seconds: float) -> Rollout:
    """Move the stage start into the past (instead of sleeping)."""
    Rollout.objects.filter(pk=rollout.pk).update(
        stage_started_at=timezone.now() - timedelta(seconds=seconds)
    )
    rollout.refresh_from_db()
    return rollout
