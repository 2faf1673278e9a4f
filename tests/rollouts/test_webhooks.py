"""Outgoing webhooks: signed, delivered once, retried only on transient answers."""

import json

import pytest

from controlplane.rollouts import transitions, webhooks
from controlplane.rollouts.models import Deployment, DeploymentRevision, WebhookDelivery
from controlplane.rollouts.tasks import webhook_deliver
from controlplane.rollouts.transitions import TRANSITIONS
from tests.rollouts.conftest import running_rollout
from tests.rollouts.webhook_support import LOOPBACK, SECRET, Receiver, make_due


@pytest.fixture
def receiver(settings):
    """A receiver on loopback, which the operator setting allows for these tests."""
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = [LOOPBACK]
    receiver = Receiver()
    yield receiver.url(), receiver.received, receiver.answers
    receiver.close()


def test_a_transition_is_delivered_signed_and_only_once(
    api, deployment, versions, receiver
) -> None:
    url, received, _ = receiver
    response = api("release_manager").post(
        "/api/v1/webhooks/",
        {"name": "ops", "url": url, "secret": SECRET, "events": ["rollout.rollback"]},
        format="json",
    )
    assert response.status_code == 201
    assert "secret" not in response.json()
    rollout = running_rollout(deployment, versions[1])
    assert WebhookDelivery.objects.count() == 0  # not subscribed to these events
    api("on_call").post(
        f"/api/v1/rollouts/{rollout.pk}/rollback/", {"reason": "drill"}, format="json"
    )
    delivery = WebhookDelivery.objects.get()
    assert delivery.event == "rollout.rollback"

    webhook_deliver.apply(args=[delivery.pk])
    webhook_deliver.apply(args=[delivery.pk])  # delivered twice: sent once

    assert len(received) == 1
    headers, body = received[0]
    assert webhooks.signature_verify(
        secret=SECRET, header=headers["X-Rollout-Signature"], body=body
    )
    assert not webhooks.signature_verify(
        secret="wrong", header=headers["X-Rollout-Signature"], body=body
    )
    assert headers["X-Rollout-Delivery"] == str(delivery.event_id)
    payload = json.loads(body)
    assert (payload["event"], payload["state"], payload["reason"], payload["canary_weight"]) == (
        "rollout.rollback",
        "rolled_back",
        "drill",
        0,
    )
    delivery.refresh_from_db()
    assert (
        delivery.status,
        delivery.attempts,
        delivery.last_status_code,
        delivery.last_error,
    ) == ("succeeded", 1, 204, "")


def test_a_server_error_is_transient_and_a_client_error_is_final(
    deployment, versions, receiver, monkeypatch
) -> None:
    url, received, answers = receiver
    # the first backoff is 1 to 2 s, due up to 1 s early: a slow machine could reach it
    # before the early call below; a long one keeps that call early
    monkeypatch.setattr(webhooks, "backoff_s", lambda attempt: 60.0)
    webhooks.webhook_endpoint_create(actor=None, name="ops", url=url, secret=SECRET, events=["*"])
    running_rollout(deployment, versions[1])
    first, *_ = WebhookDelivery.objects.order_by("id")
    answers.extend([503, 404])
    with pytest.raises(webhooks.TransientDeliveryError):
        webhooks.delivery_send(delivery_id=first.pk)
    first.refresh_from_db()
    assert (first.status, first.attempts, first.last_status_code, first.last_error) == (
        "pending",
        1,
        503,
        "http_5xx",
    )
    webhooks.delivery_send(delivery_id=first.pk)  # before its backoff: not attempted
    assert len(received) == 1
    make_due(first)
    webhooks.delivery_send(delivery_id=first.pk)
    first.refresh_from_db()
    assert (first.status, first.attempts, first.last_status_code, first.last_error) == (
        "failed",
        2,
        404,
        "http_4xx",
    )
    assert len(received) == 2


def test_the_last_transient_failure_is_final(deployment, versions, receiver) -> None:
    url, received, answers = receiver
    webhooks.webhook_endpoint_create(actor=None, name="ops", url=url, secret=SECRET, events=["*"])
    running_rollout(deployment, versions[1])
    first, *_ = WebhookDelivery.objects.order_by("id")
    answers.extend([503] * webhooks.MAX_ATTEMPTS)
    for _ in range(webhooks.MAX_ATTEMPTS - 1):
        with pytest.raises(webhooks.TransientDeliveryError):
            webhooks.delivery_send(delivery_id=first.pk)
        make_due(first)
    webhooks.delivery_send(delivery_id=first.pk)
    webhooks.delivery_send(delivery_id=first.pk)  # spent: never sent again
    first.refresh_from_db()
    assert (first.status, first.attempts, first.last_status_code, first.last_error) == (
        "failed",
        webhooks.MAX_ATTEMPTS,
        503,
        "http_5xx",
    )
    assert len(received) == webhooks.MAX_ATTEMPTS


def test_signature_is_hmac_sha256_over_timestamp_and_body() -> None:
    import hashlib
    import hmac

    header = webhooks.signature_header(secret="k", timestamp=1700000000, body=b'{"a":1}')
    expected = hmac.new(b"k", b'1700000000.{"a":1}', hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"
    assert webhooks.signature_verify(secret="k", header=header, body=b'{"a":1}', now=1700000100)
    assert not webhooks.signature_verify(secret="k", header=header, body=b'{"a":1}', now=1700001000)


def test_every_rollout_event_and_undo_can_be_subscribed_to() -> None:
    actions = {spec.action for spec in TRANSITIONS.values()}
    assert actions | {"rollout.create", "rollout.gate_blocked", "deployment.undo"} == set(
        webhooks.WEBHOOK_EVENTS
    )


def test_an_undo_is_delivered_to_its_subscribers(api, deployment, versions, receiver) -> None:
    """An undo changes the stable version outside any rollout: subscribers of
    deployment.undo (and of every event) get it, signed, with the versions swapped, the
    revision and the reason; others do not."""
    url, received, _ = receiver
    manager = api("release_manager")
    for name, events in (
        ("undo", ["deployment.undo"]),
        ("all", ["*"]),
        ("other", ["rollout.promote"]),
    ):
        response = manager.post(
            "/api/v1/webhooks/",
            {"name": name, "url": url, "secret": SECRET, "events": events},
            format="json",
        )
        assert response.status_code == 201, response.json()
    stable, candidate = versions
    rollout = running_rollout(deployment, candidate)
    transitions.rollout_advance(actor=None, rollout_id=rollout.pk, reason="held", full=True)
    WebhookDelivery.objects.all().delete()  # the promotion's

    response = api("on_call").post(
        "/api/v1/deployments/smollm2/undo/", {"reason": "errors on bf16"}, format="json"
    )
    assert response.status_code == 200, response.json()
    deliveries = WebhookDelivery.objects.order_by("endpoint__name")
    assert [(d.endpoint.name, d.event) for d in deliveries] == [
        ("all", "deployment.undo"),
        ("undo", "deployment.undo"),
    ]
    assert deliveries[0].event_id == deliveries[1].event_id
    webhook_deliver.apply(args=[deliveries[1].pk])
    ((headers, body),) = received
    assert headers["X-Rollout-Event"] == "deployment.undo"
    assert webhooks.signature_verify(
        secret=SECRET, header=headers["X-Rollout-Signature"], body=body
    )
    payload = json.loads(body)
    revision = DeploymentRevision.objects.filter(deployment=deployment).first()
    assert revision is not None
    assert {k: v for k, v in payload.items() if k not in ("at", "event_id")} == {
        "event": "deployment.undo",
        "deployment": "smollm2",
        "stable_version_id": stable.pk,
        "previous_version_id": candidate.pk,
        "routing_revision": Deployment.objects.get(pk=deployment.pk).routing_revision,
        "revision_id": revision.pk,
        "switch": "after_load",
        "reason": "errors on bf16",
    }
