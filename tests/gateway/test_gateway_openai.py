"""The gateway through the official OpenAI client, against real engines and real stores."""

import concurrent.futures
import math

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from contracts.routing import REQUESTS_STREAM
from controlplane.rollouts.routing import routing_table_publish
from controlplane.telemetry.models import RequestSample
from controlplane.tenants.models import UsageRecord
from tests.conftest import wait_until
from tests.gateway.conftest import (
    client_for,
    endpoint_secrets,
    error_body,
    ingest_all,
    make_setup,
    stream_records,
    usage_of,
    wait_for_fresh_window,
    wait_for_model,
    wait_for_records,
)

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


def publish(setup, weights, endpoints, **options):
    return routing_table_publish(
        deployment=setup.model.name,
        model=setup.model.name,
        versions=[
            {
                "version_id": version.pk,
                "label": version.label,
                "weight": weight,
                "endpoints": endpoint_list,
                "endpoint_secrets": endpoint_secrets(endpoint_list),
                "max_model_len": version.serving_config["max_model_len"],
            }
            for version, weight, endpoint_list in zip(
                setup.versions, weights, endpoints, strict=True
            )
        ],
        **options,
    )


def usage_totals(tenant) -> tuple[int, int, int, int]:
    rows = UsageRecord.objects.filter(tenant=tenant)
    return (
        sum(r.requests for r in rows),
        sum(r.prompt_tokens for r in rows),
        sum(r.completion_tokens for r in rows),
        sum(r.errors for r in rows),
    )


def test_streaming_and_plain_chat_are_metered_exactly(stores, engines, gateways) -> None:
    setup = make_setup()
    publish(setup, [100, 0], [[engines[0]], [engines[1]]])
    gateway = gateways[0]
    wait_for_model(gateway, setup.raw_key, "smollm2")
    client = client_for(gateway, setup.raw_key)

    # Streamed, without include_usage: the gateway asks the engine for usage and strips it.
    chunks = list(
        client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=6, stream=True, temperature=0
        )
    )
    assert all(chunk.usage is None for chunk in chunks)
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-1].choices[0].finish_reason == "length"

    # Streamed with include_usage: the client gets the usage chunk.
    with_usage = list(
        client.chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},  # exactly 5, whatever it samples
        )
    )
    usage_chunk = with_usage[-1]
    assert usage_chunk.choices == []
    assert usage_of(usage_chunk).completion_tokens == 5

    # Not streamed.
    plain = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert usage_of(plain).completion_tokens == 4
    assert plain.choices[0].message.content

    # Legacy completions.
    completion = client.completions.create(
        model="smollm2", prompt="Paris is", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert usage_of(completion).completion_tokens == 3

    records = wait_for_records(stores, 4)
    assert [r.status for r in records] == [200, 200, 200, 200]
    assert [r.is_stream for r in records] == [True, True, False, False]
    assert {r.version_id for r in records} == {setup.versions[0].pk}
    assert {r.agent for r in records} == {engines[0]}
    assert {r.usage_source for r in records} == {"engine"}
    assert records[0].completion_tokens == len(content_chunks) == 6
    assert records[0].ttft_s is not None and records[0].ttft_s <= records[0].e2e_s
    assert records[0].itl_mean_s is not None and records[0].itl_p95_s is not None
    assert records[2].ttft_s is None
    assert records[0].prompt is None and records[0].completion is None  # policy: off

    ingest_all(stores)
    expected_prompt = (
        records[0].prompt_tokens
        + usage_of(usage_chunk).prompt_tokens
        + usage_of(plain).prompt_tokens
        + usage_of(completion).prompt_tokens
    )
    assert usage_totals(setup.tenant) == (4, expected_prompt, 6 + 5 + 4 + 3, 0)
    assert RequestSample.objects.filter(tenant=setup.tenant).count() == 4


def test_replayed_entries_are_not_counted_twice(stores, engines, gateways) -> None:
    setup = make_setup()
    publish(setup, [100, 0], [[engines[0]], []])
    wait_for_model(gateways[1], setup.raw_key, "smollm2")
    client = client_for(gateways[1], setup.raw_key)
    responses = [
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2)
        for _ in range(3)
    ]
    wait_for_records(stores, 3)
    ingest_all(stores)
    totals = usage_totals(setup.tenant)
    assert totals == (
        3,
        sum(usage_of(r).prompt_tokens for r in responses),
        sum(usage_of(r).completion_tokens for r in responses),
        0,
    )
    # Redelivery: the very same entries written again (a spool replay, a retried XADD).
    for _, fields in stores.xrange(REQUESTS_STREAM):
        stores.xadd(REQUESTS_STREAM, fields)
    ingest_all(stores)
    assert usage_totals(setup.tenant) == totals
    assert RequestSample.objects.filter(tenant=setup.tenant).count() == 3


def test_error_statuses_in_openai_shape(stores, engines, gateways) -> None:
    setup = make_setup(requests_per_minute=2)
    other = make_setup(model_name="secret-model", version_count=1)
    publish(setup, [100, 0], [[engines[0]], []])
    routing_table_publish(
        deployment="secret-model",
        model="secret-model",
        versions=[
            {
                "version_id": other.versions[0].pk,
                "label": "v1",
                "weight": 100,
                "endpoints": [engines[1]],
                "endpoint_secrets": endpoint_secrets([engines[1]]),
            }
        ],
    )
    gateway = gateways[0]
    wait_for_model(gateway, setup.raw_key, "smollm2")
    wait_for_model(gateway, other.raw_key, "secret-model")
    wait_for_fresh_window(stores, needed_s=15)
    client = client_for(gateway, setup.raw_key)

    with pytest.raises(openai.AuthenticationError) as bad_key:
        client_for(gateway, "sk-not-a-key").chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=1
        )
    assert bad_key.value.status_code == 401
    assert error_body(bad_key.value)["code"] == "invalid_api_key"

    # A model that is deployed but not the tenant's answers exactly as one that does not
    # exist (a key learns nothing of other tenants' models); nothing is counted or routed.
    answers = {}
    for model in ("secret-model", "no-such-model"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
        answers[model] = (missing.value.status_code, error_body(missing.value))
    assert answers["secret-model"] == (
        404,
        {
            "message": "The model 'secret-model' does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        },
    )
    assert answers["no-such-model"][1]["code"] == "model_not_found"
    assert answers["no-such-model"][1]["message"] == "The model 'no-such-model' does not exist."
    assert [m.id for m in client.models.list()] == ["smollm2"]
    assert stores.xlen(REQUESTS_STREAM) == 0

    client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
    client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
    assert error_body(limited.value)["code"] == "rate_limit_exceeded"
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60

    # No ready agent: the only weighted version has no endpoints.
    routing_table_publish(
        deployment="secret-model",
        model="secret-model",
        versions=[
            {"version_id": other.versions[0].pk, "label": "v1", "weight": 100, "endpoints": []}
        ],
    )
    other_client = client_for(gateway, other.raw_key)

    def is_unavailable() -> bool:
        try:
            other_client.chat.completions.create(
                model="secret-model", messages=MESSAGES, max_tokens=1
            )
        except openai.InternalServerError as exc:
            assert exc.status_code == 503
            assert error_body(exc)["code"] == "no_ready_agent"
            return True
        return False

    wait_until(is_unavailable, timeout=10, interval=0.1)
    records = stream_records(stores)
    assert [r.tenant_id for r in records] == [setup.tenant.pk] * 2


def test_limits_hold_across_two_gateway_processes(stores, engines, gateways) -> None:
    setup = make_setup(requests_per_minute=5)
    publish(setup, [100, 0], [[engines[0]], []])
    for gateway in gateways:
        wait_for_model(gateway, setup.raw_key, "smollm2")
    wait_for_fresh_window(stores, needed_s=20)
    clients = [client_for(gateway, setup.raw_key) for gateway in gateways]
    outcomes = []
    for index in range(12):
        try:
            clients[index % 2].chat.completions.create(
                model="smollm2", messages=MESSAGES, max_tokens=1
            )
            outcomes.append(200)
        except openai.RateLimitError:
            outcomes.append(429)
    assert outcomes == [200] * 5 + [429] * 7
    assert len(wait_for_records(stores, 5)) == 5


def test_tokens_per_minute_limit(stores, engines, gateways) -> None:
    # Each call reserves the most it can use (its prompt's bound plus max_tokens); what it
    # did not use is given back before the client's next call is admitted.
    setup = make_setup(tokens_per_minute=200)
    publish(setup, [100, 0], [[engines[0]], []])
    wait_for_model(gateways[0], setup.raw_key, "smollm2")
    wait_for_fresh_window(stores, needed_s=20)
    client = client_for(gateways[0], setup.raw_key)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=500)
    assert error_body(limited.value)["type"] == "tokens"
    assert not stores.keys(f"ratelimit:{{{setup.tenant.pk}}}:*")  # refused: no trace
    used = 0
    while True:
        try:
            response = client.chat.completions.create(
                model="smollm2", messages=MESSAGES, max_tokens=2
            )
        except openai.RateLimitError:
            break
        used += usage_of(response).total_tokens
        assert used <= 200
    assert used > 0
    # The window counts exactly what was served: every settlement landed before the refusal.
    seconds, _ = stores.time()
    window = seconds - seconds % 60
    assert int(stores.get(f"ratelimit:{{{setup.tenant.pk}}}:t:{window}")) == used


def test_a_request_without_max_tokens_reserves_the_whole_context(stores, engines, gateways):
    # Without max_tokens a chat completion may fill its version's context (2048 tokens),
    # which a tenant allowed 1000 tokens a minute cannot afford; with max_tokens it can.
    setup = make_setup(tokens_per_minute=1000)
    publish(setup, [100, 0], [[engines[0]], []])
    wait_for_model(gateways[0], setup.raw_key, "smollm2")
    wait_for_fresh_window(stores, needed_s=20)
    client = client_for(gateways[0], setup.raw_key)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="smollm2", messages=MESSAGES)
    assert error_body(limited.value)["type"] == "tokens"
    assert error_body(limited.value)["code"] == "request_exceeds_token_limit"
    assert "up to 2048 tokens" in error_body(limited.value)["message"]
    assert "retry-after" not in limited.value.response.headers
    response = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4)
    assert usage_of(response).completion_tokens <= 4


def test_a_stream_refused_while_its_request_is_under_way_leaves_no_trace(
    stores, engines, gateways
) -> None:
    # A tenant far below its limits has its streams sent to the agent while the admission
    # is on its way; when Redis refuses after all (other gateways used the rest), the
    # client gets the 429 and no byte of the stream, and nothing is counted.
    setup = make_setup(requests_per_minute=10)
    publish(setup, [100, 0], [[engines[0]], []])
    gateway = gateways[0]
    wait_for_model(gateway, setup.raw_key, "smollm2")
    wait_for_fresh_window(stores, needed_s=20)
    client = client_for(gateway, setup.raw_key)
    list(
        client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=1, stream=True
        )
    )  # 1 of 10: the gateway now knows the tenant is far below its limits
    # Its entry is written with its token settlement, in one batch, after the response.
    wait_for_records(stores, 1)
    seconds, _ = stores.time()
    prefix = f"ratelimit:{{{setup.tenant.pk}}}:"
    window = seconds - seconds % 60
    stores.set(f"{prefix}r:{window}", 10)  # what other gateways used meanwhile
    tokens_used = int(stores.get(f"{prefix}t:{window}"))

    with pytest.raises(openai.RateLimitError) as limited:
        list(
            client.chat.completions.create(
                model="smollm2", messages=MESSAGES, max_tokens=50, stream=True
            )
        )
    assert error_body(limited.value)["type"] == "requests"
    assert (int(stores.get(f"{prefix}r:{window}")), int(stores.get(f"{prefix}t:{window}"))) == (
        10,
        tokens_used,
    )
    (record,) = wait_for_records(stores, 1)
    assert record.status == 200  # the first request's entry only
    ingest_all(stores)
    assert usage_totals(setup.tenant)[0] == 1


def test_weights_are_honoured(stores, engines, gateways) -> None:
    setup = make_setup()
    gateway = gateways[0]
    client = client_for(gateway, setup.raw_key)

    def run(count: int) -> list[int]:
        stores.delete(REQUESTS_STREAM)
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            list(
                pool.map(
                    lambda _: client.chat.completions.create(
                        model="smollm2", messages=MESSAGES, max_tokens=1
                    ),
                    range(count),
                )
            )
        return [r.version_id for r in wait_for_records(stores, count)]

    first, second = setup.versions
    publish(setup, [0, 100], [[engines[0]], [engines[1]]])
    wait_for_model(gateway, setup.raw_key, "smollm2")
    assert set(run(30)) == {second.pk}

    publish(setup, [50, 50], [[engines[0]], [engines[1]]])
    # The new table reaches the gateway by pub/sub; wait until a draw lands on `first`.
    wait_until(lambda: first.pk in run(4), timeout=10, interval=0)
    n = 160
    picks = run(n)
    on_first = picks.count(first.pk)
    # Binomial(160, 0.5): sd 6.3; 6 sd either side fails with probability ~2e-9.
    bound = 6 * math.sqrt(n * 0.25)
    assert abs(on_first - n / 2) <= bound, on_first
    records = stream_records(stores)
    assert {r.agent for r in records if r.version_id == first.pk} == {engines[0]}
    assert {r.agent for r in records if r.version_id == second.pk} == {engines[1]}


def test_session_affinity_keeps_a_session_on_one_version(stores, engines, gateways) -> None:
    setup = make_setup()
    publish(setup, [50, 50], [[engines[0]], [engines[1]]], affinity="session")
    gateway = gateways[1]
    wait_for_model(gateway, setup.raw_key, "smollm2")
    seen: dict[str, set[str]] = {}
    for session in ("alpha", "beta", "gamma"):
        for _ in range(2):
            response = httpx.post(
                f"{gateway.url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {setup.raw_key}", "X-Session-Id": session},
                json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 1},
                timeout=60,
            )
            assert response.status_code == 200
            seen.setdefault(session, set()).add(response.headers["x-request-id"])
    records = {r.request_id: r.version_id for r in wait_for_records(stores, 6)}
    for request_ids in seen.values():
        assert len({records[request_id] for request_id in request_ids}) == 1


def test_a_refusing_agent_is_retried_on_another_of_the_same_version(
    stores, engines, gateways
) -> None:
    setup = make_setup()
    dead = "http://127.0.0.1:9"  # discard port: nothing listens, the connect is refused
    publish(setup, [100, 0], [[dead, engines[0]], [engines[1]]])
    wait_for_model(gateways[0], setup.raw_key, "smollm2")
    client = client_for(gateways[0], setup.raw_key)
    # The two agents tie on outstanding requests, so each request draws the dead one first
    # with probability 1/2: 20 requests miss it every time once in a million runs.
    for _ in range(20):
        client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
    records = wait_for_records(stores, 20)
    assert {(r.status, r.agent, r.version_id) for r in records} == {
        (200, engines[0], setup.versions[0].pk)
    }
    assert any(r.attempts == 2 for r in records)


def test_client_disconnect_cancels_the_stream(stores, engines, gateways) -> None:
    setup = make_setup()
    publish(setup, [100, 0], [[engines[0]], []])
    wait_for_model(gateways[0], setup.raw_key, "smollm2")
    client = client_for(gateways[0], setup.raw_key)
    stream = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=400, stream=True
    )
    for index, _ in enumerate(stream):
        if index == 2:
            break
    stream.close()
    (record,) = wait_for_records(stores, 1)
    assert record.status == 499
    assert record.completion_tokens < 400


def test_prompts_are_kept_only_when_the_policy_says_so(stores, engines, gateways) -> None:
    from controlplane.telemetry.models import PromptRecord

    keeps = make_setup(prompt_logging="full")
    publish(keeps, [100, 0], [[engines[0]], []])
    wait_for_model(gateways[0], keeps.raw_key, "smollm2")
    answer = client_for(gateways[0], keeps.raw_key).chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=3
    )
    (record,) = wait_for_records(stores, 1)
    assert record.prompt == MESSAGES[0]["content"]
    assert record.completion == answer.choices[0].message.content
    ingest_all(stores)
    kept = PromptRecord.objects.get(tenant=keeps.tenant)
    assert kept.completion == answer.choices[0].message.content
