"""Publication of the live routing tables the gateways read.

The reconciler is the one writer: `routing:<deployment>` holds the table (with an
increasing generation), `routing:deployments` indexes them, `routing:changed` announces
each change. Gateways only read (contracts.routing parses and checks what they read).
"""

import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from contracts import tracing
from contracts.routing import (
    ROUTING_CHANNEL,
    ROUTING_INDEX_KEY,
    Affinity,
    RoutingContractError,
    RoutingTable,
    VersionRoute,
    routing_key,
    routing_table_build,
)
from controlplane.core.errors import DomainError
from controlplane.core.redis_clients import redis_client


def routing_table_publish(
    *,
    deployment: str,
    model: str,
    versions: Sequence[VersionRoute | Mapping[str, Any]],
    affinity: Affinity | str = Affinity.NONE,
    tenant_weights: Mapping[str, Mapping[int, int]] | None = None,
    client: redis.Redis | None = None,
) -> RoutingTable:
    """Write the live routing table of a deployment and announce the change.

    `versions`: each a VersionRoute or a mapping with version_id, label, weight (0..100),
    endpoints (base URLs of ready agents), endpoint_secrets ({endpoint: its engine's
    serving secret}), max_model_len (0 or absent: not known) and role (stable, canary, or
    shadow: mirrored `weight` percent of requests, never answering; absent: not said).
    `tenant_weights`: {tenant slug: {version_id: weight}} for the tenants of a
    tenant-scoped stage.
    """
    routes = [
        item
        if isinstance(item, VersionRoute)
        else VersionRoute(
            version_id=item["version_id"],
            label=str(item.get("label", "")),
            weight=item["weight"],
            endpoints=tuple(item.get("endpoints", ())),
            max_model_len=item.get("max_model_len", 0),
            endpoint_secrets=dict(item.get("endpoint_secrets", {})),
            role=str(item.get("role", "")),
        )
        for item in versions
    ]
    own_client = client is None
    client = client or redis_client()
    try:
        return _publish(client, deployment, model, routes, affinity, tenant_weights)
    finally:
        if own_client:
            client.close()


@tracing.traced(__name__, "rollouts.routing.publish")
def _publish(
    client: redis.Redis,
    deployment: str,
    model: str,
    routes: list[VersionRoute],
    affinity: Affinity | str,
    tenant_weights: Mapping[str, Mapping[int, int]] | None,
) -> RoutingTable:
    try:
        table = routing_table_build(
            deployment=deployment,
            model=model,
            versions=routes,
            affinity=affinity,
            tenant_weights=tenant_weights,
        )
    except RoutingContractError as exc:
        raise DomainError("invalid_routing", str(exc)) from exc
    generation = int(client.incr(f"routing:generation:{deployment}"))
    table = routing_table_build(
        deployment=table.deployment,
        model=table.model,
        versions=table.versions,
        affinity=table.affinity,
        generation=generation,
        published_at=time.time(),
        tenant_weights=table.tenant_weights,
    )
    pipe = client.pipeline(transaction=True)
    pipe.set(routing_key(deployment), table.to_json())
    pipe.sadd(ROUTING_INDEX_KEY, deployment)
    pipe.publish(ROUTING_CHANNEL, deployment)
    pipe.execute()
    tracing.span_attributes_set(
        deployment=deployment,
        routing_generation=generation,
        versions=",".join(f"{v.version_id}:{v.weight}:{v.role}" for v in table.versions),
    )
    return table
