import pytest

from loadgen.energy import energy_delta, parse_prometheus, pick_energy
from loadgen.stats import (
    ExactSeries,
    RunStats,
    Slo,
    StreamingSeries,
    max_rate_at_attainment,
    time_per_output_token,
)


def test_streaming_series_stays_within_half_a_percent():
    exact, streaming = ExactSeries(), StreamingSeries()
    for millis in range(1, 2001):
        exact.add(millis / 1000)
        streaming.add(millis / 1000)
    for q in (50, 90, 95, 99):
        assert streaming.percentile(q) == pytest.approx(exact.percentile(q), rel=0.006)
    assert streaming.mean() == pytest.approx(exact.mean())
    assert streaming.values() is None


def test_time_per_output_token_excludes_the_first_token():
    assert time_per_output_token(e2e_s=1.5, ttft_s=0.5, completion_tokens=11) == pytest.approx(0.1)
    assert time_per_output_token(e2e_s=1.0, ttft_s=0.5, completion_tokens=1) is None


def test_goodput_counts_requests_meeting_both_limits():
    stats = RunStats(slo=Slo(ttft_s=0.5, tpot_s=0.1))
    # (status, ttft, e2e, tokens): TPOT = (e2e - ttft) / (tokens - 1)
    requests = [
        ("200", 0.2, 1.0, 10),  # TPOT 0.089: meets both
        ("200", 0.4, 0.85, 10),  # TPOT 0.05: meets both
        ("200", 0.6, 0.9, 10),  # TTFT too slow
        ("200", 0.1, 2.0, 10),  # TPOT 0.211: too slow
        ("200", 0.3, 0.3, 1),  # one token: no TPOT, TTFT meets
        ("500", None, 0.05, 0),  # failed
    ]
    for offset, (status, ttft, e2e, tokens) in enumerate(requests):
        stats.record(
            status=status,
            is_success=status == "200",
            started=float(offset),
            e2e_s=e2e,
            ttft_s=ttft,
            itls=[],
            prompt_tokens=5,
            completion_tokens=tokens,
            usage_reported=True,
        )
    summary = stats.summary(elapsed_s=10.0)
    assert summary["good_requests"] == 3
    assert summary["slo_attainment"] == pytest.approx(0.5)
    assert summary["goodput"] == pytest.approx(0.3)
    assert summary["request_throughput"] == pytest.approx(0.5)
    assert summary["completion_tokens"] == 41
    assert summary["output_token_throughput"] == pytest.approx(4.1)
    assert summary["errors_by_status"] == {"500": 1}
    ttft_figures, tpot_figures = summary["ttft_s"], summary["tpot_s"]
    assert isinstance(ttft_figures, dict) and isinstance(tpot_figures, dict)
    assert ttft_figures["p50"] == pytest.approx(0.3)
    assert tpot_figures["count"] == 4


def test_max_rate_at_ninety_percent_interpolates_the_crossing():
    sweep = [(4.0, 0.5), (1.0, 1.0), (3.0, 0.85), (2.0, 0.95)]
    reading = max_rate_at_attainment(sweep, target=0.9)
    # between (2, 0.95) and (3, 0.85): 2 + (0.95 - 0.9) / (0.95 - 0.85) * 1 = 2.5
    assert reading.rate == pytest.approx(2.5)
    assert reading.highest_measured == 2.0
    assert reading.is_lower_bound is False


def test_max_rate_reads_the_first_drop_and_reports_bounds():
    # A noisy later point above the target does not count after the curve has dropped.
    reading = max_rate_at_attainment([(1, 0.92), (2, 0.8), (3, 0.95)], target=0.9)
    assert reading.rate == pytest.approx(1 + (0.92 - 0.9) / (0.92 - 0.8))
    every_point_meets = max_rate_at_attainment([(1, 1.0), (2, 0.9)], target=0.9)
    assert (every_point_meets.rate, every_point_meets.is_lower_bound) == (2, True)
    nothing_meets = max_rate_at_attainment([(1, 0.5), (2, 0.1)], target=0.9)
    assert nothing_meets.rate is None


def test_energy_counters_are_parsed_summed_and_differenced():
    text = (
        "# HELP engine:energy_joules_total Energy.\n"
        "# TYPE engine:energy_joules_total counter\n"
        'engine:energy_joules_total{device="0"} 100.5\n'
        'engine:energy_joules_total{device="1"} 50 1712345678\n'
        "agent_energy_joules_total 7\n"
        "engine:num_requests_running NaN\n"
    )
    totals = parse_prometheus(text)
    assert totals["engine:energy_joules_total"] == 150.5
    assert "engine:num_requests_running" not in totals
    assert pick_energy(totals, ("engine:energy_joules_total", "agent_energy_joules_total")) == (
        "engine:energy_joules_total",
        150.5,
    )
    assert pick_energy({"other": 1.0}, ("engine:energy_joules_total",)) is None
    before = {"a": ("engine:energy_joules_total", 100.0), "b": ("agent_energy_joules_total", 9.0)}
    after = {"a": ("engine:energy_joules_total", 130.0), "b": ("agent_energy_joules_total", 5.0)}
    assert energy_delta(before, after) == (
        30.0,
        ["agent_energy_joules_total", "engine:energy_joules_total"],
    )
    assert energy_delta({}, after) is None
