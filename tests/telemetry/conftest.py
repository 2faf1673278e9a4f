"""Telemetry test fixtures: the API fixtures (users per role, signer, versions) and a
listener on the fleet's live group."""

import asyncio

import pytest
from channels.layers import channel_layers

from controlplane.core.events import FLEET_LIVE_GROUP
from tests.api.support import *  # noqa: F403


class LiveGroupListener:
    """A real Channels channel (on Redis) subscribed to the fleet's live group.

    A layer instance and an event loop of its own: a layer's receive side is bound to one loop.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pending: list[dict] = []  # received, not yet returned
        self.layer = channel_layers.make_backend("default")
        self.channel = self.loop.run_until_complete(self.layer.new_channel())
        self.loop.run_until_complete(self.layer.group_add(FLEET_LIVE_GROUP, self.channel))

    def receive(self, timeout: float = 5.0) -> dict:
        """The next event (a layer message carries one or more)."""
        if not self.pending:
            message = self.loop.run_until_complete(
                asyncio.wait_for(self.layer.receive(self.channel), timeout)
            )
            self.pending.extend(
                {"event": event["event"], "payload": event["payload"]}
                for event in message["events"]
            )
        return self.pending.pop(0)

    def events(self, timeout: float = 0.5) -> list[dict]:
        received = []
        while True:
            try:
                received.append(self.receive(timeout))
            except TimeoutError:
                return received

    def close(self) -> None:
        self.loop.run_until_complete(self.layer.group_discard(FLEET_LIVE_GROUP, self.channel))
        self.loop.run_until_complete(self.layer.close_pools())  # redis_client empties the keys
        self.loop.close()


@pytest.fixture
def live_group(redis_client):
    listener = LiveGroupListener()
    yield listener
    listener.close()
