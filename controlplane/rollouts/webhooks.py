"""Outgoing webhooks: endpoints, and HMAC-SHA256 signed POSTs of rollout events.

The outbox rows are written in each rollout change's own transaction (hooks.emit);
`delivery_send` makes one attempt at one, which its task retries with backoff, and
`deliveries_sweep` finds the ones whose task was lost. Targets are checked by
`webhook_targets` when an endpoint is created and again before every attempt, which
connects to a checked address.

Headers: `X-Rollout-Event`, `X-Rollout-Delivery` (the event id, stable across retries, so
receivers can drop duplicates) and `X-Rollout-Signature: t=<unix seconds>,v1=<hex>` where
v1 = HMAC-SHA256(secret, f"{t}.{body}"). Receivers recompute it and refuse old timestamps.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import ssl
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import Case, F, Value, When
from django.utils import timezone

from controlplane.audit.services import Actor, acting_user, audit_event_record
from controlplane.core.errors import Conflict, DomainError
from controlplane.rollouts import webhook_targets
from controlplane.rollouts.models import (
    DeliveryError,
    DeliveryStatus,
    WebhookDelivery,
    WebhookEndpoint,
)

SIGNATURE_HEADER = "X-Rollout-Signature"

MAX_ATTEMPTS = 9  # the first and 8 retries
BACKOFF_FIRST_S = 2.0
BACKOFF_MAX_S = 300.0
# Addresses of one host tried in turn when the connection itself fails (no request sent).
MAX_ADDRESSES = 3
# Longer than any attempt (the resolver, then connect, write and read on each address tried,
# each within ROLLOUTS_WEBHOOK_TIMEOUT_S): past it a claimed attempt counts as lost.
ATTEMPT_LEASE_S = 120.0
# A retry that runs a little early (its worker's clock ahead) still finds its row due.
DUE_TOLERANCE_S = 1.0
# A pending delivery this long past due lost its task: the sweep sends it again.
SWEEP_OVERDUE_S = 60.0
SWEEP_BATCH = 500


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
    "deployment.undo",
)


def webhook_endpoint_create(
    *, actor: Actor, name: str, url: str, secret: str, events: list[str]
) -> WebhookEndpoint:
    """Refused, with nothing written, for unknown events or a target not allowed."""
    unknown = sorted(set(events) - set(WEBHOOK_EVENTS) - {"*"})
    if not events or unknown:
        raise DomainError(
            "invalid_events",
            f"Events must be '*' or among: {', '.join(WEBHOOK_EVENTS)}.",
            fields={"events": unknown or ["Required."]},
        )
    webhook_target_require(url)  # outside the transaction: it waits on DNS
    with transaction.atomic():
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


def webhook_target_require(url: str) -> None:
    """Refuse a target the control plane must not POST to (webhook_targets)."""
    try:
        webhook_targets.target_check(url)
    except webhook_targets.TargetForbidden as exc:
        reason = str(exc)
    except webhook_targets.TargetUnresolvable:
        # Said as the forbidden case is: which internal names exist is not for callers to learn.
        reason = webhook_targets.HOST_NOT_ALLOWED
    else:
        return
    raise DomainError(
        "webhook_target_forbidden",
        "Webhook URLs must be http or https without credentials, to a host that resolves "
        "to public addresses only (or to a network ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS allows).",
        fields={"url": [reason]},
    )


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
    """This attempt failed in a way worth retrying; the next one is due at `retry_at`."""

    def __init__(self, error: str, retry_at: datetime) -> None:
        super().__init__(f"{error}; next attempt at {retry_at.isoformat()}")
        self.error = error
        self.retry_at = retry_at


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


@dataclass(frozen=True, slots=True)
class Outcome:
    status_code: int | None = None
    error: str = ""  # a DeliveryError; empty when the receiver accepted it
    is_final: bool = False  # not worth retrying


def delivery_send(*, delivery_id: int) -> WebhookDelivery | None:
    """Make the delivery's due attempt. Idempotent: a delivery that is done, not due yet or
    being attempted by another worker is left alone. Raises TransientDeliveryError when
    this attempt failed and another one is scheduled."""
    attempt = _claim(delivery_id)
    if attempt is None:
        return WebhookDelivery.objects.filter(pk=delivery_id).first()
    delivery = WebhookDelivery.objects.select_related("endpoint").get(pk=delivery_id)
    delivery = _record(delivery_id, attempt=attempt, outcome=_attempt(delivery))
    if delivery.status == DeliveryStatus.PENDING and delivery.attempts == attempt:
        raise TransientDeliveryError(delivery.last_error, delivery.next_attempt_at)
    return delivery


@transaction.atomic
def _claim(delivery_id: int) -> int | None:
    """Count an attempt and lease the row for it; the attempt's number, or None."""
    now = timezone.now()
    delivery = (
        WebhookDelivery.objects.select_for_update(skip_locked=True)
        .filter(
            pk=delivery_id,
            status=DeliveryStatus.PENDING,
            attempts__lt=MAX_ATTEMPTS,
            next_attempt_at__lte=now + timedelta(seconds=DUE_TOLERANCE_S),
        )
        .first()
    )
    if delivery is None:
        return None
    delivery.attempts += 1
    delivery.next_attempt_at = now + timedelta(seconds=ATTEMPT_LEASE_S)
    delivery.save(update_fields=["attempts", "next_attempt_at"])
    return delivery.attempts


def _attempt(delivery: WebhookDelivery) -> Outcome:
    endpoint = delivery.endpoint
    try:
        target = webhook_targets.target_check(endpoint.url)
    except webhook_targets.TargetForbidden:
        return Outcome(error=DeliveryError.TARGET_FORBIDDEN, is_final=True)
    except webhook_targets.TargetUnresolvable:
        return Outcome(error=DeliveryError.DNS_ERROR)
    body = json.dumps(delivery.payload, sort_keys=True, separators=(",", ":")).encode()
    timestamp = int(time.time())
    headers = {
        "Host": target.host_header,
        "Content-Type": "application/json",
        "User-Agent": "fleet-control-plane-webhooks/1",
        "X-Rollout-Event": delivery.event,
        "X-Rollout-Delivery": str(delivery.event_id),
        SIGNATURE_HEADER: signature_header(secret=endpoint.secret, timestamp=timestamp, body=body),
    }
    outcome = Outcome(error=DeliveryError.CONNECT_ERROR)
    # No proxy from the environment: the connection goes to the checked address itself.
    with httpx.Client(
        timeout=settings.ROLLOUTS_WEBHOOK_TIMEOUT_S, follow_redirects=False, trust_env=False
    ) as client:
        for address in target.addresses[:MAX_ADDRESSES]:
            try:
                response = client.post(
                    target.url_for(address),
                    content=body,
                    headers=headers,
                    # TLS names and verifies the URL's host, not the address connected to.
                    extensions={"sni_hostname": target.hostname},
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                outcome = Outcome(error=transport_error_category(exc))
                continue  # nothing was sent: the next address may answer
            except httpx.TransportError as exc:
                return Outcome(error=transport_error_category(exc))
            return response_outcome(response.status_code)
    return outcome


def response_outcome(status_code: int) -> Outcome:
    if 200 <= status_code < 300:
        return Outcome(status_code=status_code)
    if status_code >= 500:
        return Outcome(status_code=status_code, error=DeliveryError.HTTP_5XX)
    if status_code in {408, 429}:
        return Outcome(status_code=status_code, error=DeliveryError.HTTP_4XX)
    error = DeliveryError.HTTP_4XX if status_code >= 400 else DeliveryError.HTTP_3XX
    return Outcome(status_code=status_code, error=error, is_final=True)


def transport_error_category(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return DeliveryError.TIMEOUT
    if isinstance(exc, httpx.ConnectError):
        return DeliveryError.TLS_ERROR if _caused_by_tls(exc) else DeliveryError.CONNECT_ERROR
    return DeliveryError.TRANSPORT_ERROR


def _caused_by_tls(exc: BaseException) -> bool:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError | ssl.CertificateError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def backoff_s(attempt: int) -> float:
    """Seconds before the attempt after `attempt`: doubling, capped, with jitter."""
    delay = min(BACKOFF_FIRST_S * 2 ** (attempt - 1), BACKOFF_MAX_S)
    return delay * random.uniform(0.5, 1.0)


@transaction.atomic
def _record(delivery_id: int, *, attempt: int, outcome: Outcome) -> WebhookDelivery:
    delivery = WebhookDelivery.objects.select_for_update().get(pk=delivery_id)
    # A lease that ran out gave the row to another attempt: that one records, not this.
    if delivery.status != DeliveryStatus.PENDING or delivery.attempts != attempt:
        return delivery
    now = timezone.now()
    delivery.last_status_code = outcome.status_code
    delivery.last_error = outcome.error
    fields = ["last_status_code", "last_error", "status"]
    if not outcome.error:
        delivery.status = DeliveryStatus.SUCCEEDED
        delivery.delivered_at = now
        fields.append("delivered_at")
    elif outcome.is_final or attempt >= MAX_ATTEMPTS:
        delivery.status = DeliveryStatus.FAILED
    else:
        delivery.next_attempt_at = now + timedelta(seconds=backoff_s(attempt))
        fields.append("next_attempt_at")
    delivery.save(update_fields=fields)
    return delivery


def deliveries_sweep(*, now: datetime | None = None) -> list[int]:
    """Fail the pending deliveries whose last attempt is spent, and return the ids of the
    others that are overdue (their task was lost) for the caller to enqueue, marking them
    due now so that the next sweep leaves them to that task for SWEEP_OVERDUE_S. Rows are
    taken with SKIP LOCKED, so concurrent sweeps share them out; and an attempt is claimed
    under a row lock (`delivery_send`), so a delivery enqueued twice is attempted once."""
    now = now or timezone.now()
    overdue = (
        WebhookDelivery.objects.select_for_update(skip_locked=True)
        .filter(
            status=DeliveryStatus.PENDING,
            next_attempt_at__lte=now - timedelta(seconds=SWEEP_OVERDUE_S),
        )
        .order_by("next_attempt_at")
    )
    with transaction.atomic():
        spent = list(
            overdue.filter(attempts__gte=MAX_ATTEMPTS).values_list("pk", flat=True)[:SWEEP_BATCH]
        )
        WebhookDelivery.objects.filter(pk__in=spent).update(
            status=DeliveryStatus.FAILED,
            # The last attempt never recorded its outcome: its worker stopped.
            last_error=Case(
                When(last_error="", then=Value(DeliveryError.INTERRUPTED.value)),
                default=F("last_error"),
            ),
        )
        lost = list(
            overdue.filter(attempts__lt=MAX_ATTEMPTS).values_list("pk", flat=True)[:SWEEP_BATCH]
        )
        WebhookDelivery.objects.filter(pk__in=lost).update(next_attempt_at=now)
    return lost
