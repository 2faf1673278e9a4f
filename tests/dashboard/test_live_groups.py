"""The websocket sends each user only what they may see."""

import asyncio

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.test import Client

from controlplane.accounts.services import user_create
from controlplane.asgi import application
from controlplane.core.events import publish_event
from controlplane.core.roles import Role
from controlplane.dashboard.consumers import live_groups_for_user, tenant_live_group
from controlplane.tenants.models import Tenant

pytestmark = pytest.mark.django_db(transaction=True)


def _user(role: str, tenant: Tenant | None = None):
    return user_create(
        actor=None, username=f"u-{role}", password="pw-123456789", role=role, tenant=tenant
    )


def _cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


def test_groups_by_role() -> None:
    acme = Tenant.objects.create(slug="acme", name="Acme")
    assert live_groups_for_user(_user(Role.VIEWER)) == ["live.fleet", "live.rollouts", "live.audit"]
    assert live_groups_for_user(_user(Role.TENANT_MEMBER, acme)) == [tenant_live_group(acme.pk)]
    assert live_groups_for_user(_user(Role.AGENT)) == []


def test_tenant_member_receives_only_their_tenants_events(redis_client) -> None:
    acme = Tenant.objects.create(slug="acme", name="Acme")
    globex = Tenant.objects.create(slug="globex", name="Globex")
    member_cookie = _cookie(_user(Role.TENANT_MEMBER, acme))
    viewer_cookie = _cookie(_user(Role.VIEWER))

    def headers(cookie: str) -> list[tuple[bytes, bytes]]:
        return [
            (b"origin", b"http://localhost"),
            (b"host", b"localhost"),
            (b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode()),
        ]

    async def scenario() -> tuple[list[dict], list[dict]]:
        member = WebsocketCommunicator(application, "/ws/live/", headers=headers(member_cookie))
        viewer = WebsocketCommunicator(application, "/ws/live/", headers=headers(viewer_cookie))
        assert (await member.connect(timeout=5))[0]
        assert (await viewer.connect(timeout=5))[0]
        send = database_sync_to_async(publish_event)
        await send("live.rollouts", "rollout.stage_start", {"rollout_id": 1})
        await send(tenant_live_group(globex.pk), "usage.minute", {"tenant": "globex"})
        await send(tenant_live_group(acme.pk), "usage.minute", {"tenant": "acme"})
        member_got = [await member.receive_json_from(timeout=5)]
        viewer_got = [await viewer.receive_json_from(timeout=5)]
        assert await member.receive_nothing(timeout=0.3)
        assert await viewer.receive_nothing(timeout=0.3)
        await member.disconnect()
        await viewer.disconnect()
        return member_got, viewer_got

    member_got, viewer_got = asyncio.run(scenario())
    assert member_got == [{"type": "usage.minute", "payload": {"tenant": "acme"}}]
    assert viewer_got == [{"type": "rollout.stage_start", "payload": {"rollout_id": 1}}]
