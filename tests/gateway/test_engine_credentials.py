"""The gateway presents each engine's serving secret from the routing table; an engine
that refuses it is another agent's turn, never a 401 for the tenant."""

import secrets

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from controlplane.rollouts.routing import routing_table_publish
from tests.conftest import wait_until
from tests.gateway.conftest import (
    ENGINE_SECRETS,
    client_for,
    error_body,
    make_setup,
    serving_headers,
    wait_for_model,
)

pytestmark = pytest.mark.slow

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi"}]


def refused_by(engine: str) -> float:
    text = httpx.get(f"{engine}/metrics", headers=serving_headers(engine), timeout=10).text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "engine:unauthorized_requests_total"
        and sample.labels == {"scope": "serving"}
    )


def test_a_refused_serving_secret_is_retried_elsewhere_and_never_reaches_the_tenant(
    stores, engines, gateways
) -> None:
    setup = make_setup()
    version = setup.versions[0]
    stale = secrets.token_hex(32)  # a secret the engine does not hold (an older load's)

    def publish(secrets_by_endpoint: dict[str, str]) -> None:
        routing_table_publish(
            deployment="smollm2",
            model="smollm2",
            versions=[
                {
                    "version_id": version.pk,
                    "label": version.label,
                    "weight": 100,
                    "endpoints": list(secrets_by_endpoint),
                    "endpoint_secrets": secrets_by_endpoint,
                    "max_model_len": version.serving_config["max_model_len"],
                }
            ],
        )

    gateway = gateways[0]
    client = client_for(gateway, setup.raw_key)

    def answer() -> int | str:
        try:
            client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=1)
        except openai.APIStatusError as exc:
            return error_body(exc)["code"]
        return 200

    # The only engine refuses the table's secret: the tenant gets no_ready_agent (503).
    publish({engines[0]: stale})
    wait_for_model(gateway, setup.raw_key, "smollm2")
    before = refused_by(engines[0])
    wait_until(lambda: answer() == "no_ready_agent", timeout=15, message="stale table kept")
    seen = refused_by(engines[0])
    assert seen > before
    assert [answer() for _ in range(3)] == ["no_ready_agent"] * 3
    assert refused_by(engines[0]) == seen + 3  # one refused attempt each, no other engine

    # With a second engine whose secret is right, every request is served.
    publish({engines[0]: stale, engines[1]: ENGINE_SECRETS[engines[1]].serving})
    wait_until(lambda: answer() == 200, timeout=15, message="new table not read")
    assert [answer() for _ in range(4)] == [200] * 4
