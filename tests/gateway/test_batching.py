"""The gateway's Redis batcher: many requests' commands in one pipeline, nothing lost."""

import asyncio
import uuid

import pytest
import redis
from django.conf import settings

from contracts.routing import REQUESTS_STREAM
from controlplane.core.redis_clients import async_redis_client
from controlplane.gateway.ratelimit import Admission
from controlplane.gateway.recorder import RedisBatcher
from controlplane.gateway.spool import Spool
from tests.gateway.conftest import free_port, wait_for_fresh_window


def entry(index: int) -> dict[str, str]:
    return {"v": "1", "request_id": uuid.uuid4().hex, "index": str(index)}


def spooled(spool: Spool) -> list[dict[str, str]]:
    entries: list[dict[str, str]] = []
    spool.replay(entries.extend)
    return entries


async def serve_requests(
    batcher: RedisBatcher, count: int, *, requests_per_minute: int
) -> list[Admission | Exception]:
    """`count` concurrent requests: each is admitted, then queues its entry and settlement."""

    async def one(index: int) -> Admission | Exception:
        await asyncio.sleep(index % 7 * 0.001)  # arrivals spread over a few batches
        try:
            admission: Admission | Exception = await batcher.admit(
                tenant_id=7,
                requests_per_minute=requests_per_minute,
                tokens_per_minute=1_000_000,
                reservation=10,
                is_urgent=index % 3 == 0,
            )
        except redis.RedisError as exc:
            admission = exc
        settlement = None
        if isinstance(admission, Admission) and admission.is_allowed:
            settlement = (7, admission.window, 5)
        batcher.put(entry(index), settlement)
        return admission

    runner = asyncio.create_task(batcher.run())
    results = await asyncio.gather(*(one(index) for index in range(count)))
    batcher.close()  # what is still queued is written before run() returns
    await runner
    return list(results)


def test_entries_of_many_concurrent_requests_arrive_exactly_once(redis_client, tmp_path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    wait_for_fresh_window(redis_client, needed_s=5)

    async def scenario() -> list[Admission | Exception]:
        client = async_redis_client(settings.GATEWAY_REDIS_URL)
        try:
            await client.script_flush()  # the batcher loads its scripts when Redis lacks them
            batcher = RedisBatcher(client, spool)
            return await serve_requests(batcher, 200, requests_per_minute=150)
        finally:
            await client.aclose()

    results = asyncio.run(scenario())

    indexes = [int(fields["index"]) for _, fields in redis_client.xrange(REQUESTS_STREAM)]
    assert sorted(indexes) == list(range(200))
    assert spool.pending_count() == 0
    allowed = [r for r in results if isinstance(r, Admission) and r.is_allowed]
    refused = [r for r in results if isinstance(r, Admission) and not r.is_allowed]
    assert (len(allowed), len(refused)) == (150, 50)
    assert sorted(a.requests_used for a in allowed) == list(range(1, 151))
    assert {r.limit for r in refused} == {"requests"}
    # Each allowed request reserved 10 tokens and settled +5; refused ones left no trace.
    window = allowed[0].window
    assert int(redis_client.get(f"ratelimit:{{7}}:r:{window}")) == 150
    assert int(redis_client.get(f"ratelimit:{{7}}:t:{window}")) == 150 * (10 + 5)


def test_a_batch_redis_refuses_spools_every_entry_and_still_admits(redis_client, tmp_path) -> None:
    redis_client.set(REQUESTS_STREAM, "not a stream")  # every XADD fails with WRONGTYPE
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)

    async def scenario() -> list[Admission | Exception]:
        client = async_redis_client(settings.GATEWAY_REDIS_URL)
        try:
            return await serve_requests(RedisBatcher(client, spool), 40, requests_per_minute=1_000)
        finally:
            await client.aclose()

    results = asyncio.run(scenario())

    assert all(isinstance(r, Admission) and r.is_allowed for r in results)
    assert sorted(int(fields["index"]) for fields in spooled(spool)) == list(range(40))


def test_a_batch_that_cannot_reach_redis_spools_every_entry(tmp_path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)

    async def scenario() -> list[Admission | Exception]:
        client = async_redis_client(f"redis://127.0.0.1:{free_port()}/0")
        try:
            return await serve_requests(RedisBatcher(client, spool), 40, requests_per_minute=1)
        finally:
            await client.aclose()

    results = asyncio.run(scenario())

    assert all(isinstance(r, redis.ConnectionError) for r in results)
    assert sorted(int(fields["index"]) for fields in spooled(spool)) == list(range(40))


@pytest.mark.parametrize("gather_s", [0.002, 60.0])
def test_closing_writes_what_is_queued(redis_client, tmp_path, gather_s) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)

    async def scenario() -> None:
        client = async_redis_client(settings.GATEWAY_REDIS_URL)
        try:
            batcher = RedisBatcher(client, spool, gather_s=gather_s)
            runner = asyncio.create_task(batcher.run())
            for index in range(30):
                batcher.put(entry(index))
            batcher.close()
            await asyncio.wait_for(runner, timeout=10)
        finally:
            await client.aclose()

    asyncio.run(scenario())

    indexes = [int(fields["index"]) for _, fields in redis_client.xrange(REQUESTS_STREAM)]
    assert sorted(indexes) == list(range(30))
    assert spool.pending_count() == 0


def test_an_admission_counts_every_settlement_queued_before_it(redis_client, tmp_path) -> None:
    # A client sends its next request as soon as the last response ends, so that request's
    # admission is queued right after the last one's settlement, often in the same batch.
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    wait_for_fresh_window(redis_client, needed_s=5)

    async def scenario() -> list[Admission]:
        client = async_redis_client(settings.GATEWAY_REDIS_URL)
        batcher = RedisBatcher(client, spool)
        runner = asyncio.create_task(batcher.run())
        admissions = []
        try:
            for index in range(20):
                admission = await batcher.admit(
                    tenant_id=8,
                    requests_per_minute=1000,
                    tokens_per_minute=1000,
                    reservation=10,
                    is_urgent=True,
                )
                admissions.append(admission)
                if not admission.is_allowed:
                    break
                # It used 50 tokens, not 10; a background write may be in flight meanwhile.
                batcher.put(entry(index), (8, admission.window, 40))
                batcher.put(entry(1000 + index))
        finally:
            batcher.close()
            await runner
            await client.aclose()
        return admissions

    admissions = asyncio.run(scenario())

    # Each admission saw the settlements of every request before it (20 of 50 fill 1000).
    assert [a.tokens_used for a in admissions] == [50 * i + 10 for i in range(20)]
    assert all(a.is_allowed for a in admissions)
    window = admissions[0].window
    assert int(redis_client.get(f"ratelimit:{{8}}:t:{window}")) == 1000
