"""A flood of made-up keys: throttled per address, never evicting a real key's grant."""

import asyncio

import httpx
import pytest

from controlplane.gateway import caches
from controlplane.gateway.auth_throttle import AuthFailures
from controlplane.gateway.caches import KeyCache
from controlplane.gateway.selectors import KeyGrant
from tests.gateway.conftest import (
    make_setup,
    route_wholly,
    start_gateway,
    stop_gateway,
    wait_for_model,
)

GRANT = KeyGrant(
    key_id=1,
    tenant_id=1,
    tenant_slug="acme",
    scopes=frozenset({"chat"}),
    allowed_models=frozenset({"smollm2"}),
    requests_per_minute=60,
    tokens_per_minute=1000,
    is_prompt_logging=False,
    expires_at=None,
)


def test_made_up_keys_never_evict_a_grant_and_are_looked_up_once_each() -> None:
    lookups: list[str] = []

    def lookup(raw_key: str) -> KeyGrant | None:  # the database's answer, counted
        lookups.append(raw_key)
        return GRANT if raw_key == "sk-real" else None

    async def scenario() -> tuple[KeyGrant | None, KeyGrant | None]:
        cache = KeyCache(ttl_s=60, lookup=lookup)
        assert await cache.get("sk-real") is GRANT
        for index in range(caches.MAX_UNKNOWN * 3):
            assert await cache.get(f"sk-fake-{index}") is None
        again = await cache.get("sk-fake-0", may_look_up=False)  # not in memory: no lookup
        return await cache.get("sk-real"), again

    real, again = asyncio.run(scenario())
    assert real is GRANT and again is None
    assert lookups.count("sk-real") == 1  # its grant survived 30,000 unknown keys
    assert len(lookups) == 1 + caches.MAX_UNKNOWN * 3


def test_an_address_with_too_many_failures_waits_for_its_window() -> None:
    failures = AuthFailures(limit=3, window_s=60)
    for second in range(3):
        assert failures.retry_after_s("10.0.0.1", now=100.0 + second) is None
        failures.record("10.0.0.1", now=100.0 + second)
    assert failures.retry_after_s("10.0.0.1", now=103.0) == pytest.approx(57.0)
    assert failures.retry_after_s("10.0.0.2", now=103.0) is None  # another address
    assert failures.retry_after_s("10.0.0.1", now=160.0) is None  # a new window


def test_the_gateway_throttles_key_guessing_and_still_serves_known_keys(
    stores, engines, tmp_path
) -> None:
    gateway = start_gateway(tmp_path, tmp_path / "spool", GATEWAY_AUTH_FAILURES_PER_MINUTE="5")
    try:
        setup = make_setup()
        route_wholly(setup.versions[0], engines[0])
        wait_for_model(gateway, setup.raw_key, "smollm2")  # its grant is now in memory

        def models(key: str) -> httpx.Response:
            return httpx.get(
                f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10
            )

        statuses = [models(f"sk-guess-{index}").status_code for index in range(8)]
        assert statuses == [401] * 5 + [429] * 3
        throttled = models("sk-guess-99")
        assert throttled.json()["error"]["code"] == "too_many_failed_authentications"
        assert 1 <= int(throttled.headers["retry-after"]) <= 60
        assert models(setup.raw_key).status_code == 200  # the known key is still served
    finally:
        stop_gateway(gateway)
