"""The significance test of the paper's Appendix G: a one-sided paired t-test over training seeds.

With per-seed scores b_i (baseline) and j_i (JREG) of the same seed i, d_i = j_i - b_i, n seeds:
    mean = (1/n) sum d_i,  s = sqrt(sum (d_i - mean)^2 / (n - 1)),  se = s / sqrt(n),  t = mean / se
    p = P(T_{n-1} >= t)                       (H0: mean <= 0, H1: JREG is better)
    lower = mean - t_{n-1, confidence} * se   (lower end of the one-sided confidence interval)
JREG is better at level 1 - confidence exactly when p < 1 - confidence, i.e. when lower > 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats


@dataclass(frozen=True)
class PairedTest:
    n: int
    mean_diff: float
    t: float
    p_value: float
    lower_bound: float
    confidence: float

    @property
    def significant(self) -> bool:
        """JREG better at level 1 - confidence (False when the test is undefined: no variation, mean 0)."""
        return self.p_value < 1.0 - self.confidence


def paired_one_sided(
    jreg: Sequence[float], baseline: Sequence[float], confidence: float = 0.95
) -> PairedTest:
    """One-sided paired t-test of jreg > baseline over paired seeds (formulas in the module docstring).

    Equal differences on every seed have no spread: t is +-inf (p 0 or 1) unless they are all zero,
    where the test is undefined (t and p NaN), as in scipy.
    """
    if len(jreg) != len(baseline):
        raise ValueError(
            f"paired test needs as many JREG as baseline scores, got {len(jreg)} and {len(baseline)}"
        )
    n = len(jreg)
    if n < 2:
        raise ValueError(f"a t-test needs at least 2 seeds per arm, got {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence}: must be between 0 and 1")
    diffs = [j - b for j, b in zip(jreg, baseline)]
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1)) / math.sqrt(n)
    if se > 0.0:
        t = mean / se
    else:
        t = math.copysign(math.inf, mean) if mean != 0.0 else math.nan
    p = float(stats.t.sf(t, n - 1))
    lower = mean - float(stats.t.ppf(confidence, n - 1)) * se
    return PairedTest(n=n, mean_diff=mean, t=t, p_value=p, lower_bound=lower, confidence=confidence)
