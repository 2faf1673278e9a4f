"""Weighted version choice with tenant-scoped weights (no I/O: the table is in memory)."""

from collections import Counter

from contracts.routing import Affinity, RoutingTable, VersionRoute, routing_table_build
from controlplane.gateway.caches import choose_version

VERSIONS = [
    VersionRoute(version_id=1, label="stable", weight=100, endpoints=("http://a:1",)),
    VersionRoute(version_id=2, label="canary", weight=0, endpoints=("http://b:1",)),
]


def table(**overrides):
    return routing_table_build(
        **{"deployment": "smol", "model": "SmolLM2", "versions": VERSIONS, **overrides}
    )


def chosen_id(routing: RoutingTable, affinity_value: str | None, tenant: str | None) -> int:
    route = choose_version(routing, affinity_value, tenant)
    assert route is not None
    return route.version_id


def draws(routing: RoutingTable, tenant: str | None, count: int = 2000) -> Counter[int]:
    return Counter(chosen_id(routing, None, tenant) for _ in range(count))


def test_only_the_named_tenants_reach_a_tenant_scoped_canary() -> None:
    routing = table(tenant_weights={"acme": {1: 50, 2: 50}})
    assert draws(routing, "globex") == {1: 2000}
    assert draws(routing, None) == {1: 2000}
    acme = draws(routing, "acme")
    # Binomial(2000, 0.5): 5 standard deviations are about 112.
    assert abs(acme[2] - 1000) < 112


def test_a_named_tenant_at_full_weight_goes_to_the_canary_only() -> None:
    routing = table(tenant_weights={"acme": {1: 0, 2: 100}})
    assert draws(routing, "acme", 200) == {2: 200}
    assert draws(routing, "globex", 200) == {1: 200}


def test_tenant_affinity_keeps_a_named_tenant_on_one_version() -> None:
    routing = table(tenant_weights={"acme": {1: 50, 2: 50}}, affinity=Affinity.TENANT)
    chosen = {chosen_id(routing, "7", "acme") for _ in range(50)}
    assert len(chosen) == 1


def test_a_version_without_ready_agents_is_never_chosen() -> None:
    versions = [VERSIONS[0], VersionRoute(version_id=2, label="canary", weight=0)]
    routing = table(versions=versions, tenant_weights={"acme": {1: 0, 2: 100}})
    assert choose_version(routing, None, "acme") is None
