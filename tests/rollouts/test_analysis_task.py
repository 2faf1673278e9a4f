"""The analysis task on real request samples: advance, roll back, idempotent per tick."""

from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.rollouts import decisions, transitions
from controlplane.rollouts.models import AnalysisRun, Deployment, Rollout
from controlplane.rollouts.tasks import analysis_tick, rollout_analyze
from tests.rollouts.conftest import add_samples, backdate_stage, running_rollout

POLICY = {"min_samples": 20, "alpha": 0.01}
STAGES = [
    {"weight": 10, "min_duration_s": 60, "min_requests": 20},
    {"weight": 100, "min_duration_s": 60, "min_requests": 20},
]


def test_a_healthy_canary_advances_once_per_tick(deployment, versions, tenant) -> None:
    rollout = backdate_stage(
        running_rollout(deployment, versions[1], stages=STAGES, policy=POLICY), 120
    )
    window_end = analysis_tick()
    start = window_end - timedelta(seconds=50)
    add_samples(
        version=versions[0], tenant=tenant, start=start, ttft_ms=[100.0 + i % 9 for i in range(40)]
    )
    add_samples(
        version=versions[1], tenant=tenant, start=start, ttft_ms=[100.0 + i % 7 for i in range(30)]
    )

    rollout_analyze.apply(args=[rollout.pk, window_end.isoformat()])
    rollout_analyze.apply(args=[rollout.pk, window_end.isoformat()])  # delivered twice

    run = AnalysisRun.objects.get()
    assert (run.verdict, run.action, run.stage_index) == ("pass", "advance", 0)
    assert (run.canary["requests"], run.baseline["requests"], run.canary["requests_in_stage"]) == (
        30,
        40,
        30,
    )
    rollout.refresh_from_db()
    assert (rollout.state, rollout.stage_index) == ("running", 1)
    assert Deployment.objects.get().desired_routing["canary_weight"] == 100
    advance = (
        AuditEvent.objects.filter(object_id=str(rollout.pk), action="rollout.stage_start")
        .order_by("id")
        .last()
    )
    assert advance is not None
    assert advance.actor_name == "system"
    assert advance.reason.startswith(f"analysis {run.pk}: pass: canary within every limit")


def test_a_slow_canary_is_rolled_back_before_the_stage_ends(deployment, versions, tenant) -> None:
    rollout = backdate_stage(
        running_rollout(deployment, versions[1], stages=STAGES, policy=POLICY), 10
    )
    window_end = analysis_tick(timezone.now() + timedelta(seconds=30))
    start = window_end - timedelta(seconds=8)
    add_samples(
        version=versions[0], tenant=tenant, start=start, ttft_ms=[100.0 + i % 9 for i in range(40)]
    )
    add_samples(
        version=versions[1], tenant=tenant, start=start, ttft_ms=[400.0 + i % 7 for i in range(30)]
    )

    rollout_analyze.apply(args=[rollout.pk, window_end.isoformat()])

    run = AnalysisRun.objects.get()
    assert (run.verdict, run.action) == ("fail", "rollback")
    assert run.reasons[0].startswith("TTFT is higher on the canary than on the baseline")
    rollout.refresh_from_db()
    assert rollout.state == "rolled_back"
    assert Deployment.objects.get().desired_routing["canary_weight"] == 0
    event = AuditEvent.objects.get(object_id=str(rollout.pk), action="rollout.rollback")
    assert event.after["analysis_run_id"] == run.pk
    assert event.after["verdict"] == "fail"


def test_too_little_traffic_extends_then_fails(deployment, versions, tenant) -> None:
    policy = {**POLICY, "max_extensions": 1, "extension_s": 30}
    rollout = backdate_stage(
        running_rollout(deployment, versions[1], stages=STAGES, policy=policy), 120
    )
    first = analysis_tick()
    rollout_analyze.apply(args=[rollout.pk, first.isoformat()])
    rollout.refresh_from_db()
    assert (rollout.state, rollout.stage_extensions) == ("running", 1)
    rollout_analyze.apply(args=[rollout.pk, (first + timedelta(seconds=10)).isoformat()])
    rollout.refresh_from_db()
    assert (rollout.state, rollout.state_reason.split(": ")[1]) == ("failed", "inconclusive")
    assert list(AnalysisRun.objects.order_by("id").values_list("action", flat=True)) == [
        "extend",
        "fail",
    ]


def test_a_paused_rollout_is_not_analyzed(deployment, versions) -> None:
    rollout = running_rollout(deployment, versions[1], stages=STAGES, policy=POLICY)
    transitions.rollout_pause(actor=None, rollout_id=rollout.pk, reason="hold on")
    rollout_analyze.apply(args=[rollout.pk, analysis_tick().isoformat()])
    assert AnalysisRun.objects.count() == 0


def test_analysis_of_a_rollout_that_no_longer_exists_does_nothing(deployment) -> None:
    result = rollout_analyze.apply(args=[987654, analysis_tick().isoformat()])
    assert result.successful()
    assert AnalysisRun.objects.count() == 0
    assert not AuditEvent.objects.filter(object_type="rollout").exists()


def test_hard_breach_rolls_back_at_once(deployment, versions, tenant) -> None:
    policy = {**POLICY, "hard_breach_window": 10, "hard_error_rate_max": 0.5}
    backdate_stage(running_rollout(deployment, versions[1], stages=STAGES, policy=policy), 5)
    start = timezone.now() - timedelta(seconds=4)
    add_samples(
        version=versions[1],
        tenant=tenant,
        start=start,
        ttft_ms=[100.0] * 10,
        errors=[True] * 5 + [False] * 5,
    )
    assert decisions.rollout_check_hard_breach(version_id=versions[1].pk) is None
    assert decisions.rollout_check_hard_breach(version_id=versions[0].pk) is None  # not a canary

    add_samples(
        version=versions[1],
        tenant=tenant,
        start=start + timedelta(seconds=2),
        ttft_ms=[100.0] * 6,
        errors=[True] * 6,
    )
    rolled_back = decisions.rollout_check_hard_breach(version_id=versions[1].pk)
    assert rolled_back is not None and rolled_back.state == "rolled_back"
    assert rolled_back.state_reason == (
        "hard breach: error rate 0.60 in the last 10 canary requests is over 0.5"
    )
    assert decisions.rollout_check_hard_breach(version_id=versions[1].pk) is None  # once
    assert Rollout.objects.get().state == "rolled_back"


def test_the_full_weight_stage_judges_latency_by_limits_against_the_last_baseline_window(
    deployment, versions, tenant
) -> None:
    """At 100 % the canary carries the baseline's share too: slower, but within the
    absolute limits, it is promoted; the baseline's figures are its last window before
    the stage, when it still had traffic."""
    rollout = running_rollout(
        deployment, versions[1], stages=STAGES, policy={**POLICY, "ttft_p95_max_ms": 1000.0}
    )
    rollout = transitions.rollout_advance(actor=None, rollout_id=rollout.pk, reason="test")
    rollout = backdate_stage(rollout, 120)
    window_end = analysis_tick()
    stage_start = rollout.stage_started_at
    assert stage_start is not None
    add_samples(
        version=versions[0],
        tenant=tenant,
        start=stage_start - timedelta(seconds=30),
        ttft_ms=[100.0 + i % 9 for i in range(40)],
    )
    add_samples(
        version=versions[1],
        tenant=tenant,
        start=window_end - timedelta(seconds=50),
        ttft_ms=[400.0 + i % 7 for i in range(30)],
    )

    rollout_analyze.apply(args=[rollout.pk, window_end.isoformat()])

    run = AnalysisRun.objects.get()
    assert (run.verdict, run.action, run.stage_index) == ("pass", "advance", 1)
    assert run.baseline["requests"] == 40
    assert run.tests["ttft_mann_whitney"] is None
    assert any(reason.startswith("latency rank tests left out") for reason in run.reasons)
    rollout.refresh_from_db()
    assert rollout.state == "promoted"


def test_the_full_weight_stage_still_fails_a_canary_over_the_absolute_limits(
    deployment, versions, tenant
) -> None:
    rollout = running_rollout(
        deployment, versions[1], stages=STAGES, policy={**POLICY, "ttft_p95_max_ms": 300.0}
    )
    rollout = transitions.rollout_advance(actor=None, rollout_id=rollout.pk, reason="test")
    rollout = backdate_stage(rollout, 120)
    window_end = analysis_tick()
    assert rollout.stage_started_at is not None
    add_samples(
        version=versions[0],
        tenant=tenant,
        start=rollout.stage_started_at - timedelta(seconds=30),
        ttft_ms=[100.0] * 40,
    )
    add_samples(
        version=versions[1],
        tenant=tenant,
        start=window_end - timedelta(seconds=50),
        ttft_ms=[400.0] * 30,
    )

    rollout_analyze.apply(args=[rollout.pk, window_end.isoformat()])

    run = AnalysisRun.objects.get()
    assert (run.verdict, run.action) == ("fail", "rollback")
    assert run.reasons[0].startswith("TTFT p95 400.0 ms is over the limit 300 ms")


def test_energy_figures_give_joules_per_token_and_load_per_agent(versions) -> None:
    from controlplane.rollouts.selectors import energy_figures
    from controlplane.telemetry.models import EnergyAllocation

    stable, candidate = versions
    end = timezone.now()
    start = end - timedelta(seconds=20)

    def interval(key: str, agent: str, ends: datetime, shares: list[dict]) -> None:
        EnergyAllocation.objects.create(
            source_key=key,
            agent=agent,
            interval_start=ends - timedelta(seconds=10),
            interval_end=ends,
            energy_joules=sum(s["joules"] for s in shares),
            attributed_joules=sum(s["joules"] for s in shares),
            tokens=sum(s["tokens"] for s in shares),
            shares=shares,
        )

    def share(version, tokens: int, joules: float) -> dict:
        return {"tenant_id": 1, "version_id": version.pk, "tokens": tokens, "joules": joules}

    # two agents serve the stable version, one the candidate, over the 20 s window
    interval("a", "http://a", end, [share(stable, 300, 3.0)])
    interval("b", "http://b", end - timedelta(seconds=10), [share(stable, 100, 1.0)])
    interval("c", "http://c", end, [share(candidate, 100, 2.0), share(candidate, 20, 0.4)])
    interval("old", "http://a", start, [share(stable, 999, 99.0)])  # ends at the window's start
    assert energy_figures(version_id=stable.pk, start=start, end=end) == (
        pytest.approx(0.01),
        pytest.approx(400 / 2 / 20),
    )
    assert energy_figures(version_id=candidate.pk, start=start, end=end) == (
        pytest.approx(0.02),
        pytest.approx(120 / 1 / 20),
    )
    assert energy_figures(version_id=stable.pk, start=end, end=end + timedelta(seconds=5)) == (
        None,
        None,
    )
