"""Live events for the dashboard, sent through the Channels layer (Redis).

Domain code calls `publish_event` after its transaction commits; every websocket
consumer subscribed to the group forwards the event to its browser.
"""

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

BROADCAST_GROUP = "live.all"  # joined by no one: kept for operators' debugging tools
ROLLOUTS_LIVE_GROUP = "live.rollouts"
AUDIT_LIVE_GROUP = "live.audit"


def tenant_live_group(tenant_id: int) -> str:
    """The group for one tenant's own events (usage, keys); only its members join it."""
    return f"live.tenant.{tenant_id}"


def publish_event(group: str, event: str, payload: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    async_to_sync(layer.group_send)(
        group, {"type": "live.event", "event": event, "payload": payload}
    )


def publish_event_after_commit(group: str, event: str, payload: dict[str, Any]) -> None:
    """Publish once the current transaction commits; a lost live event is only logged.

    The dashboard re-renders from the database on each event, so a dropped event
    delays a view and loses nothing.
    """

    def send() -> None:
        try:
            publish_event(group, event, payload)
        except Exception:
            logger.warning("live event not published", extra={"group": group, "event": event})

    transaction.on_commit(send)
