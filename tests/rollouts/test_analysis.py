"""Analysis as pure functions: hand-computed figures and scipy cross-checks."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from controlplane.rollouts.analysis import (
    SIGNALS,
    Action,
    AnalysisPolicy,
    Samples,
    Verdict,
    analyze,
    hard_breach,
    mann_whitney_greater,
    stage_decide,
    summarize,
    two_proportion_z_greater,
)

POLICY = AnalysisPolicy(min_samples=5, alpha=0.05, latency_tolerance=0.0)


def test_summary_counts_errors_and_rates() -> None:
    figures = summarize(Samples(ttft_ms=[1, 2], itl_ms=[3], errors=[True, False, False, False]))
    assert figures["requests"] == 4
    assert figures["errors"] == 1
    assert figures["error_rate"] == 0.25
    assert figures["ttft_p50_ms"] == 1.5
    assert figures["itl_p95_ms"] == 3.0


def test_two_proportion_z_matches_the_hand_computation() -> None:
    # canary 10/100, baseline 2/100: pooled 0.06, se = sqrt(0.06 * 0.94 * 0.02) = 0.033586
    result = two_proportion_z_greater(10, 100, 2, 100)
    se = math.sqrt(0.06 * 0.94 * (2 / 100))
    assert result["z"] == pytest.approx(0.08 / se)
    assert result["z"] == pytest.approx(2.381965, abs=1e-6)
    assert result["p_value"] == pytest.approx(stats.norm.sf(0.08 / se))
    assert result["p_value"] == pytest.approx(0.008610, abs=1e-6)


def test_two_proportion_z_without_variance_is_no_evidence() -> None:
    assert two_proportion_z_greater(0, 50, 0, 70) == {"z": 0.0, "p_value": 1.0}
    assert two_proportion_z_greater(50, 50, 70, 70) == {"z": 0.0, "p_value": 1.0}


def test_mann_whitney_is_scipys_one_sided_test_on_the_shifted_baseline() -> None:
    canary = [12.0, 15.0, 14.0, 18.0, 20.0, 16.0]
    baseline = [10.0, 11.0, 9.0, 12.0, 10.5, 11.5]
    result = mann_whitney_greater(canary, baseline, tolerance=0.1)
    expected = stats.mannwhitneyu(canary, np.array(baseline) * 1.1, alternative="greater")
    assert result == {"u": float(expected.statistic), "p_value": float(expected.pvalue)}
    # U counts the pairs where the canary is larger. Shifted baseline: 11, 12.1, 9.9, 13.2,
    # 11.55, 12.65. Canary 12 beats 3 of them; 14, 15, 16, 18, 20 beat all 6: 3 + 30 = 33.
    assert result["u"] == 33.0


def test_a_slower_canary_fails_with_reasons() -> None:
    baseline = Samples(
        ttft_ms=[100.0 + i for i in range(40)], itl_ms=[20.0] * 40, errors=[False] * 40
    )
    canary = Samples(
        ttft_ms=[300.0 + i for i in range(40)], itl_ms=[20.0] * 40, errors=[False] * 40
    )
    result = analyze(baseline=baseline, canary=canary, policy=POLICY)
    assert result.verdict == Verdict.FAIL
    assert result.reasons[0].startswith("TTFT is higher on the canary than on the baseline")
    assert result.tests["ttft_mann_whitney"]["u"] == 1600.0
    assert result.tests["itl_mann_whitney"]["p_value"] > 0.05


def test_an_equal_canary_passes() -> None:
    values = [100.0 + (i % 7) for i in range(40)]
    side = Samples(ttft_ms=values, itl_ms=[20.0 + (i % 3) for i in range(40)], errors=[False] * 40)
    result = analyze(baseline=side, canary=side, policy=POLICY)
    assert result.verdict == Verdict.PASS
    assert result.reasons == [
        "canary within every limit and not worse than baseline",
        "energy per token: no figures for one side; not compared",
    ]


def test_absolute_limits_fail_even_when_baseline_is_as_bad() -> None:
    policy = AnalysisPolicy(min_samples=5, ttft_p95_max_ms=150.0, error_rate_max=0.05)
    side = Samples(
        ttft_ms=[100.0, 120.0, 140.0, 160.0, 200.0],
        itl_ms=[10.0] * 5,
        errors=[True, False, False, False, False],
    )
    result = analyze(baseline=side, canary=side, policy=policy)
    assert result.verdict == Verdict.FAIL
    assert result.reasons[:2] == [
        "TTFT p95 192.0 ms is over the limit 150 ms",
        "error rate 0.200 is over the limit 0.05",
    ]


def test_energy_over_tolerance_fails() -> None:
    base = Samples(ttft_ms=[10.0] * 5, itl_ms=[5.0] * 5, errors=[False] * 5, joules_per_token=1.0)
    can = Samples(ttft_ms=[10.0] * 5, itl_ms=[5.0] * 5, errors=[False] * 5, joules_per_token=1.2)
    result = analyze(
        baseline=base, canary=can, policy=AnalysisPolicy(min_samples=5, energy_tolerance=0.15)
    )
    assert result.verdict == Verdict.FAIL
    assert result.tests["energy_limit_j_per_token"] == pytest.approx(1.15)
    assert result.reasons == ["energy 1.2 J/token is over the baseline's 1 J/token + 15%"]
    assert result.signals == {
        "ttft_p95_limit": "pass",
        "itl_p95_limit": "pass",
        "error_rate_limit": "pass",
        "ttft_vs_baseline": "pass",
        "itl_vs_baseline": "pass",
        "errors_vs_baseline": "pass",
        "energy_vs_baseline": "fail",
    }


def test_signals_not_judged_are_inconclusive() -> None:
    few = Samples(ttft_ms=[10.0] * 4, itl_ms=[5.0] * 4, errors=[False] * 4)
    result = analyze(baseline=few, canary=few, policy=POLICY)
    assert result.verdict == Verdict.INCONCLUSIVE
    assert set(result.signals.values()) == {"inconclusive"}
    assert set(result.signals) == set(SIGNALS)
    # At a full-weight stage the rank tests are left out; with no energy figures, energy too.
    side = Samples(ttft_ms=[10.0] * 5, itl_ms=[5.0] * 5, errors=[False] * 5)
    full = analyze(baseline=side, canary=side, policy=POLICY, compare_latency=False)
    assert [name for name, verdict in full.signals.items() if verdict == "inconclusive"] == [
        "ttft_vs_baseline",
        "itl_vs_baseline",
        "energy_vs_baseline",
    ]


def energy_side(joules_per_token: float, tokens_per_agent_s: float) -> Samples:
    return Samples(
        ttft_ms=[10.0] * 5,
        itl_ms=[5.0] * 5,
        errors=[False] * 5,
        joules_per_token=joules_per_token,
        tokens_per_agent_s=tokens_per_agent_s,
    )


def test_energy_is_not_compared_at_unequal_loads() -> None:
    """A 25 % canary batches less than a 75 % baseline and reads its weights for fewer
    tokens per step: its energy per token says more about its load than its version."""
    policy = AnalysisPolicy(min_samples=5)
    result = analyze(baseline=energy_side(1.0, 9.0), canary=energy_side(2.5, 3.0), policy=policy)
    assert result.verdict == Verdict.PASS
    assert result.tests["energy_load_ratio"] == pytest.approx(1 / 3)
    assert "energy_limit_j_per_token" not in result.tests
    assert result.reasons[1] == (
        "energy per token: loads differ (3 tokens/s per agent on the canary, 9 on the"
        " baseline, ratio 0.33 < 0.75); not compared"
    )
    assert result.canary["tokens_per_agent_s"] == 3.0


def test_energy_is_compared_at_comparable_loads() -> None:
    policy = AnalysisPolicy(min_samples=5)
    result = analyze(baseline=energy_side(1.0, 9.0), canary=energy_side(1.2, 8.0), policy=policy)
    assert result.verdict == Verdict.FAIL
    assert result.reasons == ["energy 1.2 J/token is over the baseline's 1 J/token + 15%"]
    # the ratio is the policy's to set: 0 compares at any load
    result = analyze(
        baseline=energy_side(1.0, 9.0),
        canary=energy_side(1.2, 1.0),
        policy=AnalysisPolicy(min_samples=5, energy_load_ratio=0.0),
    )
    assert result.verdict == Verdict.FAIL


def test_too_few_samples_is_inconclusive() -> None:
    side = Samples(ttft_ms=[1.0] * 4, itl_ms=[1.0] * 4, errors=[False] * 4)
    result = analyze(baseline=side, canary=side, policy=POLICY)
    assert result.verdict == Verdict.INCONCLUSIVE
    assert result.reasons == ["not enough samples: canary 4, baseline 4, need 5 each"]


@pytest.mark.parametrize(
    ("verdict", "elapsed", "requests", "extensions", "on_inconclusive", "expected"),
    [
        (Verdict.FAIL, 1, 0, 0, "fail", Action.ROLLBACK),
        (Verdict.PASS, 59, 500, 0, "fail", Action.WAIT),
        (Verdict.PASS, 60, 50, 0, "fail", Action.ADVANCE),
        (Verdict.PASS, 60, 49, 0, "fail", Action.EXTEND),
        (Verdict.INCONCLUSIVE, 60, 50, 0, "fail", Action.EXTEND),
        (Verdict.INCONCLUSIVE, 80, 50, 1, "fail", Action.WAIT),
        (Verdict.INCONCLUSIVE, 90, 50, 1, "fail", Action.EXTEND),
        (Verdict.INCONCLUSIVE, 120, 50, 2, "fail", Action.FAIL),
        (Verdict.INCONCLUSIVE, 120, 50, 2, "hold", Action.HOLD),
        (Verdict.PASS, 120, 50, 2, "hold", Action.ADVANCE),
    ],
)
def test_stage_decisions(verdict, elapsed, requests, extensions, on_inconclusive, expected) -> None:
    policy = AnalysisPolicy(extension_s=30, max_extensions=2, on_inconclusive=on_inconclusive)
    action = stage_decide(
        verdict=verdict,
        elapsed_s=elapsed,
        canary_requests_in_stage=requests,
        min_duration_s=60,
        min_requests=50,
        extensions=extensions,
        policy=policy,
    )
    assert action == expected


def test_hard_breach_needs_a_full_window_over_the_limit() -> None:
    policy = AnalysisPolicy(hard_breach_window=4, hard_error_rate_max=0.5)
    assert hard_breach(recent_errors=[True, True, True], policy=policy) is None
    assert hard_breach(recent_errors=[False, True, True, False, False], policy=policy) is None
    assert hard_breach(recent_errors=[False, True, True, True], policy=policy) == (
        "hard breach: error rate 0.75 in the last 4 canary requests is over 0.5"
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"alpha": 1.5}, "alpha must be between 0 and 1"),
        ({"min_samples": 0}, "min_samples must be an integer >= 1"),
        ({"on_inconclusive": "shrug"}, "on_inconclusive must be 'fail' or 'hold'"),
        ({"ttft_p95_max_ms": -1}, "ttft_p95_max_ms must be a positive number"),
        ({"energy_load_ratio": 1.5}, "energy_load_ratio must be between 0 and 1"),
        ({"surprise": 1}, "unknown policy fields: surprise"),
    ],
)
def test_policy_validation_names_the_field(data, message) -> None:
    with pytest.raises(ValueError, match=message):
        AnalysisPolicy.from_dict(data)


@settings(max_examples=60, deadline=None)
@given(
    canary=st.lists(st.floats(1, 1000), min_size=8, max_size=40),
    baseline=st.lists(st.floats(1, 1000), min_size=8, max_size=40),
)
def test_mann_whitney_agrees_with_scipy_for_any_samples(canary, baseline) -> None:
    result = mann_whitney_greater(canary, baseline, tolerance=0.0)
    expected = stats.mannwhitneyu(canary, baseline, alternative="greater")
    assert result["p_value"] == pytest.approx(float(expected.pvalue))
    assert 0.0 <= result["p_value"] <= 1.0
