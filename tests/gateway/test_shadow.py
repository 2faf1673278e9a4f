"""Shadow routes on live traffic: a real gateway process copies admitted requests to the
shadow version's engine, answers every client from the stable one, records each copy as
a shadow sample of the candidate, and counts none of them as the tenant's usage or
against its limits.

Real engines (the shadow on the second), a gateway process, the real ingest handler.
"""

import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam
from scipy.stats import binom

from contracts.routing import RequestRecord
from controlplane.rollouts.routing import routing_table_publish
from controlplane.telemetry.models import PromptRecord, RequestSample
from controlplane.tenants.models import UsageRecord
from tests.agent.test_agent_processes import scrape
from tests.conftest import wait_until
from tests.gateway.conftest import (
    Setup,
    client_for,
    endpoint_secrets,
    ingest_all,
    make_setup,
    stream_records,
    wait_for_fresh_window,
    wait_for_model,
    wait_for_records,
)

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi"}]
REQUESTS = 40
SHARE = 50
# Mirrored copies of REQUESTS draws at SHARE %: outside this range one run in a million.
LOW, HIGH = (int(bound) for bound in binom.interval(1 - 1e-6, REQUESTS, SHARE / 100))


def publish(setup: Setup, engines: list[str], client: redis.Redis, **tenant_weights) -> None:
    stable, candidate = setup.versions
    routing_table_publish(
        deployment="smollm2",
        model="smollm2",
        versions=[
            {
                "version_id": stable.pk,
                "label": stable.label,
                "weight": 100,
                "endpoints": [engines[0]],
                "endpoint_secrets": endpoint_secrets([engines[0]]),
                "max_model_len": 2048,
                "role": "stable",
            },
            {
                "version_id": candidate.pk,
                "label": candidate.label,
                "weight": SHARE,
                "endpoints": [engines[1]],
                "endpoint_secrets": endpoint_secrets([engines[1]]),
                "max_model_len": 2048,
                "role": "shadow",
            },
        ],
        tenant_weights=tenant_weights,
        client=client,
    )


def shadow_counts(url: str) -> dict[str, float]:
    samples = scrape(url)
    counts = {
        outcome: samples.get(
            ("gateway_shadow_requests_total", frozenset({("outcome", outcome)})), 0.0
        )
        for outcome in ("sent", "failed", "dropped")
    }
    counts["in_flight"] = samples[("gateway_shadow_requests_in_flight", frozenset())]
    return counts


def ask(client: openai.OpenAI, index: int) -> None:
    """One request, streamed or not by turns; it must succeed."""
    if index % 2:
        chunks = list(
            client.chat.completions.create(
                model="smollm2",
                messages=MESSAGES,
                max_tokens=2,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks
    else:
        response = client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert response.choices[0].finish_reason == "length"


def rate_limit_counts(client: redis.Redis, tenant_id: int, kind: str) -> int:
    return sum(
        int(client.get(key) or 0) for key in client.keys(f"ratelimit:{{{tenant_id}}}:{kind}:*")
    )


def test_mirrored_requests_are_the_candidates_samples_and_never_the_tenants_usage(
    stores, engines, gateways
) -> None:
    setup = make_setup(prompt_logging="full")
    stable, candidate = setup.versions
    gateway = gateways[0]
    # A table an earlier test left in the gateway's memory goes first (Redis is empty).
    wait_for_model(gateway, setup.raw_key, "smollm2", present=False)
    publish(setup, engines, stores)
    wait_for_model(gateway, setup.raw_key, "smollm2")
    before = shadow_counts(gateway.url)
    client = client_for(gateway, setup.raw_key)

    for index in range(REQUESTS):
        ask(client, index)
    wait_until(
        lambda: shadow_counts(gateway.url)["in_flight"] == 0,
        timeout=60,
        message="mirrored requests still under way",
    )
    after = shadow_counts(gateway.url)
    mirrored = after["sent"] - before["sent"]
    assert (after["failed"] - before["failed"], after["dropped"] - before["dropped"]) == (0, 0)
    assert LOW <= mirrored <= HIGH, (mirrored, LOW, HIGH)

    records = wait_for_records(stores, REQUESTS + int(mirrored))
    answered = [r for r in records if not r.is_shadow]
    copies = [r for r in records if r.is_shadow]
    # Every client was answered by the stable version's engine.
    assert len(answered) == REQUESTS
    assert {(r.version_id, r.agent, r.status) for r in answered} == {(stable.pk, engines[0], 200)}
    # Each copy is the candidate's, on its engine, under the tenant, without its text.
    assert len(copies) == mirrored
    assert {(r.version_id, r.agent, r.status, r.tenant_id) for r in copies} == {
        (candidate.pk, engines[1], 200, setup.tenant.pk)
    }
    assert all(r.prompt is None and r.completion is None for r in copies)
    assert all(r.completion_tokens == 2 and r.usage_source == "engine" for r in copies)
    assert all(r.ttft_s is not None for r in copies if r.is_stream)
    assert not {r.request_id for r in copies} & {r.request_id for r in answered}

    # Limits and usage count the client's requests only.
    assert rate_limit_counts(stores, setup.tenant.pk, "r") == REQUESTS
    assert rate_limit_counts(stores, setup.tenant.pk, "t") == sum(
        r.prompt_tokens + r.completion_tokens for r in answered
    )
    ingest_all(stores)
    usage = UsageRecord.objects.filter(tenant=setup.tenant)
    assert set(usage.values_list("version_id", flat=True)) == {stable.pk}
    assert sum(usage.values_list("requests", flat=True)) == REQUESTS
    shadow_samples = RequestSample.objects.filter(tenant=setup.tenant, is_shadow=True)
    assert shadow_samples.count() == mirrored
    assert set(shadow_samples.values_list("version_id", "is_error")) == {(candidate.pk, False)}
    assert RequestSample.objects.filter(tenant=setup.tenant, is_shadow=False).count() == REQUESTS
    assert PromptRecord.objects.filter(tenant=setup.tenant).count() == REQUESTS


def test_a_refused_request_is_never_mirrored(stores, engines, gateways) -> None:
    setup = make_setup(requests_per_minute=1)
    gateway = gateways[0]
    wait_for_model(gateway, setup.raw_key, "smollm2", present=False)
    # This tenant's every admitted request is mirrored (a tenant-scoped share of 100 %).
    stable, candidate = setup.versions
    publish(setup, engines, stores, **{setup.tenant.slug: {stable.pk: 100, candidate.pk: 100}})
    wait_for_model(gateway, setup.raw_key, "smollm2")
    wait_for_fresh_window(stores, needed_s=15)
    before = shadow_counts(gateway.url)
    client = client_for(gateway, setup.raw_key)

    ask(client, 0)
    with pytest.raises(openai.RateLimitError):
        ask(client, 1)
    wait_until(lambda: shadow_counts(gateway.url)["in_flight"] == 0, timeout=60)

    after = shadow_counts(gateway.url)
    assert after["sent"] - before["sent"] == 1
    records: list[RequestRecord] = wait_for_records(stores, 2)
    assert sorted((r.version_id, r.is_shadow) for r in stream_records(stores)) == [
        (stable.pk, False),
        (candidate.pk, True),
    ]
    assert len(records) == 2
