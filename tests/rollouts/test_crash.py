"""A real Celery worker SIGKILLed inside a transition: nothing is half applied, and the
next pass (a beat tick on a fresh worker) completes the transition exactly once."""

import os
import signal

import pytest

from contracts.routing import parse_routing_table, routing_key
from controlplane.audit.models import AuditEvent
from controlplane.rollouts import deployments
from controlplane.rollouts.models import Deployment, Rollout
from controlplane.rollouts.tasks import analyze_all
from tests.conftest import PYTHON, start_process, stop_process, wait_until

WORKER = [
    PYTHON,
    "-m",
    "celery",
    "-A",
    "controlplane",
    "worker",
    "--pool",
    "solo",
    "--loglevel",
    "INFO",
    "--without-gossip",
    "--without-mingle",
    "--without-heartbeat",
]


def actions(rollout_id: int) -> list[str]:
    events = AuditEvent.objects.filter(object_type="rollout", object_id=str(rollout_id))
    return list(events.order_by("id").values_list("action", flat=True))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("attempt", range(2))
def test_sigkill_mid_transition_then_the_next_pass_completes_it(
    tmp_path, versions, redis_client, attempt
) -> None:
    deployment = deployments.deployment_create(
        actor=None, name="smollm2", stable_version=versions[0]
    )
    rollout = deployments.rollout_create(
        actor=None, deployment=deployment, candidate=versions[1], reason="crash test"
    )
    log = tmp_path / "worker-1.log"
    worker = start_process(WORKER, log, ROLLOUTS_PAUSE_IN_TRANSITION_S="60")
    try:
        wait_until(
            lambda: "transition paused for a crash test" in log.read_text(),
            timeout=90,
            message="the worker never reached the transition",
        )
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
    finally:
        stop_process(worker)

    # The killed transaction left nothing behind.
    rollout.refresh_from_db()
    assert (rollout.state, rollout.revision) == ("pending", 0)
    assert actions(rollout.pk) == ["rollout.create"]
    assert Deployment.objects.get().routing_revision == 1

    second = start_process(WORKER, tmp_path / "worker-2.log")
    try:
        analyze_all.delay()  # the beat's next tick
        wait_until(
            lambda: (
                Deployment.objects.get().applied_revision == 3
                and redis_client.get(routing_key("smollm2")) is not None
            ),
            timeout=90,
            message=(tmp_path / "worker-2.log").read_text,
        )
        analyze_all.delay()  # another tick changes nothing
        wait_until(lambda: redis_client.llen(os.environ["CELERY_QUEUE"]) == 0, timeout=60)
    finally:
        assert stop_process(second) == 0, (tmp_path / "worker-2.log").read_text()

    rollout.refresh_from_db()
    assert (rollout.state, rollout.stage_index, rollout.revision) == ("running", 0, 2)
    assert actions(rollout.pk) == ["rollout.create", "rollout.start_gating", "rollout.stage_start"]
    table = parse_routing_table(redis_client.get(routing_key("smollm2")))
    # No agent is ready in this test, so the stable version keeps every request.
    assert [(v.version_id, v.weight) for v in table.versions] == [(versions[0].pk, 100)]
    assert Rollout.objects.count() == 1
