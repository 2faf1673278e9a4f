"""The stream contracts: what each side writes is what the other reads, and bad entries are
refused with a message naming the field."""

import json

import pytest

from contracts.commands import (
    CommandKind,
    CommandResult,
    CommandStatus,
    new_command,
    parse_command,
    parse_command_result,
    parse_drain_payload,
)
from contracts.streams import ContractError, parse_heartbeat
from tests.fleet.support import heartbeat


def test_heartbeat_round_trip_with_missing_latencies() -> None:
    beat = heartbeat(ttft_p50_s=None, joules_per_token=None, version_id=7, version_digest="a" * 64)
    assert parse_heartbeat(beat.to_fields()) == beat


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": "2"}, "v: unsupported schema version '2'"),
        ({"agent": "Not A Name"}, "agent: must be 1-63 characters of a-z, 0-9,"),
        ({"seq": "-1"}, "seq: Expected `int` >= 0, got '-1'"),
        ({"sent_at": "nan"}, "sent_at: Expected `float` >= 0.0, got 'nan'"),
        ({"state": "napping"}, "state: 'napping' is not one of idle, loading, warming"),
        ({"endpoint": "ftp://x"}, "endpoint: must be an http(s) URL of a host, or empty"),
        ({"version_digest": "abc"}, "version_digest: must be 64 lowercase hex"),
        ({"energy_source": "guess"}, "energy_source: 'guess' is not one of nvml, rapl, estimate"),
        ({"figures": "[]"}, "figures: Expected `object`, got `array`"),
    ],
)
def test_bad_heartbeat_fields_are_named(change: dict, message: str) -> None:
    with pytest.raises(ContractError) as error:
        parse_heartbeat({**heartbeat().to_fields(), **change})
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"running": -1}, "figures.running: Expected `int` >= 0, got -1"),
        ({"kv_cache_usage": 1.5}, "figures.kv_cache_usage: Expected `float` <= 1.0, got 1.5"),
        ({"power_watts": "high"}, "figures.power_watts: Expected `float`, got `str`"),
        ({"energy_joules": None}, "figures.energy_joules: Expected `float`, got `null`"),
    ],
)
def test_bad_figures_are_named(change: dict, message: str) -> None:
    fields = heartbeat().to_fields()
    figures = {**json.loads(fields["figures"]), **change}
    with pytest.raises(ContractError) as error:
        parse_heartbeat({**fields, "figures": json.dumps(figures)})
    assert str(error.value).startswith(message)


def test_missing_figure_is_named() -> None:
    fields = heartbeat().to_fields()
    figures = json.loads(fields["figures"])
    del figures["power_watts"]
    with pytest.raises(ContractError, match=r"^figures.power_watts: missing"):
        parse_heartbeat({**fields, "figures": json.dumps(figures)})


def test_commands_and_results_round_trip() -> None:
    command = new_command(CommandKind.FAULTS, {"latency_ms_per_token": 5, "error_rate": 0.5})
    assert parse_command(command.to_fields()) == command
    result = CommandResult(
        command_id=command.command_id,
        agent="agent-1",
        kind="faults",
        status=CommandStatus.SUCCEEDED,
        detail="ok",
        finished_at=1.5,
        version_id=3,
    )
    assert parse_command_result(result.to_fields()) == result


def test_a_load_without_a_signature_is_refused_before_anything_runs() -> None:
    command = new_command(CommandKind.LOAD, {"version_id": 1, "digest": "b" * 64})
    with pytest.raises(ContractError, match=r"^payload.size_bytes: missing"):
        parse_command(command.to_fields())
    faults = new_command(CommandKind.FAULTS, {"latency_ms_per_token": 1, "error_rate": 3})
    with pytest.raises(ContractError, match=r"^payload.error_rate: must be within 0..1"):
        parse_command(faults.to_fields())


def test_a_drain_may_name_the_version_it_means() -> None:
    assert parse_drain_payload({}).version_id is None
    assert parse_drain_payload({"version_id": None}).version_id is None
    assert parse_drain_payload({"version_id": 7}).version_id == 7
    cases: list[tuple[dict[str, object], str]] = [
        ({"version_id": "7"}, r"^payload.version_id: wrong type str"),
        ({"version_id": True}, r"^payload.version_id: wrong type bool"),
        ({"version_id": 0}, r"^payload.version_id: must be >= 1"),
    ]
    for payload, message in cases:
        with pytest.raises(ContractError, match=message):
            parse_command(new_command(CommandKind.DRAIN, payload).to_fields())
