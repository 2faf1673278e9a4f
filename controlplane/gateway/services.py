"""Writes for the gateways: telling them to forget cached key grants."""

import redis

from controlplane.core.redis_clients import redis_client

INVALIDATE_CHANNEL = "gateway:invalidate"


def gateway_cache_invalidate(
    *, tenant_id: int | None = None, client: redis.Redis | None = None
) -> None:
    """Tell every gateway to forget cached key grants (of one tenant, or all).

    Call after commit when a key is revoked or a tenant's limits, models or policy change.
    """
    client = client or redis_client()
    client.publish(INVALIDATE_CHANNEL, "all" if tenant_id is None else f"tenant:{tenant_id}")
