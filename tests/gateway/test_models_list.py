"""GET /v1/models lists a model once it can be served: a routing table published before any
engine of its deployment is ready (no endpoints) lists nothing yet."""

import asyncio

import httpx
import pytest
from django.conf import settings
from django.test import override_settings

from controlplane.core.redis_clients import redis_client as make_redis_client
from controlplane.gateway.app import Gateway
from controlplane.rollouts.routing import routing_table_publish
from tests.gateway.conftest import endpoint_secrets, make_setup

pytestmark = pytest.mark.django_db(transaction=True)


def listed(raw_key: str) -> list[str]:
    async def scenario() -> list[str]:
        gateway = Gateway()  # a fresh one reads every routing table at start
        await gateway.start()
        try:
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
                response = await client.get(
                    "/v1/models", headers={"Authorization": f"Bearer {raw_key}"}
                )
                assert response.status_code == 200
                return [model["id"] for model in response.json()["data"]]
        finally:
            await gateway.stop()

    return asyncio.run(scenario())


def publish(version, endpoints: list[str]) -> None:
    client = make_redis_client(url=settings.REDIS_URL)
    routing_table_publish(
        deployment="smollm2",
        model="smollm2",
        versions=[
            {
                "version_id": version.pk,
                "label": version.label,
                "weight": 100,
                "endpoints": endpoints,
                "endpoint_secrets": endpoint_secrets(endpoints),
                "max_model_len": version.serving_config["max_model_len"],
            }
        ],
        client=client,
    )
    client.close()


def test_a_model_is_listed_once_an_engine_serves_it(redis_client, tmp_path) -> None:
    setup = make_setup()
    with override_settings(GATEWAY_SPOOL_DIR=tmp_path / "spool"):
        publish(setup.versions[0], [])
        assert listed(setup.raw_key) == []
        publish(setup.versions[0], ["http://127.0.0.1:9"])
        assert listed(setup.raw_key) == ["smollm2"]
