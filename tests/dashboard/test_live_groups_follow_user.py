"""An open live socket follows its user: a role or tenant change, a deactivation or a
sign-out takes effect on it without a reconnect, through the real websocket and Redis."""

import asyncio
from collections.abc import Awaitable, Callable
from importlib import import_module
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.accounts.services import user_create
from controlplane.asgi import application
from controlplane.audit.models import AuditEvent
from controlplane.core.events import (
    AUDIT_LIVE_GROUP,
    FLEET_LIVE_GROUP,
    publish_event,
    tenant_live_group,
)
from controlplane.core.roles import Role
from controlplane.dashboard import consumers
from controlplane.tenants.models import Tenant

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "follow-password-1"
DEADLINE_S = 10.0
CLOSED_SIGNED_OUT = {"type": "websocket.close", "code": consumers.UNAUTHENTICATED_CLOSE_CODE}


def _signed_in(user: Any) -> tuple[Client, str]:
    """A client with a session of its own for `user`, and that session's cookie."""
    client = Client()
    client.force_login(user)
    return client, client.cookies[settings.SESSION_COOKIE_NAME].value


def _socket(cookie: str) -> WebsocketCommunicator:
    headers = [
        (b"origin", b"http://localhost"),
        (b"host", b"localhost"),
        (b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode()),
    ]
    return WebsocketCommunicator(application, "/ws/live/", headers=headers)


async def _connected(cookie: str) -> WebsocketCommunicator:
    communicator = _socket(cookie)
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    return communicator


async def _publish(group: str, event: str, payload: dict[str, Any]) -> None:
    await database_sync_to_async(publish_event)(group, event, payload)


async def _received_while_publishing(
    communicator: WebsocketCommunicator,
    publish: Callable[[], Awaitable[None]],
    until_type: str,
) -> list[dict[str, Any]]:
    """Publish again and again until the socket receives an event of `until_type`; every
    message it received up to and including that one."""
    received: list[dict[str, Any]] = []
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while asyncio.get_running_loop().time() < deadline:
        await publish()
        while not await communicator.receive_nothing(timeout=0.2, interval=0.02):
            received.append(await communicator.receive_json_from(timeout=1))
            if received[-1]["type"] == until_type:
                return received
    raise AssertionError(f"no {until_type} within {DEADLINE_S}s; received {received}")


async def _received_until(
    communicator: WebsocketCommunicator, last: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every message the socket receives up to and including `last`."""
    received: list[dict[str, Any]] = []
    while not received or received[-1] != last:
        received.append(await communicator.receive_json_from(timeout=DEADLINE_S))
    return received


def test_demoted_viewer_stops_receiving_staff_events_and_gets_their_tenants(
    redis_client,
) -> None:
    acme = Tenant.objects.create(slug="acme", name="Acme")
    viewer = user_create(actor=None, username="watcher", password=PASSWORD, role=Role.VIEWER)
    admin = user_create(actor=None, username="boss", password=PASSWORD, role=Role.ADMIN)
    _, viewer_cookie = _signed_in(viewer)
    admin_client, _ = _signed_in(admin)
    acme_group = tenant_live_group(acme.pk)
    fleet_event = {"type": "fleet.figures", "payload": {"agents": 2}}
    acme_event = {"type": "usage.minute", "payload": {"tenant": "acme"}}

    async def scenario() -> tuple[Any, int, list[dict[str, Any]], list[dict[str, Any]]]:
        socket = await _connected(viewer_cookie)
        await _publish(FLEET_LIVE_GROUP, "fleet.figures", {"agents": 2})
        before = await socket.receive_json_from(timeout=DEADLINE_S)
        response = await sync_to_async(admin_client.post)(
            f"/api/v1/users/{viewer.pk}/role/",
            {"role": Role.TENANT_MEMBER, "tenant": acme.pk, "reason": "moved to acme"},
            content_type="application/json",
        )
        # The tenant's group is joined in the same step that leaves the staff groups.
        until_probe = await _received_while_publishing(
            socket, lambda: _publish(acme_group, "usage.probe", {}), "usage.probe"
        )
        await _publish(FLEET_LIVE_GROUP, "fleet.figures", {"agents": 2})
        await _publish(AUDIT_LIVE_GROUP, "audit.event", {"id": 1})
        await _publish(acme_group, "usage.minute", {"tenant": "acme"})
        after = await _received_until(socket, acme_event)
        await socket.disconnect()
        return before, response.status_code, until_probe, after

    before, status, until_probe, after = asyncio.run(scenario())
    assert before == fleet_event
    assert status == 200
    # The audit event of the change itself went out while the user was still a viewer.
    set_role = AuditEvent.objects.get(action="user.set_role", object_id=str(viewer.pk))
    assert until_probe == [
        {
            "type": "audit.event",
            "payload": {"id": set_role.pk, "action": "user.set_role", "object_type": "user"},
        },
        {"type": "usage.probe", "payload": {}},
    ]
    # Probes published while waiting may still arrive; no fleet or audit event does.
    assert [message for message in after if message["type"] != "usage.probe"] == [acme_event]


def test_refused_role_change_leaves_the_socket_as_it_was(redis_client) -> None:
    viewer = user_create(actor=None, username="watcher", password=PASSWORD, role=Role.VIEWER)
    admin = user_create(actor=None, username="boss", password=PASSWORD, role=Role.ADMIN)
    _, viewer_cookie = _signed_in(viewer)
    admin_client, _ = _signed_in(admin)

    async def scenario() -> tuple[int, dict[str, Any]]:
        socket = await _connected(viewer_cookie)
        # A tenant member without a tenant is refused: nothing changes, the socket stays.
        response = await sync_to_async(admin_client.post)(
            f"/api/v1/users/{viewer.pk}/role/",
            {"role": Role.TENANT_MEMBER},
            content_type="application/json",
        )
        await _publish(FLEET_LIVE_GROUP, "fleet.figures", {"agents": 2})
        received = await socket.receive_json_from(timeout=DEADLINE_S)
        await socket.disconnect()
        return response.status_code, received

    status, received = asyncio.run(scenario())
    assert status == 400
    assert received == {"type": "fleet.figures", "payload": {"agents": 2}}
    viewer.refresh_from_db()
    assert viewer.membership.role == Role.VIEWER


def test_user_deactivated_in_the_admin_has_their_socket_closed(redis_client) -> None:
    viewer = user_create(actor=None, username="watcher", password=PASSWORD, role=Role.VIEWER)
    root = get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)
    _, viewer_cookie = _signed_in(viewer)
    root_client, _ = _signed_in(root)
    change_form = {
        "username": "watcher",
        "first_name": "",
        "last_name": "",
        "email": "",
        # is_active left out: the checkbox unticked
        "last_login_0": "",
        "last_login_1": "",
        "date_joined_0": viewer.date_joined.strftime("%Y-%m-%d"),
        "date_joined_1": viewer.date_joined.strftime("%H:%M:%S"),
    }

    async def scenario() -> tuple[int, dict[str, Any]]:
        socket = await _connected(viewer_cookie)
        response = await sync_to_async(root_client.post)(
            f"/admin/auth/user/{viewer.pk}/change/", change_form
        )
        closed = await socket.receive_output(timeout=DEADLINE_S)
        await socket.disconnect()
        return response.status_code, closed

    status, closed = asyncio.run(scenario())
    assert status == 302  # the admin's redirect after a saved change
    viewer.refresh_from_db()
    assert viewer.is_active is False
    assert closed == CLOSED_SIGNED_OUT


def test_sign_out_closes_that_sessions_sockets_only(redis_client) -> None:
    viewer = user_create(actor=None, username="watcher", password=PASSWORD, role=Role.VIEWER)
    laptop_client, laptop_cookie = _signed_in(viewer)
    _, phone_cookie = _signed_in(viewer)

    async def scenario() -> tuple[int, dict[str, Any], dict[str, Any]]:
        laptop = await _connected(laptop_cookie)
        phone = await _connected(phone_cookie)
        response = await sync_to_async(laptop_client.post)("/accounts/logout/")
        closed = await laptop.receive_output(timeout=DEADLINE_S)
        await laptop.disconnect()
        await _publish(FLEET_LIVE_GROUP, "fleet.figures", {"agents": 2})
        still_open = await phone.receive_json_from(timeout=DEADLINE_S)
        await phone.disconnect()
        return response.status_code, closed, still_open

    status, closed, still_open = asyncio.run(scenario())
    assert status == 302
    assert closed == CLOSED_SIGNED_OUT
    assert still_open == {"type": "fleet.figures", "payload": {"agents": 2}}


def test_session_deleted_without_a_message_closes_the_socket_at_the_next_check(
    redis_client, monkeypatch
) -> None:
    # What no message announces (a session deleted from the store, an expired one) the
    # periodic check finds; it runs every 30 seconds, here sooner.
    monkeypatch.setattr(consumers, "RECHECK_INTERVAL_S", 0.1)
    viewer = user_create(actor=None, username="watcher", password=PASSWORD, role=Role.VIEWER)
    _, cookie = _signed_in(viewer)
    session_store = import_module(settings.SESSION_ENGINE).SessionStore

    async def scenario() -> dict[str, Any]:
        socket = await _connected(cookie)
        await database_sync_to_async(session_store(cookie).delete)()
        closed = await socket.receive_output(timeout=DEADLINE_S)
        await socket.disconnect()
        return closed

    assert asyncio.run(scenario()) == CLOSED_SIGNED_OUT


def test_deleting_the_user_closes_their_socket(redis_client) -> None:
    viewer = user_create(actor=None, username="watcher", password=PASSWORD, role=Role.VIEWER)
    _, cookie = _signed_in(viewer)

    async def scenario() -> dict[str, Any]:
        socket = await _connected(cookie)
        await database_sync_to_async(viewer.delete)()
        closed = await socket.receive_output(timeout=DEADLINE_S)
        await socket.disconnect()
        return closed

    assert asyncio.run(scenario()) == CLOSED_SIGNED_OUT
    assert not get_user_model().objects.filter(username="watcher").exists()
