"""The routing table contract: tenant weights for tenant-scoped canary stages, shadow
routes for shadow stages."""

import dataclasses
import json

import pytest

from contracts.routing import (
    Affinity,
    RoutingContractError,
    VersionRoute,
    parse_routing_table,
    routing_table_build,
)
from controlplane.gateway.caches import choose_version

VERSIONS = [
    VersionRoute(version_id=1, label="stable", weight=100, endpoints=("http://a:1",)),
    VersionRoute(version_id=2, label="canary", weight=0, endpoints=("http://b:1",)),
]


def build(**overrides):
    return routing_table_build(
        **{"deployment": "smol", "model": "SmolLM2", "versions": VERSIONS, **overrides}
    )


def test_tenant_weights_replace_the_versions_weights_for_those_tenants_only() -> None:
    table = build(tenant_weights={"acme": {1: 75, 2: 25}})
    assert table.weights_for("acme") == {1: 75, 2: 25}
    assert table.weights_for("globex") == {1: 100, 2: 0}
    assert table.weights_for(None) == {1: 100, 2: 0}


def test_tenant_weights_survive_the_json_round_trip() -> None:
    table = build(tenant_weights={"acme": {1: 0, 2: 100}}, generation=7)
    parsed = parse_routing_table(table.to_json())
    assert parsed == table
    assert parsed.weights_for("acme") == {1: 0, 2: 100}


def test_a_table_written_before_tenant_weights_existed_still_parses() -> None:
    data = json.loads(build().to_json())
    del data["tenant_weights"]
    parsed = parse_routing_table(json.dumps(data))
    assert parsed.tenant_weights == {}
    assert parsed.weights_for("acme") == {1: 100, 2: 0}


@pytest.mark.parametrize(
    ("tenant_weights", "message"),
    [
        ({"acme": {3: 100}}, "version 3 is not in versions"),
        ({"acme": {1: 0, 2: 0}}, "at least one weight must be positive"),
        ({"acme": {1: 101}}, "weight must be within 0..100"),
        ({"acme": {1: True}}, "weight must be within 0..100"),
        ({"not a slug!": {1: 100}}, "not a tenant slug"),
        ({"acme": {}}, "must map version ids to weights"),
    ],
)
def test_bad_tenant_weights_are_refused_naming_the_field(tenant_weights, message) -> None:
    with pytest.raises(RoutingContractError, match="tenant_weights") as refused:
        build(tenant_weights=tenant_weights)
    assert message in str(refused.value)


def test_a_stored_table_with_bad_tenant_weights_is_refused() -> None:
    data = json.loads(build().to_json())
    data["tenant_weights"] = {"acme": {"one": 100}}
    with pytest.raises(RoutingContractError, match="version ids must be integers"):
        parse_routing_table(json.dumps(data))
    data["tenant_weights"] = ["acme"]
    with pytest.raises(RoutingContractError, match="tenant_weights: must be an object"):
        parse_routing_table(json.dumps(data))


def test_a_versions_context_length_survives_the_round_trip_and_is_checked() -> None:
    versions = [VersionRoute(version_id=1, label="stable", weight=100, max_model_len=2048)]
    table = build(versions=versions)
    assert parse_routing_table(table.to_json()).versions[0].max_model_len == 2048
    older = json.loads(table.to_json())
    del older["versions"][0]["max_model_len"]  # a table published before the field
    assert parse_routing_table(json.dumps(older)).versions[0].max_model_len == 0
    for bad in (-1, True, "2048"):
        older["versions"][0]["max_model_len"] = bad
        with pytest.raises(RoutingContractError, match="max_model_len"):
            parse_routing_table(json.dumps(older))


# Shadow routes: mirrored to, never chosen to answer.

SHADOWED = [
    VersionRoute(
        version_id=1, label="stable", weight=100, endpoints=("http://a:1",), role="stable"
    ),
    VersionRoute(version_id=2, label="cand", weight=50, endpoints=("http://b:1",), role="shadow"),
]


def test_a_shadow_route_survives_the_round_trip_and_is_never_chosen_to_answer() -> None:
    table = build(versions=SHADOWED)
    parsed = parse_routing_table(table.to_json())
    assert parsed == table
    assert [(v.version_id, v.role, v.is_shadow) for v in parsed.versions] == [
        (1, "stable", False),
        (2, "shadow", True),
    ]
    assert parsed.weights_for(None) == {1: 100}
    assert parsed.shadow_shares_for(None) == [(parsed.versions[1], 50)]
    for affinity in (Affinity.NONE, Affinity.TENANT):
        table = build(versions=SHADOWED, affinity=affinity)
        chosen = {choose_version(table, str(caller), "acme") for caller in range(500)}
        assert chosen == {table.versions[0]}
    # Without a version that answers, nothing is chosen: never the shadow.
    stable_gone = build(versions=[dataclasses.replace(SHADOWED[0], endpoints=()), SHADOWED[1]])
    assert choose_version(stable_gone, None, None) is None


def test_tenant_weights_scope_a_shadow_share_to_the_named_tenants() -> None:
    versions = [SHADOWED[0], dataclasses.replace(SHADOWED[1], weight=0)]
    table = parse_routing_table(
        build(versions=versions, tenant_weights={"acme": {1: 100, 2: 25}}).to_json()
    )
    assert table.shadow_shares_for("acme") == [(table.versions[1], 25)]
    assert table.shadow_shares_for("globex") == []
    assert table.weights_for("acme") == {1: 100}
    assert {choose_version(table, None, "acme") for _ in range(200)} == {table.versions[0]}
    # A shadow without ready endpoints is mirrored to by no one.
    idle = build(versions=[SHADOWED[0], dataclasses.replace(SHADOWED[1], endpoints=())])
    assert idle.shadow_shares_for(None) == []


@pytest.mark.parametrize(
    ("versions", "tenant_weights", "message"),
    [
        # only a shadow has weight: no version answers
        ([dataclasses.replace(SHADOWED[0], weight=0), SHADOWED[1]], None, "versions: at least"),
        (
            SHADOWED,
            {"acme": {1: 0, 2: 100}},
            "tenant_weights['acme']: at least one weight must be positive",
        ),
        ([dataclasses.replace(SHADOWED[1], role="mirror")], None, "role: must be stable, canary"),
    ],
)
def test_a_table_no_version_of_which_answers_or_with_an_unknown_role_is_refused(
    versions, tenant_weights, message
) -> None:
    with pytest.raises(RoutingContractError) as refused:
        build(versions=versions, tenant_weights=tenant_weights)
    assert message in str(refused.value)
