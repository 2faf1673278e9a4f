"""Live events for the dashboard, sent through the Channels layer (Redis).

The one way to send them: `publish_events` (many events to some groups, in one event
loop entry: ingest sends many), `publish_event` for one, and `publish_event_after_commit`
from inside a transaction. Every websocket consumer subscribed to a group forwards the
event to its browser. Best effort: the dashboard re-renders from the database on each
event (and polls), so a lost event delays a view and loses nothing; a failure is logged,
never raised.
"""

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

logger = logging.getLogger(__name__)

BROADCAST_GROUP = "live.all"  # joined by no one: kept for operators' debugging tools
FLEET_LIVE_GROUP = "live.fleet"
ROLLOUTS_LIVE_GROUP = "live.rollouts"
AUDIT_LIVE_GROUP = "live.audit"


def tenant_live_group(tenant_id: int) -> str:
    """The group for one tenant's own events (usage, keys); only its members join it."""
    return f"live.tenant.{tenant_id}"


def publish_events(groups: Iterable[str], events: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Send each (event, payload) to each group."""
    groups = list(groups)
    if not events or not groups:
        return
    layer = get_channel_layer()
    if layer is None:
        return

    async def send_all() -> None:
        for event, payload in events:
            message = {"type": "live.event", "event": event, "payload": payload}
            for group in groups:
                await layer.group_send(group, message)

    try:
        async_to_sync(send_all)()
    except Exception as exc:
        logger.warning(
            "live events not published",
            extra={"groups": groups, "count": len(events), "error": str(exc)},
        )


def publish_event(group: str, event: str, payload: dict[str, Any]) -> None:
    publish_events([group], [(event, payload)])


def publish_event_after_commit(group: str, event: str, payload: dict[str, Any]) -> None:
    """Publish once the current transaction commits (nothing if it rolls back)."""
    transaction.on_commit(lambda: publish_event(group, event, payload))
