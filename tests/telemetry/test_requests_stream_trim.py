"""The requests stream keeps every entry until ingest acknowledged it, and a gap is counted.

Real Redis and PostgreSQL throughout: the gateway's batcher and spool write the entries,
the real requests handler ingests them, and the dashboard shows a loss.
"""

import asyncio
import math
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from django.db.models import Sum
from django.utils import timezone

from contracts.routing import REQUESTS_STREAM, RequestRecord
from controlplane.core.redis_clients import async_redis_client
from controlplane.gateway.recorder import RedisBatcher, RequestsStreamFull, spooled_entries_write
from controlplane.gateway.spool import Spool
from controlplane.telemetry.models import RequestSample
from controlplane.telemetry.requests import RequestsStreamHandler
from controlplane.telemetry.stream_trim import (
    STREAM_LAG,
    USAGE_GAPS_TOTAL,
    lost_entries_key,
    stream_loss_get,
)
from controlplane.telemetry.streams import StreamIngestor
from controlplane.tenants.models import Tenant, UsageRecord
from tests.gateway.conftest import Setup, make_setup, signed_entry
from tests.telemetry.support import request_record

pytestmark = pytest.mark.django_db(transaction=True)


def record(setup: Setup, index: int) -> RequestRecord:
    return request_record(
        tenant_id=setup.tenant.pk,
        version_id=setup.versions[0].pk,
        prompt_tokens=10 + index,
        completion_tokens=index % 7,
    )


def ingestor(client: redis.Redis, consumer: str = "ingest-1", **options: Any) -> StreamIngestor:
    """Ingest's consumer of the requests stream; unless told, it trims only when the test
    says so (`trim_acknowledged`)."""
    options.setdefault("trim_every_s", math.inf)
    made = StreamIngestor(
        client=client,
        group="ingest",
        consumer=consumer,
        handlers={REQUESTS_STREAM: RequestsStreamHandler()},
        block_ms=10,
        **options,
    )
    made.ensure_groups()
    return made


def drain(stream_ingestor: StreamIngestor) -> None:
    for _ in range(100):
        if stream_ingestor.run_once() == 0 and stream_ingestor.run_once() == 0:
            return
    raise AssertionError("ingest did not drain")


def usage(tenant: Tenant) -> tuple[int, int, int]:
    """The tenant's usage: requests, prompt tokens, completion tokens."""
    totals = UsageRecord.objects.filter(tenant=tenant).aggregate(
        requests=Sum("requests"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")
    )
    return (totals["requests"] or 0, totals["prompt"] or 0, totals["completion"] or 0)


def usage_of(records: Sequence[RequestRecord]) -> tuple[int, int, int]:
    return (
        len(records),
        sum(item.prompt_tokens for item in records),
        sum(item.completion_tokens for item in records),
    )


def stream_ids(client: redis.Redis) -> list[str]:
    entries: Any = client.xrange(REQUESTS_STREAM)
    return [entry_id for entry_id, _ in entries]


def stream_lag() -> float:
    return STREAM_LAG.labels(REQUESTS_STREAM)._value.get()


def lost_total() -> float:
    """Usage gaps of entries trimmed from the stream, read or not."""
    return sum(
        USAGE_GAPS_TOTAL.labels(reason)._value.get()
        for reason in ("trimmed_unread", "trimmed_pending")
    )


async def gateway_writes(setup: Setup, records: list[RequestRecord], spool: Spool) -> None:
    """The gateway's batcher writes the entries, ten to a batch."""
    client = async_redis_client(django_settings.GATEWAY_REDIS_URL)
    try:
        batcher = RedisBatcher(client, spool)
        runner = asyncio.create_task(batcher.run())
        for start in range(0, len(records), 10):
            for item in records[start : start + 10]:
                batcher.put(item.to_fields())
            # An urgent admission sends the batch: once it is answered, the ten entries
            # before it went to the stream or (their spooling awaited by run()) the spool.
            await batcher.admit(
                tenant_id=setup.tenant.pk,
                requests_per_minute=1_000_000,
                tokens_per_minute=1_000_000_000,
                reservation=1,
                is_urgent=True,
            )
        batcher.close()
        await runner
    finally:
        await client.aclose()


def test_an_ingest_outage_past_the_stream_cap_loses_no_usage(redis_client, settings, tmp_path):
    settings.GATEWAY_REQUESTS_STREAM_MAX_LENGTH = 50
    setup = make_setup()
    records = [record(setup, index) for index in range(120)]
    stream_ingestor = ingestor(redis_client)  # the group exists; then ingest is away
    lost_before = lost_total()
    spool = Spool(tmp_path / "spool", max_bytes=1 << 22)

    asyncio.run(gateway_writes(setup, records, spool))

    # Nothing was trimmed: the stream stopped growing at the cap, the rest is spooled.
    assert redis_client.xlen(REQUESTS_STREAM) == 50
    assert spool.pending_count() == 70
    stream_ingestor.trim_acknowledged()  # nothing acknowledged: nothing trimmed
    assert redis_client.xlen(REQUESTS_STREAM) == 50
    assert stream_lag() == 50  # all of them unread
    # The spool's replay waits while the stream is full, and keeps every entry.
    with pytest.raises(RequestsStreamFull):
        spool.replay(lambda entries: spooled_entries_write(redis_client, entries))
    assert spool.pending_count() == 70
    assert redis_client.xlen(REQUESTS_STREAM) == 50

    # Ingest is back: it applies the stream, trims what it acknowledged, the spool drains.
    drain(stream_ingestor)
    stream_ingestor.trim_acknowledged()
    assert redis_client.xlen(REQUESTS_STREAM) == 0
    assert stream_lag() == 0
    replayed = spool.replay(lambda entries: spooled_entries_write(redis_client, entries))
    assert replayed == 70
    assert spool.pending_count() == 0
    drain(stream_ingestor)
    stream_ingestor.trim_acknowledged()

    assert redis_client.xlen(REQUESTS_STREAM) == 0
    assert RequestSample.objects.filter(tenant=setup.tenant).count() == 120
    assert usage(setup.tenant) == usage_of(records)
    assert usage_of(records) == (120, 120 * 10 + sum(range(120)), sum(i % 7 for i in range(120)))
    assert lost_total() == lost_before
    assert stream_loss_get(redis_client, REQUESTS_STREAM) is None


def test_the_stream_is_trimmed_only_below_what_every_group_acknowledged(redis_client):
    setup = make_setup()
    records = [record(setup, index) for index in range(10)]
    first = ingestor(redis_client, batch_size=4)
    ids = [redis_client.xadd(REQUESTS_STREAM, signed_entry(item)) for item in records]
    first.run_once()  # its own pending entries: none
    first.run_once()  # entries 0-3: applied and acknowledged
    # Another consumer of the group takes 4-6 and dies before acknowledging them.
    redis_client.xreadgroup("ingest", "dead", {REQUESTS_STREAM: ">"}, count=3)

    first.trim_acknowledged()
    assert stream_ids(redis_client) == ids[4:]

    # A survivor claims the dead consumer's entries and acknowledges them; 7-9 are unread.
    survivor = ingestor(redis_client, consumer="ingest-2", claim_idle_ms=0)
    survivor.run_once()
    survivor.trim_acknowledged()
    assert stream_ids(redis_client) == ids[7:]

    # A second group that has read nothing holds everything back, whatever ingest read.
    redis_client.xgroup_create(REQUESTS_STREAM, "audit", id="0")
    drain(survivor)
    survivor.trim_acknowledged()
    assert stream_ids(redis_client) == ids[7:]
    redis_client.xreadgroup("audit", "reader", {REQUESTS_STREAM: ">"}, count=2)
    redis_client.xack(REQUESTS_STREAM, "audit", *ids[7:9])
    survivor.trim_acknowledged()
    assert stream_ids(redis_client) == ids[9:]

    assert usage(setup.tenant) == usage_of(records)
    assert stream_loss_get(redis_client, REQUESTS_STREAM) is None


def test_the_ingest_loop_trims_what_it_acknowledged_on_its_own(redis_client):
    setup = make_setup()
    records = [record(setup, index) for index in range(5)]
    looping = ingestor(redis_client, trim_every_s=0)
    for item in records:
        redis_client.xadd(REQUESTS_STREAM, signed_entry(item))
    assert redis_client.xlen(REQUESTS_STREAM) == 5
    drain(looping)
    assert redis_client.xlen(REQUESTS_STREAM) == 0
    assert usage(setup.tenant) == usage_of(records)


def test_entries_trimmed_unread_are_counted_and_shown_on_the_overview(redis_client, client_for):
    setup = make_setup()
    records = [record(setup, index) for index in range(15)]
    stream_ingestor = ingestor(redis_client, batch_size=3)
    ids = [redis_client.xadd(REQUESTS_STREAM, signed_entry(item)) for item in records[:10]]
    lost_before = lost_total()
    stream_ingestor.run_once()  # its own pending entries: none
    stream_ingestor.run_once()  # entries 0-2
    # An operator (or a writer still using MAXLEN) trims 3-6 before ingest read them.
    redis_client.xtrim(REQUESTS_STREAM, minid=ids[7], approximate=False)
    drain(stream_ingestor)
    stream_ingestor.trim_acknowledged()

    assert lost_total() - lost_before == 4
    loss = stream_loss_get(redis_client, REQUESTS_STREAM)
    assert loss is not None
    assert (loss.total, loss.last_count) == (4, 4)
    assert timezone.now() - loss.last_at < timedelta(minutes=5)
    assert usage(setup.tenant) == usage_of(records[:3] + records[7:10])
    # A gap is counted once, however often ingest looks again.
    stream_ingestor.trim_acknowledged()
    drain(stream_ingestor)
    stream_ingestor.trim_acknowledged()
    assert lost_total() - lost_before == 4

    # A second gap, found before ingest reads past it: 10-12 trimmed unread.
    later_ids = [redis_client.xadd(REQUESTS_STREAM, signed_entry(item)) for item in records[10:]]
    redis_client.xtrim(REQUESTS_STREAM, minid=later_ids[3], approximate=False)
    stream_ingestor.trim_acknowledged()
    drain(stream_ingestor)
    stream_ingestor.trim_acknowledged()

    assert lost_total() - lost_before == 7
    loss = stream_loss_get(redis_client, REQUESTS_STREAM)
    assert loss is not None
    assert (loss.total, loss.last_count) == (7, 3)
    assert usage(setup.tenant) == usage_of(records[:3] + records[7:10] + records[13:])
    assert redis_client.xlen(REQUESTS_STREAM) == 0

    page = client_for("on_call").get("/")
    assert page.status_code == 200
    text = page.content.decode()
    assert 'data-testid="usage-lost"' in text
    assert "3 request entries left the requests stream before ingest read them" in text
    assert "7 in all" in text


def test_entries_trimmed_while_pending_are_counted(redis_client):
    setup = make_setup()
    records = [record(setup, index) for index in range(8)]
    ingestor(redis_client)  # the group
    ids = [redis_client.xadd(REQUESTS_STREAM, signed_entry(item)) for item in records]
    lost_before = lost_total()
    # Consumers take entries and stop before applying them (crashed; a failed batch left
    # pending looks the same): "ingest-1" takes 0-2, "ingest-dead" takes 3-4.
    redis_client.xreadgroup("ingest", "ingest-1", {REQUESTS_STREAM: ">"}, count=3)
    redis_client.xreadgroup("ingest", "ingest-dead", {REQUESTS_STREAM: ">"}, count=2)

    # 0-1 are trimmed by hand while pending; restarted, "ingest-1" reads its own pending
    # entries first, and they come back without fields.
    redis_client.xtrim(REQUESTS_STREAM, minid=ids[2], approximate=False)
    restarted = ingestor(redis_client, claim_idle_ms=3_600_000)
    drain(restarted)
    loss = stream_loss_get(redis_client, REQUESTS_STREAM)
    assert loss is not None
    assert (lost_total() - lost_before, loss.total, loss.last_count) == (2, 2, 2)

    # 3 is trimmed while the dead consumer holds it; another consumer claims its entries
    # and Redis reports 3 gone.
    redis_client.xtrim(REQUESTS_STREAM, minid=ids[4], approximate=False)
    survivor = ingestor(redis_client, consumer="ingest-2", claim_idle_ms=0)
    drain(survivor)
    survivor.trim_acknowledged()

    loss = stream_loss_get(redis_client, REQUESTS_STREAM)
    assert loss is not None
    assert (lost_total() - lost_before, loss.total, loss.last_count) == (3, 3, 1)
    assert usage(setup.tenant) == usage_of(records[2:3] + records[4:])
    assert redis_client.xpending(REQUESTS_STREAM, "ingest")["pending"] == 0
    assert redis_client.xlen(REQUESTS_STREAM) == 0


def test_the_overview_alerts_only_for_a_loss_in_the_last_week(redis_client, client_for):
    client = client_for("viewer")
    assert 'data-testid="usage-lost"' not in client.get("/").content.decode()
    week_ago = (timezone.now() - timedelta(days=7, minutes=1)).timestamp()
    redis_client.hset(
        lost_entries_key(REQUESTS_STREAM),
        mapping={"total": "5", "last_count": "5", "last_at": repr(week_ago)},
    )
    assert 'data-testid="usage-lost"' not in client.get("/").content.decode()
    redis_client.hset(lost_entries_key(REQUESTS_STREAM), "last_at", repr(time.time()))
    assert 'data-testid="usage-lost"' in client.get("/").content.decode()
    # An unreadable record is no alert (and no failed page).
    redis_client.hset(lost_entries_key(REQUESTS_STREAM), "total", "many")
    page = client.get("/")
    assert page.status_code == 200
    assert 'data-testid="usage-lost"' not in page.content.decode()
