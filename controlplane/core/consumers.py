"""The one websocket the dashboard opens: authenticated, it forwards live events."""

from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.core.events import BROADCAST_GROUP

UNAUTHENTICATED_CLOSE_CODE = 4401


def live_groups_for_user(user: Any) -> list[str]:
    """The Channels groups whose events this user may see."""
    return [BROADCAST_GROUP]


class LiveUpdatesConsumer(AsyncJsonWebsocketConsumer):
    groups: list[str] = []

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHENTICATED_CLOSE_CODE)
            return
        self.subscribed_groups = live_groups_for_user(user)
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
