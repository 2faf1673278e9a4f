"""Canary analysis as pure functions on sample arrays: no database, no clock.

`analyze` compares canary with baseline over one window and returns a verdict
(pass, fail, inconclusive) with its figures, human-readable reasons and each signal's own
verdict (`SIGNALS`);
`stage_decide` turns a verdict and the stage's progress into an action;
`hard_breach` is the fast path ingest calls on the last N canary requests.

Latencies are in milliseconds. Error flags are booleans (True = the request failed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, TypeGuard

import numpy as np
from scipy import stats

from contracts.stats import percentile


class Verdict(StrEnum):
    PASS = "pass"  # noqa: S105 - a verdict, not a password
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


# The signals an analysis judges, each with a verdict of its own: the canary's absolute
# limits, and its comparisons with the baseline. A signal not compared (too few samples,
# loads too different, no energy figures) is inconclusive.
SIGNALS = (
    "ttft_p95_limit",
    "itl_p95_limit",
    "error_rate_limit",
    "ttft_vs_baseline",
    "itl_vs_baseline",
    "errors_vs_baseline",
    "energy_vs_baseline",
)


class Action(StrEnum):
    WAIT = "wait"  # the stage has not run long enough; nothing changes
    ADVANCE = "advance"  # next stage (or promoted after the last one)
    ROLLBACK = "rollback"
    EXTEND = "extend"  # inconclusive at the stage's end: run it longer
    FAIL = "fail"  # inconclusive past the extension limit, policy "fail"
    HOLD = "hold"  # inconclusive past the extension limit, policy "hold": pause for a human


class OnInconclusive(StrEnum):
    FAIL = "fail"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class AnalysisPolicy:
    """The SLO policy of one rollout. Every field has a default; a rollout overrides any."""

    ttft_p95_max_ms: float = 2000.0
    itl_p95_max_ms: float = 500.0
    error_rate_max: float = 0.05
    # One-sided tests are significant below this p-value.
    alpha: float = 0.01
    # The rank test asks "is the canary slower than baseline x (1 + tolerance)?", so that
    # a difference too small to matter is not a failure however many samples there are.
    latency_tolerance: float = 0.10
    # Canary joules per token may exceed the baseline's by this fraction.
    energy_tolerance: float = 0.15
    # Energy per token is compared only where the two sides' tokens per agent-second are
    # within this ratio: an engine with less traffic batches less, and the weights it
    # reads per step are most of a token's energy (a 25 % canary beside a 75 % baseline
    # would fail on load alone).
    energy_load_ratio: float = 0.75
    # Fewer samples than this on either side: inconclusive.
    min_samples: int = 30
    # Analysis window (seconds, never before the stage started).
    window_s: float = 60.0
    # Inconclusive at a stage's end extends it by `extension_s`, at most `max_extensions` times.
    extension_s: float = 30.0
    max_extensions: int = 3
    on_inconclusive: str = OnInconclusive.FAIL.value
    # Fast path: error rate above this in the last `hard_breach_window` canary requests.
    hard_error_rate_max: float = 0.5
    hard_breach_window: int = 20

    def __post_init__(self) -> None:
        positive = ("ttft_p95_max_ms", "itl_p95_max_ms", "window_s", "extension_s")
        for name in positive:
            value = getattr(self, name)
            if not is_number(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        fractions = ("error_rate_max", "hard_error_rate_max", "energy_load_ratio")
        for name in fractions:
            value = getattr(self, name)
            if not is_number(value) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be between 0 and 1, got {value!r}")
        if not is_number(self.alpha) or not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be between 0 and 1 (exclusive), got {self.alpha!r}")
        for name in ("latency_tolerance", "energy_tolerance"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("min_samples", "hard_breach_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        max_ext = self.max_extensions
        if isinstance(max_ext, bool) or not isinstance(max_ext, int) or max_ext < 0:
            raise ValueError(f"max_extensions must be an integer >= 0, got {max_ext!r}")
        if self.on_inconclusive not in OnInconclusive.__members__.values():
            raise ValueError(
                f"on_inconclusive must be 'fail' or 'hold', got {self.on_inconclusive!r}"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AnalysisPolicy:
        data = dict(data or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown policy fields: {', '.join(unknown)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Samples:
    """One side of the comparison over one window."""

    ttft_ms: Sequence[float] = ()
    itl_ms: Sequence[float] = ()
    errors: Sequence[bool] = ()  # one flag per request
    joules_per_token: float | None = None
    # tokens per second per agent serving the version over the window (its load)
    tokens_per_agent_s: float | None = None

    @property
    def requests(self) -> int:
        return len(self.errors)


@dataclass(slots=True)
class AnalysisResult:
    verdict: Verdict
    reasons: list[str]
    baseline: dict[str, Any]
    canary: dict[str, Any]
    tests: dict[str, Any] = field(default_factory=dict)
    # signal (SIGNALS) -> its verdict's value
    signals: dict[str, str] = field(
        default_factory=lambda: dict.fromkeys(SIGNALS, Verdict.INCONCLUSIVE.value)
    )


def summarize(samples: Samples) -> dict[str, Any]:
    errors = int(sum(1 for flag in samples.errors if flag))
    requests = samples.requests
    return {
        "requests": requests,
        "errors": errors,
        "error_rate": (errors / requests) if requests else None,
        "ttft_p50_ms": percentile(samples.ttft_ms, 50),
        "ttft_p95_ms": percentile(samples.ttft_ms, 95),
        "itl_p50_ms": percentile(samples.itl_ms, 50),
        "itl_p95_ms": percentile(samples.itl_ms, 95),
        "joules_per_token": samples.joules_per_token,
        "tokens_per_agent_s": samples.tokens_per_agent_s,
    }


def mann_whitney_greater(
    canary: Sequence[float], baseline: Sequence[float], *, tolerance: float
) -> dict[str, float]:
    """One-sided Mann-Whitney U: is the canary stochastically greater than baseline x (1+tol)?"""
    shifted = np.asarray(baseline, dtype=float) * (1.0 + tolerance)
    result = stats.mannwhitneyu(
        np.asarray(canary, dtype=float), shifted, alternative="greater", method="auto"
    )
    return {"u": float(result.statistic), "p_value": float(result.pvalue)}


def two_proportion_z_greater(
    canary_errors: int, canary_n: int, baseline_errors: int, baseline_n: int
) -> dict[str, float]:
    """One-sided pooled two-proportion z-test: is the canary's error rate higher?

    With no variance (no errors at all, or only errors) the rates are equal: z = 0, p = 0.5
    is not what a reader expects, so the p-value is 1.0 (no evidence of a difference).
    """
    if canary_n == 0 or baseline_n == 0:
        raise ValueError("both sides need at least one request")
    p_canary = canary_errors / canary_n
    p_baseline = baseline_errors / baseline_n
    pooled = (canary_errors + baseline_errors) / (canary_n + baseline_n)
    variance = pooled * (1 - pooled) * (1 / canary_n + 1 / baseline_n)
    if variance == 0:
        return {"z": 0.0, "p_value": 1.0}
    z = (p_canary - p_baseline) / math.sqrt(variance)
    return {"z": z, "p_value": float(stats.norm.sf(z))}


def analyze(
    *, baseline: Samples, canary: Samples, policy: AnalysisPolicy, compare_latency: bool = True
) -> AnalysisResult:
    """Compare canary with baseline over one window.

    `compare_latency=False` leaves out the latency rank tests (the absolute limits still
    apply): for windows in which the two sides did not carry comparable load.
    """
    base = summarize(baseline)
    can = summarize(canary)
    result = AnalysisResult(verdict=Verdict.PASS, reasons=[], baseline=base, canary=can)
    if canary.requests < policy.min_samples or baseline.requests < policy.min_samples:
        result.verdict = Verdict.INCONCLUSIVE
        result.reasons.append(
            f"not enough samples: canary {canary.requests}, baseline {baseline.requests},"
            f" need {policy.min_samples} each"
        )
        return result

    failures: list[str] = []
    signals = result.signals

    def judge(signal: str, is_failed: bool) -> None:
        signals[signal] = (Verdict.FAIL if is_failed else Verdict.PASS).value

    # Absolute SLO limits on the canary.
    if can["ttft_p95_ms"] is not None:
        judge("ttft_p95_limit", can["ttft_p95_ms"] > policy.ttft_p95_max_ms)
    if signals["ttft_p95_limit"] == Verdict.FAIL:
        failures.append(
            f"TTFT p95 {can['ttft_p95_ms']:.1f} ms is over the limit {policy.ttft_p95_max_ms:g} ms"
        )
    if can["itl_p95_ms"] is not None:
        judge("itl_p95_limit", can["itl_p95_ms"] > policy.itl_p95_max_ms)
    if signals["itl_p95_limit"] == Verdict.FAIL:
        failures.append(
            f"ITL p95 {can['itl_p95_ms']:.1f} ms is over the limit {policy.itl_p95_max_ms:g} ms"
        )
    judge("error_rate_limit", can["error_rate"] > policy.error_rate_max)
    if signals["error_rate_limit"] == Verdict.FAIL:
        failures.append(
            f"error rate {can['error_rate']:.3f} is over the limit {policy.error_rate_max:g}"
        )

    # Rank tests on latency, canary against baseline.
    if not compare_latency:
        result.reasons.append(
            "latency rank tests left out: the baseline had no traffic at the canary's load;"
            " absolute limits apply"
        )
    for name, canary_values, baseline_values in (
        ("ttft", canary.ttft_ms, baseline.ttft_ms),
        ("itl", canary.itl_ms, baseline.itl_ms),
    ):
        if not compare_latency or (
            len(canary_values) < policy.min_samples or len(baseline_values) < policy.min_samples
        ):
            result.tests[f"{name}_mann_whitney"] = None
            continue
        test = mann_whitney_greater(
            canary_values, baseline_values, tolerance=policy.latency_tolerance
        )
        result.tests[f"{name}_mann_whitney"] = test
        judge(f"{name}_vs_baseline", test["p_value"] < policy.alpha)
        if test["p_value"] < policy.alpha:
            failures.append(
                f"{name.upper()} is higher on the canary than on the baseline"
                f" (+{policy.latency_tolerance:.0%} tolerance): Mann-Whitney"
                f" p={test['p_value']:.2g} < {policy.alpha:g}"
            )

    # Proportion test on errors.
    errors = two_proportion_z_greater(
        can["errors"], can["requests"], base["errors"], base["requests"]
    )
    result.tests["errors_z"] = errors
    judge("errors_vs_baseline", errors["p_value"] < policy.alpha)
    if errors["p_value"] < policy.alpha:
        failures.append(
            f"error rate {can['error_rate']:.3f} is higher than the baseline's"
            f" {base['error_rate']:.3f}: z={errors['z']:.2f}, p={errors['p_value']:.2g}"
        )

    # Energy per token against the baseline, at comparable loads.
    canary_load, baseline_load = canary.tokens_per_agent_s, baseline.tokens_per_agent_s
    load_ratio = None
    if (
        canary_load is not None
        and baseline_load is not None
        and max(canary_load, baseline_load) > 0
    ):
        load_ratio = min(canary_load, baseline_load) / max(canary_load, baseline_load)
    if canary.joules_per_token is None or baseline.joules_per_token is None:
        result.reasons.append("energy per token: no figures for one side; not compared")
    elif load_ratio is not None and load_ratio < policy.energy_load_ratio:
        result.tests["energy_load_ratio"] = load_ratio
        result.reasons.append(
            f"energy per token: loads differ ({canary.tokens_per_agent_s:.3g} tokens/s per"
            f" agent on the canary, {baseline.tokens_per_agent_s:.3g} on the baseline, ratio"
            f" {load_ratio:.2f} < {policy.energy_load_ratio:g}); not compared"
        )
    else:
        limit = baseline.joules_per_token * (1 + policy.energy_tolerance)
        result.tests["energy_limit_j_per_token"] = limit
        judge("energy_vs_baseline", canary.joules_per_token > limit)
        if canary.joules_per_token > limit:
            failures.append(
                f"energy {canary.joules_per_token:.4g} J/token is over the baseline's"
                f" {baseline.joules_per_token:.4g} J/token + {policy.energy_tolerance:.0%}"
            )

    if failures:
        result.verdict = Verdict.FAIL
        result.reasons[:0] = failures
    else:
        result.reasons.insert(0, "canary within every limit and not worse than baseline")
    return result


def stage_decide(
    *,
    verdict: Verdict,
    elapsed_s: float,
    canary_requests_in_stage: int,
    min_duration_s: float,
    min_requests: int,
    extensions: int,
    policy: AnalysisPolicy,
) -> Action:
    """What the analysis does with a verdict, given how far the stage has come.

    A fail rolls back at once. Otherwise nothing happens until the stage has run its
    minimum duration (plus any extensions) and seen its minimum canary requests; then
    pass advances and inconclusive extends, up to the limit, then fails or holds.
    """
    if verdict == Verdict.FAIL:
        return Action.ROLLBACK
    stage_end_s = min_duration_s + extensions * policy.extension_s
    if elapsed_s < stage_end_s:
        return Action.WAIT
    if verdict == Verdict.PASS and canary_requests_in_stage >= min_requests:
        return Action.ADVANCE
    if extensions < policy.max_extensions:
        return Action.EXTEND
    if policy.on_inconclusive == OnInconclusive.HOLD:
        return Action.HOLD
    return Action.FAIL


def hard_breach(*, recent_errors: Sequence[bool], policy: AnalysisPolicy) -> str | None:
    """The fast path: a reason when the last N canary requests breach the hard error limit."""
    window = list(recent_errors)[-policy.hard_breach_window :]
    if len(window) < policy.hard_breach_window:
        return None
    rate = sum(1 for flag in window if flag) / len(window)
    if rate > policy.hard_error_rate_max:
        return (
            f"hard breach: error rate {rate:.2f} in the last {len(window)} canary requests"
            f" is over {policy.hard_error_rate_max:g}"
        )
    return None


def is_number(value: Any) -> TypeGuard[int | float]:
    """A finite int or float (a bool is not a number here)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
