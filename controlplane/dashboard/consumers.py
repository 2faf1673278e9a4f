"""The one websocket the dashboard opens: authenticated, it forwards live events."""

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.core import access
from controlplane.core.events import (
    AUDIT_LIVE_GROUP,
    FLEET_LIVE_GROUP,
    ROLLOUTS_LIVE_GROUP,
    tenant_live_group,
)

UNAUTHENTICATED_CLOSE_CODE = 4401


def live_groups_for_user(user: Any) -> list[str]:
    """The Channels groups whose events this user may see.

    Staff readers get the fleet, rollouts and audit groups; a tenant member only their
    tenant's group; anyone else (no role, the agent service account) nothing. The
    broadcast group ("live.all") is joined by no one: it carries events of every kind.
    """
    groups: list[str] = []
    if access.can_view_fleet(user):
        groups.append(FLEET_LIVE_GROUP)
    if access.is_staff_reader(user):
        groups.append(ROLLOUTS_LIVE_GROUP)
    if access.is_staff_reader(user):
        groups.append(AUDIT_LIVE_GROUP)
    tenant = access.tenant_for_user(user)
    if tenant is not None:
        groups.append(tenant_live_group(tenant.pk))
    return groups


class LiveUpdatesConsumer(AsyncJsonWebsocketConsumer):
    groups: list[str] = []

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHENTICATED_CLOSE_CODE)
            return
        # The role lives in the database (user.membership); read it off the event loop.
        self.subscribed_groups = await database_sync_to_async(live_groups_for_user)(user)
        for group in self.subscribed_groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "subscribed_groups", []):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        # The socket is one-way; a ping gets a pong so clients can check liveness.
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    async def live_event(self, message: dict[str, Any]) -> None:
        await self.send_json({"type": message["event"], "payload": message["payload"]})
