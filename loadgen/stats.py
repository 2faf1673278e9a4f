"""Client-side statistics: percentiles, per-request SLO checks, goodput and DistServe's max rate.

Two kinds of series: `ExactSeries` keeps every value (finite runs, exact percentiles) and
`StreamingSeries` keeps a log-bucketed histogram (forever mode: memory stays constant,
percentiles within 0.5 % relative error).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from contracts.stats import percentile

PERCENTILES = (50, 90, 95, 99)


class Series(Protocol):
    count: int

    def add(self, value: float) -> None: ...
    def mean(self) -> float | None: ...
    def percentile(self, q: float) -> float | None: ...
    def values(self) -> list[float] | None: ...


class ExactSeries:
    """Every value; exact percentiles."""

    def __init__(self) -> None:
        self._values: list[float] = []
        self.count = 0

    def add(self, value: float) -> None:
        self._values.append(value)
        self.count += 1

    def mean(self) -> float | None:
        return sum(self._values) / self.count if self.count else None

    def percentile(self, q: float) -> float | None:
        return percentile(self._values, q) if self._values else None

    def values(self) -> list[float] | None:
        return self._values


class StreamingSeries:
    """A log-bucketed histogram: constant memory, about 0.5 % relative error.

    Bucket i holds values in [MIN * G**i, MIN * G**(i+1)); a percentile reports the
    geometric middle of its bucket. Values below MIN count in bucket 0.
    """

    MIN = 1e-6
    GROWTH = 1.01

    def __init__(self) -> None:
        self._buckets: dict[int, int] = {}
        self.count = 0
        self._sum = 0.0

    def _index(self, value: float) -> int:
        if value <= self.MIN:
            return 0
        return int(math.log(value / self.MIN) / math.log(self.GROWTH))

    def add(self, value: float) -> None:
        index = self._index(value)
        self._buckets[index] = self._buckets.get(index, 0) + 1
        self.count += 1
        self._sum += value

    def mean(self) -> float | None:
        return self._sum / self.count if self.count else None

    def percentile(self, q: float) -> float | None:
        if not self.count:
            return None
        target = q / 100 * (self.count - 1)
        seen = 0
        for index in sorted(self._buckets):
            seen += self._buckets[index]
            if seen > target:
                return float(self.MIN * self.GROWTH ** (index + 0.5))
        return float(self.MIN * self.GROWTH ** (max(self._buckets) + 0.5))

    def values(self) -> list[float] | None:
        return None


def describe(series: Series) -> dict[str, float | int | None]:
    """count, mean and the PERCENTILES of a series (None where empty)."""
    summary: dict[str, float | int | None] = {"count": series.count, "mean": series.mean()}
    for q in PERCENTILES:
        summary[f"p{q}"] = series.percentile(q)
    return summary


@dataclass(slots=True, frozen=True)
class Slo:
    """Per-request limits, in seconds. A request is good when it succeeded and meets both."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("SLO limits must be positive")


def time_per_output_token(e2e_s: float, ttft_s: float, completion_tokens: int) -> float | None:
    """TPOT as vLLM's and DistServe's benchmarks define it: decode time over tokens after the
    first. None for a single-token answer (no decode phase)."""
    if completion_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (completion_tokens - 1)


def meets_slo(slo: Slo, *, is_success: bool, ttft_s: float | None, tpot_s: float | None) -> bool:
    if not is_success or ttft_s is None:
        return False
    return ttft_s <= slo.ttft_s and (tpot_s is None or tpot_s <= slo.tpot_s)


@dataclass(slots=True, frozen=True)
class MaxRate:
    """The highest request rate whose SLO attainment stays at or above the target.

    `rate` is interpolated linearly between the last sweep point that meets the target and
    the first that does not; `highest_measured` is that last meeting point itself.
    `is_lower_bound` is true when every point met the target (the true maximum is higher).
    `rate` is None when even the lowest point missed.
    """

    rate: float | None
    highest_measured: float | None
    is_lower_bound: bool


def max_rate_at_attainment(points: Iterable[tuple[float, float]], target: float = 0.9) -> MaxRate:
    """DistServe's per-GPU goodput: the maximum rate at which SLO attainment >= target.

    `points` are (rate, attainment) pairs from a sweep, attainment in 0..1. The curve is read
    from the lowest rate up and stops at its first drop below the target.
    """
    ordered = sorted(points)
    if not ordered:
        raise ValueError("a sweep needs at least one point")
    previous: tuple[float, float] | None = None
    for rate, attainment in ordered:
        if attainment < target:
            if previous is None:
                return MaxRate(rate=None, highest_measured=None, is_lower_bound=False)
            low_rate, low_attainment = previous
            fraction = (low_attainment - target) / (low_attainment - attainment)
            interpolated = low_rate + fraction * (rate - low_rate)
            return MaxRate(rate=interpolated, highest_measured=low_rate, is_lower_bound=False)
        previous = (rate, attainment)
    return MaxRate(rate=ordered[-1][0], highest_measured=ordered[-1][0], is_lower_bound=True)


@dataclass(slots=True)
class RunStats:
    """Running aggregates of one run (or one sweep step, or one reporting window)."""

    slo: Slo
    is_exact: bool = True
    requests: int = 0
    successes: int = 0
    good: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_reported: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    ttft: Series = field(init=False)
    itl: Series = field(init=False)
    tpot: Series = field(init=False)
    e2e: Series = field(init=False)
    first_start: float | None = None
    last_end: float | None = None

    def __post_init__(self) -> None:
        kind = ExactSeries if self.is_exact else StreamingSeries
        self.ttft, self.itl, self.tpot, self.e2e = kind(), kind(), kind(), kind()

    def record(
        self,
        *,
        status: str,
        is_success: bool,
        started: float,
        e2e_s: float,
        ttft_s: float | None,
        itls: Sequence[float],
        prompt_tokens: int,
        completion_tokens: int,
        usage_reported: bool,
    ) -> bool:
        """Add one finished request; returns whether it met the SLO."""
        self.requests += 1
        self.statuses[status] += 1
        self.first_start = started if self.first_start is None else min(self.first_start, started)
        end = started + e2e_s
        self.last_end = end if self.last_end is None else max(self.last_end, end)
        tpot = None
        if is_success:
            self.successes += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.usage_reported += usage_reported
            self.e2e.add(e2e_s)
            if ttft_s is not None:
                self.ttft.add(ttft_s)
                tpot = time_per_output_token(e2e_s, ttft_s, completion_tokens)
                if tpot is not None:
                    self.tpot.add(tpot)
            for gap in itls:
                self.itl.add(gap)
        is_good = meets_slo(self.slo, is_success=is_success, ttft_s=ttft_s, tpot_s=tpot)
        self.good += is_good
        return is_good

    def elapsed_s(self) -> float:
        if self.first_start is None or self.last_end is None:
            return 0.0
        return max(self.last_end - self.first_start, 1e-9)

    def summary(self, elapsed_s: float | None = None) -> dict[str, object]:
        """Every figure of the run as plain JSON-ready values.

        Throughputs divide by `elapsed_s` (the wall time of the run when given, otherwise
        first request start to last request end).
        """
        elapsed = elapsed_s if elapsed_s is not None else self.elapsed_s()
        per_second = (lambda n: n / elapsed) if elapsed > 0 else (lambda n: 0.0)
        errors = {status: n for status, n in sorted(self.statuses.items()) if status != "200"}
        return {
            "requests": self.requests,
            "successes": self.successes,
            "errors": sum(errors.values()),
            "errors_by_status": errors,
            "elapsed_s": elapsed,
            "request_throughput": per_second(self.successes),
            "output_token_throughput": per_second(self.completion_tokens),
            "total_token_throughput": per_second(self.prompt_tokens + self.completion_tokens),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "usage_reported_share": (
                self.usage_reported / self.successes if self.successes else None
            ),
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s},
            "good_requests": self.good,
            "slo_attainment": self.good / self.requests if self.requests else None,
            "goodput": per_second(self.good),
            "ttft_s": describe(self.ttft),
            "itl_s": describe(self.itl),
            "tpot_s": describe(self.tpot),
            "e2e_s": describe(self.e2e),
        }
