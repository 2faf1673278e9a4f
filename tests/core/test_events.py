"""Live events held back in a batch go out together, in order, when the batch ends."""

from controlplane.core import events
from controlplane.core.events import FLEET_LIVE_GROUP, publish_event, publishing_batched
from tests.telemetry.conftest import LiveGroupListener


def test_a_batch_sends_its_events_in_one_entry_at_its_end(redis_client, monkeypatch) -> None:
    entries = []
    real = events.async_to_sync

    def counted(function):
        entries.append(function)
        return real(function)

    monkeypatch.setattr(events, "async_to_sync", counted)
    listener = LiveGroupListener()
    try:
        with publishing_batched():
            publish_event(FLEET_LIVE_GROUP, "agent.command", {"n": 1})
            with publishing_batched():  # nested: the outer block sends
                publish_event(FLEET_LIVE_GROUP, "agent.command", {"n": 2})
            publish_event(FLEET_LIVE_GROUP, "agent.state", {"n": 3})
            assert listener.events(timeout=0.3) == []
            assert entries == []
        assert [(e["event"], e["payload"]["n"]) for e in listener.events()] == [
            ("agent.command", 1),
            ("agent.command", 2),
            ("agent.state", 3),
        ]
        assert len(entries) == 1
        publish_event(FLEET_LIVE_GROUP, "agent.state", {"n": 4})  # outside: sent at once
        assert [e["payload"]["n"] for e in listener.events()] == [4]
        assert len(entries) == 2
    finally:
        listener.close()


def test_a_batch_of_many_events_reaches_a_group_in_few_messages_in_order(
    redis_client, monkeypatch
) -> None:
    sends = []
    layer = events.get_channel_layer()
    real_send = layer.group_send

    async def counted(group, message):
        sends.append((group, len(message["events"])))
        await real_send(group, message)

    monkeypatch.setattr(layer, "group_send", counted)
    listener = LiveGroupListener()
    try:
        with publishing_batched():
            for n in range(250):
                publish_event(FLEET_LIVE_GROUP, "agent.command", {"n": n})
        assert [e["payload"]["n"] for e in listener.events()] == list(range(250))
        assert sends == [(FLEET_LIVE_GROUP, 100), (FLEET_LIVE_GROUP, 100), (FLEET_LIVE_GROUP, 50)]
    finally:
        listener.close()
