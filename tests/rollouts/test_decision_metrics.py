"""Web's /metrics reports the control plane's decisions from their rows: each series moves
when the thing it counts happens, whichever process decided it."""

import pytest
from django.db.models import F
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from controlplane.rollouts import transitions
from controlplane.rollouts.models import Deployment
from tests.rollouts.conftest import running_rollout

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
