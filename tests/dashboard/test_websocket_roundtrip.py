"""The live websocket: session-authenticated, events travel through the Redis channel layer."""

import asyncio

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from channels_redis.core import RedisChannelLayer
from django.conf import settings
from django.test import Client

from controlplane.accounts.services import user_create
from controlplane.asgi import application
from controlplane.core.events import AUDIT_LIVE_GROUP, publish_event
from controlplane.core.roles import Role
from controlplane.dashboard.consumers import UNAUTHENTICATED_CLOSE_CODE


def _session_cookie_for_new_user() -> str:
    user = user_create(
        actor=None, username="watcher", password="watcher-password-1", role=Role.VIEWER
    )
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


def _headers(cookie: str | None) -> list[tuple[bytes, bytes]]:
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if cookie:
        headers.append((b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode()))
    return headers


@pytest.mark.django_db(transaction=True)
def test_event_published_through_redis_reaches_the_browser_socket(redis_client) -> None:
    cookie = _session_cookie_for_new_user()

    async def scenario() -> dict:
        communicator = WebsocketCommunicator(application, "/ws/live/", headers=_headers(cookie))
        connected, _ = await communicator.connect(timeout=5)
        assert connected
        # publish_event is what domain code calls (synchronously, after commit).
        await database_sync_to_async(publish_event)(
            AUDIT_LIVE_GROUP, "audit.event", {"id": 1, "action": "agent.drain"}
        )
        message = await communicator.receive_json_from(timeout=5)
        await communicator.disconnect()
        return message

    assert asyncio.run(scenario()) == {
        "type": "audit.event",
        "payload": {"id": 1, "action": "agent.drain"},
    }
    # The layer that carried it is the Redis one, not an in-memory stand-in.
    assert isinstance(get_channel_layer(), RedisChannelLayer)


@pytest.mark.django_db(transaction=True)
def test_anonymous_socket_is_closed() -> None:
    async def scenario() -> tuple[bool, int | None]:
        communicator = WebsocketCommunicator(application, "/ws/live/", headers=_headers(None))
        connected, code = await communicator.connect(timeout=5)
        return connected, code

    assert asyncio.run(scenario()) == (False, UNAUTHENTICATED_CLOSE_CODE)
