"""Retention: prompt records and request samples past their tenant's retention_days are
deleted in batches; newer rows, other tenants' rows, usage and what a running rollout
reads are kept."""

import time
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.registry.models import Artifact, Model, ModelVersion
from controlplane.rollouts import deployments, transitions
from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.telemetry.models import PromptRecord, RequestSample
from controlplane.telemetry.retention import RetentionResult, retention_apply
from controlplane.telemetry.tasks import apply_retention
from controlplane.telemetry.usage import request_records_apply
from controlplane.tenants.models import Tenant, UsageRecord
from controlplane.tenants.services import tenant_create
from tests.telemetry.support import request_record

pytestmark = pytest.mark.django_db

DAY_S = 24 * 3600.0
SERVING_CONFIG = {"dtype": "float32", "max_model_len": 2048, "kv_block_size": 16}


def _versions(count: int) -> list[ModelVersion]:
    model = Model.objects.create(name="smollm2", task="chat")
    return [
        ModelVersion.objects.create(
            model=model,
            label=f"v{index}",
            artifact=Artifact.objects.create(
                digest=uuid.uuid4().hex * 2, format="gguf", size_bytes=1
            ),
            serving_config=SERVING_CONFIG,
            status="verified",
        )
        for index in range(1, count + 1)
    ]


def _tenant(slug: str, retention_days: int) -> Tenant:
    return tenant_create(
        actor=None, slug=slug, name=slug, prompt_logging="full", retention_days=retention_days
    )


def _ingest(tenant: Tenant, version: ModelVersion, *, age_s: float) -> str:
    """One request of the tenant, finished `age_s` ago, written the way ingest writes it
    (sample, prompt record and usage); its request id."""
    finished_at = time.time() - age_s
    request_id = uuid.uuid4().hex
    request_records_apply(
        records=[
            request_record(
                request_id=request_id,
                tenant_id=tenant.pk,
                version_id=version.pk,
                finished_at=finished_at,
                prompt="What is the capital of France?",
                completion="Paris.",
            )
        ]
    )
    return request_id


def _sample_ids() -> set[str]:
    return set(RequestSample.objects.values_list("request_id", flat=True))


def _prompt_ids() -> set[str]:
    return set(PromptRecord.objects.values_list("request_id", flat=True))


def _usage() -> list[tuple]:
    return list(
        UsageRecord.objects.order_by("pk").values_list(
            "pk", "tenant_id", "version_id", "minute", "requests", "prompt_tokens"
        )
    )


def test_rows_past_each_tenants_retention_go_and_the_rest_stays() -> None:
    (version,) = _versions(1)
    weekly = _tenant("weekly", retention_days=7)
    quarterly = _tenant("quarterly", retention_days=90)
    weekly_old = _ingest(weekly, version, age_s=7 * DAY_S + 3600)
    weekly_new = _ingest(weekly, version, age_s=7 * DAY_S - 3600)
    quarterly_old = _ingest(quarterly, version, age_s=90 * DAY_S + 3600)
    quarterly_new = _ingest(quarterly, version, age_s=7 * DAY_S + 3600)  # weekly's would go
    usage_before = _usage()
    assert len(usage_before) == 4  # each request in a minute of its own

    result = retention_apply()

    assert result == RetentionResult(prompt_records=2, request_samples=2, is_complete=True)
    assert _sample_ids() == {weekly_new, quarterly_new}
    assert _prompt_ids() == {weekly_new, quarterly_new}
    assert weekly_old not in _sample_ids() and quarterly_old not in _sample_ids()
    assert _usage() == usage_before  # billing reads these: never deleted

    # Again: nothing left to delete, nothing else touched.
    assert retention_apply() == RetentionResult(
        prompt_records=0, request_samples=0, is_complete=True
    )
    assert _sample_ids() == {weekly_new, quarterly_new}
    assert _usage() == usage_before


def test_more_rows_than_a_batch_are_deleted_over_several_batches() -> None:
    (version,) = _versions(1)
    acme = _tenant("acme", retention_days=1)
    globex = _tenant("globex", retention_days=1)
    old = [_ingest(acme, version, age_s=2 * DAY_S + index) for index in range(7)]
    old += [_ingest(globex, version, age_s=3 * DAY_S + index) for index in range(5)]
    new = {_ingest(acme, version, age_s=3600), _ingest(globex, version, age_s=3600)}
    assert len(old) == 12

    result = retention_apply(batch_size=2)

    assert result == RetentionResult(prompt_records=12, request_samples=12, is_complete=True)
    assert _sample_ids() == new
    assert _prompt_ids() == new


def test_a_run_out_of_time_leaves_the_rest_for_the_next_run() -> None:
    (version,) = _versions(1)
    acme = _tenant("acme", retention_days=1)
    old = {_ingest(acme, version, age_s=2 * DAY_S) for _ in range(3)}

    assert retention_apply(time_budget_s=0) == RetentionResult(
        prompt_records=0, request_samples=0, is_complete=False
    )
    assert _sample_ids() == old
    assert retention_apply() == RetentionResult(
        prompt_records=3, request_samples=3, is_complete=True
    )
    assert _sample_ids() == set()


def test_a_retention_of_zero_set_outside_the_api_counts_as_one_day() -> None:
    (version,) = _versions(1)
    acme = _tenant("acme", retention_days=30)
    Tenant.objects.filter(pk=acme.pk).update(retention_days=0)  # as the admin could
    today = _ingest(acme, version, age_s=12 * 3600)
    _ingest(acme, version, age_s=DAY_S + 3600)

    assert retention_apply() == RetentionResult(
        prompt_records=1, request_samples=1, is_complete=True
    )
    assert _sample_ids() == {today}


def test_samples_a_running_rollout_reads_are_kept_and_their_prompts_are_not() -> None:
    baseline, candidate, unrelated = _versions(3)
    deployment = deployments.deployment_create(actor=None, name="smollm2", stable_version=baseline)
    rollout = deployments.rollout_create(
        actor=None, deployment=deployment, candidate=candidate, reason="faster"
    )
    rollout = transitions.rollout_gate_check(rollout_id=rollout.pk)
    assert rollout.state == RolloutState.RUNNING
    # A long stage: it started ten days ago and still counts its canary's requests.
    Rollout.objects.filter(pk=rollout.pk).update(
        stage_started_at=timezone.now() - timedelta(days=10)
    )
    acme = _tenant("acme", retention_days=1)
    canary_in_stage = _ingest(acme, candidate, age_s=5 * DAY_S)
    baseline_in_stage = _ingest(acme, baseline, age_s=9 * DAY_S)
    unrelated_old = _ingest(acme, unrelated, age_s=5 * DAY_S)
    before_stage = _ingest(acme, baseline, age_s=20 * DAY_S)

    result = retention_apply()

    assert result == RetentionResult(prompt_records=4, request_samples=2, is_complete=True)
    assert _sample_ids() == {canary_in_stage, baseline_in_stage}
    assert unrelated_old not in _sample_ids() and before_stage not in _sample_ids()
    assert _prompt_ids() == set()

    # Once the rollout is over its samples follow the tenant's retention too.
    Rollout.objects.filter(pk=rollout.pk).update(state=RolloutState.PROMOTED)
    assert retention_apply() == RetentionResult(
        prompt_records=0, request_samples=2, is_complete=True
    )
    assert _sample_ids() == set()


def test_the_periodic_task_runs_through_celery() -> None:
    (version,) = _versions(1)
    acme = _tenant("acme", retention_days=3)
    kept = _ingest(acme, version, age_s=2 * DAY_S)
    _ingest(acme, version, age_s=4 * DAY_S)

    outcome = apply_retention.apply()

    assert outcome.successful()
    assert outcome.get() == {"prompt_records": 1, "request_samples": 1, "is_complete": True}
    assert _sample_ids() == {kept}
    assert _prompt_ids() == {kept}
