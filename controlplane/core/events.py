"""Live events for the dashboard, sent through the Channels layer (Redis).

Domain code calls `publish_event` after its transaction commits; every websocket
consumer subscribed to the group forwards the event to its browser.
"""

from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

BROADCAST_GROUP = "live.all"


def publish_event(group: str, event: str, payload: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    async_to_sync(layer.group_send)(
        group, {"type": "live.event", "event": event, "payload": payload}
    )
