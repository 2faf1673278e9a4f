"""The standalone gateway's probes and metrics (controlplane/gateway/probes.py), through
its ASGI application with the real Redis."""

import asyncio

import httpx
import pytest
from django.test import override_settings

from controlplane.gateway.app import Gateway
from controlplane.gateway.probes import with_probes

pytestmark = pytest.mark.django_db(transaction=True)


def probe(gateway: Gateway, *requests: tuple[str, str]) -> list[httpx.Response]:
    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=with_probes(gateway))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            answers = [await client.request(method, path) for method, path in requests]
            if gateway.is_started:
                await gateway.stop()
            return answers

    return asyncio.run(scenario())


def test_probes_answer_before_and_after_start(redis_client, tmp_path) -> None:
    with override_settings(GATEWAY_SPOOL_DIR=tmp_path / "spool"):
        gateway = Gateway()
        health, ready, metrics, post = probe(
            gateway, ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"),
            ("POST", "/healthz"),
        )  # fmt: skip
    assert health.status_code == 200
    # The first tenant request (or the lifespan) starts the gateway: not ready before.
    assert (ready.status_code, ready.json()) == (503, {"status": "unready", "reason": "starting"})
    assert metrics.status_code == 200
    assert "gateway_requests_total" in metrics.text
    assert post.status_code == 405


def test_ready_once_started(redis_client, tmp_path) -> None:
    async def scenario() -> tuple[int, dict]:
        gateway = Gateway()
        await gateway.start()
        try:
            transport = httpx.ASGITransport(app=with_probes(gateway))
            async with httpx.AsyncClient(transport=transport, base_url="http://g") as client:
                response = await client.get("/readyz")
                return response.status_code, response.json()
        finally:
            await gateway.stop()

    with override_settings(GATEWAY_SPOOL_DIR=tmp_path / "spool"):
        assert asyncio.run(scenario()) == (200, {"status": "ready"})
