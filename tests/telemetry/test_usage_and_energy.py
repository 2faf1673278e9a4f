"""Requests-stream ingest (idempotent, malformed entries dropped) and energy attribution."""

import dataclasses
import math
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from contracts.routing import REQUESTS_STREAM, RequestRecord
from controlplane.telemetry.energy import (
    MICROJOULES,
    energy_interval_attribute,
    energy_split,
)
from controlplane.telemetry.models import EnergyAllocation, PromptRecord, RequestSample
from controlplane.telemetry.streams import MALFORMED_TOTAL
from controlplane.tenants.models import UsageRecord
from tests.gateway.conftest import ingest_all, make_setup, signed_entry

AGENT = "http://10.0.0.1:8101"
SHADOW_AGENT = "http://10.0.0.2:8101"


def record(setup, *, tenant=None, tokens=(10, 5), status=200, finished_at=None, agent=AGENT):
    finished_at = finished_at if finished_at is not None else time.time()
    return RequestRecord(
        request_id=uuid.uuid4().hex,
        tenant_id=(tenant or setup.tenant).pk,
        api_key_id=1,
        deployment="smollm2",
        version_id=setup.versions[0].pk,
        agent=agent,
        endpoint_kind="chat",
        status=status,
        is_stream=True,
        started_at=finished_at - 0.5,
        finished_at=finished_at,
        e2e_s=0.5,
        ttft_s=0.1,
        itl_mean_s=0.02,
        itl_p95_s=0.03,
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        usage_source="engine",
    )


@pytest.mark.django_db(transaction=True)
def test_ingest_counts_each_request_once_and_drops_malformed(redis_client) -> None:
    setup = make_setup()
    entries = [record(setup), record(setup, tokens=(7, 0), status=500)]
    for entry in entries:
        redis_client.xadd(REQUESTS_STREAM, signed_entry(entry))
    redis_client.xadd(REQUESTS_STREAM, {"v": "1", "request_id": "not-hex"})
    redis_client.xadd(REQUESTS_STREAM, signed_entry(entries[0]))  # a duplicate
    malformed_before = MALFORMED_TOTAL.labels(REQUESTS_STREAM)._value.get()
    ingest_all(redis_client)
    assert MALFORMED_TOTAL.labels(REQUESTS_STREAM)._value.get() == malformed_before + 1
    usage = UsageRecord.objects.get(tenant=setup.tenant)
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.errors) == (
        2,
        17,
        5,
        1,
    )
    samples = RequestSample.objects.filter(tenant=setup.tenant).order_by("status")
    assert [(s.status, s.is_error) for s in samples] == [(200, False), (500, True)]
    assert redis_client.xpending(REQUESTS_STREAM, "ingest")["pending"] == 0


def test_energy_split_adds_up_exactly() -> None:
    weights = {"a": 1, "b": 1, "c": 1, "d": 0}
    shares = energy_split(10.0, weights)
    assert set(shares) == {"a", "b", "c"}
    assert sum(round(j * MICROJOULES) for j in shares.values()) == 10 * MICROJOULES
    assert sorted(shares.values()) == [3.333333, 3.333333, 3.333334]
    odd = energy_split(123.456789, {n: n * 7 + 1 for n in range(50)})
    assert sum(round(j * MICROJOULES) for j in odd.values()) == 123_456_789
    assert math.isclose(math.fsum(odd.values()), 123.456789, rel_tol=0, abs_tol=1e-9)
    assert energy_split(5.0, {"a": 0}) == {}


@pytest.mark.django_db(transaction=True)
def test_energy_is_attributed_by_tokens_once(redis_client) -> None:
    first = make_setup()
    second = make_setup()
    start = datetime.now(tz=UTC).replace(second=0, microsecond=0) - timedelta(minutes=5)
    inside = start.timestamp() + 3
    for entry in [
        record(first, tokens=(20, 10), finished_at=inside),  # 30 tokens
        record(first, tokens=(5, 5), finished_at=inside + 1),  # 10 tokens
        record(second, tokens=(50, 10), finished_at=inside + 2),  # 60 tokens
        record(second, tokens=(99, 99), finished_at=inside + 20),  # after the interval
        record(second, tokens=(99, 99), finished_at=inside, agent="http://other:1"),
    ]:
        redis_client.xadd(REQUESTS_STREAM, signed_entry(entry))
    ingest_all(redis_client)
    allocation = energy_interval_attribute(
        source_key="fleet:1:test",
        agent=AGENT,
        interval_start=start,
        interval_end=start + timedelta(seconds=10),
        energy_joules=7.0,
    )
    assert allocation is not None
    assert allocation.tokens == 100
    assert allocation.attributed_joules == 7.0
    energy = {
        tenant.pk: sum(r.energy_joules for r in UsageRecord.objects.filter(tenant=tenant))
        for tenant in (first.tenant, second.tenant)
    }
    assert energy == {first.tenant.pk: 2.8, second.tenant.pk: 4.2}
    assert math.fsum(energy.values()) == 7.0
    # The same interval again (a retried task): refused, nothing added.
    again = energy_interval_attribute(
        source_key="fleet:1:test",
        agent=AGENT,
        interval_start=start,
        interval_end=start + timedelta(seconds=10),
        energy_joules=7.0,
    )
    assert again is None
    assert EnergyAllocation.objects.count() == 1
    assert sum(r.energy_joules for r in UsageRecord.objects.filter(tenant=first.tenant)) == 2.8


@pytest.mark.django_db(transaction=True)
def test_a_mirrored_request_is_a_sample_and_never_usage_energy_or_a_prompt(redis_client) -> None:
    setup = make_setup(prompt_logging="full")
    finished_at = time.time()
    answered = dataclasses.replace(
        record(setup, finished_at=finished_at), prompt="hi", completion="hello"
    )
    mirrored = dataclasses.replace(
        record(setup, tokens=(10, 40), status=500, finished_at=finished_at, agent=SHADOW_AGENT),
        version_id=setup.versions[1].pk,
        prompt="hi",  # a gateway never sends it for a mirror; ingest keeps none anyway
        completion="other",
        is_shadow=True,
    )
    for entry in (answered, mirrored):
        redis_client.xadd(REQUESTS_STREAM, signed_entry(entry))
    ingest_all(redis_client)

    samples = RequestSample.objects.filter(tenant=setup.tenant).order_by("status")
    assert [(s.version_id, s.status, s.is_error, s.is_shadow) for s in samples] == [
        (setup.versions[0].pk, 200, False, False),
        (setup.versions[1].pk, 500, True, True),
    ]
    usage = UsageRecord.objects.get(tenant=setup.tenant)  # the answered request's only
    assert (usage.version_id, usage.requests, usage.completion_tokens, usage.errors) == (
        setup.versions[0].pk,
        1,
        5,
        0,
    )
    assert list(PromptRecord.objects.values_list("request_id", flat=True)) == [answered.request_id]

    # The shadow agent's energy is no tenant's: nothing is attributed.
    start = datetime.fromtimestamp(finished_at - 1, tz=UTC)
    allocation = energy_interval_attribute(
        source_key=f"shadow-{uuid.uuid4().hex}",
        agent=SHADOW_AGENT,
        interval_start=start,
        interval_end=start + timedelta(seconds=2),
        energy_joules=50.0,
    )
    assert allocation is not None
    assert (allocation.tokens, allocation.attributed_joules, allocation.shares) == (0, 0.0, [])
    assert UsageRecord.objects.filter(tenant=setup.tenant).count() == 1
    assert UsageRecord.objects.get(tenant=setup.tenant).energy_joules == 0.0
