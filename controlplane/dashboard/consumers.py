"""The one websocket the dashboard opens: authenticated, it forwards live events.

What a socket receives follows its user while it is open: every socket also joins its
user's group (`user_live_group`), where a role or tenant change, a deactivation or a
sign-out is announced (`publish_access_changed`). The consumer then reads the session and
the user again, the way an HTTP request would, leaves the groups the user may no longer
see, joins the new ones, and closes with 4401 when the session no longer signs anyone
in (signed out, expired, deleted, or its user deactivated or deleted). A recheck every
`RECHECK_INTERVAL_S` catches what no message announced (a lost message, an expired
session) and renews the socket's group memberships, which the Redis layer otherwise
forgets after a day.
"""

import asyncio
import contextlib
import logging
from importlib import import_module
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib import auth
from django.http import HttpRequest

from controlplane.core import access
from controlplane.core.events import (
    AUDIT_LIVE_GROUP,
    FLEET_LIVE_GROUP,
    ROLLOUTS_LIVE_GROUP,
    tenant_live_group,
    user_live_group,
)

logger = logging.getLogger(__name__)

UNAUTHENTICATED_CLOSE_CODE = 4401
RECHECK_INTERVAL_S = 30.0


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
        groups += [ROLLOUTS_LIVE_GROUP, AUDIT_LIVE_GROUP]
    tenant = access.tenant_for_user(user)
    if tenant is not None:
        groups.append(tenant_live_group(tenant.pk))
    return groups


def live_groups_now(*, user_id: int, session_key: str | None) -> list[str] | None:
    """The groups the socket's user may see now, or None when the socket must close.

    The session is loaded afresh from its store and resolved by Django's own
    `auth.get_user`, as the next HTTP request would be: a deleted or expired session, an
    inactive or deleted user, or a changed password sign no one in.
    """
    if session_key is None:
        return None
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = auth.get_user(request)
    if not user.is_authenticated or user.pk != user_id:
        return None
    return live_groups_for_user(user)


class LiveUpdatesConsumer(AsyncJsonWebsocketConsumer):
    groups: list[str] = []

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHENTICATED_CLOSE_CODE)
            return
        self.user_id = user.pk
        session = self.scope.get("session")
        self.session_key = session.session_key if session is not None else None
        self.subscribed_groups: list[str] = []
        self.is_signed_out = False
        # The user's group first: a change committed after the groups are read below is
        # announced there, so no change falls between the two.
        await self.channel_layer.group_add(user_live_group(self.user_id), self.channel_name)
        # The role lives in the database (user.membership); read it off the event loop.
        await self._join(await database_sync_to_async(live_groups_for_user)(user))
        await self.accept()
        self.recheck_task = asyncio.create_task(self._recheck_periodically())

    async def disconnect(self, code: int) -> None:
        task = getattr(self, "recheck_task", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if getattr(self, "user_id", None) is None:
            return
        for group in [*self.subscribed_groups, user_live_group(self.user_id)]:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        # The socket is one-way; a ping gets a pong so clients can check liveness.
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    async def live_events(self, message: dict[str, Any]) -> None:
        """Each event of the message to the browser, in order (core.events.EVENTS_MESSAGE)."""
        for event in message["events"]:
            if self.is_signed_out:
                return
            await self.send_json({"type": event["event"], "payload": event["payload"]})

    async def live_access_changed(self, message: dict[str, Any]) -> None:
        """Follow the user: regroup, or close when the session signs no one in."""
        if self.is_signed_out:
            return
        ended_session_key = message.get("ended_session_key")
        if ended_session_key is not None and ended_session_key == self.session_key:
            await self._close_signed_out()
            return
        groups = await database_sync_to_async(live_groups_now)(
            user_id=self.user_id, session_key=self.session_key
        )
        if groups is None:
            await self._close_signed_out()
            return
        for group in set(self.subscribed_groups) - set(groups):
            await self.channel_layer.group_discard(group, self.channel_name)
        await self._join(groups)

    async def _join(self, groups: list[str]) -> None:
        # Adding a group again only renews the membership, which the Redis layer forgets
        # after a day: the user's group too.
        for group in [user_live_group(self.user_id), *groups]:
            await self.channel_layer.group_add(group, self.channel_name)
        self.subscribed_groups = groups

    async def _close_signed_out(self) -> None:
        # Events already queued for this socket are dropped, not sent after the close.
        self.is_signed_out = True
        for group in self.subscribed_groups:
            await self.channel_layer.group_discard(group, self.channel_name)
        self.subscribed_groups = []
        await self.close(code=UNAUTHENTICATED_CLOSE_CODE)

    async def _recheck_periodically(self) -> None:
        # Sent to this socket's own channel, so that a recheck never runs beside another
        # handler: the consumer handles its messages one at a time.
        message = {"type": "live.access_changed", "ended_session_key": None}
        while True:
            await asyncio.sleep(RECHECK_INTERVAL_S)
            try:
                await self.channel_layer.send(self.channel_name, message)
            except Exception as exc:  # the layer is Redis: try again next time
                logger.warning("live socket recheck not sent", extra={"error": str(exc)})
