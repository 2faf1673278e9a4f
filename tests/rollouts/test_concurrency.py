"""Two callers race on the same transition: exactly one wins, the other is refused."""

import threading

import pytest
from django.db import connection

from controlplane.audit.models import AuditEvent
from controlplane.core.errors import Conflict
from controlplane.rollouts import deployments, transitions
from controlplane.rollouts.models import Deployment, Rollout
from tests.rollouts.conftest import running_rollout


def race(calls) -> list[object]:
    barrier = threading.Barrier(len(calls))
    results: list[object] = [None] * len(calls)

    def run(index, call):
        try:
            barrier.wait()
            results[index] = call()
        except Exception as exc:
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("attempt", range(3))
def test_two_promotions_of_the_same_stage_apply_once(versions, redis_client, attempt) -> None:
    deployment = deployments.deployment_create(
        actor=None, name="smollm2", stable_version=versions[0]
    )
    rollout = running_rollout(deployment, versions[1])

    def promote():
        return transitions.rollout_advance(
            actor=None, rollout_id=rollout.pk, reason="race", expected_stage=0
        )

    results = race([promote, promote])
    winners = [r for r in results if not isinstance(r, Exception)]
    losers = [r for r in results if isinstance(r, Exception)]
    assert len(winners) == 1
    assert len(losers) == 1 and isinstance(losers[0], Conflict)
    assert losers[0].code == "stale_state"
    assert (
        Rollout.objects.get().stage_index,
        Deployment.objects.get().desired_routing["canary_weight"],
    ) == (1, 25)
    actions = AuditEvent.objects.filter(object_id=str(rollout.pk)).values_list("action", flat=True)
    assert list(actions).count("rollout.stage_start") == 2  # stage 0 from the gate, stage 1 once


@pytest.mark.django_db(transaction=True)
def test_rollback_racing_promotion_leaves_one_consistent_outcome(versions, redis_client) -> None:
    deployment = deployments.deployment_create(
        actor=None, name="smollm2", stable_version=versions[0]
    )
    rollout = running_rollout(deployment, versions[1])
    revision = Rollout.objects.get().revision
    calls = [
        lambda: transitions.rollout_advance(
            actor=None, rollout_id=rollout.pk, reason="go", expected_revision=revision
        ),
        lambda: transitions.rollout_rollback(
            actor=None, rollout_id=rollout.pk, reason="stop", expected_revision=revision
        ),
    ]
    results = race(calls)
    assert sum(1 for r in results if isinstance(r, Conflict)) == 1
    final = Rollout.objects.get()
    assert final.revision == revision + 1
    expected_weight = {"running": 25, "rolled_back": 0}[final.state]
    assert Deployment.objects.get().desired_routing["canary_weight"] == expected_weight
