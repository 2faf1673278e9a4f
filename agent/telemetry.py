"""Interval figures from the engines' /admin/stats, and the agent's running totals.

Each heartbeat covers the interval since the previous one: token counts come from the
engines' monotonic counters (a restart of an engine is a counter reset), latencies and
request outcomes from the `recent` list of finished requests after a watermark.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from contracts.stats import percentile


@dataclass(slots=True)
class IntervalFigures:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    itl_mean_s: float | None = None
    itl_p95_s: float | None = None


@dataclass(slots=True)
class _EngineWatermark:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    finished_after: float = 0.0
    is_observed: bool = False  # a heartbeat has seen its stats


def _counter(stats: Mapping[str, Any], name: str) -> int:
    value = stats.get(name, 0)
    return int(value) if isinstance(value, int | float) and value >= 0 else 0


def _delta(now: int, before: int) -> int:
    return now - before if now >= before else now  # a reset counter starts again from 0


@dataclass
class TelemetryAccumulator:
    """Turns successive stats of one or more engines into interval figures and totals."""

    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    requests_ok_total: int = 0
    requests_failed_total: int = 0
    _engines: dict[str, _EngineWatermark] = field(default_factory=dict)

    def begin_engine(self, key: str, stats: Mapping[str, Any] | None, now: float) -> None:
        """Count only what an engine does from now on (its warm-up is not traffic)."""
        stats = stats or {}
        self._engines[key] = _EngineWatermark(
            prompt_tokens_total=_counter(stats, "prompt_tokens_total"),
            generation_tokens_total=_counter(stats, "generation_tokens_total"),
            finished_after=now,
        )

    def observe(self, stats_by_engine: Mapping[str, Mapping[str, Any] | None]) -> IntervalFigures:
        figures = IntervalFigures()
        ttfts: list[float] = []
        itl_p95s: list[float] = []
        itl_weighted_sum = 0.0
        itl_weight = 0
        for key, stats in stats_by_engine.items():
            if stats is None:
                continue
            mark = self._engines.setdefault(key, _EngineWatermark())
            mark.is_observed = True
            prompt_total = _counter(stats, "prompt_tokens_total")
            generated_total = _counter(stats, "generation_tokens_total")
            figures.prompt_tokens += _delta(prompt_total, mark.prompt_tokens_total)
            figures.generated_tokens += _delta(generated_total, mark.generation_tokens_total)
            mark.prompt_tokens_total, mark.generation_tokens_total = prompt_total, generated_total
            newest = mark.finished_after
            recent = stats.get("recent")
            for request in recent if isinstance(recent, list) else []:
                if not isinstance(request, dict):
                    continue
                finished_at = request.get("finished_at")
                if not isinstance(finished_at, int | float) or finished_at <= mark.finished_after:
                    continue
                newest = max(newest, float(finished_at))
                status = request.get("status")
                if status == "ok":
                    figures.requests_ok += 1
                    ttft = request.get("ttft_s")
                    if isinstance(ttft, int | float):
                        ttfts.append(float(ttft))
                    itl_mean = request.get("itl_mean_s")
                    completion = request.get("completion_tokens")
                    if isinstance(itl_mean, int | float) and isinstance(completion, int):
                        gaps = max(0, completion - 1)
                        itl_weighted_sum += float(itl_mean) * gaps
                        itl_weight += gaps
                    itl_p95 = request.get("itl_p95_s")
                    if isinstance(itl_p95, int | float):
                        itl_p95s.append(float(itl_p95))
                elif status == "aborted":
                    figures.requests_aborted += 1
                else:
                    figures.requests_failed += 1
            mark.finished_after = newest
        # Engines that are gone keep no watermark; one begun but not yet in a heartbeat
        # keeps its own, or its warm-up would be counted as traffic.
        for key, mark in list(self._engines.items()):
            if key not in stats_by_engine and mark.is_observed:
                del self._engines[key]
        figures.ttft_p50_s = percentile(ttfts, 50)
        figures.ttft_p95_s = percentile(ttfts, 95)
        figures.itl_mean_s = itl_weighted_sum / itl_weight if itl_weight else None
        figures.itl_p95_s = percentile(itl_p95s, 95)
        self.prompt_tokens_total += figures.prompt_tokens
        self.generated_tokens_total += figures.generated_tokens
        self.requests_ok_total += figures.requests_ok
        self.requests_failed_total += figures.requests_failed
        return figures
