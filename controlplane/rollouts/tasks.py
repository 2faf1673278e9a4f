"""Celery tasks: thin, id-only, idempotent. Each fetches by id and calls one domain function.

- `rollouts.reconcile` / `rollouts.reconcile_all`: routing and agents match the database.
- `rollouts.gate`: pending -> gating -> running once required evaluations pass; enqueues
  `rollouts.evaluate` for each required suite the candidate has no result for.
- `rollouts.analyze_all` (beat) -> `rollouts.analyze` per running rollout and tick.
- `rollouts.webhook_deliver`: one signed POST, retried with backoff on transient errors.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import httpx
from celery import shared_task
from django.conf import settings
from django.utils import timezone

from controlplane.core.errors import NotFound
from controlplane.core.redis_clients import redis_client
from controlplane.rollouts import (
    decisions,
    evaluation_jobs,
    hooks,
    reconciler,
    transitions,
    webhooks,
)
from controlplane.rollouts.models import Deployment, Rollout, RolloutState

logger = logging.getLogger(__name__)

TASK_OPTIONS = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True}
# An evaluation job in progress is not enqueued again for this long (released when it ends).
EVALUATION_LOCK_S = 600


@shared_task(name=hooks.RECONCILE_TASK, **TASK_OPTIONS)
def reconcile_deployment(deployment_id: int) -> None:
    report = reconciler.reconcile_deployment(deployment_id=deployment_id)
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


@shared_task(name="rollouts.reconcile_all", **TASK_OPTIONS)
def reconcile_all() -> None:
    for deployment_id in Deployment.objects.values_list("pk", flat=True):
        reconcile_deployment.delay(deployment_id)


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
    """One evaluation job; its in-progress key is released however it ends."""
    try:
        evaluation_jobs.evaluation_run(rollout_id=rollout_id, suite_id=suite_id)
    finally:
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


@shared_task(
    name=hooks.WEBHOOK_DELIVER_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    autoretry_for=(httpx.TransportError, webhooks.TransientDeliveryError),
    retry_backoff=2,
    retry_backoff_max=300,
    retry_jitter=True,
    max_retries=8,
)
def webhook_deliver(delivery_id: int) -> None:
    webhooks.delivery_send(delivery_id=delivery_id)
