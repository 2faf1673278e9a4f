"""Interval figures from successive /metrics snapshots: differenced counters and histograms."""

import pytest

from agent.engines.prometheus import Histogram, MetricsSnapshot
from agent.telemetry import TelemetryAccumulator

INF = float("inf")


def latency(under_100ms: float, under_1s: float, total_s: float) -> Histogram:
    """Cumulative buckets: so many under 0.1 s, so many under 1 s, none slower."""
    return Histogram(
        buckets=((0.1, under_100ms), (1.0, under_1s), (INF, under_1s)),
        sum=total_s,
        count=under_1s,
    )


def snapshot(
    generated: float,
    prompt: float,
    ok: float = 0,
    failed: float = 0,
    aborted: float = 0,
    ttft: Histogram | None = None,
    itl: Histogram | None = None,
) -> MetricsSnapshot:
    return MetricsSnapshot(
        running=1,
        kv_cache_usage=0.1,
        prompt_tokens=prompt,
        generation_tokens=generated,
        requests_ok=ok,
        requests_failed=failed,
        requests_aborted=aborted,
        ttft=ttft,
        itl=itl,
    )


def test_each_interval_counts_only_what_is_new() -> None:
    telemetry = TelemetryAccumulator()
    # The engine warmed up with one request: its baseline, not traffic.
    telemetry.begin_engine("e1", snapshot(100, 50, ok=1, ttft=latency(1, 1, 0.05)))
    first = telemetry.observe(
        {"e1": snapshot(130, 60, ok=2, ttft=latency(1, 2, 0.45), itl=latency(29, 29, 0.58))}
    )
    assert (first.generated_tokens, first.prompt_tokens) == (30, 10)
    assert (first.requests_ok, first.requests_failed) == (1, 0)
    # the interval's one request took between 0.1 and 1 s to its first token
    assert first.ttft_p95_s is not None and 0.1 < first.ttft_p95_s <= 1.0
    assert first.itl_mean_s == pytest.approx(0.02)
    second = telemetry.observe(
        {"e1": snapshot(150, 70, ok=2, failed=1, aborted=1, ttft=latency(1, 2, 0.45))}
    )
    assert (second.generated_tokens, second.requests_ok) == (20, 0)
    assert (second.requests_failed, second.requests_aborted) == (1, 1)
    assert second.ttft_p95_s is None  # no first token in this interval
    assert telemetry.generated_tokens_total == 50
    assert telemetry.requests_failed_total == 1


def test_a_restarted_engine_is_a_counter_reset_and_engines_add_up() -> None:
    telemetry = TelemetryAccumulator()
    telemetry.observe({"old": snapshot(500, 0)})
    figures = telemetry.observe({"old": snapshot(20, 0), "new": snapshot(7, 0)})
    assert figures.generated_tokens == 27


def test_two_engines_latencies_are_merged_into_one_distribution() -> None:
    telemetry = TelemetryAccumulator()
    figures = telemetry.observe(
        {
            "old": snapshot(0, 0, ttft=latency(9, 9, 0.45)),
            "new": snapshot(0, 0, ttft=Histogram(((0.5, 1), (INF, 1)), sum=0.4, count=1)),
        }
    )
    assert figures.ttft_p50_s is not None and figures.ttft_p50_s <= 0.1
    assert figures.ttft_p95_s is not None and 0.1 < figures.ttft_p95_s <= 0.5


def test_an_engine_begun_before_a_heartbeat_sees_it_keeps_its_warm_up_out() -> None:
    telemetry = TelemetryAccumulator()
    telemetry.begin_engine("new", snapshot(40, 90))
    telemetry.observe({})  # a heartbeat that read the engines before "new" was current
    figures = telemetry.observe({"new": snapshot(52, 95)})
    assert (figures.generated_tokens, figures.prompt_tokens) == (12, 5)
    telemetry.observe({})  # once seen, an engine that is gone keeps no mark
    assert telemetry.observe({"new": snapshot(3, 1)}).generated_tokens == 3
