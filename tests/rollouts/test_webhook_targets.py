"""Webhook targets: no internal networks, errors told as categories, lost deliveries swept."""

import base64
import importlib
import ipaddress
import json
import socket
import threading
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.rollouts import webhook_targets, webhooks
from controlplane.rollouts.models import DeliveryError, WebhookDelivery, WebhookEndpoint
from controlplane.rollouts.tasks import webhook_deliver, webhook_sweep
from tests.rollouts.conftest import running_rollout
from tests.rollouts.webhook_support import LOOPBACK, SECRET, Receiver, make_due


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.close()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def endpoint_for(url: str, name: str = "ops") -> WebhookEndpoint:
    """An endpoint row as an earlier check (or a DNS answer since changed) let it in."""
    return WebhookEndpoint.objects.create(name=name, url=url, secret=SECRET, events=["*"])


def first_delivery(deployment, versions) -> WebhookDelivery:
    running_rollout(deployment, versions[1])
    return WebhookDelivery.objects.order_by("id")[0]


FORBIDDEN_URLS = {
    "loopback": "http://127.0.0.1:8080/hook",
    "metadata": "http://169.254.169.254/latest/meta-data",
    "ipv6 loopback": "http://[::1]/",
    "rfc 1918": "http://10.0.0.5/",
    "name of loopback": "http://localhost:8080/hook",
    "ipv4-mapped loopback": "http://[::ffff:127.0.0.1]/",
    "ipv6 link-local": "http://[fe80::1]/",
    "unique local": "http://[fd00::1]/",
    "carrier-grade nat": "http://100.64.0.1/",
    "unspecified": "http://0.0.0.0:8080/",
    "multicast": "http://224.0.0.1/",
    "reserved": "http://240.0.0.1/",
    "userinfo": "http://user:password@example.com/hook",
    "scheme": "ftp://example.com/hook",
}


@pytest.mark.parametrize("url", FORBIDDEN_URLS.values(), ids=FORBIDDEN_URLS.keys())
def test_an_internal_or_malformed_target_is_refused_and_nothing_is_written(api, url) -> None:
    response = api("release_manager").post(
        "/api/v1/webhooks/",
        {"name": "probe", "url": url, "secret": SECRET, "events": ["*"]},
        format="json",
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "webhook_target_forbidden"
    assert list(error["fields"]) == ["url"]
    assert WebhookEndpoint.objects.count() == 0
    assert AuditEvent.objects.filter(object_type="webhook").count() == 0


def test_the_refusal_does_not_say_what_a_name_resolves_to(api) -> None:
    answers = [
        api("release_manager")
        .post(
            "/api/v1/webhooks/",
            {"name": "probe", "url": url, "secret": SECRET, "events": ["*"]},
            format="json",
        )
        .json()["error"]
        for url in ("http://localhost/", "http://nothing-here.invalid/")
    ]
    assert answers[0] == answers[1]
    assert answers[0]["fields"] == {"url": ["the host must resolve, and only to public addresses"]}


def test_an_allowed_network_lets_its_targets_in_and_no_others(api, settings) -> None:
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    client = api("release_manager")
    created = client.post(
        "/api/v1/webhooks/",
        {"name": "local", "url": "http://localhost:8080/hook", "secret": SECRET, "events": ["*"]},
        format="json",
    )
    assert created.status_code == 201
    refused = client.post(
        "/api/v1/webhooks/",
        {"name": "lan", "url": "http://10.0.0.5/", "secret": SECRET, "events": ["*"]},
        format="json",
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "webhook_target_forbidden"
    assert list(WebhookEndpoint.objects.values_list("name", flat=True)) == ["local"]
    assert list(
        AuditEvent.objects.filter(object_type="webhook").values_list("action", "object_repr")
    ) == [("webhook.create", "local")]


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "100.127.255.254",
        "0.0.0.0",
        "224.0.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "192.0.2.1",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "fd12:3456::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "::ffff:10.0.0.5",
        "2002:7f00:1::",  # 6to4 around 127.0.0.1
        "64:ff9b::a00:5",  # NAT64 around 10.0.0.5
        "2001:db8::1",
    ],
)
def test_internal_addresses_are_forbidden(address) -> None:
    assert webhook_targets.address_is_forbidden(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address", ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"]
)
def test_public_addresses_are_not(address) -> None:
    assert not webhook_targets.address_is_forbidden(ipaddress.ip_address(address))


def test_an_allowed_network_matches_only_its_own_family() -> None:
    loopback_v4 = (ipaddress.ip_network("127.0.0.0/8"),)
    assert webhook_targets.address_is_allowed(ipaddress.ip_address("::ffff:127.0.0.1"), loopback_v4)
    # ::7f00:1 has the integer value of 127.0.0.1 but is an IPv6 address.
    assert not webhook_targets.address_is_allowed(ipaddress.ip_address("::7f00:1"), loopback_v4)


def test_a_malformed_allowed_network_is_a_configuration_error(settings) -> None:
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = ["10.0.0.0/33"]
    with pytest.raises(ImproperlyConfigured) as refusal:
        webhook_targets.allowed_networks()
    assert str(refusal.value) == "ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS: '10.0.0.0/33' is not a network"


def test_a_target_forbidden_at_delivery_time_is_not_sent(
    deployment, versions, receiver, settings
) -> None:
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = [LOOPBACK]
    webhooks.webhook_endpoint_create(
        actor=None, name="ops", url=receiver.url(), secret=SECRET, events=["*"]
    )
    delivery = first_delivery(deployment, versions)
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = []

    webhook_deliver.apply(args=[delivery.pk])

    assert receiver.received == []
    delivery.refresh_from_db()
    assert (
        delivery.status,
        delivery.attempts,
        delivery.last_status_code,
        delivery.last_error,
    ) == ("failed", 1, None, "target_forbidden")


def test_delivery_connects_to_the_checked_address_with_the_named_host(
    deployment, versions, receiver, settings
) -> None:
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = [LOOPBACK]
    webhooks.webhook_endpoint_create(
        actor=None, name="ops", url=receiver.url("localhost"), secret=SECRET, events=["*"]
    )
    delivery = first_delivery(deployment, versions)

    webhook_deliver.apply(args=[delivery.pk])

    assert len(receiver.received) == 1
    headers, _ = receiver.received[0]
    assert headers["Host"] == f"localhost:{receiver.port}"
    delivery.refresh_from_db()
    assert (delivery.status, delivery.last_status_code) == ("succeeded", 204)


def test_the_deliveries_api_returns_error_categories_only(
    api, deployment, versions, receiver, settings
) -> None:
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = [LOOPBACK]
    settings.ROLLOUTS_WEBHOOK_TIMEOUT_S = 0.5
    endpoints = {
        "http_5xx": endpoint_for(receiver.url(), "server-error"),
        "timeout": endpoint_for(receiver.url(), "held"),
        "connect_error": endpoint_for(f"http://127.0.0.1:{closed_port()}/hook", "closed-port"),
        "tls_error": endpoint_for(f"https://127.0.0.1:{receiver.port}/hook", "plain-http"),
        "dns_error": endpoint_for("http://nothing-here.invalid/hook", "no-name"),
        "target_forbidden": endpoint_for("http://10.0.0.5/hook", "internal"),
    }
    running_rollout(deployment, versions[1])
    # One delivery per endpoint for the first event; the receiver answers in this order.
    receiver.answers.extend([503, 0])
    for category, endpoint in endpoints.items():
        delivery = endpoint.deliveries.order_by("id").first()
        assert delivery is not None
        webhook_deliver.apply(args=[delivery.pk])
        delivery.refresh_from_db()
        assert delivery.last_error == category, endpoint.name

    client = api("viewer")
    seen = {}
    for category, endpoint in endpoints.items():
        response = client.get(f"/api/v1/webhooks/{endpoint.pk}/deliveries/")
        assert response.status_code == 200
        first = min(response.json()["results"], key=lambda row: row["id"])
        seen[category] = (first["last_error"], first["last_status_code"], first["status"])
        text = response.content.decode()
        for leak in ("Errno", "refused", "SSL", "Name or service", "10.0.0.5", "127.0.0.1"):
            assert leak not in text
    assert seen == {
        "http_5xx": ("http_5xx", 503, "pending"),
        "timeout": ("timeout", None, "pending"),
        "connect_error": ("connect_error", None, "pending"),
        "tls_error": ("tls_error", None, "pending"),
        "dns_error": ("dns_error", None, "pending"),
        "target_forbidden": ("target_forbidden", None, "failed"),
    }
    assert {value for value, _, _ in seen.values()} <= set(DeliveryError.values)


def broker_messages(redis_client) -> list[tuple[str, list]]:
    """The (task name, args) of each message waiting in this test's Celery queue."""
    messages = []
    for raw in redis_client.lrange(django_settings.CELERY_TASK_DEFAULT_QUEUE, 0, -1):
        message = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        messages.append((message["headers"]["task"], args))
    return messages


def test_the_sweep_sends_a_delivery_whose_task_was_lost_once(
    deployment, versions, receiver, settings, redis_client
) -> None:
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = [LOOPBACK]
    endpoint = endpoint_for(receiver.url())
    delivery = first_delivery(deployment, versions)
    others = endpoint.deliveries.exclude(pk=delivery.pk)
    assert others.exists()
    make_due(delivery, overdue_s=webhooks.SWEEP_OVERDUE_S + 1)

    webhook_sweep.apply()
    webhook_sweep.apply()  # a second pass leaves it to the task the first one sent

    messages = broker_messages(redis_client)
    assert messages == [("rollouts.webhook_deliver", [delivery.pk])]
    webhook_deliver.apply(args=messages[0][1])
    webhook_deliver.apply(args=messages[0][1])  # delivered twice: sent once
    assert len(receiver.received) == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("succeeded", 1)
    # Deliveries not yet overdue are their own tasks' to send.
    assert set(others.values_list("status", "attempts")) == {("pending", 0)}


def test_the_sweep_fails_a_delivery_whose_last_attempt_is_spent(
    deployment, versions, receiver, settings, redis_client
) -> None:
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = [LOOPBACK]
    endpoint_for(receiver.url())
    running_rollout(deployment, versions[1])
    retried, interrupted, in_flight = WebhookDelivery.objects.order_by("id")[:3]
    overdue = timezone.now() - timedelta(seconds=webhooks.SWEEP_OVERDUE_S + 1)
    WebhookDelivery.objects.filter(pk=retried.pk).update(
        attempts=webhooks.MAX_ATTEMPTS, last_error="http_5xx", next_attempt_at=overdue
    )
    WebhookDelivery.objects.filter(pk=interrupted.pk).update(
        attempts=webhooks.MAX_ATTEMPTS, next_attempt_at=overdue
    )
    # Its last attempt still holds its lease.
    WebhookDelivery.objects.filter(pk=in_flight.pk).update(
        attempts=webhooks.MAX_ATTEMPTS,
        next_attempt_at=timezone.now() + timedelta(seconds=webhooks.ATTEMPT_LEASE_S),
    )

    webhook_sweep.apply()
    webhook_sweep.apply()

    rows = {
        row.pk: (row.status, row.attempts, row.last_error)
        for row in WebhookDelivery.objects.filter(pk__in=[retried.pk, interrupted.pk, in_flight.pk])
    }
    assert rows == {
        retried.pk: ("failed", webhooks.MAX_ATTEMPTS, "http_5xx"),
        interrupted.pk: ("failed", webhooks.MAX_ATTEMPTS, "interrupted"),
        in_flight.pk: ("pending", webhooks.MAX_ATTEMPTS, ""),
    }
    assert broker_messages(redis_client) == []
    webhook_deliver.apply(args=[retried.pk])
    assert receiver.received == []


@pytest.mark.django_db(transaction=True)
def test_a_delivery_being_attempted_is_not_attempted_again(
    deployment, versions, receiver, settings
) -> None:
    settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS = [LOOPBACK]
    endpoint_for(receiver.url())
    delivery = first_delivery(deployment, versions)
    receiver.answers.append(0)  # the first POST is held until released

    def first_worker() -> None:
        try:
            webhooks.delivery_send(delivery_id=delivery.pk)
        finally:
            connection.close()

    first = threading.Thread(target=first_worker)
    first.start()
    try:
        assert receiver.arrived.wait(timeout=30)
        webhooks.delivery_send(delivery_id=delivery.pk)  # another worker, same moment
        assert len(receiver.received) == 1
    finally:
        receiver.release.set()
        first.join(timeout=30)
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("succeeded", 1)


def test_errors_stored_as_text_before_categories_migrate_to_their_category() -> None:
    migration = importlib.import_module(
        "controlplane.rollouts.migrations.0002_webhook_delivery_error_categories_and_schedule"
    )
    stored = {
        ("ConnectError: [Errno 111] Connection refused", None): "connect_error",
        ("ConnectError: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed", None): (
            "tls_error"
        ),
        ("ConnectTimeout: timed out", None): "timeout",
        ("ReadTimeout: The read operation timed out", None): "timeout",
        ("RemoteProtocolError: Server disconnected", None): "transport_error",
        ("transient answer", 503): "http_5xx",
        ("transient answer", 429): "http_4xx",
        ("refused with 404", 404): "http_4xx",
        ("refused with 301", 301): "http_3xx",
        ("", 204): "",
    }
    migrated = {key: migration.legacy_error_category(*key) for key in stored}
    assert migrated == stored
    assert set(migrated.values()) - {""} <= set(DeliveryError.values)
