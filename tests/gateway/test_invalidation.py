"""Tenant writes reach the gateways at once: a revoked key or a paused tenant is refused
long before the cached grant would expire (the `gateway:invalidate` channel)."""

import httpx
import pytest

from controlplane.tenants.models import ApiKey
from controlplane.tenants.services import api_key_revoke, tenant_update
from tests.conftest import wait_until
from tests.gateway.conftest import (
    make_setup,
    route_wholly,
    start_gateway,
    stop_gateway,
    wait_for_model,
)

pytestmark = pytest.mark.slow

# Long enough that only the invalidation message can explain a refusal within the test.
CACHE_TTL_S = "600"


def status_for(url: str, raw_key: str) -> int:
    headers = {"Authorization": f"Bearer {raw_key}"}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=10).status_code


def test_revoking_a_key_or_pausing_a_tenant_is_seen_by_a_gateway_at_once(
    stores, engines, tmp_path
) -> None:
    gateway = start_gateway(tmp_path, tmp_path / "spool", GATEWAY_KEY_CACHE_TTL_S=CACHE_TTL_S)
    try:
        revoked, paused, bystander = make_setup(), make_setup(), make_setup()
        route_wholly(revoked.versions[0], engines[0])
        for setup in (revoked, paused, bystander):
            wait_for_model(gateway, setup.raw_key, "smollm2")  # each grant is now cached

        api_key_revoke(actor=None, key=ApiKey.objects.get(tenant=revoked.tenant))
        tenant_update(actor=None, tenant=paused.tenant, is_active=False, reason="paused")

        for setup in (revoked, paused):
            wait_until(
                lambda setup=setup: status_for(gateway.url, setup.raw_key) == 401,
                timeout=10,
                message="the gateway still serves a key it was told to forget",
            )
        assert status_for(gateway.url, bystander.raw_key) == 200
    finally:
        stop_gateway(gateway)
