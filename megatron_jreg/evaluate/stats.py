"""The significance test of the paper's Appendix G: scipy's paired t-test over seeds read on both tails, with the
one-sided bound; a difference with no spread is NaN, never "significant" (DEVELOPERS.md, evaluate)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean, stdev

import numpy as np
from scipy import stats

# Spread at most this fraction of the scores' magnitude is rounding (float32 leaves ~1.2e-7), not a difference.
TIE_RTOL = 1e-6


@dataclass(frozen=True)
class PairedTest:
    """One paired test; `mean_diff` is JREG - baseline in the metric's units; t, p_*, bound NaN if undefined."""

    n: int
    mean_diff: float
    sd_diff: float
    t: float
    p_value: float  # one-sided, H1: JREG better
    p_worse: float  # one-sided, H1: JREG worse
    p_two_sided: float
    bound: float  # one-sided `confidence` bound on mean_diff: lower if higher_is_better, else upper
    confidence: float
    higher_is_better: bool = True

    @property
    def defined(self) -> bool:
        return not math.isnan(self.t)

    @property
    def tested(self) -> bool:
        return self.n >= 2

    @property
    def significant(self) -> bool:
        return self.p_value < 1.0 - self.confidence

    @property
    def worse(self) -> bool:
        return self.p_worse < 1.0 - self.confidence


def _check_scores(name: str, values: Sequence[float]) -> None:
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{name} score {i} is {value!r}, not a finite number; leave that seed out of both arms or "
                             "re-evaluate")


def paired_one_sided(jreg: Sequence[float], baseline: Sequence[float], confidence: float = 0.95,
                     higher_is_better: bool = True) -> PairedTest:
    """Paired t-test of JREG against the baseline; ValueError for inputs whose p-value would mean nothing."""
    if len(jreg) != len(baseline):
        raise ValueError(f"paired test needs as many JREG as baseline scores, got {len(jreg)} and {len(baseline)}")
    n = len(jreg)
    if n < 2:
        raise ValueError(f"a t-test needs at least 2 seeds per arm, got {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence}: must be between 0 and 1")
    _check_scores("JREG", jreg)
    _check_scores("baseline", baseline)
    diffs = [float(j) - float(b) for j, b in zip(jreg, baseline)]
    mean, sd = fmean(diffs), stdev(diffs)
    scale = max(abs(float(x)) for x in [*jreg, *baseline])
    if sd <= TIE_RTOL * scale:
        nan = math.nan
        return PairedTest(n, mean, sd, nan, nan, nan, nan, nan, confidence, higher_is_better)
    better, worse = ("greater", "less") if higher_is_better else ("less", "greater")
    test = stats.ttest_rel(jreg, baseline, alternative=better)
    t, p = float(test.statistic), float(test.pvalue)
    p_worse = float(stats.ttest_rel(jreg, baseline, alternative=worse).pvalue)
    p_two = min(1.0, 2.0 * min(p, p_worse))
    interval = test.confidence_interval(confidence)
    bound = float(interval.low if higher_is_better else interval.high)
    return PairedTest(n, mean, sd, t, p, p_worse, p_two, bound, confidence, higher_is_better)


def untested(jreg: float, baseline: float, confidence: float = 0.95, higher_is_better: bool = True) -> PairedTest:
    """One seed per arm: the difference alone (a t-test has no degrees of freedom on one pair)."""
    _check_scores("JREG", [jreg])
    _check_scores("baseline", [baseline])
    nan = math.nan
    return PairedTest(1, float(jreg) - float(baseline), nan, nan, nan, nan, nan, nan, confidence, higher_is_better)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values in input order; a NaN p stays NaN and counts in m (it cannot be rejected)."""
    p = np.asarray(p_values, dtype=float)
    if (bad := np.flatnonzero((p < 0) | (p > 1))).size:
        raise ValueError(f"p-value {p_values[bad[0]]!r} at position {bad[0]}: must be in [0, 1] or NaN")
    order = np.argsort(p, kind="stable")  # NaN last, running max keeps it NaN
    adjusted = np.empty_like(p)
    adjusted[order] = np.maximum.accumulate(np.minimum(1.0, (len(p) - np.arange(len(p))) * p[order]))
    return adjusted.tolist()
