"""Live events for the dashboard, sent through the Channels layer (Redis).

The one way to send them: `publish_events` (many events to some groups, in one event
loop entry: ingest sends many), `publish_event` for one, and `publish_event_after_commit`
from inside a transaction; a pass of many changes (the reconciler's) wraps them in
`publishing_batched`, which sends everything they published in one entry at its end.
Every websocket consumer subscribed to a group forwards the event to its browser. Best
effort: the dashboard re-renders from the database on each
event (and polls), so a lost event delays a view and loses nothing; a failure is logged,
never raised.

`publish_access_changed` is the other kind of message: not an event for the browser but
a word to one user's open sockets that the user's role, tenant or session changed, so
that each re-reads the user and follows (see `dashboard.consumers`).
"""

import asyncio
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
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


def user_live_group(user_id: int) -> str:
    """The group every socket of one user joins; it carries no events, only the word that
    the user's access changed (`publish_access_changed`)."""
    return f"live.user.{user_id}"


# The layer message carrying events (a consumer's `live_events`): a list, so that a group
# gets many events in one send, each a few Redis round trips.
EVENTS_MESSAGE = "live.events"
EVENTS_PER_MESSAGE = 100

_batches = threading.local()  # publishing_batched: this thread's messages held back


@contextmanager
def publishing_batched() -> Iterator[None]:
    """Hold back the messages this thread publishes (after each commit too) and send them
    in one event loop entry when the block ends, each group's in order: each entry costs
    a few milliseconds (async_to_sync), about 30 % of a reconcile pass that sends hundreds
    of loads. Nested blocks send with the outermost."""
    if getattr(_batches, "messages", None) is not None:
        yield
        return
    _batches.messages = []
    try:
        yield
    finally:
        messages, _batches.messages = _batches.messages, None
        _group_send_all(messages)


def _group_send_all(messages: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Send each (group, message) in one event loop entry, each group's in order; a failure
    is logged."""
    held = getattr(_batches, "messages", None)
    if held is not None:
        held.extend(messages)
        return
    layer = get_channel_layer()
    if layer is None or not messages:
        return

    by_group = _by_group(messages)

    async def send_group(group: str, group_messages: list[dict[str, Any]]) -> None:
        for message in group_messages:
            await layer.group_send(group, message)

    async def send_all() -> None:
        # Each group in order; the groups side by side (a send is two round trips or more).
        await asyncio.gather(*(send_group(group, sent) for group, sent in by_group.items()))

    try:
        async_to_sync(send_all)()
    except Exception as exc:
        logger.warning(
            "live messages not published",
            extra={
                "groups": sorted({group for group, _ in messages}),
                "count": len(messages),
                "error": str(exc),
            },
        )


def _by_group(messages: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Each group's messages in order, a group's consecutive events merged into messages
    of up to EVENTS_PER_MESSAGE (a reconcile pass publishes hundreds)."""
    by_group: dict[str, list[dict[str, Any]]] = {}
    for group, message in messages:
        sent = by_group.setdefault(group, [])
        last = sent[-1] if sent else None
        if (
            message["type"] == EVENTS_MESSAGE
            and last is not None
            and last["type"] == EVENTS_MESSAGE
            and len(last["events"]) + len(message["events"]) <= EVENTS_PER_MESSAGE
        ):
            sent[-1] = {"type": EVENTS_MESSAGE, "events": last["events"] + message["events"]}
        else:
            sent.append(message)
    return by_group


def publish_events(groups: Iterable[str], events: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """Send each (event, payload) to each group."""
    groups = list(groups)
    listed = [{"event": event, "payload": payload} for event, payload in events]
    chunks = [
        listed[start : start + EVENTS_PER_MESSAGE]
        for start in range(0, len(listed), EVENTS_PER_MESSAGE)
    ]
    _group_send_all(
        [(group, {"type": EVENTS_MESSAGE, "events": chunk}) for chunk in chunks for group in groups]
    )


def publish_event(group: str, event: str, payload: dict[str, Any]) -> None:
    publish_events([group], [(event, payload)])


def publish_event_after_commit(group: str, event: str, payload: dict[str, Any]) -> None:
    """Publish once the current transaction commits (nothing if it rolls back)."""
    transaction.on_commit(lambda: publish_event(group, event, payload))


def publish_access_changed(user_id: int, *, ended_session_key: str | None = None) -> None:
    """Tell every open socket of the user to read the user's access again (and leave the
    groups it may no longer see); `ended_session_key` names a session that just signed out,
    whose sockets close."""
    message = {"type": "live.access_changed", "ended_session_key": ended_session_key}
    _group_send_all([(user_live_group(user_id), message)])


def publish_access_changed_after_commit(user_id: int) -> None:
    """`publish_access_changed` once the current transaction commits, so that the sockets
    read what it wrote (nothing if it rolls back)."""
    transaction.on_commit(lambda: publish_access_changed(user_id))
