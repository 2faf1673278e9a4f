"""The standalone gateway process (`uvicorn controlplane.gateway.asgi:application`) serves
its own /metrics: the series named in docs/metrics.md exist and move when what they count
happens (a refused key, a stream's first token, a tenant limit, an unreachable agent)."""

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.agent.test_agent_processes import scrape
from tests.conftest import stop_process, wait_until
from tests.gateway.conftest import (
    client_for,
    free_port,
    make_setup,
    route_wholly,
    start_gateway,
    wait_for_model,
)

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
UNKNOWN = {"model": "unknown", "version": "unknown"}


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def scrape_once_counted(url: str, before: dict, requests: int) -> dict:
    """The metrics once `requests` more requests are counted: the gateway counts one after
    its last byte is sent (and its admission is back), so a client that has read the end
    of its response can scrape before the count."""
    after: dict = {}

    def counted() -> bool:
        nonlocal after
        after = scrape(url)
        total = sum(
            value - before.get(key, 0.0)
            for key, value in after.items()
            if key[0] == "gateway_requests_total"
        )
        return total >= requests

    wait_until(counted, timeout=15, interval=0.1, message=lambda: "the requests were not counted")
    return after


def test_the_standalone_gateway_counts_refusals_latencies_and_upstream_errors(
    stores, engines, tmp_path
) -> None:
    setup = make_setup()
    version = setup.versions[0]
    route_wholly(version, engines[0], stores)
    gateway = start_gateway(
        tmp_path, tmp_path / "spool", application="controlplane.gateway.asgi:application"
    )
    try:
        wait_for_model(gateway, setup.raw_key, "smollm2")
        routed = {"model": "smollm2", "version": str(version.pk)}
        before = scrape(gateway.url)
        for name in ("requests", "tokens"):
            assert ("gateway_rate_limited_total", frozenset({("limit", name)})) in before

        # A refused key.
        refused = httpx.get(
            f"{gateway.url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=5
        )
        assert refused.status_code == 401
        # A stream, then a whole response.
        client = client_for(gateway, setup.raw_key)
        chunks = list(
            client.chat.completions.create(
                model="smollm2",
                messages=MESSAGES,
                max_tokens=4,
                stream=True,
                temperature=0,  # greedy: plain words, never a token that is half a character
                extra_body={"ignore_eos": True},
            )
        )
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 4
        client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=2, extra_body={"ignore_eos": True}
        )
        # A request no window of a small tokens-per-minute limit would admit.
        small = make_setup(tokens_per_minute=100)
        with pytest.raises(openai.RateLimitError):
            client_for(gateway, small.raw_key).chat.completions.create(
                model="smollm2", messages=MESSAGES, max_tokens=500
            )
        after = scrape_once_counted(gateway.url, before, 4)

        assert moved(before, after, "gateway_requests_total", status="401") == 1
        assert moved(before, after, "gateway_requests_total", status="200") == 2
        assert moved(before, after, "gateway_requests_total", status="429") == 1
        duration = "gateway_request_duration_seconds_count"
        assert moved(before, after, duration, **UNKNOWN, outcome="client_error") == 1
        assert moved(before, after, duration, **routed, outcome="ok") == 2
        assert moved(before, after, duration, **routed, outcome="rate_limited") == 1
        # Time to first token: the stream's and the whole response's.
        assert moved(before, after, "gateway_time_to_first_token_seconds_count", **routed) == 2
        first_token_s = moved(before, after, "gateway_time_to_first_token_seconds_sum", **routed)
        assert first_token_s > 0
        # Four tokens streamed: three gaps between them.
        assert moved(before, after, "gateway_inter_token_latency_seconds_count", **routed) == 3
        assert moved(before, after, "gateway_rate_limited_total", limit="tokens") == 1
        assert moved(before, after, "gateway_rate_limited_total", limit="requests") == 0

        # Its only agent stops answering: each request fails with no_ready_agent.
        route_wholly(version, f"http://127.0.0.1:{free_port()}", stores)
        statuses: list[int] = []

        def unanswered() -> bool:
            try:
                client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
                statuses.append(200)
            except openai.APIStatusError as error:
                statuses.append(error.status_code)
            return statuses[-1] == 503

        wait_until(unanswered, timeout=15, interval=0.1, message=lambda: f"{statuses}")
        final = scrape_once_counted(gateway.url, after, len(statuses))
        errors = "gateway_upstream_errors_total"
        assert moved(after, final, errors, **routed, reason="no_ready_agent") == 1
        assert moved(after, final, duration, **routed, outcome="upstream_error") == 1
        assert moved(after, final, "gateway_requests_total", status="503") == 1
    finally:
        stop_process(gateway.process)


def test_the_gateway_inside_web_shares_webs_metrics(stores, engines, gateways) -> None:
    setup = make_setup()
    version = setup.versions[0]
    route_wholly(version, engines[0], stores)
    web = gateways[0]
    wait_for_model(web, setup.raw_key, "smollm2")
    routed = {"model": "smollm2", "version": str(version.pk)}
    before = scrape(web.url)
    list(
        client_for(web, setup.raw_key).chat.completions.create(
            model="smollm2",
            messages=MESSAGES,
            max_tokens=2,
            stream=True,
            # greedy: at temperature 1 SmolLM2 opens with an emoji one time in ten, two
            # tokens of one character that stream no text, and so no first token
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    )
    after = scrape_once_counted(web.url, before, 1)
    assert moved(before, after, "gateway_time_to_first_token_seconds_count", **routed) == 1
    # web's own decisions, from the database, on the same page
    assert ("rollouts_reconcile_lag_seconds", frozenset()) in after
