"""Study v3's pre-registered analysis: endpoints, the test, the family, the verdict rule, MDE and power.

Fixed here and committed before the first v3 run (issue 30); `experiments/study/study.py --design v3` trains and
measures, the v3 report is made from its raw files with these functions only. What v3 changes from v2
(experiments/study/report_v3.md, "Earlier designs"), and why:

- Regime: 12 layers × 64 (2 heads, FFN 176), the regime in which a top-of-stack jump formed in 7 of 8 baseline
  seeds (experiments/demo_regimes/regimes.txt). Seeds 9..20: fresh, never used to choose the regime (that used 1..8).
- Arms at one token budget (4 × 3,000 × 128 = 1,536,000 tokens): baseline-small (batch 4, 3,000 steps),
  baseline-large (batch 16, 750 steps), jreg-a1 (λ = 1, α = 1) and jreg-a0 (λ = 1, α = 0) at the small batch.
- Primary endpoints that do not depend on which layer jumps: the top-of-stack rise R = 100 · max over
  ℓ ∈ {L−2, L−1, L} of (Ψ_ℓ − Ψ_{ℓ−1}), unclipped (it is negative when the top three layers all move less than
  the one below), instead of ζ_L, which is clipped at 0 and is 0 for every JREG run (a paired test cannot fit
  differences (−x, 0, 0, 0)). Held-out cross-entropy for the language-modelling claims.
- The mechanism, measured by removing layers (a layer's output := its input) at the final checkpoint on every
  held-out window: ΔCE when the top 2 layers are removed, and the dispersion of single-layer ΔCE over the middle
  layers (coefficient of variation, sd/mean, population sd, over the central half ℓ = L/4+1 .. L − L/4).
- The test: the exact paired sign-flip permutation test of the mean difference (all 2^n sign patterns), two-sided,
  as the primary test; the paired t-test and the Wilcoxon signed-rank test beside it. One Holm family over
  every primary endpoint below (family-wise error 0.05). Verdict: *confirmed* when the Holm-adjusted
  two-sided p < 0.05 and the mean lies on the predicted side, *contradicted* when it is < 0.05 on the other
  side, *inconclusive* otherwise. Every difference gets a 95 % CI from inverting the same sign-flip test (and
  the t-interval beside it). "JREG worse" is stated as a finding when a language-modelling contrast's 95 % CI
  lies above 0, whatever the verdict.
- MDE and power under the rule actually used: the exact sign-flip test at the Holm step that is hardest to pass,
  0.05 / m two-sided (m = the family's size), normal paired differences, by simulation (`power`, `mde`).

Every primary endpoint is a final-checkpoint quantity on every held-out window, paired by seed.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

import numpy as np

LEVEL = 0.05
POWER = 0.80
SEEDS = tuple(range(9, 21))  # 12 fresh seeds (the regime was chosen on seeds 1..8)
TOP = 3  # R: the largest rise among the top TOP layers
REMOVED_TOP = 2  # M-a: ΔCE of removing the top REMOVED_TOP layers


@dataclass(frozen=True)
class Endpoint:
    """A paired contrast over seeds: value(arm) − value(reference); the hypothesis predicts `sign` (+1 or −1)."""

    key: str
    claim: str
    arm: str
    reference: str
    metric: str  # a name of `METRICS`
    sign: int
    label: str
    source: str  # where the claim comes from


# Fixed before the runs: the one Holm family.
PRIMARY = (
    Endpoint("ii", "(ii) more steps at a fixed token budget make the top-of-stack jump larger", "baseline-small",
             "baseline-large", "top_rise", +1, "R(baseline-small) − R(baseline-large)",
             "paper §3.4: 170M, ζ_L 1.93 with 20K steps vs 7.24 with 200K steps at 100B tokens"),
    Endpoint("iii", "(iii) JREG (λ = 1, α = 1) removes the top-of-stack jump", "jreg-a1", "baseline-small",
             "top_rise", -1, "R(jreg-a1) − R(baseline-small)",
             "paper Table 2: 1B, ζ_L 6.42 → 0.00 with λ = 1, α = 1"),
    Endpoint("iv", "(iv) JREG (α = 1) improves held-out language modelling", "jreg-a1", "baseline-small", "ce", -1,
             "CE(jreg-a1) − CE(baseline-small), nats/token",
             "paper §4: 10 seeds, mean downstream gain +0.41 points, one-sided paired t-test p = 0.034"),
    Endpoint("v", "(v) JREG with uniform layer weights (α = 0) improves held-out language modelling", "jreg-a0",
             "baseline-small", "ce", -1, "CE(jreg-a0) − CE(baseline-small), nats/token",
             "study v1 (commit 383c20c): 6 × 128, 300 steps, 3 seeds: −0.092 nats, one-sided p 0.008"),
    Endpoint("ma", "(M-a) JREG makes its top layers removable: removing the top 2 layers costs less", "jreg-a1",
             "baseline-small", "removal_top", -1,
             f"ΔCE_top{REMOVED_TOP}(jreg-a1) − ΔCE_top{REMOVED_TOP}(baseline-small)",
             "our Ψ tables: JREG's top two layers become near-identity maps (v2: Ψ_11 0.0027, Ψ_12 0.0003)"),
    Endpoint("mb", "(M-b) JREG spreads the work more evenly over the middle layers", "jreg-a1", "baseline-small",
             "removal_dispersion", -1, "CV of middle-layer ΔCE(jreg-a1) − CV(baseline-small)",
             "paper §5: JREG leads to 'a more balanced use of the middle layers'"),
)
LM_KEYS = ("iv", "v")  # the language-modelling contrasts ("JREG worse" when the CI lies above 0)

# Reported with the same test and CI, outside the Holm family.
SECONDARY = (
    Endpoint("iii-a0", "JREG with α = 0 removes the top-of-stack jump", "jreg-a0", "baseline-small", "top_rise",
             -1, "R(jreg-a0) − R(baseline-small)", "paper: removed for every α of {0, 0.1, 0.3, 0.5, 1, 3} (170M)"),
    *(Endpoint(f"{e.key}:{m}", f"{e.claim}, on {m}", e.arm, e.reference, m, e.sign, f"{m}: {e.arm} − {e.reference}",
               e.source) for e in PRIMARY[:2] for m in ("zeta_L", "zeta_L-1", "zeta_L-2", "psi_L_over_mid")),
    Endpoint("ma:top1", "removing the top layer costs less with JREG", "jreg-a1", "baseline-small", "removal_top1",
             -1, "ΔCE_top1(jreg-a1) − ΔCE_top1(baseline-small)", "mechanism, k = 1"),
    Endpoint("ma:top3", "removing the top 3 layers costs less with JREG", "jreg-a1", "baseline-small", "removal_top3",
             -1, "ΔCE_top3(jreg-a1) − ΔCE_top3(baseline-small)", "mechanism, k = 3"),
    Endpoint("ma-a0", "removing the top 2 layers costs less with JREG α = 0", "jreg-a0", "baseline-small",
             "removal_top", -1, "ΔCE_top2(jreg-a0) − ΔCE_top2(baseline-small)", "mechanism, α = 0"),
    Endpoint("mb-a0", "α = 0 spreads the work more evenly over the middle layers", "jreg-a0", "baseline-small",
             "removal_dispersion", -1, "CV(jreg-a0) − CV(baseline-small)", "mechanism, α = 0"),
)


# ----------------------------------------------------------------------------------------------------------
# the measures, from a run's final held-out measurement (`heldout`) and its layer-removal record (`removal`)


def top_rise(psi: list[float], top: int = TOP) -> float:
    """R = 100 · max over the top `top` layers ℓ of (Ψ_ℓ − Ψ_{ℓ−1}); unclipped."""
    if len(psi) < top + 1:
        raise ValueError(f"top-of-stack rise needs more than {top} layers, got {len(psi)}")
    return 100.0 * max(psi[i] - psi[i - 1] for i in range(len(psi) - top, len(psi)))


def middle_layers(num_layers: int) -> tuple[int, int]:
    """(first, last) 1-based ℓ of the central half of the stack, never layer 1 or L (as `analyze` uses)."""
    lo, hi = max(2, num_layers // 4 + 1), min(num_layers - 1, num_layers - num_layers // 4)
    if lo > hi:
        raise ValueError(f"no middle layers in a {num_layers}-layer model")
    return lo, hi


def dispersion(single: list[float]) -> float:
    """Coefficient of variation (population sd / mean) of the middle layers' single-layer ΔCE; NaN when their
    mean is not positive (then no layer matters on average and the ratio means nothing)."""
    lo, hi = middle_layers(len(single))
    mid = single[lo - 1 : hi]
    mean = statistics.fmean(mid)
    return statistics.pstdev(mid) / mean if mean > 0 else math.nan


def metric(name: str, heldout: dict, removal: dict | None) -> float:
    """One endpoint's value for one run. `removal`: {"base_ce", "single": [ΔCE_ℓ], "top": {"1", "2", "3"}}."""
    if name == "top_rise":
        return top_rise(heldout["psi"])
    if name in ("ce", "zeta_L", "zeta_L-1", "zeta_L-2", "psi_L_over_mid"):
        return float(heldout[name])
    if removal is None:
        return math.nan
    if name == "removal_top":
        return float(removal["top"][str(REMOVED_TOP)])
    if name.startswith("removal_top"):
        return float(removal["top"][name.removeprefix("removal_top")])
    if name == "removal_dispersion":
        return dispersion(removal["single"])
    raise KeyError(name)


# ----------------------------------------------------------------------------------------------------------
# the test


def _signs(n: int) -> np.ndarray:
    """All 2^n sign patterns, [2^n, n] of ±1."""
    return np.array(list(itertools.product((1.0, -1.0), repeat=n)))


def sign_flip(diffs: list[float] | np.ndarray, shift: float = 0.0) -> dict[str, float]:
    """Exact paired sign-flip permutation test of mean(diffs − shift) = 0: p two-sided, and each one-sided p."""
    d = np.asarray(diffs, dtype=np.float64) - shift
    n = len(d)
    if n == 0:
        raise ValueError("sign-flip test of no differences")
    means = _signs(n) @ d / n
    obs = d.mean()
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))
    return {"two_sided": float(np.mean(np.abs(means) >= abs(obs) - tol)),
            "greater": float(np.mean(means >= obs - tol)), "less": float(np.mean(means <= obs + tol))}


def sign_flip_ci(diffs: list[float], level: float = LEVEL) -> tuple[float, float]:
    """95 % CI of the mean difference by inverting the two-sided sign-flip test: the shifts μ it does not reject
    at `level` (bisection on each side of the mean, to 1e-6 of the differences' range)."""
    d = np.asarray(diffs, dtype=np.float64)
    if len(d) < 2 or np.ptp(d) == 0:
        return (math.nan, math.nan)
    if 2.0 / 2 ** len(d) > level:  # no shift is ever rejected: the smallest exact p is 2/2^n
        return (-math.inf, math.inf)
    mean, span = float(d.mean()), float(np.ptp(d)) + float(np.abs(d).max())

    def edge(direction: int) -> float:
        inside, outside = mean, mean + direction * span
        while sign_flip(d, outside)["two_sided"] > level:
            outside += direction * span
        for _ in range(60):
            mid = (inside + outside) / 2
            if sign_flip(d, mid)["two_sided"] > level:
                inside = mid
            else:
                outside = mid
            if abs(outside - inside) < 1e-6 * span:
                break
        return (inside + outside) / 2

    return edge(-1), edge(+1)


def t_ci(diffs: list[float], level: float = LEVEL) -> tuple[float, float]:
    from scipy import stats as sp

    n = len(diffs)
    if n < 2:
        return (math.nan, math.nan)
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = float(sp.t.ppf(1 - level / 2, n - 1)) * sd / math.sqrt(n)
    return mean - half, mean + half


def paired(diffs: list[float], sign: int) -> dict:
    """Every figure of one contrast: mean, sd, the exact sign-flip p (two-sided, predicted side, other side),
    its 95 % CI, the t-test and the Wilcoxon signed-rank test beside it."""
    from scipy import stats as sp

    diffs = [float(x) for x in diffs if not math.isnan(x)]
    n = len(diffs)
    out: dict = {"n": n, "diffs": diffs, "mean": statistics.fmean(diffs) if n else None}
    if n < 2:
        out["note"] = "fewer than 2 seeds: no test"
        return out
    sf = sign_flip(diffs)
    out.update(sd=statistics.stdev(diffs), p=sf["two_sided"],
               p_predicted=sf["greater"] if sign > 0 else sf["less"],
               p_other=sf["less"] if sign > 0 else sf["greater"],
               ci=list(sign_flip_ci(diffs)), t_ci=list(t_ci(diffs)))
    if out["sd"] > 0:
        out["p_t"] = float(sp.ttest_1samp(diffs, 0.0).pvalue)
    if any(x != 0 for x in diffs):
        out["p_wilcoxon"] = float(sp.wilcoxon(diffs).pvalue)
    return out


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm-adjusted p-values (step-down, monotone, capped at 1), by key."""
    keys = sorted(pvalues, key=lambda k: pvalues[k])
    m, running, out = len(keys), 0.0, {}
    for i, k in enumerate(keys):
        running = max(running, min(1.0, (m - i) * pvalues[k]))
        out[k] = running
    return out


def verdict(test: dict, adjusted: float | None, sign: int) -> str:
    """confirmed / contradicted at LEVEL after Holm by the side the mean lies on; inconclusive otherwise."""
    if "p" not in test or adjusted is None:
        return "not testable (" + test.get("note", "no data") + ")"
    if adjusted >= LEVEL:
        return "inconclusive"
    return "confirmed" if test["mean"] * sign > 0 else "contradicted"


def worse_finding(test: dict) -> bool:
    """A language-modelling contrast whose 95 % CI lies above 0: JREG is worse, stated as a finding."""
    ci = test.get("ci") or [math.nan, math.nan]
    return bool(ci[0] > 0)


# ----------------------------------------------------------------------------------------------------------
# MDE and power under the rule used


def power(effect: float, sd: float, n: int, level: float, draws: int = 2000, seed: int = 0) -> float:
    """P(the two-sided exact sign-flip test rejects at `level` with the mean on the effect's side) for n normal
    paired differences of mean `effect` and sd `sd` (simulation, fixed seed)."""
    rng = np.random.default_rng(seed)
    signs = _signs(n)
    d = rng.normal(effect, sd, size=(draws, n))
    perm = np.abs(d @ signs.T) / n  # [draws, 2^n]
    obs = np.abs(d.mean(axis=1, keepdims=True))
    p = np.mean(perm >= obs - 1e-12, axis=1)
    right_side = np.sign(d.mean(axis=1)) == np.sign(effect) if effect != 0 else np.ones(draws, bool)
    return float(np.mean((p < level) & right_side))


def mde(sd: float, n: int, level: float, target: float = POWER) -> float:
    """The smallest |mean difference| that the rule detects with probability `target` (in the units of sd)."""
    if not sd > 0:
        return math.nan
    lo, hi = 0.0, 1.0
    while power(hi * sd, sd, n, level) < target:
        hi *= 2
        if hi > 64:
            return math.inf  # n too small for `level`: no effect size is detected this often
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(mid * sd, sd, n, level) < target else (lo, mid)
    return hi * sd


def family_level(m: int = len(PRIMARY)) -> float:
    """The Holm step that is hardest to pass: the level the MDE and power are computed at."""
    return LEVEL / m


# ----------------------------------------------------------------------------------------------------------
# analysis of the raw files


def analyse(finals: dict[tuple[str, int], dict], removals: dict[tuple[str, int], dict]) -> dict:
    """Every primary and secondary contrast from the runs' final held-out measurements and removal records,
    keyed (arm, seed). Returns {"primary": {key: test}, "secondary": {key: test}}; each test carries its seeds,
    and each primary test its Holm-adjusted p and verdict, MDE and the "JREG worse" finding."""

    def contrast(ep: Endpoint) -> dict:
        seeds = sorted(s for (a, s) in finals if a == ep.arm and (ep.reference, s) in finals)
        values = {s: (metric(ep.metric, finals[ep.arm, s], removals.get((ep.arm, s))),
                      metric(ep.metric, finals[ep.reference, s], removals.get((ep.reference, s))))
                  for s in seeds}
        used = [s for s in seeds if not any(math.isnan(v) for v in values[s])]
        test = paired([values[s][0] - values[s][1] for s in used], ep.sign)
        test.update(seeds=used, values={s: list(values[s]) for s in used},
                    dropped=[s for s in seeds if s not in used])
        return test

    primary = {ep.key: contrast(ep) for ep in PRIMARY}
    adjusted = holm({k: t["p"] for k, t in primary.items() if "p" in t})
    level = family_level()
    for ep in PRIMARY:
        test = primary[ep.key]
        test["p_holm"] = adjusted.get(ep.key)
        test["verdict"] = verdict(test, adjusted.get(ep.key), ep.sign)
        if "sd" in test:
            test["mde"] = mde(test["sd"], test["n"], level)
        if ep.key in LM_KEYS:
            test["jreg_worse"] = worse_finding(test)
    secondary = {ep.key: contrast(ep) for ep in SECONDARY}
    return {"primary": primary, "secondary": secondary, "level_for_mde": level}


# Effect sizes seen before v3 (mean paired difference, its sd, n, where), for the power statement.
SEEN = (
    ("ii", "R, v2 (12 × 128) baseline-small − baseline-large", 1.098, 0.709, 4),
    ("iii", "R, v2 (12 × 128) jreg-a1 − baseline-small", -1.950, 0.594, 4),
    ("iii", "R, 12 × 64 baseline seeds 1–8 (3.66 ± 1.96) against JREG ≈ −0.2, sd taken as the baseline's", -3.86,
     1.96, 8),
    ("iv", "CE, v2 jreg-a1 − baseline-small (JREG worse)", 0.016, 0.009, 4),
    ("v", "CE, v1 (6 × 128, 300 steps) α = 0 − baseline, sd from its t-test", -0.092, 0.020, 3),
)


def main() -> None:
    """Print the power statement of the pre-registration (experiments/study/power_v3.txt)."""
    level, n = family_level(), len(SEEDS)
    print(f"Study v3: {len(PRIMARY)} primary endpoints in one Holm family; MDE and power for the exact two-sided "
          f"sign-flip test at the hardest Holm step, {LEVEL} / {len(PRIMARY)} = {level:.4f}, n = {n} seed pairs, "
          "normal paired differences, 2,000 simulated studies")
    print(f"MDE (power {POWER:.0%}) = {mde(1.0, n, level):.3f} × the paired sd; with 4 seeds: "
          f"{mde(1.0, 4, level)} (the smallest exact two-sided p with 4 seeds is 2/16 = 0.125)")
    for key, what, effect, sd, seen_n in SEEN:
        print(f"  ({key}) {what}: effect {effect:+.3f}, sd {sd:.3f} (n = {seen_n}) → power with {n} seeds "
              f"{power(effect, sd, n, level):.3f}; with half the effect {power(effect / 2, sd, n, level):.3f}")
    print("(M-a), (M-b): no earlier measurement; detectable when |mean| ≥ the MDE above in units of their sd.")


if __name__ == "__main__":
    main()
