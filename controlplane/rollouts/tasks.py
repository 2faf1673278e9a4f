"""Celery tasks: thin, id-only, idempotent. Each fetches by id and calls one domain function.

- `rollouts.reconcile` / `rollouts.reconcile_all`: routing and agents match the database.
- `rollouts.autoscale` (beat): deployments with an autoscaling policy scale their replicas.
- `rollouts.gate`: pending -> gating -> running once required evaluations pass; enqueues
  `rollouts.evaluate` for each required suite the candidate has no result for (and
  `rollouts.evaluate_energy` follows it when the suite asks for joules per token).
- `rollouts.analyze_all` (beat) -> `rollouts.analyze` per running rollout and tick.
- `rollouts.webhook_deliver`: one signed POST, retried with backoff on transient errors.
- `rollouts.webhook_sweep` (beat): fails spent deliveries, re-enqueues those whose task was lost.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from celery import Task, shared_task
from django.conf import settings
from django.utils import timezone

from controlplane.core.errors import DomainError, NotFound
from controlplane.core.redis_clients import redis_client
from controlplane.rollouts import (
    decisions,
    evaluation_jobs,
    hooks,
    reconciler,
    scaling,
    transitions,
    webhooks,
)
from controlplane.rollouts.models import Deployment, Rollout, RolloutState

logger = logging.getLogger(__name__)

TASK_OPTIONS = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}
# An evaluation job in progress is not enqueued again for this long (released when it ends).
EVALUATION_LOCK_S = 600
# Joules per token waits for a heartbeat after the workload: first look after a heartbeat
# interval, then every half second, for about 30 s in all.
ENERGY_FIRST_LOOK_S = 1.0
ENERGY_LOOK_EVERY_S = 0.5
ENERGY_LOOKS = 60


@shared_task(name=hooks.RECONCILE_TASK, **TASK_OPTIONS)
def reconcile_deployment(deployment_id: int) -> None:
    _reconciled(reconciler.reconcile_deployment(deployment_id=deployment_id))


@shared_task(name="rollouts.reconcile_all", **TASK_OPTIONS)
def reconcile_all() -> None:
    """Every deployment in one pass that reads the fleet once (a task per deployment read
    every agent once per deployment)."""
    deployment_ids = list(Deployment.objects.order_by("pk").values_list("pk", flat=True))
    for report in reconciler.reconcile_deployments(deployment_ids=deployment_ids):
        _reconciled(report)


def _reconciled(report: reconciler.ReconcileReport) -> None:
    if report.loads or report.drains or report.rolled_back:
        # In the message itself: worker logs are what a failed rollout is read from.
        logger.info(
            "reconciled %s revision %s: weights %s, loads %s, drains %s%s",
            report.deployment,
            report.revision,
            report.weights,
            report.loads,
            report.drains,
            ", rolled back" if report.rolled_back else "",
        )
    else:
        logger.info(
            "reconciled", extra={"deployment": report.deployment, "revision": report.revision}
        )


@shared_task(name="rollouts.autoscale", **TASK_OPTIONS)
def autoscale() -> None:
    """One autoscaling pass; a change writes the desired routing and asks for a reconcile."""
    scaling.autoscale_all()


@shared_task(name=hooks.GATE_TASK, **TASK_OPTIONS)
def rollout_gate(rollout_id: int) -> None:
    """Check the gate; enqueue each required suite not evaluated yet (one job at a time)."""
    rollout = transitions.rollout_gate_check(rollout_id=rollout_id)
    if rollout.state != RolloutState.GATING:
        return
    client = redis_client(decode_responses=True)
    try:
        for suite_id in evaluation_jobs.evaluations_due(rollout_id=rollout_id):
            key = f"rollouts:evaluating:{rollout_id}:{suite_id}"
            if client.set(key, "1", nx=True, ex=EVALUATION_LOCK_S):
                rollout_evaluate.delay(rollout_id, suite_id)
    finally:
        client.close()


@shared_task(name="rollouts.evaluate", **TASK_OPTIONS)
def rollout_evaluate(rollout_id: int, suite_id: int) -> None:
    """One evaluation job; its in-progress key is released however it ends (by the energy
    step when the suite asks for joules per token)."""
    is_handed_on = False
    try:
        measured = evaluation_jobs.evaluation_measure(rollout_id=rollout_id, suite_id=suite_id)
        if measured is None:
            return
        if measured.needs_energy:
            rollout_evaluate_energy.apply_async(
                (rollout_id, suite_id, measured.to_json()), countdown=ENERGY_FIRST_LOOK_S
            )
            is_handed_on = True
            return
        evaluation_jobs.evaluation_finish(
            rollout_id=rollout_id, suite_id=suite_id, measured=measured
        )
    finally:
        if not is_handed_on:
            _evaluation_lock_release(rollout_id, suite_id)


@shared_task(
    name="rollouts.evaluate_energy", bind=True, max_retries=ENERGY_LOOKS - 1, **TASK_OPTIONS
)
def rollout_evaluate_energy(self: Task, rollout_id: int, suite_id: int, measured: dict) -> None:
    """An evaluation job's last step: joules per token from the candidate agent's first
    heartbeat after the workload. Until it is ingested, the task is retried, not slept in."""
    job = evaluation_jobs.Measured.from_json(measured)
    assert job.workload_ended_at is not None
    # A heartbeat sent half a second after the workload ended counts all of its tokens.
    after = evaluation_jobs.agent_figures_after(job.endpoint, after=job.workload_ended_at + 0.5)
    if after is None and self.request.retries < ENERGY_LOOKS - 1:
        raise self.retry(countdown=ENERGY_LOOK_EVERY_S)
    try:
        if after is None:
            raise DomainError("no_heartbeat", f"No heartbeat from the agent at {job.endpoint}.")
        evaluation_jobs.evaluation_energy_add(job, after)
        evaluation_jobs.evaluation_finish(rollout_id=rollout_id, suite_id=suite_id, measured=job)
    finally:
        _evaluation_lock_release(rollout_id, suite_id)


def _evaluation_lock_release(rollout_id: int, suite_id: int) -> None:
    client = redis_client(decode_responses=True)
    try:
        client.delete(f"rollouts:evaluating:{rollout_id}:{suite_id}")
    finally:
        client.close()


def analysis_tick(now: datetime | None = None) -> datetime:
    """The window end of the current tick: now, floored to the analysis interval."""
    now = now or timezone.now()
    interval = settings.ROLLOUTS_ANALYSIS_INTERVAL_S
    floored = int(now.timestamp() // interval * interval)
    return datetime.fromtimestamp(floored, tz=UTC)


@shared_task(name="rollouts.analyze_all", **TASK_OPTIONS)
def analyze_all() -> None:
    """Beat: analyze each running rollout for this tick; re-check gating ones."""
    window_end = analysis_tick().isoformat()
    for rollout_id in Rollout.objects.filter(state=RolloutState.RUNNING).values_list(
        "pk", flat=True
    ):
        rollout_analyze.delay(rollout_id, window_end)
    for rollout_id in Rollout.objects.filter(
        state__in=[RolloutState.PENDING, RolloutState.GATING]
    ).values_list("pk", flat=True):
        rollout_gate.delay(rollout_id)


@shared_task(name="rollouts.analyze", **TASK_OPTIONS)
def rollout_analyze(rollout_id: int, window_end: str) -> None:
    try:
        decisions.rollout_analyze(
            rollout_id=rollout_id, window_end=datetime.fromisoformat(window_end)
        )
    except NotFound:
        # Queued before its rollout was deleted (a demo started over): nothing to judge.
        logger.info("analysis skipped: rollout gone", extra={"rollout": rollout_id})


@shared_task(name=hooks.WEBHOOK_DELIVER_TASK, bind=True, max_retries=None, **TASK_OPTIONS)
def webhook_deliver(self: Task, delivery_id: int) -> None:
    """One attempt; the row keeps the count and the backoff (webhooks.MAX_ATTEMPTS)."""
    try:
        webhooks.delivery_send(delivery_id=delivery_id)
    except webhooks.TransientDeliveryError as exc:
        raise self.retry(eta=exc.retry_at) from None


@shared_task(name="rollouts.webhook_sweep", **TASK_OPTIONS)
def webhook_sweep() -> None:
    """Beat: fail spent deliveries, send again the ones whose task was lost."""
    for delivery_id in webhooks.deliveries_sweep():
        webhook_deliver.delay(delivery_id)
