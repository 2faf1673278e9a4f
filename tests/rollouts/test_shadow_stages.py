"""Shadow stages: the plan's checks, the desired routing they imply, and the analysis of
the requests mirrored to the candidate."""

from datetime import timedelta
from typing import Any

import pytest

from controlplane.core.errors import DomainError
from controlplane.rollouts import deployments, transitions
from controlplane.rollouts.models import AnalysisRun, Deployment, Rollout
from controlplane.rollouts.stages import stages_validate
from controlplane.rollouts.tasks import analysis_tick, rollout_analyze
from tests.rollouts.conftest import add_samples, backdate_stage, running_rollout

SHADOW_PLAN: list[dict[str, Any]] = [
    {"weight": 50, "min_duration_s": 60, "min_requests": 20, "shadow": True},
    {"weight": 100, "min_duration_s": 60, "min_requests": 20},
]


def test_a_shadow_stage_is_kept_and_a_plain_one_reads_as_before(db) -> None:
    plan = stages_validate([*SHADOW_PLAN[:1], {"weight": 100, "shadow": False}])
    assert plan == [
        {"weight": 50, "min_duration_s": 60, "min_requests": 20, "tenants": [], "shadow": True},
        {"weight": 100, "min_duration_s": 60, "min_requests": 0, "tenants": []},
    ]


@pytest.mark.parametrize("value", ["true", 1, 0, None, "yes"])
def test_shadow_must_be_a_boolean(db, value) -> None:
    with pytest.raises(DomainError) as refused:
        stages_validate([{"weight": 10, "shadow": value}, {"weight": 100}])
    assert refused.value.code == "invalid_stages"
    assert refused.value.fields == {"stages": {0: "shadow must be true or false."}}


def test_the_last_stage_cannot_be_a_shadow_stage(deployment, versions) -> None:
    stages = [{"weight": 10}, {"weight": 100, "shadow": True}]
    with pytest.raises(DomainError) as refused:
        deployments.rollout_create(
            actor=None, deployment=deployment, candidate=versions[1], stages=stages, reason="t"
        )
    assert refused.value.code == "invalid_stages"
    assert refused.value.message.startswith("Stage 1: the last stage cannot be a shadow stage")
    assert not Rollout.objects.exists()


def test_the_api_takes_a_shadow_stage_and_refuses_a_shadow_that_is_no_boolean(
    api, deployment, versions
) -> None:
    manager = api("release_manager")
    body = {"deployment": "smollm2", "candidate": versions[1].pk, "reason": "mirror first"}
    refused = manager.post(
        "/api/v1/rollouts/",
        {**body, "stages": [{"weight": 50, "shadow": "yes"}, {"weight": 100}]},
        format="json",
    )
    assert refused.status_code == 400, refused.json()
    assert not Rollout.objects.exists()
    created = manager.post("/api/v1/rollouts/", {**body, "stages": SHADOW_PLAN}, format="json")
    assert created.status_code == 201, created.json()
    assert [stage.get("shadow", False) for stage in created.json()["stages"]] == [True, False]


def test_desired_routing_mirrors_during_the_shadow_stage_only(deployment, versions) -> None:
    stable, candidate = versions
    rollout = running_rollout(deployment, candidate, stages=SHADOW_PLAN)
    routing = Deployment.objects.get().desired_routing
    assert (routing["canary_version_id"], routing["canary_weight"], routing["canary_shadow"]) == (
        candidate.pk,
        50,
        True,
    )
    assert routing["preload_version_ids"] == [stable.pk, candidate.pk]
    transitions.rollout_advance(actor=None, rollout_id=rollout.pk, reason="test")
    routing = Deployment.objects.get().desired_routing
    assert (routing["canary_weight"], routing["canary_shadow"]) == (100, False)


def test_the_analysis_of_a_shadow_stage_reads_the_mirrored_requests(
    deployment, versions, tenant
) -> None:
    stable, candidate = versions
    policy = {"min_samples": 20, "alpha": 0.01}
    plan = [{**SHADOW_PLAN[0], "weight": 100}, SHADOW_PLAN[1]]  # mirrors every request
    rollout = backdate_stage(
        running_rollout(deployment, candidate, stages=plan, policy=policy), 120
    )
    window_end = analysis_tick()
    start = window_end - timedelta(seconds=50)
    add_samples(
        version=stable, tenant=tenant, start=start, ttft_ms=[100.0 + i % 9 for i in range(40)]
    )
    add_samples(
        version=candidate,
        tenant=tenant,
        start=start,
        ttft_ms=[100.0 + i % 7 for i in range(30)],
        is_shadow=True,
    )
    # Samples of requests the candidate answered (none in a shadow stage) are not its own:
    # these slow ones would fail it.
    add_samples(
        version=candidate, tenant=tenant, start=start, ttft_ms=[5000.0] * 10, is_shadow=False
    )

    rollout_analyze.apply(args=[rollout.pk, window_end.isoformat()])

    run = AnalysisRun.objects.get()
    assert (run.verdict, run.action) == ("pass", "advance")
    # The baseline is measured beside the canary, not before the stage: a shadow stage at
    # 100 % leaves the baseline every request, so its rank tests are kept.
    assert (run.canary["requests"], run.baseline["requests"], run.canary["requests_in_stage"]) == (
        30,
        40,
        30,
    )
    assert run.tests["ttft_mann_whitney"] is not None
    rollout.refresh_from_db()
    assert (rollout.state, rollout.stage_index) == ("running", 1)
    assert Deployment.objects.get().desired_routing["canary_shadow"] is False
