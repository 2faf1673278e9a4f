"""The at-least-once stream consumer that ingest is built on, against the real Redis."""

from collections.abc import Mapping, Sequence

import pytest
from prometheus_client import REGISTRY

from controlplane.telemetry.streams import MalformedEntry, StreamIngestor

STREAM = "test:events"


class RecordingHandler:
    """Parses `n` as an int; apply can be told to fail to simulate a database outage."""

    def __init__(self) -> None:
        self.applied: list[int] = []
        self.failures_left = 0

    def parse(self, entry_id: str, fields: Mapping[str, str]) -> int:
        try:
            return int(fields["n"])
        except (KeyError, ValueError) as exc:
            raise MalformedEntry(f"bad n: {fields!r}") from exc

    def apply(self, items: Sequence[int]) -> None:
        if self.failures_left:
            self.failures_left -= 1
            raise RuntimeError("database unavailable")
        self.applied.extend(items)


def make_ingestor(redis_client, handler, consumer="c1", **options) -> StreamIngestor:
    ingestor = StreamIngestor(
        client=redis_client,
        group="g",
        consumer=consumer,
        handlers={STREAM: handler},
        block_ms=10,
        **options,
    )
    ingestor.ensure_groups()
    return ingestor


def pending_count(redis_client) -> int:
    return redis_client.xpending(STREAM, "g")["pending"]


def test_entries_are_applied_in_order_and_acknowledged(redis_client) -> None:
    handler = RecordingHandler()
    ingestor = make_ingestor(redis_client, handler)
    for n in range(5):
        redis_client.xadd(STREAM, {"n": str(n)})
    ingestor.run_once()  # own pending (none)
    ingestor.run_once()
    assert handler.applied == [0, 1, 2, 3, 4]
    assert pending_count(redis_client) == 0


def test_failed_apply_leaves_entries_pending_and_they_come_back(redis_client) -> None:
    handler = RecordingHandler()
    ingestor = make_ingestor(redis_client, handler)
    redis_client.xadd(STREAM, {"n": "7"})
    ingestor.run_once()  # own pending (none)
    ingestor.run_once()
    assert handler.applied == [7]
    handler.failures_left = 1
    redis_client.xadd(STREAM, {"n": "8"})
    with pytest.raises(RuntimeError):
        ingestor.run_once()
    assert pending_count(redis_client) == 1
    # A restarted consumer with the same name first re-reads its own pending entries.
    restarted = make_ingestor(redis_client, handler)
    restarted.run_once()
    assert handler.applied == [7, 8]
    assert pending_count(redis_client) == 0


def test_malformed_entries_are_counted_dropped_and_do_not_stop_the_stream(redis_client) -> None:
    handler = RecordingHandler()
    ingestor = make_ingestor(redis_client, handler)
    before = REGISTRY.get_sample_value("ingest_malformed_entries_total", {"stream": STREAM}) or 0
    redis_client.xadd(STREAM, {"n": "1"})
    redis_client.xadd(STREAM, {"n": "not a number"})
    redis_client.xadd(STREAM, {"other": "x"})
    redis_client.xadd(STREAM, {"n": "2"})
    ingestor.run_once()
    ingestor.run_once()
    after = REGISTRY.get_sample_value("ingest_malformed_entries_total", {"stream": STREAM})
    assert handler.applied == [1, 2]
    assert after is not None
    assert after - before == 2
    assert pending_count(redis_client) == 0


def test_entries_left_by_a_dead_consumer_are_claimed(redis_client) -> None:
    handler = RecordingHandler()
    redis_client.xgroup_create(STREAM, "g", id="0", mkstream=True)
    for n in (1, 2, 3):
        redis_client.xadd(STREAM, {"n": str(n)})
    # A consumer reads them and dies before acknowledging.
    redis_client.xreadgroup("g", "dead", {STREAM: ">"}, count=10)
    assert pending_count(redis_client) == 3
    survivor = make_ingestor(redis_client, handler, consumer="alive", claim_idle_ms=0)
    survivor.run_once()
    assert handler.applied == [1, 2, 3]
    assert pending_count(redis_client) == 0


def test_two_consumers_in_one_group_share_entries_without_overlap(redis_client) -> None:
    first, second = RecordingHandler(), RecordingHandler()
    a = make_ingestor(redis_client, first, consumer="a", batch_size=3)
    b = make_ingestor(redis_client, second, consumer="b", batch_size=3)
    for n in range(12):
        redis_client.xadd(STREAM, {"n": str(n)})
    for _ in range(4):
        a.run_once()
        b.run_once()
    assert sorted(first.applied + second.applied) == list(range(12))
    assert first.applied
    assert second.applied


def test_an_entry_the_parser_fails_on_is_dropped_as_malformed_not_retried(redis_client) -> None:
    """A parser bug on one entry would otherwise fail its batch on every delivery."""

    class FragileHandler(RecordingHandler):
        def parse(self, entry_id: str, fields: Mapping[str, str]) -> int:
            if fields.get("n") == "boom":
                raise OverflowError("a parser that did not expect this")
            return super().parse(entry_id, fields)

    handler = FragileHandler()
    ingestor = make_ingestor(redis_client, handler)
    before = REGISTRY.get_sample_value("ingest_malformed_entries_total", {"stream": STREAM}) or 0
    for n in ("1", "boom", "2"):
        redis_client.xadd(STREAM, {"n": n})
    ingestor.run_once()  # own pending (none)
    ingestor.run_once()
    after = REGISTRY.get_sample_value("ingest_malformed_entries_total", {"stream": STREAM})
    assert handler.applied == [1, 2]
    assert after is not None
    assert after - before == 1
    assert pending_count(redis_client) == 0


def test_a_batch_is_applied_in_one_call_and_acknowledged_after_it(redis_client) -> None:
    class BatchRecorder(RecordingHandler):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list[list[int]] = []
            self.pending_during_apply: list[int] = []

        def apply(self, items: Sequence[int]) -> None:
            self.pending_during_apply.append(pending_count(redis_client))
            self.batches.append(list(items))
            super().apply(items)

    handler = BatchRecorder()
    ingestor = make_ingestor(redis_client, handler, batch_size=4)
    for n in range(6):
        redis_client.xadd(STREAM, {"n": str(n)})
    ingestor.run_once()  # own pending (none)
    ingestor.run_once()
    ingestor.run_once()
    assert handler.batches == [[0, 1, 2, 3], [4, 5]]
    assert handler.pending_during_apply == [4, 2]  # nothing acknowledged before its apply
    assert pending_count(redis_client) == 0
