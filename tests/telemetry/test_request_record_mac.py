"""Ingest trusts only request entries a gateway signed, through the real requests handler,
StreamIngestor, PostgreSQL and Redis: a forged or altered entry changes nothing in the
database and is counted, logged without its text and audited (at most once a minute); prompt
text is kept only while the tenant's policy keeps prompts."""

import asyncio
import logging
from typing import Any

import pytest
from django.conf import settings
from prometheus_client import REGISTRY

from contracts.routing import (
    REQUEST_MAC_FIELD,
    REQUESTS_STREAM,
    RequestRecord,
    request_fields_verify,
)
from controlplane.audit.models import AuditEvent
from controlplane.core.redis_clients import async_redis_client
from controlplane.gateway.recorder import RedisBatcher, spooled_entries_write
from controlplane.gateway.spool import Spool
from controlplane.telemetry.models import PromptRecord, RequestSample
from controlplane.telemetry.requests import RequestsStreamHandler
from controlplane.telemetry.streams import StreamIngestor
from controlplane.tenants.models import Tenant, UsageRecord
from controlplane.tenants.services import tenant_update
from tests.gateway.conftest import Setup, free_port, make_setup, signed_entry
from tests.telemetry.support import request_record

pytestmark = pytest.mark.django_db(transaction=True)

SECRET_PROMPT = "the forged prompt text"
AUDIT_ACTION = "telemetry.requests_refused"


def record(setup: Setup, **changes: Any) -> RequestRecord:
    return request_record(tenant_id=setup.tenant.pk, version_id=setup.versions[0].pk, **changes)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_ingestor(redis_client, handler: RequestsStreamHandler) -> StreamIngestor:
    ingestor = StreamIngestor(
        client=redis_client,
        group="ingest",
        consumer="c1",
        handlers={REQUESTS_STREAM: handler},
        block_ms=10,
    )
    ingestor.ensure_groups()
    return ingestor


def drain(ingestor: StreamIngestor) -> None:
    for _ in range(100):
        if ingestor.run_once() == 0 and ingestor.run_once() == 0:
            return
    raise AssertionError("ingest did not drain")


def refused(reason: str) -> float:
    return REGISTRY.get_sample_value("ingest_requests_refused_total", {"reason": reason}) or 0.0


def refused_counts() -> tuple[float, float]:
    return (refused("missing_mac"), refused("bad_mac"))


def usage(tenant: Tenant) -> tuple[int, int, int]:
    rows = UsageRecord.objects.filter(tenant=tenant)
    return (
        sum(row.requests for row in rows),
        sum(row.prompt_tokens for row in rows),
        sum(row.completion_tokens for row in rows),
    )


def audits() -> list[dict[str, Any]]:
    return [
        {"actor": event.actor_name, "object": event.object_id, **event.after}
        for event in AuditEvent.objects.filter(action=AUDIT_ACTION).order_by("pk")
    ]


def pending(redis_client) -> int:
    return redis_client.xpending(REQUESTS_STREAM, "ingest")["pending"]


@pytest.mark.parametrize(
    ("forge", "reason"),
    [
        (lambda fields: fields, "missing_mac"),
        (lambda fields: {**fields, REQUEST_MAC_FIELD: "0" * 64}, "bad_mac"),
        (lambda fields: {**fields, REQUEST_MAC_FIELD: "forged"}, "bad_mac"),
    ],
)
def test_a_forged_entry_is_refused_and_changes_nothing(redis_client, caplog, forge, reason):
    setup = make_setup(prompt_logging="full")
    bill = record(setup, prompt_tokens=1_000_000, prompt=SECRET_PROMPT, completion="ok")
    redis_client.xadd(REQUESTS_STREAM, forge(bill.to_fields()))
    before = refused_counts()

    with caplog.at_level(logging.WARNING):
        drain(make_ingestor(redis_client, RequestsStreamHandler()))

    assert usage(setup.tenant) == (0, 0, 0)
    assert RequestSample.objects.count() == 0
    assert PromptRecord.objects.count() == 0
    after = refused_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (
        (1, 0) if reason == "missing_mac" else (0, 1)
    )
    assert audits() == [
        {
            "actor": "system",
            "object": REQUESTS_STREAM,
            "refused": 1,
            "by_reason": {reason: 1},
        }
    ]
    assert pending(redis_client) == 0  # dropped like a malformed entry: it blocks nothing
    logged = [r for r in caplog.records if r.getMessage().startswith("refusing an unsigned")]
    assert [r.reason for r in logged] == [reason]
    text = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert SECRET_PROMPT not in text

    # The stream moves on: a signed entry after it is applied.
    good = record(setup)
    redis_client.xadd(REQUESTS_STREAM, signed_entry(good))
    drain(make_ingestor(redis_client, RequestsStreamHandler()))
    assert usage(setup.tenant) == (1, 10, 5)


def test_a_signed_entry_is_applied_with_its_prompt(redis_client) -> None:
    setup = make_setup(prompt_logging="full")
    good = record(setup, prompt="what is 2+2", completion="4")
    redis_client.xadd(REQUESTS_STREAM, signed_entry(good))
    before = refused_counts()

    drain(make_ingestor(redis_client, RequestsStreamHandler()))

    assert usage(setup.tenant) == (1, 10, 5)
    assert list(RequestSample.objects.values_list("request_id", flat=True)) == [good.request_id]
    assert list(PromptRecord.objects.values_list("request_id", "prompt", "completion")) == [
        (good.request_id, "what is 2+2", "4")
    ]
    assert refused_counts() == before
    assert audits() == []


def test_an_entry_altered_after_signing_is_refused(redis_client) -> None:
    setup = make_setup()
    signed = signed_entry(record(setup))
    redis_client.xadd(REQUESTS_STREAM, {**signed, "prompt_tokens": "1000000"})
    redis_client.xadd(REQUESTS_STREAM, {**signed, "tenant_id": str(make_setup().tenant.pk)})
    before = refused_counts()

    drain(make_ingestor(redis_client, RequestsStreamHandler()))

    assert UsageRecord.objects.count() == 0
    assert RequestSample.objects.count() == 0
    after = refused_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (0, 2)
    # Both in one minute: one audit event, for the first.
    assert audits() == [
        {"actor": "system", "object": REQUESTS_STREAM, "refused": 1, "by_reason": {"bad_mac": 1}}
    ]


def test_refusals_are_audited_at_most_once_a_minute(redis_client) -> None:
    setup = make_setup()
    clock = Clock()
    handler = RequestsStreamHandler(clock=clock)
    ingestor = make_ingestor(redis_client, handler)
    unsigned = record(setup).to_fields()
    redis_client.xadd(REQUESTS_STREAM, unsigned)
    drain(ingestor)
    assert [event["refused"] for event in audits()] == [1]

    clock.now += 59
    for _ in range(3):
        redis_client.xadd(REQUESTS_STREAM, unsigned)
    redis_client.xadd(REQUESTS_STREAM, {**signed_entry(record(setup)), "status": "500"})
    drain(ingestor)
    assert [event["refused"] for event in audits()] == [1]  # within the minute: none

    # The minute is up: the next entry, even a good one, audits what waited.
    clock.now += 1
    redis_client.xadd(REQUESTS_STREAM, signed_entry(record(setup)))
    drain(ingestor)
    assert audits()[1:] == [
        {
            "actor": "system",
            "object": REQUESTS_STREAM,
            "refused": 4,
            "by_reason": {"bad_mac": 1, "missing_mac": 3},
        }
    ]
    assert usage(setup.tenant) == (1, 10, 5)

    clock.now += 600
    redis_client.xadd(REQUESTS_STREAM, signed_entry(record(setup)))
    drain(ingestor)
    assert len(audits()) == 2  # nothing refused since: nothing to audit


def test_prompts_of_a_tenant_that_does_not_keep_them_are_discarded(redis_client) -> None:
    keeps = make_setup(prompt_logging="full")
    declines = make_setup(prompt_logging="off")
    kept = record(keeps, prompt="kept", completion="kept too")
    discarded = record(declines, prompt=SECRET_PROMPT, completion="secret completion")
    redis_client.xadd(REQUESTS_STREAM, signed_entry(kept))
    redis_client.xadd(REQUESTS_STREAM, signed_entry(discarded))

    drain(make_ingestor(redis_client, RequestsStreamHandler()))

    assert usage(declines.tenant) == (1, 10, 5)
    assert usage(keeps.tenant) == (1, 10, 5)
    assert list(PromptRecord.objects.values_list("request_id", "prompt")) == [
        (kept.request_id, "kept")
    ]


def test_the_policy_at_ingest_time_decides(redis_client) -> None:
    """A prompt the gateway captured while the policy was `full` is not stored once the
    tenant turned it off before ingest applied the entry."""
    setup = make_setup(prompt_logging="full")
    entry = record(setup, prompt=SECRET_PROMPT, completion="c")
    redis_client.xadd(REQUESTS_STREAM, signed_entry(entry))
    tenant_update(actor=None, tenant=setup.tenant, prompt_logging="off")

    drain(make_ingestor(redis_client, RequestsStreamHandler()))

    assert usage(setup.tenant) == (1, 10, 5)
    assert PromptRecord.objects.count() == 0


def test_an_entry_spooled_by_the_gateway_is_signed_and_accepted(redis_client, tmp_path) -> None:
    setup = make_setup()
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    entries = [record(setup, prompt_tokens=n) for n in (3, 4)]

    async def gateway_without_redis() -> None:
        client = async_redis_client(f"redis://127.0.0.1:{free_port()}/0")
        try:
            batcher = RedisBatcher(client, spool)
            runner = asyncio.create_task(batcher.run())
            for entry in entries:
                batcher.put(entry.to_fields())
            batcher.close()
            await asyncio.wait_for(runner, timeout=10)
        finally:
            await client.aclose()

    asyncio.run(gateway_without_redis())
    spooled: list[dict[str, str]] = []
    spool.replay(spooled.extend)  # the lines as the gateway wrote them
    assert sorted(fields["request_id"] for fields in spooled) == sorted(
        entry.request_id for entry in entries
    )
    for fields in spooled:
        request_fields_verify(fields, settings.TELEMETRY_RECORD_KEY)

    spooled_entries_write(redis_client, spooled)
    drain(make_ingestor(redis_client, RequestsStreamHandler()))
    assert usage(setup.tenant) == (2, 7, 10)
    assert audits() == []


def test_an_unsigned_line_left_in_the_spool_is_signed_on_replay(redis_client, tmp_path) -> None:
    """A spool line written before gateways signed entries (the spool is the gateway's own
    disk) is signed as it is replayed, so an upgrade loses no usage."""
    setup = make_setup()
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    entry = record(setup)
    assert spool.append(entry.to_fields())

    assert spool.replay(lambda entries: spooled_entries_write(redis_client, entries)) == 1
    drain(make_ingestor(redis_client, RequestsStreamHandler()))

    assert usage(setup.tenant) == (1, 10, 5)
    assert audits() == []
