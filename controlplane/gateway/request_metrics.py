"""The gateway's per-request Prometheus series: latency histograms by model and version,
refusals by limit, upstream errors by reason.

Label values are bounded: `model` is a model some routing table names (else "unknown"),
`version` the id of a version a routing table routed the request to (else "unknown"),
`outcome`, `limit` and `reason` each come from a fixed set. Tenants are never labels.

The histograms are kept here rather than in prometheus_client's `Histogram`, whose
`observe` takes a lock and walks the buckets in Python: the gateway observes every
inter-token gap of every stream, on the event loop that forwards the tokens. Here an
observation is one `bisect` and two additions (one event loop writes them; a scrape
copies the counts, so it may see an observation's bucket a moment before its sum).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import HistogramMetricFamily, Metric

from contracts.routing import RequestRecord
from controlplane.gateway.http_io import CLIENT_CLOSED

UNKNOWN = "unknown"

# Outcomes of a request, as the duration histogram labels them.
OK = "ok"
CLIENT_ERROR = "client_error"
RATE_LIMITED = "rate_limited"
UPSTREAM_ERROR = "upstream_error"
CANCELLED = "cancelled"
OUTCOMES = (OK, CLIENT_ERROR, RATE_LIMITED, UPSTREAM_ERROR, CANCELLED)

LIMITS = ("requests", "tokens")  # the tenant limit that refused a request
# Why a request routed to an agent failed on the agent's side.
UPSTREAM_REASONS = ("no_ready_agent", "timeout", "broken", "engine_error", "stream_error")
_REASON_OF_CODE = {
    "no_ready_agent": "no_ready_agent",
    "upstream_timeout": "timeout",
    "upstream_error": "broken",
    "stream_error": "stream_error",
}
RATE_LIMIT_CODES = frozenset({"rate_limit_exceeded", "request_exceeds_token_limit"})

# Seconds. A whole request: from a cached refusal to a long completion.
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
# Time to first token: tens of milliseconds on a warm engine, tens of seconds queued; the
# common SLO thresholds (0.5, 1, 2, 5 s) are bucket bounds, so burn rates read exactly.
TTFT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
    10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip
# Inter-token latency: milliseconds, up to the analysis's default limit (0.5 s) and past it.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip


class _Series:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket i: value <= bounds[i]
        self.total += value

    def observe_all(self, values: Iterable[float]) -> None:
        bounds, counts = self.bounds, self.counts
        total = 0.0
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            total += value
        self.total += total


class FastHistogram:
    """A labelled histogram for one event loop's hot path, collected at scrape time."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.bounds = tuple(float(bound) for bound in buckets)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"{name}: buckets must increase")
        self._series: dict[tuple[str, ...], _Series] = {}

    def labels(self, *values: str) -> _Series:
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = _Series(self.bounds)
        return series

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            counts = list(series.counts)  # one copy: the loop may observe meanwhile
            cumulative, buckets = 0, []
            for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append((_bound_text(bound), cumulative))
            family.add_metric(list(values), buckets, series.total)
        yield family


def _bound_text(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


REQUEST_DURATION = FastHistogram(
    "gateway_request_duration_seconds",
    "Tenant requests, from routing to the response's last byte, by outcome",
    ["model", "version", "outcome"],
    DURATION_BUCKETS,
)
TIME_TO_FIRST_TOKEN = FastHistogram(
    "gateway_time_to_first_token_seconds",
    "Time to the first token the client receives (a whole response: its arrival)",
    ["model", "version"],
    TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = FastHistogram(
    "gateway_inter_token_latency_seconds",
    "Gaps between a stream's consecutive tokens as forwarded to the client",
    ["model", "version"],
    ITL_BUCKETS,
)
for _histogram in (REQUEST_DURATION, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY):
    REGISTRY.register(_histogram)

UPSTREAM_ERRORS = Counter(
    "gateway_upstream_errors_total",
    "Routed requests that failed on the agent's side, by reason",
    ["model", "version", "reason"],
)
RATE_LIMITED_TOTAL = Counter(
    "gateway_rate_limited_total", "Requests refused by a tenant limit, by limit", ["limit"]
)
for _limit in LIMITS:
    RATE_LIMITED_TOTAL.labels(_limit)  # both series from the start, at zero


class RequestLabels:
    """What a request's series are labelled with, learnt as it is routed."""

    __slots__ = ("model", "started", "version")

    def __init__(self, started: float) -> None:
        self.started = started  # perf_counter() when the gateway took the request
        self.model = UNKNOWN
        self.version = UNKNOWN


def refusal_observe(labels: RequestLabels, *, status: int, code: str, seconds: float) -> None:
    """A request the gateway answered itself, without an agent's response."""
    if code in RATE_LIMIT_CODES:
        outcome = RATE_LIMITED
    elif status == CLIENT_CLOSED:
        outcome = CANCELLED
    elif status >= 500:
        outcome = UPSTREAM_ERROR
        reason = _REASON_OF_CODE.get(code, "engine_error")
        UPSTREAM_ERRORS.labels(labels.model, labels.version, reason).inc()
    else:
        outcome = CLIENT_ERROR
    REQUEST_DURATION.labels(labels.model, labels.version, outcome).observe(seconds)


def rate_limit_count(limit: str) -> None:
    RATE_LIMITED_TOTAL.labels(limit if limit in LIMITS else UNKNOWN).inc()


def request_observe(
    labels: RequestLabels, record: RequestRecord, *, gaps: Sequence[float], is_tokens: bool
) -> None:
    """A request routed to an agent, once its response is over (`gaps`: its stream's
    inter-token gaps; `is_tokens`: a response that carries tokens, not embeddings)."""
    model, version = labels.model, labels.version
    status = record.status
    if status == CLIENT_CLOSED:
        outcome = CANCELLED
    elif status >= 500:
        outcome = UPSTREAM_ERROR
        reason = _REASON_OF_CODE.get(record.error_code, "engine_error")
        UPSTREAM_ERRORS.labels(model, version, reason).inc()
    elif status == 429:
        outcome = RATE_LIMITED
    elif status >= 400:
        outcome = CLIENT_ERROR
    else:
        outcome = OK
    REQUEST_DURATION.labels(model, version, outcome).observe(record.e2e_s)
    if record.ttft_s is not None:
        TIME_TO_FIRST_TOKEN.labels(model, version).observe(record.ttft_s)
    elif outcome == OK and is_tokens and not record.is_stream:
        # A whole response: its first token reaches the client with the rest.
        TIME_TO_FIRST_TOKEN.labels(model, version).observe(record.e2e_s)
    if gaps:
        INTER_TOKEN_LATENCY.labels(model, version).observe_all(gaps)
