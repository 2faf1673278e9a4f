"""Web's /metrics reports the control plane's decisions from their rows: each series moves
when the thing it counts happens, whichever process decided it."""

import time
from datetime import timedelta

import pytest
from django.db.models import F
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from contracts.commands import CommandResult, CommandStatus
from controlplane.fleet import services as fleet_services
from controlplane.rollouts import transitions
from controlplane.rollouts.analysis import SIGNALS
from controlplane.rollouts.models import Deployment
from controlplane.rollouts.tasks import analysis_tick, rollout_analyze
from tests.fleet.support import register
from tests.rollouts.conftest import add_samples, backdate_stage, running_rollout

pytestmark = pytest.mark.django_db


def scrape() -> dict[tuple[str, tuple], float]:
    response = Client().get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


def test_rollbacks_states_and_reconcile_lag_move_with_the_decisions(
    api, deployment, versions
) -> None:
    assert scrape()[("rollouts_reconcile_pending_deployments", ())] == 1  # a new deployment
    Deployment.objects.update(applied_revision=F("routing_revision"))  # as the reconciler does
    before = scrape()
    assert before[("rollouts", (("state", "running"),))] == 0
    assert before[("rollouts_rollbacks_total", (("trigger", "automatic"),))] == 0
    assert before[("rollouts_reconcile_pending_deployments", ())] == 0
    assert before[("rollouts_reconcile_lag_seconds", ())] == 0

    rollout = running_rollout(deployment, versions[1])
    running = scrape()
    assert running[("rollouts", (("state", "running"),))] == 1
    # The new canary weight waits for the reconciler.
    assert running[("rollouts_reconcile_pending_deployments", ())] == 1
    assert running[("rollouts_reconcile_lag_seconds", ())] >= 0

    # A person rolls it back (the API), then the system rolls back a retried attempt.
    response = api("on_call").post(
        f"/api/v1/rollouts/{rollout.pk}/rollback/", {"reason": "errors"}, format="json"
    )
    assert response.status_code == 200, response.content
    transitions.rollout_retry(actor=None, rollout_id=rollout.pk, reason="again")
    transitions.rollout_gate_check(rollout_id=rollout.pk)
    transitions.rollout_rollback(actor=None, rollout_id=rollout.pk, reason="analysis failed")
    after = scrape()
    assert after[("rollouts", (("state", "rolled_back"),))] == 1
    assert after[("rollouts", (("state", "running"),))] == 0
    assert after[("rollouts_rollbacks_total", (("trigger", "manual"),))] == 1
    assert after[("rollouts_rollbacks_total", (("trigger", "automatic"),))] == 1


def signal_verdicts(samples: dict[tuple[str, tuple], float]) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["signal"], dict(labels)["verdict"]): value
        for (name, labels), value in samples.items()
        if name == "rollouts_analysis_signal_verdicts_total"
    }


def test_an_analysis_counts_its_signals_verdicts_and_its_rollback(
    deployment, versions, tenant
) -> None:
    before = scrape()
    assert signal_verdicts(before) == {
        (signal, verdict): 0 for signal in SIGNALS for verdict in ("pass", "fail", "inconclusive")
    }
    rollout = backdate_stage(
        running_rollout(
            deployment,
            versions[1],
            stages=[{"weight": 10, "min_duration_s": 60, "min_requests": 20}],
            policy={"min_samples": 20, "alpha": 0.01},
        ),
        10,
    )
    window_end = analysis_tick(timezone.now() + timedelta(seconds=30))
    start = window_end - timedelta(seconds=8)
    add_samples(
        version=versions[0], tenant=tenant, start=start, ttft_ms=[100.0 + i % 9 for i in range(40)]
    )
    add_samples(
        version=versions[1], tenant=tenant, start=start, ttft_ms=[400.0 + i % 7 for i in range(30)]
    )
    rollout_analyze.apply(args=[rollout.pk, window_end.isoformat()])  # slower: rolled back

    after = scrape()
    moved = {key: value for key, value in signal_verdicts(after).items() if value}
    assert moved == {
        ("ttft_p95_limit", "pass"): 1,
        ("itl_p95_limit", "pass"): 1,
        ("error_rate_limit", "pass"): 1,
        ("ttft_vs_baseline", "fail"): 1,
        ("itl_vs_baseline", "pass"): 1,
        ("errors_vs_baseline", "pass"): 1,
        ("energy_vs_baseline", "inconclusive"): 1,  # no energy figures
    }
    automatic = ("rollouts_rollbacks_total", (("trigger", "automatic"),))
    assert after[automatic] == before[automatic] + 1
    runs = ("rollouts_analysis_runs_total", (("action", "rollback"), ("verdict", "fail")))
    assert after[runs] == 1


def test_commands_not_acknowledged_by_their_agent(redis_client) -> None:
    register("agent-a")
    assert scrape()[("fleet_commands_oldest_unacknowledged_seconds", ())] == 0
    sent = fleet_services.agent_command_send(
        actor=None, agent_name="agent-a", kind="drain", redis_client=redis_client
    )
    waiting = scrape()
    assert waiting[("fleet_commands_unacknowledged", (("kind", "drain"),))] == 1
    assert waiting[("fleet_commands_oldest_unacknowledged_seconds", ())] >= 0
    assert waiting[("fleet_commands_open", (("kind", "drain"), ("status", "pending")))] == 1

    fleet_services.command_results_apply(
        results=[
            CommandResult(
                command_id=sent.command_id,
                agent="agent-a",
                kind="drain",
                status=CommandStatus.ACCEPTED,
                detail="",
                finished_at=time.time(),
            )
        ]
    )
    acknowledged = scrape()
    assert ("fleet_commands_unacknowledged", (("kind", "drain"),)) not in acknowledged
    assert acknowledged[("fleet_commands_oldest_unacknowledged_seconds", ())] == 0
    assert acknowledged[("fleet_commands_open", (("kind", "drain"), ("status", "accepted")))] == 1
    assert ("fleet_commands_open", (("kind", "drain"), ("status", "pending"))) not in acknowledged
    assert ("fleet_commands_total", (("kind", "drain"), ("status", "accepted"))) not in acknowledged

    fleet_services.command_results_apply(
        results=[
            CommandResult(
                command_id=sent.command_id,
                agent="agent-a",
                kind="drain",
                status=CommandStatus.SUCCEEDED,
                detail="",
                finished_at=time.time(),
            )
        ]
    )
    finished = scrape()
    assert finished[("fleet_commands_total", (("kind", "drain"), ("status", "succeeded")))] == 1
    assert ("fleet_commands_open", (("kind", "drain"), ("status", "accepted"))) not in finished
