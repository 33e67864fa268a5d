"""Study v4's pre-registered analysis: is there a (λ, α) at which JREG removes the top-of-stack rise at less than
1 % perplexity cost in one epoch, how does LayerNorm Scaling compare, and what happens at depth 24.

Fixed here and committed before the first v4 run (issue 43); `experiments/study/study.py --design v4` trains and
measures, the v4 report is made from its raw files with these functions only. The statistics (exact paired
sign-flip test, its CI, Holm, the top-of-stack rise R, the middle layers) are study v3's
(study_v3_analysis.py), imported, not copied.

Design
- Model and recipe: v3's 12 × 64 Llama (2 heads, FFN 176, BPE 4,096, context 128, AdamW 1e-3 → 1e-4 cosine, 5 %
  warm-up, weight decay 0.1, β = (0.9, 0.95), clip 1.0, batch 4, one CPU core per run), with the schedule ending at
  **one epoch** of the laptop corpus: STEPS steps of 4 × 128 tokens, no training sample seen twice. Every arm of a
  seed starts from the same weights (`--init-mode layout-independent --seed s`; LayerNorm Scaling has no parameters).
- Seeds: 21–32 (fresh: v1–v3 and the regime search used 1–20).
- Stage 0 (gate): baseline seeds 21 and 22 run first. The gate passes when both have R > 0 at their final checkpoint
  (the rise forms in one epoch). They are also stage 1's baseline runs. Fallback, fixed now: if the gate fails,
  stage 1 runs at v3's schedule length (3,000 steps, 2.67 epochs, where the rise formed in 12 of 12 seeds) with
  8 seeds per arm (21–28) and the same arms, tests and family, and stage 2 is dropped (budget); the report says that
  the rise did not form in one epoch at this scale.
- Stage 1 arms (12 × 64, 12 seeds each): `baseline` (λ = 0); JREG α = 1 at λ ∈ {0.1, 0.3, 1}; JREG λ = 1 at
  α ∈ {0, 0.3}; `lns`: LayerNorm Scaling (Sun et al. 2025, "The Curse of Depth in Large Language Models": each
  decoder layer ℓ's pre-attention and pre-MLP norm outputs × 1/√ℓ; `--layernorm-scaling`), λ = 0.
- Stage 2 (depth 24 × 64, same recipe and one-epoch schedule, seeds 21–28: n = 8 fixed now by cost alone — 16 runs
  at about twice a 12-layer run's cost fit the 12 core-hour cap beside stage 1's 84 runs, and 8 seeds are the
  fewest at which a Holm family of 2 can reject with the exact test, whose smallest two-sided p is 2/2^n):
  `d24-baseline` against `d24-<arm>`, the stage-1 arm that `stage2_arm` picks from stage 1's results: the JREG
  arm that passes its primary test with the smallest mean CE cost; if none passes, J(λ = 1, α = 1), the paper's
  setting (it asks whether α = 1's cost is "two layers of depth lost", which predicts a smaller cost at depth 24).
- Budget: at most 12 core-hours for everything (attempts included); runs in the background, resumable.
- A run whose loss or measurement is not finite is retried once; if it fails again it counts as failing: a failing
  JREG or LNS run enters its pair with the least favourable values FAILED_CE_DIFF and FAILED_R_DIFF; a failing
  baseline run drops its seed from every contrast (there is nothing to compare with).
- No interim verdicts: the report states verdicts only when every run of the stage is measured.

Measures (final checkpoint, every held-out window; `examples/measure.py`, `megatron-jreg analyze`'s layer removal)
- R: v3's top-of-stack rise, 100 · max over the top 3 layers of (Ψ_ℓ − Ψ_{ℓ−1}), unclipped.
- CE: held-out cross-entropy, nats/token. δ = 0.010 nats is a 1.005 % perplexity increase (e^0.01 = 1.01005).
- train CE (512 training windows), the generalisation gap (held-out − train CE), ΔCE_top2 (skip the top 2 layers),
  the middle layers' share of removal cost (Σ single-layer ΔCE over the central half ÷ Σ over all layers).

Primary family (one Holm family, family-wise error 0.05)
- For each JREG arm in IUT_ARMS, an intersection-union test of "removes the rise AND costs less than δ":
  p = max(p_R, p_CE), p_R the exact one-sided sign-flip p of mean(R_arm − R_baseline) < 0, p_CE the exact
  one-sided sign-flip p of mean(CE_arm − CE_baseline − δ) < 0. Verdict: *passes* (removes the rise at < 1 %
  perplexity cost) when its Holm-adjusted p < 0.05; otherwise *not shown*, with the component that failed.
- LayerNorm Scaling against the baseline, exact two-sided sign-flip test: on CE (Sun et al. predict lower: verdict
  confirmed / contradicted / inconclusive) and on R (no predicted direction: verdict higher / lower / inconclusive).
Stage 2 (its own Holm family of 2, two-sided exact test, predicted side −1): R and ΔCE_top2 of d24-<arm> against
d24-baseline; the CE cost at depth 24 is estimated with its CI, not tested.
Secondary, estimation only (mean difference to the baseline with the exact CI, no test): the dose-response in λ
(α = 1) and in α (λ = 1) of R, CE, train CE, the gap, ΔCE_top2 and the middle layers' share; the same for LNS.

What n = 12 can show (`power_statement`): the CE component is a one-sided test at 0.05 / 6 with the paired sd v3
measured (0.0115 nats); it passes reliably (power 0.8) only when the true cost is at most δ minus its MDE, which is
below 0: "< 1 % perplexity" can be shown for an arm that costs nothing or gains, not for one that costs a little.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
from study_v3_analysis import _signs, holm, middle_layers, paired, sign_flip, sign_flip_ci, top_rise

LEVEL = 0.05
POWER = 0.80
DELTA = 0.010  # nats/token: the cost bound of the primary test (a 1.005 % perplexity increase)
SEEDS = tuple(range(21, 33))  # stage 1: 12 fresh seeds
GATE_SEEDS = (21, 22)
STAGE2_SEEDS = tuple(range(21, 29))  # n = 8, fixed by cost (module docstring)
FALLBACK_SEEDS = tuple(range(21, 29))
STEPS_FALLBACK = 3000
LAYERS, LAYERS_STAGE2 = 12, 24
CHECKPOINTS = 4  # measured per run, evenly spaced; the last is the final model
REMOVED_TOP = 2
FAILED_CE_DIFF = 1.0  # nats: a failing JREG/LNS run's CE difference (worse than any real run)
FAILED_R_DIFF = 100.0  # a failing run's R difference (a full-angle rise)
BUDGET_CORE_HOURS = 12.0


@dataclass(frozen=True)
class ArmSpec:
    """One training setting of v4: λ, α (None without JREG), LayerNorm Scaling, and the model's depth."""

    name: str
    lam: float = 0.0
    alpha: float | None = None
    lns: bool = False
    layers: int = LAYERS
    label: str = ""


BASELINE = ArmSpec("baseline", label="baseline (λ = 0)")
STAGE1 = (
    BASELINE,
    ArmSpec("jreg-l0.1-a1", 0.1, 1.0, label="JREG λ = 0.1, α = 1"),
    ArmSpec("jreg-l0.3-a1", 0.3, 1.0, label="JREG λ = 0.3, α = 1"),
    ArmSpec("jreg-l1-a1", 1.0, 1.0, label="JREG λ = 1, α = 1 (the paper's)"),
    ArmSpec("jreg-l1-a0", 1.0, 0.0, label="JREG λ = 1, α = 0"),
    ArmSpec("jreg-l1-a0.3", 1.0, 0.3, label="JREG λ = 1, α = 0.3"),
    ArmSpec("lns", lns=True, label="LayerNorm Scaling (1/√ℓ), λ = 0"),
)
ARMS = {a.name: a for a in STAGE1}
IUT_ARMS = ("jreg-l0.1-a1", "jreg-l0.3-a1", "jreg-l1-a1", "jreg-l1-a0.3")  # the pre-named primary arms
LNS_TESTS = (("lns:ce", "ce", -1), ("lns:R", "top_rise", 0))  # (key, metric, predicted sign; 0: none)
STAGE2_DEFAULT = "jreg-l1-a1"
LAMBDA_DOSE = ("baseline", "jreg-l0.1-a1", "jreg-l0.3-a1", "jreg-l1-a1")  # α = 1
ALPHA_DOSE = ("jreg-l1-a0", "jreg-l1-a0.3", "jreg-l1-a1")  # λ = 1
SECONDARY_METRICS = ("top_rise", "ce", "train_ce", "gap", "removal_top2", "mid_share")


def stage2_specs(arm: str) -> tuple[ArmSpec, ArmSpec]:
    """The depth-24 baseline and the chosen arm at depth 24."""
    a = ARMS[arm]
    return (ArmSpec("d24-baseline", layers=LAYERS_STAGE2, label="baseline, 24 layers"),
            ArmSpec(f"d24-{arm}", a.lam, a.alpha, a.lns, LAYERS_STAGE2, f"{a.label}, 24 layers"))


# Predictions, written before the first run from v3's trajectories (raw_v3: the mean paired difference at v3's
# checkpoint 1,000 of 3,000, its nearest to one epoch, and at the end), as (quantity, point, range, why).
PREDICTIONS = (
    ("gate: R(baseline) > 0 at one epoch", 2.0, (0.5, 3.5),
     "v3 at step 1,000: R 2.20, > 0 in 12 of 12 seeds; a schedule decayed to its end within one epoch"),
    ("CE(jreg-l1-a1) − CE(baseline), nats", 0.020, (0.010, 0.030),
     "v3: +0.025 at step 1,000, +0.019 at 1,500, +0.010 at 3,000: the cost shrinks with training, one epoch is early; "
     "so J(1, 1) fails the < 1 % test"),
    ("CE(jreg-l1-a0) − CE(baseline), nats", -0.080, (-0.110, -0.050),
     "v3: −0.108 at step 1,000, −0.037 at 3,000"),
    ("R(jreg-l1-a0) − R(baseline)", -0.5, (-1.5, 0.5), "v3: α = 0 lowers R a little and does not remove the rise"),
    ("CE(jreg-l0.3-a1) − CE(baseline), nats", 0.006, (0.000, 0.015), "the cost scales with λ"),
    ("CE(jreg-l0.1-a1) − CE(baseline), nats", 0.002, (-0.005, 0.008), "the cost scales with λ"),
    ("R(jreg-l0.1-a1) − R(baseline)", -1.5, (-2.5, -0.5), "λ = 0.1 removes part of the rise"),
    ("CE(jreg-l1-a0.3) − CE(baseline), nats", 0.000, (-0.020, 0.015),
     "between α = 0's gain and α = 1's cost; study v1: −0.0096 at α = 0.3 (3 seeds)"),
    ("CE(lns) − CE(baseline), nats", -0.005, (-0.020, 0.005),
     "Sun et al. report lower perplexity; 12 layers is shallow"),
    ("ΔCE_top2(lns) − ΔCE_top2(baseline)", 0.05, (-0.10, 0.30), "LNS makes the deep layers do more"),
    ("CE cost at depth 24 of the stage-2 arm ÷ its cost at depth 12", 0.5, (0.0, 1.0),
     "if J(1, 1) is chosen: 'two layers lost' is a smaller share of 24 layers"),
)


# ----------------------------------------------------------------------------------------------------------
# the measures of one run's final checkpoint: {"heldout": {...}, "train": {...}, "removal": {...} | None}


def mid_share(single: list[float]) -> float:
    """The middle layers' share of the single-layer removal cost: Σ ΔCE over the central half ÷ Σ over all."""
    lo, hi = middle_layers(len(single))
    total = sum(single)
    return sum(single[lo - 1 : hi]) / total if total > 0 else math.nan


def metric(name: str, final: dict) -> float:
    """One measure of one run; NaN when its record lacks it (no layer removal)."""
    heldout, train, removal = final["heldout"], final.get("train"), final.get("removal")
    if name == "top_rise":
        return top_rise(heldout["psi"])
    if name == "ce":
        return float(heldout["ce"])
    if name in ("train_ce", "gap"):
        if train is None:
            return math.nan
        return float(train["ce"]) if name == "train_ce" else float(heldout["ce"]) - float(train["ce"])
    if removal is None:
        return math.nan
    if name.startswith("removal_top"):
        return float(removal["top"][name.removeprefix("removal_top")])
    if name == "mid_share":
        return mid_share(removal["single"])
    raise KeyError(name)


def differences(finals: dict[tuple[str, int], dict], arm: str, reference: str, name: str,
                failed: frozenset[tuple[str, int]] = frozenset()) -> dict[int, float]:
    """{seed: metric(arm) − metric(reference)} over the seeds where the reference ran; a failing arm run enters with
    the least favourable difference (module docstring), a failing reference drops its seed."""
    out = {}
    for (a, s), rec in finals.items():
        if a != reference or (reference, s) in failed:
            continue
        if (arm, s) in failed:
            out[s] = {"ce": FAILED_CE_DIFF, "top_rise": FAILED_R_DIFF}.get(name, math.nan)
        elif (arm, s) in finals:
            out[s] = metric(name, finals[arm, s]) - metric(name, rec)
    return {s: d for s, d in sorted(out.items()) if not math.isnan(d)}


# ----------------------------------------------------------------------------------------------------------
# tests


def iut(r_diffs: list[float], ce_diffs: list[float], delta: float = DELTA) -> dict:
    """Intersection-union test of "R lower AND CE cost below δ": p = max of the two exact one-sided p."""
    p_r = sign_flip(r_diffs)["less"]
    p_ce = sign_flip(ce_diffs, shift=delta)["less"]
    return {"p": max(p_r, p_ce), "p_R": p_r, "p_CE": p_ce, "n": min(len(r_diffs), len(ce_diffs)),
            "R": paired(r_diffs, -1), "CE": paired(ce_diffs, -1)}


def verdict_two_sided(test: dict, adjusted: float | None, sign: int) -> str:
    """With a predicted side: confirmed / contradicted; without (sign 0): higher / lower; else inconclusive."""
    if "p" not in test or adjusted is None:
        return "not testable (" + test.get("note", "no data") + ")"
    if adjusted >= LEVEL:
        return "inconclusive"
    if sign == 0:
        return "higher" if test["mean"] > 0 else "lower"
    return "confirmed" if test["mean"] * sign > 0 else "contradicted"


def analyse_stage1(finals: dict[tuple[str, int], dict], failed: frozenset[tuple[str, int]] = frozenset()) -> dict:
    """The primary family (IUT per pre-named arm, LNS on CE and R), Holm-adjusted, and the secondary estimates."""
    primary: dict[str, dict] = {}
    for arm in IUT_ARMS:
        r = differences(finals, arm, "baseline", "top_rise", failed)
        ce = differences(finals, arm, "baseline", "ce", failed)
        seeds = sorted(set(r) & set(ce))
        test = iut([r[s] for s in seeds], [ce[s] for s in seeds]) if len(seeds) >= 2 else \
            {"note": "fewer than 2 seeds"}
        primary[f"iut:{arm}"] = {**test, "arm": arm, "seeds": seeds}
    for key, name, sign in LNS_TESTS:
        d = differences(finals, "lns", "baseline", name, failed)
        primary[key] = {**paired(list(d.values()), sign or 1), "arm": "lns", "metric": name, "sign": sign,
                        "seeds": list(d)}
    adjusted = holm({k: t["p"] for k, t in primary.items() if "p" in t})
    for key, test in primary.items():
        test["p_holm"] = adjusted.get(key)
        if key.startswith("iut:"):
            if test["p_holm"] is None:
                test["verdict"] = "not testable (" + test.get("note", "no data") + ")"
            elif test["p_holm"] < LEVEL:
                test["verdict"] = "passes"
            else:  # the binding component: the one whose p is the IUT's
                test["verdict"] = "not shown (" + ("the rise's removal" if test["p_R"] >= test["p_CE"] else
                                                   f"a cost below {DELTA:g} nats") + " is not shown)"
        else:
            test["verdict"] = verdict_two_sided(test, test["p_holm"], test["sign"])
    secondary = {}
    for arm in [a.name for a in STAGE1 if a.name != "baseline"]:
        for name in SECONDARY_METRICS:
            d = differences(finals, arm, "baseline", name, failed)
            values = list(d.values())
            secondary[f"{arm}:{name}"] = {"n": len(values), "mean": statistics.fmean(values) if values else None,
                                          "ci": list(sign_flip_ci(values)) if len(values) >= 2 else None,
                                          "diffs": values}
    return {"primary": primary, "secondary": secondary, "family": len(adjusted)}


def stage2_arm(stage1: dict) -> str:
    """The pre-registered choice of stage 2's arm: the passing IUT arm with the smallest mean CE cost, else J(1, 1)."""
    passing = [(t["CE"]["mean"], t["arm"]) for k, t in stage1["primary"].items()
               if k.startswith("iut:") and t["verdict"] == "passes"]
    return min(passing)[1] if passing else STAGE2_DEFAULT


def analyse_stage2(finals: dict[tuple[str, int], dict], arm: str,
                   failed: frozenset[tuple[str, int]] = frozenset()) -> dict:
    """R and ΔCE_top2 of d24-<arm> against d24-baseline (Holm of 2, predicted side −1); the CE cost estimated."""
    name = f"d24-{arm}"
    tests = {}
    for key, m in (("d24:R", "top_rise"), ("d24:removal_top2", "removal_top2")):
        d = differences(finals, name, "d24-baseline", m, failed)
        tests[key] = {**paired(list(d.values()), -1), "metric": m, "seeds": list(d)}
    adjusted = holm({k: t["p"] for k, t in tests.items() if "p" in t})
    for key, t in tests.items():
        t["p_holm"] = adjusted.get(key)
        t["verdict"] = verdict_two_sided(t, t["p_holm"], -1)
    ce = differences(finals, name, "d24-baseline", "ce", failed)
    values = list(ce.values())
    cost = {"n": len(values), "mean": statistics.fmean(values) if values else None,
            "ci": list(sign_flip_ci(values)) if len(values) >= 2 else None, "diffs": values}
    return {"arm": arm, "primary": tests, "ce_cost": cost}


def gate_passes(finals: dict[tuple[str, int], dict]) -> bool:
    """Stage 0: both gate seeds' baselines have R > 0."""
    return all(top_rise(finals["baseline", s]["heldout"]["psi"]) > 0 for s in GATE_SEEDS)


# ----------------------------------------------------------------------------------------------------------
# what n = 12 can show


def power_less(effect: float, sd: float, n: int, level: float, draws: int = 4000, seed: int = 0) -> float:
    """P(the exact one-sided sign-flip test of mean < 0 rejects at `level`) for n normal differences."""
    rng = np.random.default_rng(seed)
    signs = _signs(n)
    d = rng.normal(effect, sd, size=(draws, n))
    perm = d @ signs.T / n
    p = np.mean(perm <= d.mean(axis=1, keepdims=True) + 1e-12, axis=1)
    return float(np.mean(p < level))


def largest_cost_shown(sd: float, n: int, level: float, target: float = POWER) -> float:
    """The largest true CE cost at which the CE component rejects with probability `target` (bisection)."""
    lo, hi = DELTA - 8 * sd, DELTA  # power(lo) ≈ 1, power(hi) ≈ level
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power_less(mid - DELTA, sd, n, level) >= target else (lo, mid)
    return lo


def power_statement(sd_ce: float = 0.0115, n: int = len(SEEDS)) -> list[str]:
    """The power lines of the pre-registration (experiments/study/power_v4.txt)."""
    m = len(IUT_ARMS) + len(LNS_TESTS)
    level = LEVEL / m
    lines = [f"Study v4: {m} primary tests in one Holm family; power at the hardest Holm step, {LEVEL} / {m} = "
             f"{level:.4f}, n = {n} seed pairs, normal paired differences, 4,000 simulated studies, CE paired sd "
             f"{sd_ce} nats (v3's jreg-a1 − baseline-small)"]
    for cost in (-0.02, -0.01, 0.0, 0.003, 0.005, 0.008):
        lines.append(f"  true CE cost {cost:+.3f}: P(the < {DELTA} component passes) = "
                     f"{power_less(cost - DELTA, sd_ce, n, level):.3f}")
    lines.append(f"  power {POWER:.0%} needs a true cost ≤ {largest_cost_shown(sd_ce, n, level):+.4f} nats: "
                 "'< 1 % perplexity' can be shown for an arm that costs nothing or gains, not for one that costs "
                 "a little; an arm that fails this test may still cost less than 1 %")
    lines.append(f"  the R component (v3: R difference −3.99, sd 1.50): power "
                 f"{power_less(-3.99, 1.50, n, level):.3f}; at a third of that effect "
                 f"{power_less(-1.33, 1.50, n, level):.3f}")
    lines.append(f"Stage 2: n = {len(STAGE2_SEEDS)}, Holm of 2; the smallest exact two-sided p is "
                 f"{2 / 2 ** len(STAGE2_SEEDS):.4f}")
    return lines


def main() -> None:
    print("\n".join(power_statement()))


if __name__ == "__main__":
    main()
