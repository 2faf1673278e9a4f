"""Publication of the live routing tables the gateways read.

The reconciler is the one writer: `routing:<deployment>` holds the table (with an
increasing generation), `routing:deployments` indexes them, `routing:changed` announces
each change. A table the same as the one published (and indexed) is not written again,
so gateways re-read only what changed. Gateways only read (contracts.routing parses and
checks what they read).
"""

import dataclasses
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
    parse_routing_table,
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
    published: RoutingTable | None = None,
) -> RoutingTable:
    """Write the live routing table of a deployment and announce the change; when
    `published` (what `routing_tables_read` found) already says the same, return it and
    write nothing.

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
        return _publish(client, deployment, model, routes, affinity, tenant_weights, published)
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
    published: RoutingTable | None,
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
    if (
        published is not None
        and dataclasses.replace(published, generation=0, published_at=0.0) == table
    ):
        tracing.span_attributes_set(deployment=deployment, routing_unchanged=True)
        return published
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


def routing_tables_read(client: redis.Redis, deployments: Sequence[str]) -> dict[str, RoutingTable]:
    """The tables published now for `deployments`, by name, in one round trip; one that
    is missing, unreadable or not in the index is left out (the next publish writes it)."""
    if not deployments:
        return {}
    names = list(deployments)
    pipe = client.pipeline(transaction=False)
    pipe.mget([routing_key(name) for name in names])
    pipe.smismember(ROUTING_INDEX_KEY, names)
    raws, indexed = pipe.execute()
    tables = {}
    for name, raw, is_indexed in zip(names, raws, indexed, strict=True):
        if raw is None or not is_indexed:
            continue
        try:
            tables[name] = parse_routing_table(raw)
        except RoutingContractError:
            continue  # written again, whole, by the next publish
    return tables
