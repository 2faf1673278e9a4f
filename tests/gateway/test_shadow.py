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
    free_port,
    ingest_all,
    make_setup,
    start_gateway,
    stop_gateway,
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


def publish(
    setup: Setup,
    engines: list[str],
    client: redis.Redis,
    *,
    share: int = SHARE,
    tenant_weights: dict[str, dict[int, int]] | None = None,
) -> None:
    """The stable version on the first engine answers; the candidate on the second (or
    `engines[1]`, whatever it is) is the shadow, mirrored `share` % of requests."""
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
                "weight": share,
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
    """One request, streamed or not by turns, greedy (sampled, two tokens may decode to no
    text, and a stream without text has no TTFT); it must succeed."""
    if index % 2:
        chunks = list(
            client.chat.completions.create(
                model="smollm2",
                messages=MESSAGES,
                max_tokens=2,
                temperature=0,  # the same two tokens, with text, every time
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks
    else:
        response = client.chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=2,
            temperature=0,
            extra_body={"ignore_eos": True},
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


def test_a_tenant_scoped_share_mirrors_that_tenant_only_and_never_a_refused_request(
    stores, engines, gateways
) -> None:
    setup = make_setup(requests_per_minute=1)
    other = make_setup()
    gateway = gateways[0]
    wait_for_model(gateway, setup.raw_key, "smollm2", present=False)
    # This tenant's every admitted request is mirrored; no one else's.
    stable, candidate = setup.versions
    scoped = {setup.tenant.slug: {stable.pk: 100, candidate.pk: 100}}
    publish(setup, engines, stores, share=0, tenant_weights=scoped)
    wait_for_model(gateway, setup.raw_key, "smollm2")
    wait_for_fresh_window(stores, needed_s=15)
    before = shadow_counts(gateway.url)

    ask(client_for(gateway, setup.raw_key), 0)
    with pytest.raises(openai.RateLimitError):  # refused by the tenant's limit
        ask(client_for(gateway, setup.raw_key), 1)
    for index in range(3):
        ask(client_for(gateway, other.raw_key), index)
    wait_until(lambda: shadow_counts(gateway.url)["in_flight"] == 0, timeout=60)

    after = shadow_counts(gateway.url)
    assert after["sent"] - before["sent"] == 1
    records: list[RequestRecord] = wait_for_records(stores, 5)
    assert sorted((r.tenant_id, r.version_id, r.is_shadow) for r in records) == sorted(
        [(setup.tenant.pk, stable.pk, False), (setup.tenant.pk, candidate.pk, True)]
        + [(other.tenant.pk, stable.pk, False)] * 3
    )


def test_a_shadow_that_fails_is_recorded_as_its_fault_and_the_client_never_sees_it(
    stores, engines, gateways
) -> None:
    setup = make_setup()
    stable, candidate = setup.versions
    gateway = gateways[0]
    wait_for_model(gateway, setup.raw_key, "smollm2", present=False)
    unreachable = f"http://127.0.0.1:{free_port()}"
    publish(setup, [engines[0], unreachable], stores, share=100)
    wait_for_model(gateway, setup.raw_key, "smollm2")
    before = shadow_counts(gateway.url)
    client = client_for(gateway, setup.raw_key)

    for index in range(4):
        ask(client, index)  # each answered by the stable version
    wait_until(lambda: shadow_counts(gateway.url)["in_flight"] == 0, timeout=60)

    after = shadow_counts(gateway.url)
    assert (after["sent"] - before["sent"], after["failed"] - before["failed"]) == (0, 4)
    records = wait_for_records(stores, 8)
    assert sorted((r.version_id, r.status, r.error_code, r.is_shadow) for r in records) == sorted(
        [(stable.pk, 200, "", False)] * 4 + [(candidate.pk, 503, "no_ready_agent", True)] * 4
    )
    ingest_all(stores)
    faults = RequestSample.objects.filter(version_id=candidate.pk, is_shadow=True, is_error=True)
    assert faults.count() == 4
    assert UsageRecord.objects.get(tenant=setup.tenant).errors == 0


def test_copies_beyond_the_bound_in_flight_are_dropped(stores, engines, tmp_path) -> None:
    setup = make_setup()
    gateway = start_gateway(tmp_path, tmp_path / "spool", GATEWAY_SHADOW_MAX_IN_FLIGHT="0")
    try:
        publish(setup, engines, stores, share=100)
        wait_for_model(gateway, setup.raw_key, "smollm2")
        before = shadow_counts(gateway.url)
        client = client_for(gateway, setup.raw_key)
        for index in range(3):
            ask(client, index)
        after = shadow_counts(gateway.url)
        assert (after["dropped"] - before["dropped"], after["sent"] - before["sent"]) == (3, 0)
        records = wait_for_records(stores, 3)
        assert [r.is_shadow for r in records] == [False] * 3
    finally:
        stop_gateway(gateway)
