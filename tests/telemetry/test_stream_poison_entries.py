"""Entries that parse but that the database refuses, through the real requests handler,
PostgreSQL and Redis: the good entries of their batch are applied and acknowledged, the
refused ones counted and dropped; a failure that is not an entry's fault drops nothing."""

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import pytest
from django.conf import settings
from django.db import InterfaceError, connection, transaction
from prometheus_client import REGISTRY

from contracts.routing import (
    REQUESTS_STREAM,
    RequestRecord,
    request_fields_sign,
    request_fields_verify,
)
from controlplane.telemetry.models import PromptRecord, RequestSample
from controlplane.telemetry.requests import RequestsStreamHandler
from controlplane.telemetry.streams import StreamIngestor
from controlplane.tenants.models import UsageRecord
from tests.gateway.conftest import make_setup, signed_entry
from tests.telemetry.support import request_record

pytestmark = pytest.mark.django_db(transaction=True)

SECRET_PROMPT = "the secret prompt text"
# Fields read as written, without the contract's bounds: how an entry the database refuses
# reaches `apply` (an older contract, or a column narrower than the contract believes).
UNCHECKED = {"prompt_tokens": int, "completion_tokens": int, "deployment": str, "prompt": str}
SAFE_VALUES = {"prompt_tokens": "0", "completion_tokens": "0", "deployment": "d"}


class UncheckedHandler(RequestsStreamHandler):
    def parse(self, entry_id: str, fields: Mapping[str, str]) -> RequestRecord:
        request_fields_verify(fields, settings.TELEMETRY_RECORD_KEY)
        safe = {**fields, **SAFE_VALUES}
        safe.pop("prompt", None)
        record = super().parse(entry_id, request_fields_sign(safe, settings.TELEMETRY_RECORD_KEY))
        raw = {name: kind(fields[name]) for name, kind in UNCHECKED.items() if name in fields}
        return dataclasses.replace(record, **raw)


class FailsOnceHandler(RequestsStreamHandler):
    """Fails its first apply in the given way, then applies for real."""

    def __init__(self, failure: str, redis_client) -> None:
        super().__init__()
        self.failure = failure
        self.redis_client = redis_client
        self.calls = 0
        self.pending_at_retry: int | None = None

    def apply(self, items: Sequence[RequestRecord]) -> None:
        self.calls += 1
        if self.calls == 1:
            self.fail()
        if self.calls == 2:
            self.pending_at_retry = pending(self.redis_client)
        super().apply(items)

    def fail(self) -> None:
        if self.failure == "interface_error":
            raise InterfaceError("connection already closed")
        if self.failure == "connection_killed":  # outside a transaction, as a selector would
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        with transaction.atomic(), connection.cursor() as cursor:
            if self.failure == "statement_timeout":
                cursor.execute("SET LOCAL statement_timeout = 1")
                cursor.execute("SELECT pg_sleep(10)")
            if self.failure == "undefined_table":  # as a migration not yet applied would
                cursor.execute("SELECT 1 FROM no_such_table")
        raise AssertionError(f"{self.failure} did not fail")


def record(setup, **changes) -> RequestRecord:
    return request_record(tenant_id=setup.tenant.pk, version_id=setup.versions[0].pk, **changes)


def make_ingestor(redis_client, handler, **options) -> StreamIngestor:
    ingestor = StreamIngestor(
        client=redis_client,
        group="ingest",
        consumer="c1",
        handlers={REQUESTS_STREAM: handler},
        block_ms=10,
        **options,
    )
    ingestor.ensure_groups()
    return ingestor


def drain(ingestor: StreamIngestor) -> None:
    ingestor.run_once()  # the consumer's own pending entries (none)
    while ingestor.run_once():
        pass


def pending(redis_client) -> int:
    return redis_client.xpending(REQUESTS_STREAM, "ingest")["pending"]


def counters() -> dict[str, float]:
    """The ingest metrics of the requests stream, by name (`dropped/<reason>` for drops)."""

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"stream": REQUESTS_STREAM, **labels}) or 0.0

    values = {
        "applied": sample("ingest_entries_total"),
        "malformed_or_refused": sample("ingest_malformed_entries_total"),
    }
    for reason in ("malformed", "integrity_error", "data_error", "database_error"):
        values[f"dropped/{reason}"] = sample("ingest_dropped_entries_total", reason=reason)
    return values


def increase(before: dict[str, float]) -> dict[str, float]:
    after = counters()
    return {name: after[name] - before[name] for name in before if after[name] != before[name]}


@pytest.mark.parametrize("batch_size", [2000, 3, 1])
def test_entries_the_database_refuses_are_dropped_and_the_rest_applied(
    redis_client, caplog, batch_size
) -> None:
    setup = make_setup(prompt_logging="full")
    good = [record(setup, prompt_tokens=n, completion_tokens=1) for n in (1, 2, 4, 8)]
    good[1] = dataclasses.replace(good[1], prompt="kept", completion="kept too")
    refused = {
        "integer out of range": record(setup, prompt_tokens=2**31),
        "negative count": record(setup, completion_tokens=-1),
        "deployment too long": record(setup, deployment="d" * 101),
        "NUL in the prompt": record(setup, prompt=f"{SECRET_PROMPT}\x00", completion=""),
    }
    stream = [good[0], *list(refused.values())[:2], good[1], good[2]]
    stream += [*list(refused.values())[2:], good[3]]
    for entry in stream:
        redis_client.xadd(REQUESTS_STREAM, signed_entry(entry))
    ingestor = make_ingestor(redis_client, UncheckedHandler(), batch_size=batch_size)
    before = counters()

    with caplog.at_level(logging.WARNING, logger="controlplane.telemetry.streams"):
        drain(ingestor)

    assert sorted(RequestSample.objects.values_list("request_id", flat=True)) == sorted(
        entry.request_id for entry in good
    )
    usage = UsageRecord.objects.get(tenant=setup.tenant)
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens) == (4, 15, 4)
    assert list(PromptRecord.objects.values_list("request_id", "prompt")) == [
        (good[1].request_id, "kept")
    ]
    assert increase(before) == {
        "applied": 4,
        "malformed_or_refused": 4,  # every dropped entry, as before reasons existed
        "dropped/data_error": 3,
        "dropped/integrity_error": 1,
    }
    assert pending(redis_client) == 0
    drops = [
        r for r in caplog.records if r.getMessage() == "dropping an entry the database refused"
    ]
    assert sorted(r.reason for r in drops) == ["data_error"] * 3 + ["integrity_error"]
    assert {r.entry_id for r in drops} == {
        entry_id
        for entry_id, fields in redis_client.xrange(REQUESTS_STREAM)
        if fields["request_id"] in {entry.request_id for entry in refused.values()}
    }
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert SECRET_PROMPT not in logged
    assert "Failing row" not in logged  # PostgreSQL's DETAIL, which quotes the values

    # The stream moves on.
    later = record(setup)
    redis_client.xadd(REQUESTS_STREAM, signed_entry(later))
    drain(ingestor)
    assert RequestSample.objects.filter(request_id=later.request_id).exists()
    assert pending(redis_client) == 0


def test_a_batch_without_refused_entries_is_applied_in_one_call(redis_client) -> None:
    class Counting(UncheckedHandler):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list[int] = []

        def apply(self, items: Sequence[RequestRecord]) -> None:
            self.batches.append(len(items))
            super().apply(items)

    setup = make_setup()
    for _ in range(5):
        redis_client.xadd(REQUESTS_STREAM, signed_entry(record(setup)))
    handler = Counting()
    drain(make_ingestor(redis_client, handler))
    assert handler.batches == [5]
    assert RequestSample.objects.count() == 5


@pytest.mark.parametrize(
    "failure", ["statement_timeout", "connection_killed", "interface_error", "undefined_table"]
)
def test_a_failure_that_is_not_an_entrys_fault_drops_nothing(redis_client, failure) -> None:
    setup = make_setup()
    entries = [record(setup) for _ in range(3)]
    for entry in entries:
        redis_client.xadd(REQUESTS_STREAM, signed_entry(entry))
    handler = FailsOnceHandler(failure, redis_client)
    ingestor = make_ingestor(redis_client, handler)
    before = counters()
    loops = 0

    def should_stop() -> bool:
        nonlocal loops
        loops += 1
        return handler.calls >= 2 or loops > 8

    ingestor.run(should_stop)  # the real loop: back off, re-read its own pending entries

    assert handler.calls == 2
    assert handler.pending_at_retry == 3  # nothing was acknowledged by the failed attempt
    assert sorted(RequestSample.objects.values_list("request_id", flat=True)) == sorted(
        entry.request_id for entry in entries
    )
    assert increase(before) == {"applied": 3}  # and nothing dropped
    assert pending(redis_client) == 0
