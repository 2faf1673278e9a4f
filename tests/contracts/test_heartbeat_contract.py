"""The heartbeat contract's two readers: the fast path ingest takes for valid entries, and
the field-by-field checks that name what is wrong. The fast path must never accept an
entry the checks refuse, and must read what it accepts exactly as they do."""

import json
from dataclasses import astuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.streams import (
    FIGURES_FIELD,
    MAX_BIGINT,
    AgentState,
    ContractError,
    EnergySource,
    Heartbeat,
    _parse_heartbeat_checked,
    _parse_heartbeat_fast,
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


@settings(max_examples=1500, deadline=None)
@given(entries())
def test_the_fast_path_accepts_only_what_the_checks_accept_and_reads_it_the_same(fields) -> None:
    try:
        checked = _parse_heartbeat_checked(fields)
    except ContractError:
        checked = None
    fast = _parse_heartbeat_fast(fields)
    if fast is not None:
        assert typed(fast) == typed(checked)
    # Whatever comes in, the result is a heartbeat or a ContractError, never another error.
    if checked is None:
        with pytest.raises(ContractError):
            parse_heartbeat(fields)
    else:
        assert typed(parse_heartbeat(fields)) == typed(checked)


def test_a_valid_entry_takes_the_fast_path() -> None:
    assert _parse_heartbeat_fast(VALID) == _parse_heartbeat_checked(VALID) == BEAT


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq": str(MAX_BIGINT + 1)}, f"seq: must be <= {MAX_BIGINT}"),
        ({"version_id": str(MAX_BIGINT + 1)}, f"version_id: must be <= {MAX_BIGINT}"),
        ({"sent_at": "1e300"}, "sent_at: must be <= 253402300799.0"),
        ({"detail": "a\x00b"}, "detail: contains a NUL character"),
        ({"host": "\x00"}, "host: contains a NUL character"),
        ({"figures": "[" * 100_000 + "]" * 100_000}, "figures: nested too deeply"),
    ],
)
def test_values_the_database_cannot_store_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_heartbeat({**VALID, **change})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"running": 2**31}, "figures.running: must be <= 2147483647, got 2147483648"),
        ({"requests_ok_total": 2**63}, f"figures.requests_ok_total: must be <= {MAX_BIGINT}"),
        ({"power_watts": 10**400}, "figures.power_watts: must be finite, got an integer of"),
    ],
)
def test_figures_the_database_cannot_store_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_heartbeat({**VALID, FIGURES_FIELD: json.dumps({**FIGURES, **change})})
    assert str(error.value).startswith(message)
