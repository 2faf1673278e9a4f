"""What a rollout change sets off once its transaction commits.

Every after-commit effect of the rollout writes lives here: the webhook outbox rows (in
the change's own transaction) and their deliveries, the live event, the reconciler and
the gate check. Tasks are sent by name, so this module (and every write that uses it)
never imports the task module: the tasks import the writes, not the other way round.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db import transaction
from django.utils import timezone

from contracts import tracing
from controlplane.celery import app
from controlplane.core.events import ROLLOUTS_LIVE_GROUP, publish_event_after_commit
from controlplane.rollouts.models import Deployment, Rollout, WebhookDelivery, WebhookEndpoint

# The names the tasks in tasks.py are registered under.
RECONCILE_TASK = "rollouts.reconcile"
GATE_TASK = "rollouts.gate"
WEBHOOK_DELIVER_TASK = "rollouts.webhook_deliver"


def _send_on_commit(task_name: str, *args: Any) -> None:
    # The task's trace parent is the change that sent it, not what is current at commit.
    headers = tracing.carrier_from_context() if tracing.is_enabled() else None
    transaction.on_commit(lambda: app.send_task(task_name, args=args, headers=headers))


def reconcile_after_commit(deployment_id: int) -> None:
    _send_on_commit(RECONCILE_TASK, deployment_id)


def gate_after_commit(rollout_id: int) -> None:
    _send_on_commit(GATE_TASK, rollout_id)


def rollout_event_payload(rollout: Rollout, event: str, **extra: Any) -> dict[str, Any]:
    deployment = rollout.deployment
    return {
        "event": event,
        "rollout_id": rollout.pk,
        "deployment": deployment.name,
        "state": rollout.state,
        "stage_index": rollout.stage_index,
        "canary_weight": deployment.desired_routing.get("canary_weight", 0),
        "routing_revision": deployment.routing_revision,
        "revision": rollout.revision,
        "attempt": rollout.attempt,
        "baseline_id": rollout.baseline_id,
        "candidate_id": rollout.candidate_id,
        "reason": rollout.state_reason,
        "at": timezone.now().isoformat(),
        **extra,
    }


def emit(rollout: Rollout, event: str, *, extra: dict[str, Any] | None = None) -> None:
    """Outbox rows for matching webhooks (same transaction) and a live event after commit."""
    _emit_payload(event, rollout_event_payload(rollout, event, **(extra or {})))


def emit_deployment(deployment: Deployment, event: str, fields: dict[str, Any]) -> None:
    """The same for a change of a deployment outside any rollout (an undo): its name,
    stable version and routing revision, and the change's own fields."""
    payload = {
        "event": event,
        "deployment": deployment.name,
        "stable_version_id": deployment.stable_version_id,
        "routing_revision": deployment.routing_revision,
        "at": timezone.now().isoformat(),
        **fields,
    }
    _emit_payload(event, payload)


def _emit_payload(event: str, payload: dict[str, Any]) -> None:
    event_id = uuid.uuid4()
    payload["event_id"] = str(event_id)
    for endpoint in WebhookEndpoint.objects.filter(is_active=True):
        if endpoint.wants(event):
            delivery = WebhookDelivery.objects.create(
                endpoint=endpoint, event_id=event_id, event=event, payload=payload
            )
            _send_on_commit(WEBHOOK_DELIVER_TASK, delivery.pk)
    publish_event_after_commit(ROLLOUTS_LIVE_GROUP, event, payload)


def publish_after_commit(rollout: Rollout, event: str, extra: dict[str, Any]) -> None:
    """A live event only (no webhook): analysis ticks and gate reasons."""
    publish_event_after_commit(
        ROLLOUTS_LIVE_GROUP, event, rollout_event_payload(rollout, event, **extra)
    )
