"""An engine's Prometheus /metrics text read into one snapshot, and two snapshots into an
interval's figures.

Every backend's reading goes through here: a backend only names its series (MetricNames).
Counters and histograms are differenced between two scrapes (a counter that went down is an
engine restart: it counts again from zero); latency percentiles come from the differenced
histogram buckets, interpolated within a bucket as Prometheus' histogram_quantile does.
Series of one name with different labels (a model name, an engine index, a finish reason)
are added up.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


class MetricsTextError(ValueError):
    """The /metrics body is not Prometheus text."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bucket counts by upper bound (+Inf last), their sum and count."""

    buckets: tuple[tuple[float, float], ...]
    sum: float
    count: float

    def minus(self, before: Histogram | None) -> Histogram:
        """What was observed since `before` (all of it when `before` is None or reset)."""
        if before is None or self.count < before.count or self.sum < before.sum:
            return self
        earlier = dict(before.buckets)
        return Histogram(
            buckets=tuple((le, max(0.0, n - earlier.get(le, 0.0))) for le, n in self.buckets),
            sum=self.sum - before.sum,
            count=self.count - before.count,
        )

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) by linear interpolation within its bucket; None when
        empty or when it falls in the +Inf bucket with no finite bound below it."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for upper_bound, cumulative in self.buckets:
            if cumulative >= rank and cumulative > lower_count:
                if math.isinf(upper_bound):
                    return lower_bound if lower_bound > 0 else None
                share = (rank - lower_count) / (cumulative - lower_count)
                return lower_bound + (upper_bound - lower_bound) * share
            lower_bound, lower_count = upper_bound, cumulative
        return None

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Which series of a backend's /metrics carry each heartbeat figure.

    Names are as exposed, without a counter's `_total` or a histogram's suffixes. A tuple
    lists alternatives (renamed across versions): the first one present is read.
    """

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    kv_cache_usage: tuple[str, ...] = ()  # a ratio, 1 is full
    prompt_tokens: tuple[str, ...] = ()
    generation_tokens: tuple[str, ...] = ()
    preemptions: tuple[str, ...] = ()
    ttft: tuple[str, ...] = ()  # histograms, seconds
    itl: tuple[str, ...] = ()
    # Finished requests: one counter labelled by reason, or separate counters.
    requests_by_reason: str = ""
    reason_label: str = "finished_reason"
    ok_reasons: frozenset[str] = frozenset({"stop", "length"})
    aborted_reasons: frozenset[str] = frozenset({"abort"})
    requests_ok: tuple[str, ...] = ()
    requests_aborted: tuple[str, ...] = ()
    requests_failed: tuple[str, ...] = ()
    # No ITL histogram: the mean from a seconds counter over a tokens counter.
    itl_seconds_counter: tuple[str, ...] = ()
    itl_tokens_counter: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """One scrape: gauges as they are, counters and histograms as totals so far."""

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    requests_ok: float = 0.0
    requests_aborted: float = 0.0
    requests_failed: float = 0.0
    ttft: Histogram | None = None
    itl: Histogram | None = None


@dataclass(slots=True)
class _Samples:
    """Sample values by sample name, added up over label sets (le kept for buckets)."""

    values: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    buckets: dict[str, dict[float, float]] = field(default_factory=lambda: defaultdict(dict))
    by_label: dict[tuple[str, str, str], float] = field(default_factory=lambda: defaultdict(float))

    def first(self, names: tuple[str, ...], suffixes: tuple[str, ...]) -> float | None:
        for name in names:
            for suffix in suffixes:
                if name + suffix in self.values:
                    return self.values[name + suffix]
        return None

    def gauge(self, names: tuple[str, ...]) -> float:
        return self.first(names, ("",)) or 0.0

    def counter(self, names: tuple[str, ...]) -> float:
        return self.first(names, ("_total", "")) or 0.0

    def histogram(self, names: tuple[str, ...]) -> Histogram | None:
        for name in names:
            buckets = self.buckets.get(name + "_bucket")
            if buckets:
                return Histogram(
                    buckets=tuple(sorted(buckets.items())),
                    sum=self.values.get(name + "_sum", 0.0),
                    count=self.values.get(name + "_count", max(buckets.values())),
                )
        return None


def _samples(text: str, label: str) -> _Samples:
    samples = _Samples()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value = float(sample.value)
                if math.isnan(value):
                    continue
                if sample.name.endswith("_bucket") and "le" in sample.labels:
                    bound = float(sample.labels["le"])
                    buckets = samples.buckets[sample.name]
                    buckets[bound] = buckets.get(bound, 0.0) + value
                    continue
                samples.values[sample.name] += value
                if label in sample.labels:
                    samples.by_label[(sample.name, label, sample.labels[label])] += value
    except ValueError as exc:
        raise MetricsTextError(f"not Prometheus text: {exc}") from exc
    return samples


def read_snapshot(text: str, names: MetricNames) -> MetricsSnapshot:
    """The figures `names` points at in one /metrics body (absent series read as zero)."""
    samples = _samples(text, names.reason_label)
    ok = samples.counter(names.requests_ok)
    aborted = samples.counter(names.requests_aborted)
    failed = samples.counter(names.requests_failed)
    if names.requests_by_reason:
        counter = names.requests_by_reason
        for (sample_name, _, reason), value in samples.by_label.items():
            if sample_name not in (counter + "_total", counter):
                continue
            if reason in names.ok_reasons:
                ok += value
            elif reason in names.aborted_reasons:
                aborted += value
            else:
                failed += value
    itl = samples.histogram(names.itl)
    if itl is None and names.itl_seconds_counter:
        seconds = samples.first(names.itl_seconds_counter, ("_total", ""))
        tokens = samples.first(names.itl_tokens_counter, ("_total", ""))
        if seconds is not None and tokens is not None:
            itl = Histogram(buckets=((math.inf, tokens),), sum=seconds, count=tokens)
    return MetricsSnapshot(
        running=samples.gauge(names.running),
        waiting=samples.gauge(names.waiting),
        kv_cache_usage=samples.gauge(names.kv_cache_usage),
        prompt_tokens=samples.counter(names.prompt_tokens),
        generation_tokens=samples.counter(names.generation_tokens),
        preemptions=samples.counter(names.preemptions),
        requests_ok=ok,
        requests_aborted=aborted,
        requests_failed=failed,
        ttft=samples.histogram(names.ttft),
        itl=itl,
    )


def counter_delta(now: float, before: float) -> float:
    """A counter's increase; one that went down was reset and counts again from zero."""
    return now - before if now >= before else now


def histograms_merge(histograms: list[Histogram]) -> Histogram | None:
    """Several engines' interval histograms as one (bounds united, counts added)."""
    if not histograms:
        return None
    if len(histograms) == 1:
        return histograms[0]
    bounds = sorted({le for histogram in histograms for le, _ in histogram.buckets})

    def cumulative_at(histogram: Histogram, bound: float) -> float:
        # the count at or below `bound`: the nearest bucket at or below it
        below = [n for le, n in histogram.buckets if le <= bound]
        return below[-1] if below else 0.0

    return Histogram(
        buckets=tuple((le, sum(cumulative_at(h, le) for h in histograms)) for le in bounds),
        sum=sum(h.sum for h in histograms),
        count=sum(h.count for h in histograms),
    )
