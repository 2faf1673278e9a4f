"""Interval figures from engine stats: counters, finished requests after a watermark."""

from agent.telemetry import TelemetryAccumulator


def stats(generated: int, prompt: int, recent: list[dict]) -> dict:
    return {
        "generation_tokens_total": generated,
        "prompt_tokens_total": prompt,
        "running": 1,
        "waiting": 0,
        "kv_cache_usage": 0.1,
        "recent": recent,
    }


def request(finished_at: float, status: str = "ok", ttft: float = 0.1, tokens: int = 11) -> dict:
    return {
        "finished_at": finished_at,
        "status": status,
        "ttft_s": ttft,
        "itl_mean_s": 0.02,
        "itl_p95_s": 0.03,
        "prompt_tokens": 5,
        "completion_tokens": tokens,
    }


def test_each_interval_counts_only_what_is_new() -> None:
    telemetry = TelemetryAccumulator()
    telemetry.begin_engine("e1", stats(100, 50, [request(10.0)]), now=10.5)  # warm-up excluded
    first = telemetry.observe({"e1": stats(130, 60, [request(10.0), request(11.0, ttft=0.2)])})
    assert (first.generated_tokens, first.prompt_tokens) == (30, 10)
    assert (first.requests_ok, first.requests_failed) == (1, 0)
    assert first.ttft_p95_s == 0.2
    assert first.itl_mean_s == 0.02
    second = telemetry.observe(
        {
            "e1": stats(
                150,
                70,
                [request(10.0), request(11.0), request(12.0, "error"), request(12.5, "aborted")],
            )
        }
    )
    assert (second.generated_tokens, second.requests_ok) == (20, 0)
    assert (second.requests_failed, second.requests_aborted) == (1, 1)
    assert second.ttft_p95_s is None
    assert telemetry.generated_tokens_total == 50
    assert telemetry.requests_failed_total == 1


def test_a_restarted_engine_is_a_counter_reset_and_engines_add_up() -> None:
    telemetry = TelemetryAccumulator()
    telemetry.observe({"old": stats(500, 0, [])})
    figures = telemetry.observe({"old": stats(20, 0, []), "new": stats(7, 0, [])})
    assert figures.generated_tokens == 27


def test_an_engine_begun_before_a_heartbeat_sees_it_keeps_its_warm_up_out() -> None:
    telemetry = TelemetryAccumulator()
    telemetry.begin_engine("new", stats(40, 90, []), now=1.0)
    telemetry.observe({})  # a heartbeat that read the engines before "new" was current
    figures = telemetry.observe({"new": stats(52, 95, [])})
    assert (figures.generated_tokens, figures.prompt_tokens) == (12, 5)
    telemetry.observe({})  # once seen, an engine that is gone keeps no watermark
    assert telemetry.observe({"new": stats(3, 1, [])}).generated_tokens == 3
