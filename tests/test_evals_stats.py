"""The paired comparison behind the gsm8k verdict, on constructed per-question outcomes."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from evals.stats import compare_paired, mcnemar_exact_p, paired_bootstrap_interval


def outcomes(both_right: int, losses: int, gains: int, both_wrong: int):
    """Baseline and candidate outcomes with the given counts of each kind of question."""
    baseline = [1] * both_right + [1] * losses + [0] * gains + [0] * both_wrong
    candidate = [1] * both_right + [0] * losses + [1] * gains + [0] * both_wrong
    return baseline, candidate


def test_equal_outcomes_pass_with_zero_difference():
    baseline, candidate = outcomes(both_right=60, losses=0, gains=0, both_wrong=40)
    result = compare_paired(baseline, candidate, tolerance=0.0)
    assert result.passed
    assert result.difference == 0.0
    assert (result.ci_low, result.ci_high) == (0.0, 0.0)
    assert result.mcnemar_p == 1.0


def test_clear_regression_fails():
    # the candidate loses 30 of 100 questions the baseline got right and gains none
    baseline, candidate = outcomes(both_right=30, losses=30, gains=0, both_wrong=40)
    result = compare_paired(baseline, candidate, tolerance=0.05)
    assert not result.passed
    assert result.difference == pytest.approx(-0.30)
    assert result.ci_high < 0.0
    assert result.mcnemar_p < 1e-8


def test_balanced_noise_passes_within_tolerance_but_not_at_zero_tolerance():
    baseline, candidate = outcomes(both_right=500, losses=20, gains=20, both_wrong=460)
    loose = compare_paired(baseline, candidate, tolerance=0.05)
    strict = compare_paired(baseline, candidate, tolerance=0.0)
    assert loose.passed and not strict.passed
    assert loose.ci_low < 0.0 < loose.ci_high
    assert loose.mcnemar_p == 1.0


def test_interval_widens_with_fewer_questions():
    # the same proportions of losses, gains and ties, on 1000 and on 50 questions
    many = compare_paired(*outcomes(500, 40, 20, 440), tolerance=0.05)
    few = compare_paired(*outcomes(25, 2, 1, 22), tolerance=0.05)
    assert many.difference == pytest.approx(few.difference)
    assert (few.ci_high - few.ci_low) > 3 * (many.ci_high - many.ci_low)
    assert many.passed and not few.passed


def test_bootstrap_matches_the_normal_approximation_on_many_questions():
    losses, ties, gains = 300, 9000, 200
    n = losses + ties + gains
    low, high = paired_bootstrap_interval(losses, ties, gains, 0.95, resamples=20_000, seed=7)
    diffs = np.array([-1] * losses + [0] * ties + [1] * gains)
    half_width = 1.959964 * diffs.std() / np.sqrt(n)
    assert low == pytest.approx(diffs.mean() - half_width, abs=1e-3)
    assert high == pytest.approx(diffs.mean() + half_width, abs=1e-3)


def test_bootstrap_is_deterministic_for_a_seed():
    args = (12, 70, 18, 0.9)
    assert paired_bootstrap_interval(*args, resamples=2000, seed=3) == paired_bootstrap_interval(
        *args, resamples=2000, seed=3
    )


@pytest.mark.parametrize("losses,gains", [(0, 0), (1, 0), (10, 2), (3, 9), (25, 25), (0, 40)])
def test_mcnemar_matches_scipy_binomial_test(losses, gains):
    expected = 1.0 if losses + gains == 0 else scipy_stats.binomtest(gains, losses + gains, 0.5).pvalue
    assert mcnemar_exact_p(losses, gains) == pytest.approx(expected, rel=1e-12)


def test_higher_confidence_gives_a_wider_interval():
    baseline, candidate = outcomes(50, 8, 4, 38)
    narrow = compare_paired(baseline, candidate, tolerance=0.1, confidence=0.8)
    wide = compare_paired(baseline, candidate, tolerance=0.1, confidence=0.99)
    assert wide.ci_low < narrow.ci_low and wide.ci_high > narrow.ci_high


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"baseline": [1, 0], "candidate": [1]}, "same questions"),
        ({"baseline": [1, 2], "candidate": [1, 0]}, "0 or 1"),
        ({"baseline": [], "candidate": []}, "non-empty"),
        ({"baseline": [1], "candidate": [1], "confidence": 1.0}, "confidence"),
        ({"baseline": [1], "candidate": [1], "tolerance": -0.1}, "tolerance"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(kwargs, message):
    kwargs.setdefault("tolerance", 0.0)
    with pytest.raises(ValueError, match=message):
        compare_paired(**kwargs)
