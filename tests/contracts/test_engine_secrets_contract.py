"""Engine secrets in the contracts: the routing table's serving secrets per endpoint and
the load command's two secrets, checked on parse, never quoted in an error."""

import json

import pytest

from contracts.commands import parse_load_payload
from contracts.routing import (
    RoutingContractError,
    VersionRoute,
    parse_routing_table,
    routing_table_build,
)
from contracts.streams import ContractError

SECRET_A = "a1" * 32
SECRET_B = "b2" * 32


def table(**secrets):
    version = VersionRoute(
        version_id=1,
        label="stable",
        weight=100,
        endpoints=("http://a:1", "http://b:1/"),
        endpoint_secrets=secrets or {"http://a:1": SECRET_A, "http://b:1/": SECRET_B},
    )
    return routing_table_build(deployment="smol", model="SmolLM2", versions=[version])


def test_endpoint_secrets_survive_the_json_round_trip_keyed_like_the_endpoints() -> None:
    built = table()
    assert dict(built.versions[0].endpoint_secrets) == {
        "http://a:1": SECRET_A,
        "http://b:1": SECRET_B,  # the trailing slash goes, as from the endpoint
    }
    parsed = parse_routing_table(built.to_json())
    assert parsed == built
    assert SECRET_A not in repr(parsed)  # never printed by accident


def test_a_table_written_before_endpoint_secrets_existed_still_parses() -> None:
    data = json.loads(table().to_json())
    del data["versions"][0]["endpoint_secrets"]
    assert parse_routing_table(json.dumps(data)).versions[0].endpoint_secrets == {}


BAD_SECRET = "endpoint_secrets['http://a:1']: must be 64 lowercase hex characters"


@pytest.mark.parametrize(
    ("secrets", "message"),
    [
        ({"http://a:1": "A1" * 32}, BAD_SECRET),
        ({"http://a:1": SECRET_A[:-1]}, BAD_SECRET),
        ({"http://a:1": SECRET_A + "0"}, BAD_SECRET),
        ({"http://a:1": 7}, BAD_SECRET),
        ({"http://c:1": SECRET_A}, "endpoint_secrets: 'http://c:1' is not one of its endpoints"),
    ],
)
def test_a_stored_table_with_a_bad_secret_is_refused_without_quoting_it(secrets, message):
    data = json.loads(table().to_json())
    data["versions"][0]["endpoint_secrets"] = secrets
    with pytest.raises(RoutingContractError) as refused:
        parse_routing_table(json.dumps(data))
    assert str(refused.value) == f"versions[0].{message}"
    for value in secrets.values():
        if isinstance(value, str):
            assert value not in str(refused.value)


def test_endpoint_secrets_must_be_an_object() -> None:
    data = json.loads(table().to_json())
    data["versions"][0]["endpoint_secrets"] = [SECRET_A]
    with pytest.raises(RoutingContractError, match="endpoint_secrets: wrong type list"):
        parse_routing_table(json.dumps(data))


LOAD = {
    "version_id": 3,
    "model": "smol",
    "label": "f32",
    "digest": "c" * 64,
    "format": "gguf",
    "size_bytes": 10,
    "serving_config": {"dtype": "float32"},
    "signature": "sig",
    "key_id": "release-key",
    "public_key": "key",
    "served_model_name": "smol",
    "serving_secret": SECRET_A,
    "admin_secret": SECRET_B,
}


def test_a_load_carries_both_secrets_which_its_repr_hides() -> None:
    load = parse_load_payload(LOAD)
    assert (load.serving_secret, load.admin_secret) == (SECRET_A, SECRET_B)
    assert SECRET_A not in repr(load) and SECRET_B not in repr(load)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"serving_secret": None}, "payload.serving_secret: missing"),
        ({"admin_secret": None}, "payload.admin_secret: missing"),
        (
            {"serving_secret": "short"},
            "payload.serving_secret: must be 64 lowercase hex characters",
        ),
        ({"admin_secret": 5}, "payload.admin_secret: wrong type int"),
        ({"admin_secret": SECRET_A}, "payload.admin_secret: must differ from serving_secret"),
    ],
)
def test_a_load_without_two_good_secrets_is_refused(change, message) -> None:
    payload = {**LOAD, **change}
    for name, value in change.items():
        if value is None:
            del payload[name]
    with pytest.raises(ContractError) as refused:
        parse_load_payload(payload)
    assert str(refused.value) == message
