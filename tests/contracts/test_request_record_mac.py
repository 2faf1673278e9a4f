"""The requests-stream signature: `request_fields_sign` sets `mac` over every other field in a
canonical encoding; `request_fields_verify` refuses an entry without it, or whose fields
changed after signing, whatever their order or content."""

import hashlib
import hmac
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.routing import (
    REQUEST_MAC_FIELD,
    RequestMacError,
    RequestRecord,
    RoutingContractError,
    parse_request_record,
    request_fields_sign,
    request_fields_verify,
    request_mac,
)
from tests.conftest import REPO_ROOT

KEY = b"k" * 32
OTHER_KEY = b"o" * 32

RECORD = RequestRecord(
    request_id="0123456789abcdef0123456789abcdef", tenant_id=3, api_key_id=4,
    deployment="smollm2", version_id=7, agent="http://10.0.0.1:8101", endpoint_kind="chat",
    status=200, is_stream=True, started_at=1_900_000_000.5, finished_at=1_900_000_001.25,
    e2e_s=0.75, ttft_s=0.1, itl_mean_s=0.02, itl_p95_s=None, prompt_tokens=10,
    completion_tokens=5, usage_source="engine", attempts=2, prompt="hello", completion="hi",
)  # fmt: skip


def refusal(fields: dict[str, str], key: bytes = KEY) -> str:
    with pytest.raises(RequestMacError) as caught:
        request_fields_verify(fields, key)
    return caught.value.reason


def test_a_signed_record_verifies_and_still_parses() -> None:
    signed = request_fields_sign(RECORD.to_fields(), KEY)
    assert set(signed) == {*RECORD.to_fields(), REQUEST_MAC_FIELD}
    assert len(signed[REQUEST_MAC_FIELD]) == 64
    request_fields_verify(signed, KEY)
    assert parse_request_record(signed) == RECORD


def test_the_mac_is_hmac_sha256_of_the_length_prefixed_sorted_fields() -> None:
    fields = {"b": "2", "a": "xy"}
    message = b"controlplane.telemetry.requests.v1\n1:a2:xy1:b1:2"
    assert request_mac(fields, KEY) == hmac.new(KEY, message, hashlib.sha256).hexdigest()


def test_field_order_does_not_matter() -> None:
    fields = RECORD.to_fields()
    reversed_fields = dict(reversed(list(fields.items())))
    assert list(reversed_fields) != list(fields)
    assert request_mac(reversed_fields, KEY) == request_mac(fields, KEY)
    request_fields_verify({**request_fields_sign(fields, KEY)}, KEY)
    signed_reversed = dict(reversed(list(request_fields_sign(fields, KEY).items())))
    request_fields_verify(signed_reversed, KEY)


def test_a_missing_mac_is_refused() -> None:
    assert refusal(RECORD.to_fields()) == "missing_mac"
    assert refusal({**RECORD.to_fields(), REQUEST_MAC_FIELD: ""}) == "missing_mac"


@pytest.mark.parametrize(
    "change",
    [
        {"prompt_tokens": "1000000"},
        {"tenant_id": "4"},
        {"prompt": "hello!"},
        {"error_code": "http_500"},  # a field added after signing
        {REQUEST_MAC_FIELD: "0" * 64},
        {REQUEST_MAC_FIELD: "not hex"},
        {REQUEST_MAC_FIELD: "A" * 64},  # upper case: not the gateway's spelling
    ],
)
def test_a_change_after_signing_is_refused(change) -> None:
    signed = request_fields_sign(RECORD.to_fields(), KEY)
    assert refusal({**signed, **change}) == "bad_mac"


def test_a_removed_field_is_refused() -> None:
    signed = request_fields_sign(RECORD.to_fields(), KEY)
    del signed["completion"]
    assert refusal(signed) == "bad_mac"


def test_another_key_is_refused_and_short_keys_are_not_used() -> None:
    signed = request_fields_sign(RECORD.to_fields(), KEY)
    assert refusal(signed, OTHER_KEY) == "bad_mac"
    with pytest.raises(ValueError, match="at least 32 bytes"):
        request_fields_sign(RECORD.to_fields(), b"k" * 31)


def test_signing_replaces_an_existing_mac() -> None:
    forged = {**RECORD.to_fields(), REQUEST_MAC_FIELD: "f" * 64}
    request_fields_verify(request_fields_sign(forged, KEY), KEY)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # A separator inside a value cannot move text between fields...
        ({"prompt": "a", "completion": "b"}, {"prompt": "a1:completion1:b"}),
        ({"a": "1:b1:2"}, {"a": "", "b": "2"}),
        # ...nor across a name and its value, nor split one field in two.
        ({"ab": "c"}, {"a": "bc"}),
        ({"a": "b", "c": ""}, {"a": "b1:c0:"}),
        ({"x": "1\n2"}, {"x": "1", "2": ""}),
    ],
)
def test_values_holding_separators_cannot_collide(first, second) -> None:
    assert request_mac(first, KEY) != request_mac(second, KEY)
    assert refusal({**second, REQUEST_MAC_FIELD: request_mac(first, KEY)}) == "bad_mac"


TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)


@given(
    first=st.dictionaries(TEXT, TEXT, max_size=4),
    second=st.dictionaries(TEXT, TEXT, max_size=4),
)
def test_different_fields_never_share_a_message(first, second) -> None:
    first.pop(REQUEST_MAC_FIELD, None)
    second.pop(REQUEST_MAC_FIELD, None)
    if first != second:
        assert request_mac(first, KEY) != request_mac(second, KEY)


def test_the_refusal_is_a_contract_error() -> None:
    assert issubclass(RequestMacError, RoutingContractError)


def settings_key(**env: str) -> subprocess.CompletedProcess[str]:
    """Load the settings in a fresh interpreter with this environment; print the key."""
    environment = {k: v for k, v in os.environ.items() if k != "TELEMETRY_RECORD_KEY"}
    environment.update({"DEBUG": "1", "SECRET_KEY": "a secret key", **env})
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from controlplane import settings; print(settings.TELEMETRY_RECORD_KEY.hex())",
        ],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_record_key_setting() -> None:
    derived = hmac.new(b"a secret key", b"controlplane.telemetry.record-key", hashlib.sha256)
    unset = settings_key()
    assert (unset.returncode, unset.stdout.strip()) == (0, derived.hexdigest())
    own = settings_key(TELEMETRY_RECORD_KEY="x" * 32)
    assert (own.returncode, own.stdout.strip()) == (0, (b"x" * 32).hex())
    for refused in ("", "x" * 31):
        short = settings_key(TELEMETRY_RECORD_KEY=refused)
        assert short.returncode == 1
        assert "TELEMETRY_RECORD_KEY must be at least 32 bytes" in short.stderr
