"""Study v3's report (experiments/study/report_v3.md; docs/study.md is study v4's), made only from its raw results
and study v2's, with the analysis that study_v3_analysis.py fixed before the runs.

    python experiments/study/study_v3_report.py --raw experiments/study/raw_v3 --report experiments/study/report_v3.md

tests/test_study_v3.py regenerates the committed report from the committed raw files and checks every table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(HERE)]

import study_v3_analysis as A  # noqa: E402

PREREGISTRATION = "19a637e"  # the commit that fixed study_v3_analysis.py, before any v3 run
RAW_V2 = HERE / "raw_v2"
ARMS = ("baseline-large", "baseline-small", "jreg-a1", "jreg-a0")
ARM_LABELS = {"baseline-large": "baseline, batch 16 × 750 steps", "baseline-small": "baseline, batch 4 × 3,000 steps",
              "jreg-a1": "JREG λ = 1, α = 1, batch 4", "jreg-a0": "JREG λ = 1, α = 0, batch 4"}


# ----------------------------------------------------------------------------------------------------------
# reading


def load(raw: Path) -> tuple[dict, dict[tuple[str, int], dict]]:
    """(study.json, {(arm, seed): run record}) of a raw folder."""
    study = json.loads((raw / "study.json").read_text())
    runs = {}
    for path in sorted(raw.glob("*__seed-*.json")):
        rec = json.loads(path.read_text())
        runs[rec["arm"], rec["seed"]] = rec
    return study, runs


def finals(runs: dict) -> tuple[dict, dict]:
    """The final held-out measurement and the layer-removal record of each run (runs without removal: absent)."""
    fin = {k: r["measures"]["series"][-1]["heldout"] for k, r in runs.items()}
    rem = {k: r["removal"] for k, r in runs.items() if "removal" in r}
    return fin, rem


def _mean_sd(values: list[float]) -> str:
    """Mean ± sd of the values there are (a run without layer removal gives NaN), with their count when some
    are missing; one value alone has no sd."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return "—"
    text = f"{statistics.fmean(known):.3f}" + (f" ± {statistics.stdev(known):.3f}" if len(known) > 1 else "")
    return text + (f" (n = {len(known)})" if len(known) < len(values) else "")


def _num(v: float | None, spec: str = "{:+.3f}") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)


def _p(p: float | None) -> str:
    return "—" if p is None else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _ci(ci: list[float] | None) -> str:
    if not ci or any(math.isnan(c) for c in ci):
        return "—"
    return f"[{_num(ci[0])}, {_num(ci[1])}]"


# ----------------------------------------------------------------------------------------------------------
# sections


def one_sentence(ep: A.Endpoint, t: dict, planned: int) -> str:
    if "p" not in t:
        return f"- **{ep.claim}** — not testable yet ({t.get('note', 'no data')})."
    worse = " **JREG is worse**: the 95 % CI lies above 0." if t.get("jreg_worse") else ""
    interim = f" Interim: {t['n']} of {planned} seed pairs." if t["n"] < planned else ""
    return (f"- **{ep.claim}** — **{t['verdict']}**. {ep.label} = {_num(t['mean'])} (95 % CI {_ci(t['ci'])}; "
            f"exact sign-flip p {_p(t['p'])}, Holm {_p(t['p_holm'])}; {t['n']} seeds; "
            f"MDE {_num(t.get('mde'), '{:.3f}')}).{worse}{interim}")


def contrast_table(endpoints: tuple[A.Endpoint, ...], tests: dict, primary: bool) -> list[str]:
    head = ["contrast", "n", "mean", "95 % CI (sign-flip)", "95 % CI (t)", "p exact", "p t-test", "p Wilcoxon"]
    head += ["Holm", "MDE", "verdict"] if primary else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for ep in endpoints:
        t = tests[ep.key]
        row = [ep.label, str(t["n"]), _num(t.get("mean")), _ci(t.get("ci")), _ci(t.get("t_ci")), _p(t.get("p")),
               _p(t.get("p_t")), _p(t.get("p_wilcoxon"))]
        if primary:
            row += [_p(t.get("p_holm")), _num(t.get("mde"), "{:.3f}"), t["verdict"]]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def arm_table(fin: dict, rem: dict, seeds: list[int]) -> list[str]:
    cols = [("held-out CE", "ce"), ("R (top-3 rise)", "top_rise"), ("ζ_L", "zeta_L"), ("ζ_L−1", "zeta_L-1"),
            ("ζ_L−2", "zeta_L-2"), ("Ψ_L / mid Ψ", "psi_L_over_mid"), ("ΔCE top 1", "removal_top1"),
            ("ΔCE top 2", "removal_top2"), ("ΔCE top 3", "removal_top3"), ("CV middle ΔCE", "removal_dispersion")]
    lines = ["| arm | seeds | " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for arm in ARMS:
        have = [s for s in seeds if (arm, s) in fin]
        if not have:
            continue
        cells = [_mean_sd([A.metric(m, fin[arm, s], rem.get((arm, s))) for s in have]) for _, m in cols]
        lines.append(f"| {arm} ({ARM_LABELS[arm]}) | {len(have)} | " + " | ".join(cells) + " |")
    return lines


def layer_table(fin: dict, rem: dict, seeds: list[int]) -> tuple[list[str], dict]:
    """Mean Ψ_ℓ and mean single-layer ΔCE_ℓ per arm, and the data for the plots."""
    data: dict = {}
    for arm in ARMS:
        have = [s for s in seeds if (arm, s) in fin]
        if not have:
            continue
        psi = [statistics.fmean(fin[arm, s]["psi"][i] for s in have) for i in range(len(fin[arm, have[0]]["psi"]))]
        with_removal = [s for s in have if (arm, s) in rem]
        removal = ([statistics.fmean(rem[arm, s]["single"][i] for s in with_removal) for i in range(len(psi))]
                   if with_removal else None)
        data[arm] = {"psi": psi, "removal": removal}
    if not data:
        return [], data
    layers = len(next(iter(data.values()))["psi"])
    head = ["ℓ"] + [f"Ψ {a}" for a in data] + [f"ΔCE {a}" for a in data if data[a]["removal"]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i in range(layers):
        row = [str(i + 1)] + [f"{data[a]['psi'][i]:.4f}" for a in data]
        row += [f"{data[a]['removal'][i]:+.4f}" for a in data if data[a]["removal"]]
        lines.append("| " + " | ".join(row) + " |")
    return lines, data


PLOT = "study_v3_layers.png"


def plot(data: dict, folder: Path) -> None:
    """study_v3_layers.png: mean Ψ_ℓ and mean ΔCE_ℓ per arm (the mechanism at a glance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, d in data.items():
        layers = range(1, len(d["psi"]) + 1)
        axes[0].plot(layers, d["psi"], marker="o", label=arm)
        if d["removal"]:
            axes[1].plot(layers, d["removal"], marker="o", label=arm)
    axes[0].set(title="Ψ_ℓ (angular), final checkpoints, mean over seeds", xlabel="layer ℓ", ylabel="Ψ_ℓ")
    axes[1].set(title="ΔCE when layer ℓ alone is removed", xlabel="layer ℓ", ylabel="ΔCE (nats/token)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / PLOT, dpi=110)
    plt.close(fig)


def earlier_designs() -> list[str]:
    """v1 (quoted from its committed report) and v2 (recomputed from raw_v2, with v3's endpoint post hoc)."""
    _, v2 = load(RAW_V2)
    fin, _ = finals({k: r for k, r in v2.items() if not k[0].startswith("sft")})
    seeds = sorted({s for (_, s) in fin})
    r_small_large = [A.top_rise(fin["baseline-small", s]["psi"]) - A.top_rise(fin["baseline-large", s]["psi"])
                     for s in seeds]
    r_jreg = [A.top_rise(fin["jreg-a1", s]["psi"]) - A.top_rise(fin["baseline-small", s]["psi"]) for s in seeds]
    ce = [fin["jreg-a1", s]["ce"] - fin["baseline-small", s]["ce"] for s in seeds]
    top = [statistics.fmean(fin["jreg-a1", s]["psi"][i] for s in seeds) for i in (-2, -1)]
    lo, hi = A.middle_layers(len(fin["jreg-a1", seeds[0]]["psi"]))
    mid = statistics.fmean(statistics.median(fin["jreg-a1", s]["psi"][lo - 1 : hi]) for s in seeds)
    return [
        "## Earlier designs",
        "",
        "- **v1** (commit 383c20c, its report then docs/study.md): a 6-layer model, 300 steps, 3 seeds, α ∈ {0, 0.3, "
        "1, 3}. JREG with α ≥ 0.3 kept ζ_L at 0; held-out loss was *better* with α = 0 (−0.092 nats, one-sided "
        "t-test p 0.008) and worse with α = 1 (+0.038) and α = 3 (+0.047). Superseded: too short for the jump to "
        "form (the baseline's ζ_L fell from 1.04 to 0.60 over training) and too few seeds.",
        f"- **v2** (experiments/study/report_v2.md, raw files in experiments/study/raw_v2): 12 × 128, 4 seeds, ζ_L as "
        "the endpoint, one-sided t-tests. All three claims came out inconclusive, and could not have done otherwise: "
        "ζ_L is clipped at 0 and JREG's is always 0, so (iii)'s differences were (−1.30, 0, 0, 0), and no exact test "
        "on 4 seeds reaches 0.05. The jump mostly sat below the last layer (1 of 4 baselines jumped at ℓ = L). "
        f"Re-read with v3's endpoint (post hoc, not a test): R(baseline-small) − R(baseline-large) "
        f"{statistics.fmean(r_small_large):+.2f} (positive in {sum(d > 0 for d in r_small_large)} of {len(seeds)} "
        f"seeds), R(jreg-a1) − R(baseline-small) {statistics.fmean(r_jreg):+.2f} (negative in "
        f"{sum(d < 0 for d in r_jreg)} of {len(seeds)}); held-out CE JREG − baseline {statistics.fmean(ce):+.4f} "
        f"(worse in {sum(d > 0 for d in ce)} of {len(seeds)}). JREG's top two layers ended near-identity maps: "
        f"Ψ_{{L−1}} {top[0]:.4f}, Ψ_L {top[1]:.4f} against a middle-layer median of {mid:.4f}; v3 tests that "
        "mechanism by removing layers.",
        "- **The demo** (`make demo`) trains seed 1 of the 12 × 64 regime, the largest final ζ_L (5.79) of the "
        "regime's 8 seeds (median 1.41; experiments/demo_regimes/regimes.txt): it shows the jump and JREG removing "
        "it, not how often the jump forms. v3 uses seeds 9–20, never used to choose the regime.",
        "",
    ]


def against_the_paper(primary: dict) -> list[str]:
    """One plain line on where the verdicts disagree with the paper's reading (none when they do not)."""
    said = []
    if primary["iv"]["verdict"] == "contradicted":
        said.append("the paper reports a downstream gain (+0.41 points, 10 seeds, §4); here JREG α = 1 costs "
                    f"held-out cross-entropy ({math.exp(primary['iv']['mean']) - 1:+.2%} perplexity). 'Contradicted' "
                    "refutes this laptop proxy of the claim (held-out CE), not the paper's downstream gain, which "
                    "this scale cannot measure")
    if primary["ma"]["verdict"] == "confirmed":
        said.append("here JREG removes the jump by making the top two layers near-identity maps that can be "
                    "skipped at almost no cost (the layer below them still matters). Whether it also spreads the "
                    "work more evenly over the middle layers (the paper's 'more balanced use of the middle layers') "
                    "this endpoint could not answer: its MDE exceeds the baseline's whole dispersion. Post hoc (not a "
                    "test), JREG raised the middle layers' summed removal cost in every seed: it uses them more, "
                    "though not measurably more evenly")
    return [f"- **Beside the paper**: {'; '.join(said)}."] if said else []


def provenance(study: dict, runs: dict) -> list[str]:
    commits = sorted({a.get("commit") for r in runs.values() for a in r.get("attempts", []) if a.get("commit")})
    cpu = sum(a.get("cpu_s") or 0.0 for r in runs.values() for a in r.get("attempts", []))
    replaced = sum(a.get("cpu_s") or 0.0 for r in study.get("reproductions", [])
                   for a in r.get("committed_attempts", []))
    dirty = sorted({f for r in runs.values() for a in r.get("attempts", []) for f in (a.get("dirty_files") or [])})
    return [
        "## Provenance and cost",
        "",
        f"- Pre-registration: commit {PREREGISTRATION} fixed experiments/study/study_v3_analysis.py (endpoints, test, "
        "family, verdict rule, MDE) and study.py's v3 design before the first v3 run.",
        f"- Code that trained and measured: commit(s) {', '.join(c[:7] for c in commits) or '—'}"
        + (f"; local changes: {', '.join(dirty)}" if dirty else "; no local changes to examples, experiments or "
           "megatron_jreg") + ".",
        f"- Cost: {(cpu + replaced) / 3600:.1f} core-hours of training and measurement (the processes' own CPU time): "
        f"{cpu / 3600:.1f} for the {len(runs)} runs reported and {replaced / 3600:.1f} for the first copies of the "
        f"re-run ones; invocations: {len(study.get('invocations', []))}.",
        "- Every run's command (`megatron-jreg train` flags) is in its raw file.",
        *reruns(study),
        "",
    ]


def reruns(study: dict) -> list[str]:
    """One line on the runs trained twice (a re-run adds the layer removal a committed run lacked): how far the
    second training landed from the first, per arm kind."""
    reps = study.get("reproductions", [])
    if not reps:
        return []
    base = [r for r in reps if r["run"].startswith("baseline")]
    jreg = [r for r in reps if not r["run"].startswith("baseline")]
    same = sum(r["committed"] == r["rerun"] for r in base)
    gap = max((abs(r["committed"]["ce"] - r["rerun"]["ce"]) for r in jreg), default=0.0)
    return [
        f"- Re-runs: {len(reps)} runs were trained a second time to record their layer removal (the report uses "
        f"the re-run). {same} of {len(base)} baseline re-runs equal the first run in every endpoint to the last "
        f"digit; the {len(jreg)} JREG re-runs moved by at most {gap:.4f} nats of held-out CE: the JREG op's "
        "code changed between the two commits (its fused path) while the rest did not. Both values of "
        "each run are in raw_v3/study.json (`reproductions`)."
    ]


def report_text(raw: Path, folder: Path, plots: bool = True) -> tuple[str, dict]:
    study, runs = load(raw)
    fin, rem = finals(runs)
    results = A.analyse(fin, rem)
    seeds = sorted({s for (_, s) in fin})
    planned = len(A.SEEDS)
    done = len({s for s in seeds if all((a, s) in fin for a in ARMS)})
    table, data = layer_table(fin, rem, seeds)
    shown = str(raw.relative_to(ROOT)) if raw.resolve().is_relative_to(ROOT) else str(raw)
    lines = [
        "# Does JREG remove the final-layer jump, and how? Study v3 at laptop scale",
        "",
        f"Generated by `python experiments/study/study_v3_report.py --raw {shown} --report "
        "experiments/study/report_v3.md` from "
        "the raw results (one JSON per run, with its command and commit). The endpoints, test, family and "
        f"verdict rule were fixed in `experiments/study/study_v3_analysis.py` at commit {PREREGISTRATION}, before "
        "the first run.",
        "",
    ]
    if done < planned:
        lines += [f"**Interim**: {done} of {planned} seeds have every arm measured; verdicts are final only at "
                  f"{planned}.", ""]
    lines += ["## What came out", ""]
    lines += [one_sentence(ep, results["primary"][ep.key], planned) for ep in A.PRIMARY]
    lines += against_the_paper(results["primary"])
    lines += [
        "- **What this scale cannot tell**: whether any of this holds at 170M–3.4B parameters and 100B tokens; "
        "downstream accuracy (benchmarks are at chance here, so held-out cross-entropy stands in); α other than "
        "0 and 1; a learning-rate schedule other than ours.",
        "",
        "## Design",
        "",
        "- Model: a Llama of 12 layers × 64 (2 heads, FFN 176, RoPE, RMSNorm, SwiGLU, untied embeddings, context "
        "128), BPE vocabulary 4,096, Megatron-LM's training loop, one CPU core per run.",
        "- Data: WikiText-2 split by article (examples/laptop_scale.py); every measurement reads the 21 held-out "
        "articles.",
        "- Arms at one budget of 1,536,000 tokens: " + "; ".join(f"{a}: {ARM_LABELS[a]}" for a in ARMS)
        + ". Recipe: AdamW 1e-3 → 1e-4 cosine, 5 % warm-up, weight decay 0.1, β = (0.9, 0.95), clip 1.0; the "
        "arms of a seed start from the same weights.",
        f"- Seeds {A.SEEDS[0]}–{A.SEEDS[-1]} ({planned}), never used to choose the regime.",
        f"- R = 100 · max over the top {A.TOP} layers of (Ψ_ℓ − Ψ_ℓ−1), unclipped; held-out CE in nats/token; "
        f"ΔCE_top{A.REMOVED_TOP}: the CE increase when the top {A.REMOVED_TOP} layers are skipped (output := "
        "input); CV: sd/mean of single-layer ΔCE over the middle layers (the central half of the stack).",
        f"- Test: exact paired sign-flip permutation test, two-sided; one Holm family of {len(A.PRIMARY)}; "
        "confirmed / contradicted when Holm p < 0.05 on the predicted / other side; CIs by inverting the same "
        f"test; MDE at power 0.8 for the level of the hardest Holm step ({A.family_level():.4f}).",
        "",
        "## Primary endpoints (one Holm family)",
        "",
        *contrast_table(A.PRIMARY, results["primary"], primary=True),
        "",
        "Sources of the claims: " + "; ".join(f"({ep.key}) {ep.source}" for ep in A.PRIMARY) + ".",
        "",
        "## Secondary contrasts (same test, outside the family)",
        "",
        *contrast_table(A.SECONDARY, results["secondary"], primary=False),
        "",
        "## Final checkpoints per arm (mean ± sd over seeds)",
        "",
        *arm_table(fin, rem, seeds),
        "",
        "## The mechanism: Ψ_ℓ and the cost of removing each layer (mean over seeds)",
        "",
        *table,
        "",
    ]
    if data:  # the plot's name is fixed; `plots` says whether to draw it
        lines += [f"![Ψ_ℓ and ΔCE_ℓ per arm]({PLOT})", ""]
        if plots:
            plot(data, folder)
    lines += earlier_designs() + provenance(study, runs)
    return "\n".join(lines).rstrip() + "\n", results


def write_report(raw: Path, report: Path, plots: bool = True, text_of=None) -> dict:  # noqa: ANN001
    """The report and its results JSON beside it; `text_of`: a design's report_text (v3's by default)."""
    text, results = (text_of or report_text)(raw, report.parent, plots)
    report.write_text(text, encoding="utf-8")
    (report.parent / f"{report.stem}_results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return results


def main(argv: list[str] | None = None, design: str = "v3", doc: str = __doc__, text_of=None) -> int:  # noqa: ANN001
    """The command line of study_{design}_report.py (v4's reuses it with its own report_text)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--raw", type=Path, required=True,
                   help=f"study {design}'s raw results (experiments/study/raw_{design})")
    p.add_argument("--report", type=Path, required=True, help="the markdown report; its plots are written beside it")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    args = p.parse_args(argv)
    if not (args.raw / "study.json").is_file():
        print(f"study_{design}_report.py: error: --raw {args.raw}: no study.json there (run experiments/study/study.py "
              f"--design {design} first)", file=sys.stderr)
        return 2
    write_report(args.raw.resolve(), args.report, plots=not args.no_plots, text_of=text_of)
    print(f"[study] report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
