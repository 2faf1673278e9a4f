"""Interval figures from the engines' /metrics snapshots, and the agent's running totals.

Each heartbeat covers the interval since the previous one: every counter and histogram is
the difference between this scrape and the engine's previous one (agent/engines/
prometheus.py reads a scrape, whichever the engine). An engine's first snapshot, taken
when it became current, is the baseline, so its warm-up is not counted as traffic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.engines.prometheus import (
    Histogram,
    MetricsSnapshot,
    counter_delta,
    histograms_merge,
)


@dataclass(slots=True)
class IntervalFigures:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    requests_aborted: int = 0
    preemptions: int = 0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    itl_mean_s: float | None = None
    itl_p95_s: float | None = None


@dataclass(slots=True)
class _EngineMark:
    last: MetricsSnapshot
    is_observed: bool = False  # a heartbeat has seen it


def _count(now: float, before: float) -> int:
    return round(counter_delta(now, before))


@dataclass
class TelemetryAccumulator:
    """Turns successive snapshots of one or more engines into interval figures and totals."""

    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    requests_ok_total: int = 0
    requests_failed_total: int = 0
    _engines: dict[str, _EngineMark] = field(default_factory=dict)

    def begin_engine(self, key: str, snapshot: MetricsSnapshot | None) -> None:
        """Count only what an engine does from now on (its warm-up is not traffic)."""
        self._engines[key] = _EngineMark(last=snapshot or MetricsSnapshot())

    def observe(self, snapshots: Mapping[str, MetricsSnapshot | None]) -> IntervalFigures:
        figures = IntervalFigures()
        ttfts: list[Histogram] = []
        itls: list[Histogram] = []
        for key, now in snapshots.items():
            if now is None:
                continue
            mark = self._engines.get(key)
            if mark is None:
                # Never begun (it was serving before the agent saw it): all of it counts.
                mark = self._engines[key] = _EngineMark(last=MetricsSnapshot())
            before = mark.last
            mark.last, mark.is_observed = now, True
            figures.prompt_tokens += _count(now.prompt_tokens, before.prompt_tokens)
            figures.generated_tokens += _count(now.generation_tokens, before.generation_tokens)
            figures.requests_ok += _count(now.requests_ok, before.requests_ok)
            figures.requests_failed += _count(now.requests_failed, before.requests_failed)
            figures.requests_aborted += _count(now.requests_aborted, before.requests_aborted)
            figures.preemptions += _count(now.preemptions, before.preemptions)
            if now.ttft is not None:
                ttfts.append(now.ttft.minus(before.ttft))
            if now.itl is not None:
                itls.append(now.itl.minus(before.itl))
        # Engines that are gone keep no mark; one begun but not yet in a heartbeat keeps
        # its own, or its warm-up would be counted as traffic.
        for key, mark in list(self._engines.items()):
            if key not in snapshots and mark.is_observed:
                del self._engines[key]
        ttft = histograms_merge(ttfts)
        itl = histograms_merge(itls)
        if ttft is not None:
            figures.ttft_p50_s = ttft.quantile(0.50)
            figures.ttft_p95_s = ttft.quantile(0.95)
        if itl is not None:
            figures.itl_mean_s = itl.mean()
            figures.itl_p95_s = itl.quantile(0.95)
        self.prompt_tokens_total += figures.prompt_tokens
        self.generated_tokens_total += figures.generated_tokens
        self.requests_ok_total += figures.requests_ok
        self.requests_failed_total += figures.requests_failed
        return figures
