"""The heartbeat contract's reader: whatever an entry holds, a Heartbeat whose every value
the database can store, or a ContractError naming the field; and every Heartbeat an agent
writes reads back as itself."""

import json
from dataclasses import astuple, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.streams import (
    ENGINE_ERROR_MESSAGE_MAX_LENGTH,
    FIGURES_FIELD,
    FLOAT_FIGURES,
    INT_FIGURES,
    MAX_BIGINT,
    MAX_SENT_AT,
    AgentState,
    ContractError,
    EnergySource,
    EngineError,
    EngineFailure,
    Heartbeat,
    parse_heartbeat,
)

BEAT = Heartbeat(
    agent="agent-1", seq=3, sent_at=1_900_000_000.25, host="host-a",
    endpoint="http://127.0.0.1:9100", state=AgentState.READY, version_id=7,
    version_digest="a" * 64, detail="", running=1, waiting=0, kv_cache_usage=0.25,
    interval_s=1.0, tokens_per_second=20.0, prompt_tokens=10, generated_tokens=20,
    requests_ok=2, requests_failed=0, requests_aborted=0, ttft_p50_s=0.05, ttft_p95_s=0.08,
    itl_mean_s=0.02, itl_p95_s=None, prompt_tokens_total=30, generated_tokens_total=60,
    requests_ok_total=6, requests_failed_total=0, power_watts=40.0, energy_joules=120.0,
    energy_source=EnergySource.ESTIMATE, joules_per_token=2.0,
)  # fmt: skip
VALID = BEAT.to_fields()
FIGURES = json.loads(VALID[FIGURES_FIELD])

# Values chosen to sit on the edges of what each reader accepts, field by field.
NUMBERS = ["", "0", "1", "-1", "-0", " 5", "+5", "1_0", "\u0663", "1.0", "0x1", "nan", "inf"]
FIELD_VALUES = {
    "v": ["1", "2", "", " 1"],
    "agent": ["agent-1", "a", "a" * 63, "a" * 64, "Agent", "-a", "a\n", "a b", "\u00e9"],
    "seq": [*NUMBERS, str(2**63 - 1), str(2**63)],
    "sent_at": [*NUMBERS, "1e300", "253402300799", "253402300799.5", "1e-320", "-inf"],
    "host": ["", "h" * 255, "h" * 256, "h\x00"],
    "endpoint": ["", "http://h", "https://h:1/", "http://h/x", "ftp://h", "http://" + "h" * 249,
                 "http://" + "h" * 250, "http://h\x00"],
    "state": ["ready", "idle", "lost", "READY", ""],
    "version_id": [*NUMBERS, str(2**63 - 1), str(2**63)],
    "version_digest": ["", "a" * 64, "A" * 64, "a" * 63, "g" * 64],
    "energy_source": ["nvml", "rapl", "estimate", "guess", ""],
    "detail": ["", "d" * 1000, "d" * 1001, "d\x00"],
    "engine_error": ["", "exited", "killed", "EXITED", "oom", " exited", "exited\n"],
    "engine_error_message": ["", "m", "m" * 500, "m" * 501, "m\x00"],
}  # fmt: skip
JSON_VALUE: st.SearchStrategy[object] = st.one_of(
    st.sampled_from(
        [None, True, False, 0, 1, -1, 0.0, -0.0, 0.5, 1.0, 1.5, 2**31, 2**31 - 1, 2**63,
         2**63 - 1, 10**400, float("inf"), float("nan"), 1e308, "1", [], {}]
    ),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
)  # fmt: skip


def typed(heartbeat: Heartbeat | None) -> list | None:
    """A heartbeat's values with their types (1 == 1.0, but the database tells them apart)."""
    return None if heartbeat is None else [(type(v), v) for v in astuple(heartbeat)]


@st.composite
def entries(draw: st.DrawFn) -> dict:
    """A valid entry with a few changes: to its fields, or to its figures, or to both."""
    fields = dict(VALID)
    where = draw(st.sampled_from(["fields", "figures", "both"]))
    if where != "figures":
        for name in draw(
            st.lists(
                st.sampled_from(sorted(set(VALID) - {FIGURES_FIELD})),
                min_size=1,
                max_size=2,
                unique=True,
            )
        ):
            if draw(st.integers(0, 5)) == 0:
                del fields[name]
            else:
                fields[name] = draw(st.one_of(st.sampled_from(FIELD_VALUES[name]), st.text()))
    if where != "fields":
        figures = dict(FIGURES)
        for name in draw(
            st.lists(st.sampled_from(sorted(FIGURES)), min_size=1, max_size=2, unique=True)
        ):
            if draw(st.integers(0, 5)) == 0:
                del figures[name]
            else:
                figures[name] = draw(JSON_VALUE)
        fields[FIGURES_FIELD] = draw(
            st.one_of(
                st.just(json.dumps(figures)),
                st.sampled_from(["", "[]", "null", "{", "1", '"x"', "[" * 50_000]),
            )
        )
    return fields


def assert_storable(heartbeat: Heartbeat) -> None:
    """Every value within what its column and the contract allow, of its exact type."""
    assert type(heartbeat.seq) is int and 0 <= heartbeat.seq <= MAX_BIGINT
    assert type(heartbeat.sent_at) is float and 0 <= heartbeat.sent_at <= MAX_SENT_AT
    assert heartbeat.version_id is None or (
        type(heartbeat.version_id) is int and 1 <= heartbeat.version_id <= MAX_BIGINT
    )
    for text, limit in ((heartbeat.host, 255), (heartbeat.endpoint, 255), (heartbeat.detail, 1000)):
        assert type(text) is str and len(text) <= limit and "\x00" not in text
    assert isinstance(heartbeat.state, AgentState)
    assert isinstance(heartbeat.energy_source, EnergySource)
    if heartbeat.engine_error is not None:
        assert isinstance(heartbeat.engine_error.reason, EngineFailure)
        message = heartbeat.engine_error.message
        assert len(message) <= ENGINE_ERROR_MESSAGE_MAX_LENGTH and "\x00" not in message
    for name, maximum in INT_FIGURES.items():
        count = getattr(heartbeat, name)
        assert type(count) is int and 0 <= count <= maximum, name
    for name, bound in FLOAT_FIGURES.items():
        number = getattr(heartbeat, name)
        assert type(number) is float and 0 <= number <= (bound or 1.8e308), name


@settings(max_examples=1500, deadline=None)
@given(entries())
def test_an_entry_is_a_storable_heartbeat_or_a_contract_error(fields) -> None:
    # Whatever comes in, the result is a heartbeat or a ContractError, never another error.
    try:
        heartbeat = parse_heartbeat(fields)
    except ContractError as error:
        assert str(error).split(":", 1)[0]  # it names what is wrong
        return
    assert_storable(heartbeat)


@settings(max_examples=300, deadline=None)
@given(
    seq=st.integers(0, MAX_BIGINT),
    sent_at=st.floats(0, MAX_SENT_AT),
    version_id=st.none() | st.integers(1, MAX_BIGINT),
    running=st.integers(0, 2**31 - 1),
    kv_cache_usage=st.floats(0, 1),
    ttft=st.none() | st.floats(0, 1e6),
    detail=st.text(max_size=50).filter(lambda text: "\x00" not in text),
    engine_error=st.none()
    | st.builds(
        EngineError,
        st.sampled_from(EngineFailure),
        st.text(max_size=ENGINE_ERROR_MESSAGE_MAX_LENGTH).filter(lambda text: "\x00" not in text),
    ),
)
def test_what_an_agent_writes_reads_back_as_itself(
    seq, sent_at, version_id, running, kv_cache_usage, ttft, detail, engine_error
) -> None:
    beat = replace(
        BEAT,
        seq=seq,
        sent_at=sent_at,
        version_id=version_id,
        running=running,
        kv_cache_usage=kv_cache_usage,
        ttft_p50_s=ttft,
        detail=detail,
        engine_error=engine_error,
    )
    assert typed(parse_heartbeat(beat.to_fields())) == typed(beat)
    assert parse_heartbeat(beat.to_fields()).engine_error == engine_error


def test_an_engine_error_reads_back_and_an_older_agent_reports_none() -> None:
    failed = replace(BEAT, engine_error=EngineError(EngineFailure.KILLED, "killed by SIGKILL"))
    fields = failed.to_fields()
    assert (fields["engine_error"], fields["engine_error_message"]) == (
        "killed",
        "killed by SIGKILL",
    )
    assert parse_heartbeat(fields) == failed
    assert (VALID["engine_error"], VALID["engine_error_message"]) == ("", "")
    older = {name: value for name, value in VALID.items() if not name.startswith("engine_error")}
    assert parse_heartbeat(older) == BEAT


def test_a_valid_entry_reads_as_the_heartbeat_written() -> None:
    assert parse_heartbeat(VALID) == BEAT


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("agent", "a\n"),  # a trailing newline: no name
        ("agent", "Agent"),
        ("endpoint", "http://h\x00"),
        ("endpoint", "http://h/x"),
        ("version_digest", "a" * 64 + "\n"),
        ("seq", "-1"),
        ("seq", " 5"),
        ("sent_at", "nan"),
        ("sent_at", "inf"),
        ("state", "lost"),  # ingest decides it; no agent reports it
        ("v", "2"),
        ("engine_error", "oom"),
        ("engine_error", "exited\n"),
        ("engine_error_message", "m" * (ENGINE_ERROR_MESSAGE_MAX_LENGTH + 1)),
        ("engine_error_message", "a reason without a code"),
    ],
)
def test_fields_out_of_the_contract_are_refused_by_name(name: str, value: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_heartbeat({**VALID, name: value})
    assert str(error.value).startswith(f"{name}: ")


def test_a_missing_field_is_named() -> None:
    entry = dict(VALID)
    del entry["host"]
    with pytest.raises(ContractError) as error:
        parse_heartbeat(entry)
    assert str(error.value) == "host: missing"
    figures = dict(FIGURES)
    del figures["running"]
    with pytest.raises(ContractError) as error:
        parse_heartbeat({**VALID, FIGURES_FIELD: json.dumps(figures)})
    assert str(error.value) == "figures.running: missing"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq": str(MAX_BIGINT + 1)}, f"seq: Expected `int` <= {MAX_BIGINT}"),
        ({"version_id": str(MAX_BIGINT + 1)}, "version_id: Expected `int` <= "),
        ({"sent_at": "1e300"}, "sent_at: Expected `float` <= 253402300799.0"),
        ({"detail": "a\x00b"}, "detail: must not contain NUL"),
        ({"host": "\x00"}, "host: must not contain NUL"),
        ({"figures": "[" * 100_000 + "]" * 100_000}, "figures: Expected `object`, got `array`"),
    ],
)
def test_values_the_database_cannot_store_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_heartbeat({**VALID, **change})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"running": 2**31}, "figures.running: Expected `int` <= 2147483647, got 2147483648"),
        (
            {"requests_ok_total": 2**63},
            f"figures.requests_ok_total: Expected `int` <= {MAX_BIGINT}",
        ),
        ({"power_watts": 10**400}, "figures.power_watts: Number out of range"),
        ({"kv_cache_usage": 1.5}, "figures.kv_cache_usage: Expected `float` <= 1.0"),
    ],
)
def test_figures_the_database_cannot_store_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_heartbeat({**VALID, FIGURES_FIELD: json.dumps({**FIGURES, **change})})
    assert str(error.value).startswith(message)
