"""Outgoing webhooks: endpoints, and HMAC-SHA256 signed POSTs of rollout events.

The outbox rows are written in each rollout change's own transaction (hooks.emit);
`delivery_send` posts one, retried by its task.

Headers: `X-Rollout-Event`, `X-Rollout-Delivery` (the event id, stable across retries, so
receivers can drop duplicates) and `X-Rollout-Signature: t=<unix seconds>,v1=<hex>` where
v1 = HMAC-SHA256(secret, f"{t}.{body}"). Receivers recompute it and refuse old timestamps.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.audit.services import Actor, acting_user, audit_event_record
from controlplane.core.errors import Conflict, DomainError
from controlplane.rollouts.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint

SIGNATURE_HEADER = "X-Rollout-Signature"


WEBHOOK_EVENTS = (
    "rollout.create",
    "rollout.start_gating",
    "rollout.gate_blocked",
    "rollout.stage_start",
    "rollout.extend",
    "rollout.promote",
    "rollout.pause",
    "rollout.resume",
    "rollout.rollback",
    "rollout.abort",
    "rollout.fail",
    "rollout.retry",
)


@transaction.atomic
def webhook_endpoint_create(
    *, actor: Actor, name: str, url: str, secret: str, events: list[str]
) -> WebhookEndpoint:
    unknown = sorted(set(events) - set(WEBHOOK_EVENTS) - {"*"})
    if not events or unknown:
        raise DomainError(
            "invalid_events",
            f"Events must be '*' or among: {', '.join(WEBHOOK_EVENTS)}.",
            fields={"events": unknown or ["Required."]},
        )
    if WebhookEndpoint.objects.filter(name=name).exists():
        raise Conflict("webhook_exists", f"A webhook named {name!r} exists.")
    endpoint = WebhookEndpoint.objects.create(
        name=name,
        url=url,
        secret=secret,
        events=sorted(set(events)),
        created_by=acting_user(actor),
    )
    audit_event_record(
        actor=actor,
        action="webhook.create",
        object_type="webhook",
        object_id=endpoint.pk,
        object_repr=name,
        after={"url": url, "events": endpoint.events},
    )
    return endpoint


@transaction.atomic
def webhook_endpoint_delete(*, actor: Actor, endpoint: WebhookEndpoint) -> None:
    audit_event_record(
        actor=actor,
        action="webhook.delete",
        object_type="webhook",
        object_id=endpoint.pk,
        object_repr=endpoint.name,
        before={"url": endpoint.url, "events": endpoint.events},
    )
    endpoint.delete()


class TransientDeliveryError(Exception):
    """A 5xx, 408 or 429 answer: worth retrying."""


def signature(*, secret: str, timestamp: int, body: bytes) -> str:
    message = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signature_header(*, secret: str, timestamp: int, body: bytes) -> str:
    return f"t={timestamp},v1={signature(secret=secret, timestamp=timestamp, body=body)}"


def signature_verify(
    *, secret: str, header: str, body: bytes, tolerance_s: int = 300, now: float | None = None
) -> bool:
    """What a receiver does (and what the tests check)."""
    try:
        parts = dict(item.split("=", 1) for item in header.split(","))
        timestamp = int(parts["t"])
    except (ValueError, KeyError):
        return False
    if abs((now or time.time()) - timestamp) > tolerance_s:
        return False
    expected = signature(secret=secret, timestamp=timestamp, body=body)
    return hmac.compare_digest(expected, parts.get("v1", ""))


def delivery_send(*, delivery_id: int) -> WebhookDelivery | None:
    """POST one delivery; idempotent (a delivered or failed one is not sent again)."""
    delivery = WebhookDelivery.objects.select_related("endpoint").filter(pk=delivery_id).first()
    if delivery is None or delivery.status != DeliveryStatus.PENDING:
        return delivery
    endpoint = delivery.endpoint
    body = json.dumps(delivery.payload, sort_keys=True, separators=(",", ":")).encode()
    timestamp = int(time.time())
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "fleet-control-plane-webhooks/1",
        "X-Rollout-Event": delivery.event,
        "X-Rollout-Delivery": str(delivery.event_id),
        SIGNATURE_HEADER: signature_header(secret=endpoint.secret, timestamp=timestamp, body=body),
    }
    WebhookDelivery.objects.filter(pk=delivery.pk).update(attempts=delivery.attempts + 1)
    try:
        response = httpx.post(
            endpoint.url,
            content=body,
            headers=headers,
            timeout=settings.ROLLOUTS_WEBHOOK_TIMEOUT_S,
            follow_redirects=False,
        )
    except httpx.TransportError as exc:
        _record(delivery.pk, status_code=None, error=f"{type(exc).__name__}: {exc}")
        raise
    if 200 <= response.status_code < 300:
        _record(delivery.pk, status_code=response.status_code, status=DeliveryStatus.SUCCEEDED)
    elif response.status_code >= 500 or response.status_code in {408, 429}:
        _record(delivery.pk, status_code=response.status_code, error="transient answer")
        raise TransientDeliveryError(f"{endpoint.url} answered {response.status_code}")
    else:
        _record(
            delivery.pk,
            status_code=response.status_code,
            status=DeliveryStatus.FAILED,
            error=f"refused with {response.status_code}",
        )
    return WebhookDelivery.objects.get(pk=delivery.pk)


@transaction.atomic
def _record(
    delivery_id: int,
    *,
    status_code: int | None,
    status: str | None = None,
    error: str = "",
) -> None:
    delivery = WebhookDelivery.objects.select_for_update().get(pk=delivery_id)
    if delivery.status != DeliveryStatus.PENDING:
        return
    delivery.last_status_code = status_code
    delivery.last_error = error[:2000]
    fields = ["last_status_code", "last_error"]
    if status is not None:
        delivery.status = status
        fields.append("status")
        if status == DeliveryStatus.SUCCEEDED:
            delivery.delivered_at = timezone.now()
            fields.append("delivered_at")
    delivery.save(update_fields=fields)
