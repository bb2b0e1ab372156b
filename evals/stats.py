"""Paired comparison of two KV-cache settings on the same questions.

Both runs answer the same questions, so the comparison is paired: what matters is on how many
questions the candidate loses (baseline right, candidate wrong) or gains against the baseline.

- Verdict: a two-sided paired percentile-bootstrap interval of the accuracy difference
  (candidate − baseline) at the chosen confidence; pass when its lower bound ≥ −tolerance, i.e.
  the candidate is not worse than the baseline by more than the tolerance at that confidence.
  A question's paired difference is −1, 0 or +1, so a bootstrap resample is fully described by
  how many losses, ties and gains it draws: the resamples are drawn as multinomial counts, which
  is exactly the resampling of questions with replacement, at any number of questions.
- Reported alongside: the exact McNemar test (two-sided binomial test on the discordant pairs),
  which asks whether the two settings differ at all, not whether the difference is tolerable.

When both settings agree on every question the interval is [0, 0] whatever the number of
questions: the agreement is itself the evidence. Read `discordant` with the verdict.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class PairedComparison:
    n: int
    baseline_accuracy: float
    candidate_accuracy: float
    difference: float  # candidate − baseline
    ci_low: float
    ci_high: float
    confidence: float
    tolerance: float
    losses: int  # baseline right, candidate wrong
    gains: int  # baseline wrong, candidate right
    mcnemar_p: float
    passed: bool

    @property
    def discordant(self) -> int:
        return self.losses + self.gains

    def as_dict(self) -> dict:
        return asdict(self) | {"discordant": self.discordant}


def _as_outcomes(name: str, values) -> np.ndarray:
    array = np.asarray(values, dtype=float)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name}: need a non-empty 1-D sequence of per-question outcomes")
    if not np.isin(array, (0.0, 1.0)).all():
        raise ValueError(f"{name}: per-question outcomes must be 0 or 1")
    return array.astype(np.int64)


def mcnemar_exact_p(losses: int, gains: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of min(losses, gains) out of the
    discordant pairs at p = 1/2 (1.0 when there are no discordant pairs)."""
    if losses < 0 or gains < 0:
        raise ValueError("losses and gains must be >= 0")
    discordant = losses + gains
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, k) for k in range(min(losses, gains) + 1))
    return min(1.0, 2.0 * tail / 2.0**discordant)


def paired_bootstrap_interval(
    losses: int, ties: int, gains: int, confidence: float, resamples: int, seed: int
) -> tuple[float, float]:
    """Percentile interval of the mean paired difference, resampling questions with replacement."""
    n = losses + ties + gains
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, [losses / n, ties / n, gains / n], size=resamples)
    means = (counts[:, 2] - counts[:, 0]) / n
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1.0 - alpha / 2])
    return float(low), float(high)


def compare_paired(
    baseline,
    candidate,
    *,
    tolerance: float,
    confidence: float = 0.95,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> PairedComparison:
    """Compare per-question 0/1 outcomes of a candidate with a baseline on the same questions
    (element i of both is the same question)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    base = _as_outcomes("baseline", baseline)
    cand = _as_outcomes("candidate", candidate)
    if base.shape != cand.shape:
        raise ValueError(f"baseline and candidate must score the same questions: {base.size} vs {cand.size} outcomes")
    n = base.size
    losses = int(((base == 1) & (cand == 0)).sum())
    gains = int(((base == 0) & (cand == 1)).sum())
    low, high = paired_bootstrap_interval(losses, n - losses - gains, gains, confidence, resamples, seed)
    return PairedComparison(
        n=n,
        baseline_accuracy=float(base.mean()),
        candidate_accuracy=float(cand.mean()),
        difference=(gains - losses) / n,
        ci_low=low,
        ci_high=high,
        confidence=confidence,
        tolerance=tolerance,
        losses=losses,
        gains=gains,
        mcnemar_p=mcnemar_exact_p(losses, gains),
        # a small epsilon so that a bound equal to −tolerance is not failed by float rounding
        passed=low >= -tolerance - 1e-12,
    )
