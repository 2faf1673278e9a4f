"""The requests-stream contract: `parse_request_record` accepts only what the database can
store (telemetry.RequestSample, tenants.UsageRecord, telemetry.PromptRecord) and names the
field of anything else, so ingest drops such an entry instead of failing its batch."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.routing import RequestRecord, RoutingContractError, parse_request_record

MAX_BIGINT = 2**63 - 1
MAX_INTEGER = 2**31 - 1
MAX_TIME = 253_402_300_799  # 9999-12-31T23:59:59Z

RECORD = RequestRecord(
    request_id="0123456789abcdef0123456789abcdef", tenant_id=3, api_key_id=4,
    deployment="smollm2", version_id=7, agent="http://10.0.0.1:8101", endpoint_kind="chat",
    status=200, is_stream=True, started_at=1_900_000_000.5, finished_at=1_900_000_001.25,
    e2e_s=0.75, ttft_s=0.1, itl_mean_s=0.02, itl_p95_s=None, prompt_tokens=10,
    completion_tokens=5, usage_source="engine", attempts=2, prompt="hello", completion="hi",
)  # fmt: skip
VALID = RECORD.to_fields()

# The largest value of every bounded field: all of it fits its column.
AT_THE_BOUNDS = {
    "tenant_id": str(MAX_BIGINT),
    "api_key_id": str(MAX_BIGINT),
    "version_id": str(MAX_BIGINT),
    "status": "599",
    "prompt_tokens": str(MAX_INTEGER),
    "completion_tokens": str(MAX_INTEGER),
    "attempts": str(MAX_INTEGER),
    "started_at": str(MAX_TIME),
    "finished_at": str(MAX_TIME),
    "deployment": "d" * 100,
    "agent": "a" * 255,
    "endpoint_kind": "e" * 20,
}


def test_a_record_survives_the_round_trip() -> None:
    assert parse_request_record(VALID) == RECORD
    without_prompt = dataclasses.replace(RECORD, prompt=None, completion=None)
    assert parse_request_record(without_prompt.to_fields()) == without_prompt


def test_values_at_the_columns_bounds_are_accepted() -> None:
    record = parse_request_record({**VALID, **AT_THE_BOUNDS})
    assert (record.tenant_id, record.prompt_tokens, record.finished_at) == (
        MAX_BIGINT,
        MAX_INTEGER,
        MAX_TIME,
    )
    assert (len(record.deployment), len(record.agent), len(record.endpoint_kind)) == (100, 255, 20)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tenant_id": str(MAX_BIGINT + 1)}, f"tenant_id: must be <= {MAX_BIGINT}, got"),
        ({"tenant_id": "0"}, "tenant_id: must be >= 1, got 0"),
        ({"api_key_id": str(MAX_BIGINT + 1)}, f"api_key_id: must be <= {MAX_BIGINT}, got"),
        ({"version_id": str(MAX_BIGINT + 1)}, f"version_id: must be <= {MAX_BIGINT}, got"),
        ({"version_id": "9" * 5000}, "version_id: not an integer"),
        ({"status": "32768"}, "status: must be <= 599, got 32768"),
        ({"status": "99"}, "status: must be >= 100, got 99"),
        ({"prompt_tokens": str(MAX_INTEGER + 1)}, "prompt_tokens: must be <= 2147483647, got"),
        ({"prompt_tokens": "-1"}, "prompt_tokens: must be >= 0, got -1"),
        ({"completion_tokens": str(MAX_INTEGER + 1)}, "completion_tokens: must be <= 2147483647"),
        ({"attempts": str(MAX_INTEGER + 1)}, "attempts: must be <= 2147483647"),
        ({"attempts": "0"}, "attempts: must be >= 1, got 0"),
        ({"started_at": str(MAX_TIME + 1)}, "started_at: must be <= 253402300799.0, got"),
        ({"finished_at": "1e300"}, "finished_at: must be <= 253402300799.0, got 1e+300"),
        ({"finished_at": "inf"}, "finished_at: must be a finite number >= 0, got 'inf'"),
        ({"finished_at": "nan"}, "finished_at: must be a finite number >= 0, got 'nan'"),
        ({"started_at": "-1"}, "started_at: must be a finite number >= 0"),
        ({"e2e_s": "-inf"}, "e2e_s: must be a finite number >= 0"),
        ({"ttft_s": "1e999"}, "ttft_s: must be a finite number >= 0, got '1e999'"),
        ({"deployment": "d" * 101}, "deployment: longer than 100 characters"),
        ({"deployment": "smol\x00lm"}, "deployment: contains a NUL character"),
        ({"agent": "a" * 256}, "agent: longer than 255 characters"),
        ({"agent": "http://h\x00"}, "agent: contains a NUL character"),
        ({"endpoint_kind": "e" * 21}, "endpoint_kind: longer than 20 characters"),
        ({"endpoint_kind": "\x00"}, "endpoint_kind: contains a NUL character"),
        ({"prompt": "tell me\x00"}, "prompt: contains a NUL character"),
        ({"completion": "\x00"}, "completion: contains a NUL character"),
        ({"request_id": "0123456789ABCDEF0123456789ABCDEF"}, "request_id: must be 32 lowercase"),
        ({"usage_source": "guess"}, "usage_source: must be engine or gateway"),
        ({"is_stream": "yes"}, "is_stream: must be 0 or 1"),
        ({"v": "2"}, "v: unsupported schema version '2'"),
    ],
)
def test_values_the_database_cannot_store_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(RoutingContractError) as error:
        parse_request_record({**VALID, **change})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("name", sorted(set(VALID) - {"prompt", "completion"}))
def test_every_field_but_the_prompt_is_required(name: str) -> None:
    fields = {key: value for key, value in VALID.items() if key != name}
    with pytest.raises(RoutingContractError) as error:
        parse_request_record(fields)
    assert str(error.value).startswith(f"{name}: ")


FIELD_VALUES = st.one_of(
    st.text(max_size=300),
    st.sampled_from(
        ["", "0", "-0", "1", "-1", " 5", "+5", "1_0", "\u0663", "1e999", "nan", "inf", "1e300",
         str(MAX_BIGINT), str(MAX_BIGINT + 1), str(MAX_INTEGER + 1), str(MAX_TIME + 1),
         "a\x00", "x" * 256]
    ),
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(VALID)), FIELD_VALUES, max_size=4))
def test_whatever_comes_in_is_a_storable_record_or_a_named_refusal(changes: dict) -> None:
    try:
        record = parse_request_record({**VALID, **changes})
    except RoutingContractError as error:
        assert str(error).split(":", 1)[0] in VALID  # names a field
        return
    for name in ("tenant_id", "api_key_id", "version_id"):
        assert 0 <= getattr(record, name) <= MAX_BIGINT
    for name in ("prompt_tokens", "completion_tokens", "attempts"):
        assert 0 <= getattr(record, name) <= MAX_INTEGER
    assert 100 <= record.status <= 599
    assert 0 <= record.started_at <= MAX_TIME
    assert 0 <= record.finished_at <= MAX_TIME
    texts = [record.deployment, record.agent, record.endpoint_kind]
    assert not any(
        "\x00" in text for text in [*texts, record.prompt or "", record.completion or ""]
    )
    assert len(record.deployment) <= 100
    assert len(record.agent) <= 255
    assert len(record.endpoint_kind) <= 20


@pytest.mark.django_db
def test_a_record_at_every_bound_is_stored_by_ingest() -> None:
    """The bounds are the columns': what the contract accepts, the database takes."""
    from controlplane.telemetry.models import PromptRecord, RequestSample
    from controlplane.telemetry.usage import request_records_apply
    from controlplane.tenants.models import UsageRecord
    from tests.gateway.conftest import make_setup

    setup = make_setup(prompt_logging="full")
    at_the_bounds = {**AT_THE_BOUNDS, "tenant_id": str(setup.tenant.pk)}
    at_the_bounds["version_id"] = str(setup.versions[0].pk)
    at_the_bounds["prompt"] = "p" * 100_000
    record = parse_request_record({**VALID, **at_the_bounds})
    assert request_records_apply(records=[record]) == 1
    sample = RequestSample.objects.get(request_id=record.request_id)
    assert (sample.prompt_tokens, sample.completion_tokens) == (MAX_INTEGER, MAX_INTEGER)
    assert sample.finished_at.year == 9999
    assert UsageRecord.objects.get(tenant=setup.tenant).prompt_tokens == MAX_INTEGER
    assert len(PromptRecord.objects.get(request_id=record.request_id).prompt) == 100_000


def test_an_error_code_travels_with_the_record_and_is_checked() -> None:
    failed = dataclasses.replace(RECORD, status=400, error_code="context_length_exceeded")
    assert parse_request_record(failed.to_fields()) == failed
    assert "error_code" not in VALID  # none when it succeeded, as before the field existed
    assert parse_request_record(VALID).error_code == ""
    for bad in ("", "Not A Code", "x" * 65, "a\x00b"):
        with pytest.raises(RoutingContractError, match="error_code"):
            parse_request_record({**VALID, "error_code": bad})


@pytest.mark.parametrize(
    ("status", "is_fault"), [(200, False), (400, False), (429, False), (499, False), (500, True)]
)
def test_only_server_failures_count_against_a_version(status, is_fault) -> None:
    assert dataclasses.replace(RECORD, status=status).is_server_fault is is_fault


def test_a_mirrored_requests_record_says_so_and_others_read_as_before() -> None:
    mirrored = dataclasses.replace(RECORD, prompt=None, completion=None, is_shadow=True)
    fields = mirrored.to_fields()
    assert fields["is_shadow"] == "1"
    assert parse_request_record(fields) == mirrored
    assert "is_shadow" not in VALID  # an answered request's entry is unchanged
    assert parse_request_record(VALID).is_shadow is False
    assert parse_request_record({**VALID, "is_shadow": "0"}).is_shadow is False
    for bad in ("true", "", "2"):
        with pytest.raises(RoutingContractError, match="is_shadow: must be 0 or 1"):
            parse_request_record({**VALID, "is_shadow": bad})
