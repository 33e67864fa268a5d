"""The study's report, made only from its raw results files (one small JSON per run + study.json).

    python experiments/study/study_report.py --raw experiments/study/raw_v2 --report experiments/study/report_v2.md

`export_raw` (called by experiments/study/study.py) collects each finished run's numbers from its folder into
OUTPUT/raw/; `write_report` reads nothing else, so the committed experiments/study/report_v2.md can be regenerated
from the
committed experiments/study/raw_v2 (tests/test_study.py does). The endpoints and the rule that turns tests into verdicts
are fixed in ENDPOINTS and `verdict` below, before the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(HERE)]

LEVEL = 0.05
POWER = 0.80

# the paper's numbers quoted by the report (Shibata et al. 2026)
PAPER = {
    "ii": "170M at a fixed 100B-token budget: ζ_L 1.93 with 20K steps, 7.24 with 200K steps (10× smaller batch)",
    "iii": "1B: baseline ζ_L 6.42 → 0.00 with JREG (λ = 1, α = 1); removed for every α of {0, 0.1, 0.3, 0.5, 1, 3}",
    "iv": "10 seeds: mean downstream gain +0.41 points, one-sided paired t-test p = 0.034",
    "sft": "3.4B after SFT on Tulu-v1: baseline ζ_L 5.14, JREG 0.0",
}


@dataclass(frozen=True)
class Endpoint:
    """A paired contrast over seeds: value(arm) − value(reference); the paper predicts `sign` (+1 or −1)."""

    key: str
    claim: str
    arm: str
    reference: str
    metric: str  # a key of a final held-out measurement ("zeta_L", "ce", ...)
    sign: int
    label: str


# Fixed before the runs. "jreg" stands for the study's JREG arm (α = 1 by default).
ENDPOINTS = (
    Endpoint("ii", "(ii) more steps at a fixed token budget make the jump larger", "baseline-small",
             "baseline-large", "zeta_L", +1, "ζ_L(baseline-small) − ζ_L(baseline-large)"),
    Endpoint("iii", "(iii) JREG removes the jump", "jreg", "baseline-small", "zeta_L", -1,
             "ζ_L(JREG) − ζ_L(baseline-small)"),
    Endpoint("iv", "(iv) JREG improves held-out language modelling", "jreg", "baseline-small", "ce", -1,
             "held-out CE(JREG) − CE(baseline-small), nats/token"),
)
SECONDARY_METRICS = (("zeta_L-1", "ζ_L−1"), ("zeta_L-2", "ζ_L−2"), ("psi_L_over_mid", "Ψ_L / median middle Ψ"))
SECONDARY_FOR = ("ii", "iii")  # the jump endpoints; (iv)'s companion is the train–held-out gap per arm


# ----------------------------------------------------------------------------------------------------------
# raw results: one JSON per run, written from the run folders


def _jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _portable(text: str, cfg) -> str:
    """Commands with the output folder as $OUT and this checkout as ., so they read the same anywhere."""
    return text.replace(str(cfg.output), "$OUT").replace(sys.executable, "python").replace(str(ROOT) + "/", "./")


def export_raw(cfg, runs: list) -> Path:
    """OUTPUT/raw/<arm>__seed-<s>.json for every measured run (v3: its layer removal too), and
    OUTPUT/raw/study.json."""
    raw = cfg.output / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for run in runs:
        if (run.dir / "failed.json").exists():  # study v4: not finite after its one retry, counted as failing
            rec = {"run": run.name, "arm": run.arm, "seed": run.seed,
                   "spec": json.loads((run.dir / "spec.json").read_text()),
                   "command": _portable((run.dir / "command.txt").read_text().strip(), cfg),
                   "attempts": _jsonl(run.dir / "attempts.jsonl"),
                   "failed": json.loads((run.dir / "failed.json").read_text())}
            (raw / f"{run.arm}__seed-{run.seed}.json").write_text(json.dumps(rec, indent=1) + "\n")
            continue
        if not (run.dir / "post.done").exists() or (cfg.design != "v2" and not (run.dir / "removal.done").exists()):
            continue
        records = _jsonl(run.dir / "metrics.jsonl")
        train = {r["iteration"]: r for r in records if "lm_loss" in r}  # a resume repeats steps: the last wins
        valid = [r for r in records if r.get("split") == "valid"]
        rec = {
            "run": run.name, "arm": run.arm, "seed": run.seed,
            "spec": json.loads((run.dir / "spec.json").read_text()),
            "command": _portable((run.dir / "command.txt").read_text().strip(), cfg),
            "attempts": [{**a, "argv": a.get("argv")} for a in _jsonl(run.dir / "attempts.jsonl")],
            "train_curve": [[it, train[it]["lm_loss"], train[it].get("zeta_L")] for it in sorted(train)],
            "megatron_validation": ({k: valid[-1].get(k) for k in ("iteration", "val_loss", "zeta_L")}
                                    if valid else None),
            "measures": json.loads((run.dir / "measures.json").read_text()),
        }
        if (run.dir / "removal.json").exists():  # study v3's layer removal at the final checkpoint
            rec["removal"] = json.loads((run.dir / "removal.json").read_text())
        if run.sft:  # "before SFT" is the model this run started from, measured in this output folder
            parent = json.loads((run.parent.dir / "measures.json").read_text())
            rec["parent_final"] = parent["series"][-1]["heldout"]
        (raw / f"{run.arm}__seed-{run.seed}.json").write_text(json.dumps(rec, indent=1) + "\n")
    gate = cfg.output / "gate.json"
    data = json.loads((cfg.output / "data.json").read_text()) if (cfg.output / "data.json").exists() else {}
    study = {
        "config": json.loads(json.dumps(_asdict(cfg), default=str)),
        "arms": [{"name": a.name, "batch": a.batch, "steps": a.steps, "tokens": a.tokens, "lambda": a.lam,
                  "alpha": a.alpha, **({"layernorm_scaling": True} if a.lns else {})} for a in cfg.arms()],
        "jreg_arm": cfg.jreg_arm,
        "gate": json.loads(gate.read_text()) if gate.exists() else None,
        "invocations": _invocations(cfg.output / "invocations.jsonl", cfg),
        "data": _data_summary(data),
    }
    (raw / "study.json").write_text(json.dumps(study, indent=1) + "\n")
    return raw


REPRODUCED = ("ce", "zeta_L", "zeta_L-1", "zeta_L-2", "psi_L_over_mid")  # final held-out values compared


def merge_raw(new: Path, into: Path) -> list[str]:
    """Add the runs of another invocation's raw folder (`study.py --runs`) to a committed one: runs the committed
    folder lacks are copied in; a run it already has (a pretrained model re-trained to fine-tune it) is kept as
    committed, and the re-run's final held-out values beside the committed ones go to study.json's
    `reproductions` — unless the committed run lacks the layer-removal record the re-run has (v3 runs whose final
    checkpoint was lost before removal was measured, re-trained for it): then the re-run replaces it, so that
    every figure of the run comes from one model, and `reproductions` keeps the committed values (`replaced`).
    Its invocations are appended. The settings must be the same. Returns what it did."""
    old_study, new_study = (json.loads((d / "study.json").read_text()) for d in (into, new))
    if old_study["config"] != new_study["config"]:
        diff = sorted(k for k in set(old_study["config"]) | set(new_study["config"])
                      if old_study["config"].get(k) != new_study["config"].get(k))
        raise ValueError(f"{new} was made with other settings than {into} ({', '.join(diff)}): nothing merged")
    done = []
    reproductions = {r["run"]: r for r in old_study.get("reproductions", [])}
    for path in sorted(new.glob("*__seed-*.json")):
        rec = json.loads(path.read_text())
        target = into / path.name
        if not target.exists():
            target.write_text(path.read_text())
            done.append(f"added {rec['run']}")
            continue
        old = json.loads(target.read_text())
        if old["spec"] != rec["spec"]:
            raise ValueError(f"{path.name}: the re-run's spec differs from the committed one: nothing merged")
        final_old = old["measures"]["series"][-1]["heldout"]
        final_new = rec["measures"]["series"][-1]["heldout"]
        reproductions[rec["run"]] = {
            "run": rec["run"], "committed": {k: final_old[k] for k in REPRODUCED},
            "rerun": {k: final_new[k] for k in REPRODUCED},
            "committed_commit": old["attempts"][0].get("commit"), "rerun_commit": rec["attempts"][0].get("commit"),
            "rerun_command": rec["command"], "rerun_attempts": rec["attempts"],
        }
        if "removal" in rec and "removal" not in old:
            target.write_text(path.read_text())
            reproductions[rec["run"]]["replaced"] = True
            done.append(f"re-run of {rec['run']} replaced the committed one (which had no layer removal)")
            continue
        done.append(f"re-run of {rec['run']} compared with the committed one")
    known = {i["start"] for i in old_study["invocations"]}
    old_study["invocations"] += [i for i in new_study["invocations"] if i["start"] not in known]
    old_study["reproductions"] = [reproductions[k] for k in sorted(reproductions)]
    (into / "study.json").write_text(json.dumps(old_study, indent=1) + "\n")
    return done


def _asdict(cfg) -> dict:
    from dataclasses import asdict

    d = asdict(cfg)
    d.pop("output")
    return d


def _invocations(path: Path, cfg) -> list[dict]:
    """The last record of each invocation (one is written at its start and one at its end)."""
    by_start: dict[float, dict] = {}
    for rec in _jsonl(path):
        by_start[rec["start"]] = {"argv": rec["argv"], "start": rec["start"], "wall_s": rec.get("wall_s"),
                                  "commit": rec.get("commit"), "dirty_files": rec.get("dirty_files")}
    return [by_start[k] for k in sorted(by_start)]


def _data_summary(data: dict) -> dict:
    if not data:
        return {}
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = {}
    for split in ("train", "heldout"):
        ds = IndexedDataset(data[f"{split}_prefix"])
        out[split] = {"documents": len(ds), "tokens": int(sum(int(n) for n in ds.sequence_lengths))}
    return out


# ----------------------------------------------------------------------------------------------------------
# statistics


def paired(diffs: list[float], sign: int) -> dict:
    """Paired t-test of mean(diffs) on the paper's side (`sign`), the other side and two-sided
    (`megatron_jreg.evaluate.stats`), and the minimum detectable effect at LEVEL/POWER from the measured SD."""
    from scipy import stats as sp

    from megatron_jreg.evaluate.stats import paired_one_sided

    n = len(diffs)
    out: dict = {"n": n, "diffs": diffs, "mean": statistics.fmean(diffs) if diffs else None}
    if n < 2:
        out["note"] = "fewer than 2 seeds: no test"
        return out
    test = paired_one_sided(diffs, [0.0] * n, confidence=1 - LEVEL, higher_is_better=sign > 0)
    out["sd"] = test.sd_diff
    if not test.defined:
        out["note"] = "every seed gives the same difference: no spread, the test is undefined"
        return out
    out.update(p_paper=test.p_value, p_other=test.p_worse, p_two_sided=test.p_two_sided,
               mde=(sp.t.ppf(1 - LEVEL, n - 1) + sp.t.ppf(POWER, n - 1)) * test.sd_diff / math.sqrt(n))
    return out


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's adjustment over the primary endpoints (family-wise error at LEVEL), by endpoint key."""
    from megatron_jreg.evaluate.stats import holm as holm_list

    keys = list(pvalues)
    return dict(zip(keys, holm_list([pvalues[k] for k in keys])))


def verdict(test: dict, adjusted_paper: float | None, adjusted_other: float | None) -> str:
    """confirmed: the paper's direction at LEVEL after Holm; contradicted: the opposite direction at LEVEL after
    Holm; inconclusive otherwise (with the minimum detectable effect beside it)."""
    if "p_paper" not in test:
        return "not testable (" + test.get("note", "no data") + ")"
    if adjusted_paper is not None and adjusted_paper < LEVEL:
        return "confirmed"
    if adjusted_other is not None and adjusted_other < LEVEL:
        return "contradicted"
    return "inconclusive"


def spearman(x: list[float], y: list[float]) -> float:
    from scipy import stats as sp

    if len(x) < 3 or len(set(y)) < 2:
        return math.nan
    return float(sp.spearmanr(x, y).statistic)


def sign_test(values: list[float]) -> dict:
    """How many of the seeds have ρ > 0, and the one-sided binomial p of that many or more under p = 1/2."""
    from scipy import stats as sp

    vals = [v for v in values if not math.isnan(v) and v != 0]
    k = sum(v > 0 for v in vals)
    p = float(sp.binomtest(k, len(vals), 0.5, alternative="greater").pvalue) if vals else math.nan
    return {"positive": k, "n": len(vals), "p": p}


# ----------------------------------------------------------------------------------------------------------
# reading the raw files


@dataclass
class Raw:
    study: dict
    runs: dict[tuple[str, int], dict]  # (arm, seed) → run record

    @classmethod
    def load(cls, folder: Path) -> Raw:
        study = json.loads((folder / "study.json").read_text())
        runs = {}
        for path in sorted(folder.glob("*__seed-*.json")):
            rec = json.loads(path.read_text())
            runs[rec["arm"], rec["seed"]] = rec
        return cls(study, runs)

    @property
    def jreg(self) -> str:
        return self.study["jreg_arm"]

    def arm(self, name: str) -> str:
        return self.jreg if name == "jreg" else name

    def seeds(self, *arms: str) -> list[int]:
        want = [self.arm(a) for a in arms]
        common = None
        for a in want:
            have = {s for (arm, s) in self.runs if arm == a}
            common = have if common is None else common & have
        return sorted(common or [])

    def final(self, arm: str, seed: int, split: str = "heldout") -> dict:
        return self.runs[self.arm(arm), seed]["measures"]["series"][-1][split]

    def series(self, arm: str, seed: int) -> list[dict]:
        return self.runs[self.arm(arm), seed]["measures"]["series"]


def contrast(raw: Raw, ep: Endpoint, metric: str | None = None) -> dict:
    metric = metric or ep.metric
    seeds = raw.seeds(ep.arm, ep.reference)
    diffs = [raw.final(ep.arm, s)[metric] - raw.final(ep.reference, s)[metric] for s in seeds]
    return {"seeds": seeds, **paired(diffs, ep.sign)}


def iso_loss(raw: Raw) -> dict:
    """Per seed: the first baseline-small checkpoint whose core held-out CE is at most baseline-large's final
    one, and ζ_L there against baseline-large's final ζ_L (both on the core windows)."""
    rows = {}
    for s in raw.seeds("baseline-small", "baseline-large"):
        target = raw.series("baseline-large", s)[-1]["core"]
        hit = next((c for c in raw.series("baseline-small", s) if c["core"]["ce"] <= target["ce"]), None)
        if hit is not None:
            rows[s] = {"iteration": hit["iteration"], "ce": hit["core"]["ce"], "zeta_L": hit["core"]["zeta_L"],
                       "large_ce": target["ce"], "large_zeta_L": target["zeta_L"]}
    diffs = [r["zeta_L"] - r["large_zeta_L"] for r in rows.values()]
    return {"rows": rows, "test": paired(diffs, +1)}


def growth(raw: Raw, arm: str) -> dict:
    """Within-run Spearman ρ(step, core ζ_L) per seed and the sign test over seeds."""
    rho = {}
    for s in raw.seeds(arm):
        series = raw.series(arm, s)
        rho[s] = spearman([c["iteration"] for c in series], [c["core"]["zeta_L"] for c in series])
    return {"rho": rho, "sign": sign_test(list(rho.values()))}


def analyse(raw: Raw) -> dict:
    """Every number the report prints, in one dict (also written beside the report as results.json)."""
    primary = {ep.key: contrast(raw, ep) for ep in ENDPOINTS}
    paper_side = holm({k: t["p_paper"] for k, t in primary.items() if "p_paper" in t})
    other_side = holm({k: t["p_other"] for k, t in primary.items() if "p_other" in t})
    for key, test in primary.items():
        test["p_paper_holm"] = paper_side.get(key)
        test["p_other_holm"] = other_side.get(key)
        test["verdict"] = verdict(test, paper_side.get(key), other_side.get(key))
    secondary = {ep.key: {m: contrast(raw, ep, m) for m, _ in SECONDARY_METRICS}
                 for ep in ENDPOINTS if ep.key in SECONDARY_FOR}
    arms = [a["name"] for a in raw.study["arms"]]
    finals = {}
    for arm in arms:
        seeds = raw.seeds(arm)
        finals[arm] = {key: {s: raw.final(arm, s)[key] for s in seeds}
                       for key in ("ce", "zeta_L", "zeta_L-1", "zeta_L-2", "psi_L_over_mid")}
        finals[arm]["train_ce"] = {s: raw.final(arm, s, "train")["ce"] for s in seeds}
        finals[arm]["gap"] = {s: raw.final(arm, s)["ce"] - raw.final(arm, s, "train")["ce"] for s in seeds}
    return {"primary": primary, "secondary": secondary, "finals": finals, "iso_loss": iso_loss(raw),
            "growth": {arm: growth(raw, arm) for arm in ("baseline-small", "baseline-large") if arm in arms},
            "sft": sft_summary(raw)}


def sft_summary(raw: Raw) -> dict:
    """ζ and Ψ before (the final of the pretrained model the SFT run started from: `parent_final`, else the
    committed pretraining run) and after SFT (λ = 0) on the same held-out windows, per seed."""
    out = {}
    for parent in ("baseline-small", raw.jreg):
        arm = f"sft-{parent}"
        seeds = raw.seeds(arm, parent)
        if not seeds:
            continue
        out[parent] = {s: {"before": _pick(raw.runs[arm, s].get("parent_final") or raw.final(parent, s)),
                           "after": _pick(raw.final(arm, s)),
                           "chat_val_loss": (raw.runs[arm, s]["megatron_validation"] or {}).get("val_loss")}
                       for s in seeds}
    if "baseline-small" in out and raw.jreg in out:
        seeds = sorted(set(out["baseline-small"]) & set(out[raw.jreg]))
        diffs = [out[raw.jreg][s]["after"]["zeta_L"] - out["baseline-small"][s]["after"]["zeta_L"] for s in seeds]
        out["test_after"] = paired(diffs, -1)
    return out


def _pick(m: dict) -> dict:
    return {k: m[k] for k in ("zeta_L", "zeta_L-1", "zeta_L-2", "psi_L_over_mid", "ce")}


# ----------------------------------------------------------------------------------------------------------
# the report


def _f(v: float | None, spec: str = "{:.2f}") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else spec.format(v)


def _p(p: float | None) -> str:
    return "—" if p is None or math.isnan(p) else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _cell(values: dict, spec: str = "{:.2f}") -> str:
    vals = [v for v in values.values() if v is not None]
    if not vals:
        return "—"
    sd = f" ± {spec.format(statistics.stdev(vals))}" if len(vals) > 1 else ""
    return f"{spec.format(statistics.fmean(vals))}{sd}<br>({', '.join(spec.format(v) for v in vals)})"


def _inline(values: dict, spec: str = "{:.2f}") -> str:
    """mean (seed values) for a sentence."""
    vals = [v for v in values.values() if v is not None]
    return f"{spec.format(statistics.fmean(vals))} ({', '.join(spec.format(v) for v in vals)})" if vals else "—"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _label(raw: Raw, arm: str) -> str:
    spec = next(a for a in raw.study["arms"] if a["name"] == arm)
    what = "baseline (λ = 0)" if not spec["lambda"] else f"JREG λ = {spec['lambda']:g}, α = {spec['alpha']:g}"
    return f"{arm}: {what}, batch {spec['batch']} × {spec['steps']} steps"


def render(raw: Raw, results: dict, plots: dict[str, str], command: str) -> str:
    """The markdown report; `plots` names the figure files and the raw folder relative to the report."""
    st = raw.study
    cfg = st["config"]
    arms = [a["name"] for a in st["arms"]]
    seeds = sorted({s for (_, s) in raw.runs})
    tokens = st["arms"][0]["tokens"]
    lines = ["# JREG at laptop scale: a study designed to test the paper's claims", "",
             f"Generated by `{command}` from the raw results in `{plots.get('raw', 'raw/')}` (one JSON per run, "
             "with its command and the commit that trained it); `experiments/study/study.py` wrote them. The design, "
             "endpoints and verdict rule were fixed in `experiments/study/study.py` and "
             "`experiments/study/study_report.py` before "
             "the runs.", ""]
    lines += ["## Design", ""]
    model = cfg["model"]
    train, heldout = st["data"].get("train", {}), st["data"].get("heldout", {})
    lines += [
        f"- Model: a Llama of {model['layers']} layers × {model['hidden']} ({model['heads']} heads, FFN "
        f"{model['ffn']}, RoPE, RMSNorm, SwiGLU, untied embeddings, context 128), BPE vocabulary 4,096; "
        "Megatron-LM's training loop on one CPU core per run.",
        f"- Data: WikiText-2 split by article (`examples/laptop_scale.py`): {_f(train.get('tokens'), '{:,}')} "
        f"training tokens ({train.get('documents', '—')} articles); {_f(heldout.get('tokens'), '{:,}')} held-out "
        f"tokens ({heldout.get('documents', '—')} articles never trained on), which every evaluation reads.",
        f"- Arms, one fixed budget of {tokens:,} tokens each (the paper's §3.4 changes the batch size at a fixed "
        "token budget):", *[f"  - {_label(raw, a)}" for a in arms],
        "- Recipe (ours; the paper does not state it): AdamW lr 1e-3 → 1e-4 cosine, 5 % warm-up, weight decay 0.1, "
        "β = (0.9, 0.95), clip 1.0, the same for every arm; `--init-mode layout-independent --seed s`: the arms "
        "of a seed start from the same weights.",
        f"- Seeds: {', '.join(map(str, seeds))}. Measurement: held-out cross-entropy (nats/token), Ψ_ℓ (angular) "
        f"and ζ on the same {cfg['core_windows']} held-out windows of 128 tokens at each of the "
        f"{cfg['checkpoints']} checkpoints, and on every held-out window at the final one; the train–held-out "
        f"gap from {cfg['train_windows']} training windows.",
        f"- Primary endpoints (paired over seeds, one-sided t-test in the paper's direction at {LEVEL:g}, "
        "Holm-adjusted over the three; the other side is tested the same way): "
        + "; ".join(f"{ep.claim}: {ep.label} {'> 0' if ep.sign > 0 else '< 0'}" for ep in ENDPOINTS) + ".",
        "- Verdicts: *confirmed* when the paper's side is significant after Holm, *contradicted* when the "
        "opposite side is, *inconclusive* otherwise; the minimum detectable effect (MDE, "
        f"{LEVEL:g} one-sided, power {POWER:g}, from the measured paired SD) says how large an effect the seeds "
        "could have seen.",
    ]
    gate = st.get("gate")
    if gate:
        state = "passed" if gate["passed"] else ("failed; the study went on (--ignore-gate)" if gate.get("ignored")
                                                 else "failed: the study stopped after the pilot")
        lines += [f"- Pilot gate ({gate['run']} first, with baseline-large seed 1): final held-out ζ_L "
                  f"{gate['zeta_L']:.2f} against the threshold {gate['threshold']:g}: {state}."]
    lines += [""]

    prim = results["primary"]
    lines += ["## What came out", ""]
    for ep in ENDPOINTS:
        t = prim[ep.key]
        if "p_paper" not in t:
            lines += [f"- **{ep.claim}**: {t.get('note', 'no data')} (n = {t['n']})."]
            continue
        lines += [f"- **{ep.claim}** — **{t['verdict']}**. {ep.label}: mean {_f(t['mean'], '{:+.4f}')} "
                  f"(per seed {', '.join(_f(d, '{:+.3f}') for d in t['diffs'])}; n = {t['n']}); one-sided p "
                  f"{_p(t['p_paper'])} (Holm {_p(t['p_paper_holm'])}), opposite side {_p(t['p_other'])} "
                  f"(Holm {_p(t['p_other_holm'])}), two-sided {_p(t['p_two_sided'])}; MDE {_f(t['mde'], '{:.4f}')}. "
                  f"Paper: {PAPER[ep.key]}."]
    iso = results["iso_loss"]
    if iso["rows"]:
        it = iso["test"]
        lines += [f"- Iso-loss (secondary): at the first baseline-small checkpoint whose held-out CE reaches "
                  f"baseline-large's final CE, ζ_L − ζ_L(baseline-large) = {_f(it.get('mean'), '{:+.3f}')} "
                  f"(per seed {', '.join(_f(d, '{:+.2f}') for d in it['diffs'])}; one-sided p "
                  f"{_p(it.get('p_paper'))}). This separates 'more steps' from 'lower loss'."]
    for arm, g in results["growth"].items():
        rho = ", ".join(_f(r, "{:+.2f}") for r in g["rho"].values())
        lines += [f"- Growth within a run ({arm}, secondary): Spearman ρ(step, ζ_L) per seed {rho}; ρ > 0 in "
                  f"{g['sign']['positive']} of {g['sign']['n']} seeds (sign test p {_p(g['sign']['p'])})."]
    sft = results["sft"]
    if sft.get("baseline-small") and sft.get(raw.jreg):
        t = sft["test_after"]
        b, j = sft["baseline-small"], sft[raw.jreg]
        lines += [f"- SFT analogue (λ = 0 in SFT for both, the paper's plain cross-entropy SFT): ζ_L after SFT, "
                  f"baseline {_inline({s: v['after']['zeta_L'] for s, v in b.items()})} (before "
                  f"{_inline({s: v['before']['zeta_L'] for s, v in b.items()})}), JREG "
                  f"{_inline({s: v['after']['zeta_L'] for s, v in j.items()})} (before "
                  f"{_inline({s: v['before']['zeta_L'] for s, v in j.items()})}); JREG − baseline after SFT "
                  f"{_f(t.get('mean'), '{:+.3f}')}, one-sided p {_p(t.get('p_paper'))} (n = {t['n']}). "
                  f"Paper: {PAPER['sft']}."]
    lines += ["", "### Where this differs from the paper", ""]
    lines += _differences(raw, results)
    lines += [""]

    lines += ["## Primary and secondary contrasts", "",
              "Paired differences over seeds (final checkpoints, every held-out window). p (paper): one-sided in the "
              "paper's direction; p (other): the opposite side; Holm over the three primary endpoints.", ""]
    rows = []
    for ep in ENDPOINTS:
        t = prim[ep.key]
        rows.append([f"**{ep.label}**", _f(t.get("mean"), "{:+.4f}"), _f(t.get("sd"), "{:.4f}"),
                     _p(t.get("p_paper")), _p(t.get("p_paper_holm")), _p(t.get("p_other")), _p(t.get("p_two_sided")),
                     _f(t.get("mde"), "{:.4f}"), t["verdict"]])
        for metric, name in SECONDARY_METRICS if ep.key in SECONDARY_FOR else ():
            s = results["secondary"][ep.key][metric]
            rows.append([f"&nbsp;&nbsp;{name} (secondary)", _f(s.get("mean"), "{:+.4f}"), _f(s.get("sd"), "{:.4f}"),
                         _p(s.get("p_paper")), "", _p(s.get("p_other")), _p(s.get("p_two_sided")),
                         _f(s.get("mde"), "{:.4f}"), ""])
    lines += _table(["contrast", "mean", "sd", "p (paper)", "Holm", "p (other)", "p two-sided", "MDE", "verdict"],
                    rows)
    lines += [""]

    fin = results["finals"]
    lines += ["## Final checkpoints per arm", "",
              "Mean ± sd over seeds, then each seed. Held-out: every held-out window; train: training windows; "
              "gap = held-out − train cross-entropy.", ""]
    rows = [[a, _cell(fin[a]["ce"], "{:.4f}"), _cell(fin[a]["train_ce"], "{:.4f}"), _cell(fin[a]["gap"], "{:.4f}"),
             _cell(fin[a]["zeta_L"]), _cell(fin[a]["zeta_L-1"]), _cell(fin[a]["zeta_L-2"]),
             _cell(fin[a]["psi_L_over_mid"], "{:.3f}")] for a in arms]
    lines += _table(["arm", "held-out CE", "train CE", "gap", "ζ_L", "ζ_L−1", "ζ_L−2", "Ψ_L / mid Ψ"], rows)
    lines += [""]

    lines += ["## ζ_L through training", "", f"![ζ_L against tokens]({plots['zeta']})", "",
              "Core held-out windows at each checkpoint (fraction of the token budget), mean over seeds and each seed.",
              ""]
    fractions = None
    rows = []
    for a in arms:
        per = [raw.series(a, s) for s in raw.seeds(a)]
        if not per:
            continue
        fractions = [c["iteration"] / raw.runs[a, raw.seeds(a)[0]]["spec"]["steps"] for c in per[0]]
        rows.append([a] + [_cell({s: raw.series(a, s)[i]["core"]["zeta_L"] for s in raw.seeds(a)})
                           for i in range(len(fractions))])
    if fractions:
        lines += _table(["arm"] + [f"{f:.0%}" for f in fractions], rows)
    lines += [""]

    lines += ["## Displacement per layer (the paper's Table 5 at this scale)", "",
              f"![Ψ per layer]({plots['psi']})", "",
              "Ψ_ℓ at the final checkpoints (every held-out window), mean over seeds; Δ_ℓ = Ψ_ℓ(JREG) − "
              "Ψ_ℓ(baseline-small) of the same seed; w_ℓ = softmax(α·ℓ), the weight JREG puts on layer ℓ.", ""]
    L = raw.study["config"]["model"]["layers"]
    weights = _weights(L, next(a["alpha"] for a in st["arms"] if a["name"] == raw.jreg))
    rows = []
    for layer in range(L):
        cells = [str(layer + 1)]
        for a in arms:
            vals = [raw.final(a, s)["psi"][layer] for s in raw.seeds(a)]
            cells.append(_f(statistics.fmean(vals), "{:.4f}") if vals else "—")
        d = {s: raw.final(raw.jreg, s)["psi"][layer] - raw.final("baseline-small", s)["psi"][layer]
             for s in raw.seeds(raw.jreg, "baseline-small")}
        cells += [_cell(d, "{:+.4f}"), f"{weights[layer]:.3f}"]
        rows.append(cells)
    lines += _table(["ℓ", *[f"Ψ_ℓ {a}" for a in arms], "Δ_ℓ (JREG − baseline-small)", "w_ℓ"], rows)
    lines += [""]

    if iso["rows"]:
        lines += ["## Iso-loss comparison", "", f"![held-out CE against steps]({plots['ce']})", "",
                  "Per seed: baseline-large's final core-window CE and ζ_L, and the first baseline-small checkpoint "
                  "that reaches that CE.", ""]
        lines += _table(["seed", "baseline-large final CE", "ζ_L", "baseline-small step", "CE", "ζ_L", "Δζ_L"],
                        [[str(s), f"{r['large_ce']:.4f}", f"{r['large_zeta_L']:.2f}", str(r["iteration"]),
                          f"{r['ce']:.4f}", f"{r['zeta_L']:.2f}", f"{r['zeta_L'] - r['large_zeta_L']:+.2f}"]
                         for s, r in iso["rows"].items()])
        lines += [""]

    if sft.get("baseline-small"):
        lines += ["## SFT analogue", "",
                  "Both pretrained models fine-tuned with λ = 0 (the paper's SFT is plain cross-entropy; JREG during "
                  "SFT stays available with `--jreg-lambda` but is not compared here), "
                  f"{cfg['sft_steps']} steps × {cfg['sft_batch']} packed conversations of the vendored chat data "
                  f"(examples/sft/data, built from WikiText-2 valid articles only), lr {cfg['sft_lr']:g} linear to 0. "
                  "Before/after on the same held-out windows; chat val loss: Megatron-LM's validation on the chat "
                  "data's held-out 5 %.", ""]
        rows = []
        for parent in ("baseline-small", raw.jreg):
            for s, v in sft.get(parent, {}).items():
                rows.append([parent, str(s), f"{v['before']['zeta_L']:.2f} → {v['after']['zeta_L']:.2f}",
                             f"{v['before']['zeta_L-1']:.2f} → {v['after']['zeta_L-1']:.2f}",
                             f"{v['before']['zeta_L-2']:.2f} → {v['after']['zeta_L-2']:.2f}",
                             f"{v['before']['psi_L_over_mid']:.3f} → {v['after']['psi_L_over_mid']:.3f}",
                             f"{v['before']['ce']:.4f} → {v['after']['ce']:.4f}", _f(v["chat_val_loss"], "{:.4f}")])
        lines += _table(["pretrained", "seed", "ζ_L", "ζ_L−1", "ζ_L−2", "Ψ_L / mid Ψ", "held-out CE",
                         "chat val loss"], rows)
        lines += [""]

    lines += ["## Provenance and cost", ""]
    lines += _provenance(raw)
    return "\n".join(lines) + "\n"


def _differences(raw: Raw, results: dict) -> list[str]:
    out = []
    for ep in ENDPOINTS:
        t = results["primary"][ep.key]
        if t["verdict"] != "confirmed":
            out.append(f"- {ep.claim}: {t['verdict']} here (mean {_f(t.get('mean'), '{:+.4f}')}, MDE "
                       f"{_f(t.get('mde'), '{:.4f}')}), where the paper reports it.")
    model = raw.study["config"]["model"]
    out.append(f"- Scale: a {model['layers']} × {model['hidden']} model ({_params(model) / 1e6:.1f}M parameters) on "
               f"{raw.study['arms'][0]['tokens']:,} tokens against 170M–3.4B models on 100B tokens; the "
               "downstream claim is tested as held-out cross-entropy (benchmarks are at chance at this scale).")
    return out


def _params(model: dict, vocab: int = 4096) -> int:
    """Parameters of the study's Llama: attention 4h², SwiGLU 3·h·ffn, two norms per layer, untied embeddings."""
    h = model["hidden"]
    return model["layers"] * (4 * h * h + 3 * h * model["ffn"] + 2 * h) + 2 * vocab * h + h


def _weights(num_layers: int, alpha: float) -> list[float]:
    from megatron_jreg import jreg

    return jreg.layer_weights(num_layers, alpha).tolist()


def _provenance(raw: Raw) -> list[str]:
    commits: dict[str, list[str]] = {}
    cpu = {"train": 0.0, "post": 0.0}
    wall = 0.0
    for (arm, seed), rec in sorted(raw.runs.items()):
        for a in rec["attempts"]:
            key = (a.get("commit") or "unknown")[:12] + (" (with local changes)" if a.get("dirty_files") else "")
            commits.setdefault(key, []).append(f"{arm}/seed-{seed} {a['kind']}")
            cpu[a["kind"]] += a.get("cpu_s") or 0.0
    invocations = raw.study.get("invocations", [])
    wall = sum(i.get("wall_s") or 0.0 for i in invocations)
    unrecorded = sum(i.get("wall_s") is None for i in invocations)
    out = [f"- Cost: {cpu['train'] / 60:.0f} core-minutes of training and {cpu['post'] / 60:.0f} of measurement "
           f"(CPU time of the processes, whatever else the machine ran); {wall / 3600:.1f} h wall over "
           f"{len(invocations) - unrecorded} of {len(invocations)} invocation(s)"
           + (f" ({unrecorded} stopped before recording their wall time)." if unrecorded else "."),
           "- Code of each attempt (commit → attempts):"]
    for key, what in sorted(commits.items()):
        out.append(f"  - `{key}`: {len(what)} attempt(s) ({', '.join(sorted(set(what))[:6])}"
                   f"{', …' if len(set(what)) > 6 else ''})")
    for inv in invocations:
        out.append(f"- invocation `{' '.join(inv['argv'])}` at `{(inv.get('commit') or 'unknown')[:12]}`"
                   f"{' (with local changes)' if inv.get('dirty_files') else ''}: "
                   + (f"{inv['wall_s'] / 60:.0f} min" if inv.get("wall_s") is not None
                      else "wall time not recorded (stopped before it ended)"))
    out.append("- Each run's exact command is in its raw file (`command`), with `$OUT` for the output folder.")
    for rep in raw.study.get("reproductions", []):
        worst = max(abs(rep["rerun"][k] - rep["committed"][k]) for k in REPRODUCED)
        shown = ", ".join(f"{k} {_f(rep['committed'][k], '{:.4f}')} → {_f(rep['rerun'][k], '{:.4f}')}"
                          for k in REPRODUCED)
        out.append(f"- Re-trained to fine-tune it (a later invocation): `{rep['run']}` at "
                   f"`{(rep.get('rerun_commit') or 'unknown')[:12]}`, the committed run at "
                   f"`{(rep.get('committed_commit') or 'unknown')[:12]}`; final held-out values committed → "
                   f"re-run: {shown} (largest difference {worst:.2g}). The pretraining tables use the committed run; "
                   "the SFT table's \"before\" is the re-run, the model its SFT started from.")
    return out


def plot(raw: Raw, folder: Path, stem: str) -> dict[str, str]:
    """ζ_L against tokens, Ψ per layer and held-out CE against tokens; returns {name: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a["name"] for a in raw.study["arms"]]
    names = {"zeta": f"{stem}_zeta.png", "psi": f"{stem}_psi.png", "ce": f"{stem}_ce.png"}
    for key, ylabel, pick in (("zeta", "held-out ζ_L (core windows)", lambda c: c["core"]["zeta_L"]),
                              ("ce", "held-out CE, nats/token (core windows)", lambda c: c["core"]["ce"])):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for i, a in enumerate(arms):
            for j, s in enumerate(raw.seeds(a)):
                series = raw.series(a, s)
                tok = [c["iteration"] * raw.runs[a, s]["spec"]["batch"] * 128 / 1e6 for c in series]
                ax.plot(tok, [pick(c) for c in series], color=f"C{i}", alpha=0.8, marker=".",
                        label=a if j == 0 else None)
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / names[key], dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, a in enumerate(arms):
        rows = [raw.final(a, s)["psi"] for s in raw.seeds(a)]
        if rows:
            ax.plot(range(1, len(rows[0]) + 1), [statistics.fmean(c) for c in zip(*rows)], marker="o",
                    color=f"C{i}", label=a)
    ax.set_xlabel("layer ℓ")
    ax.set_ylabel("Ψ_ℓ (angular), held-out, mean over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / names["psi"], dpi=110)
    plt.close(fig)
    return names


def _shown(path: Path) -> str:
    """A path as the report prints it: relative to this checkout when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def report_text(raw_dir: Path, report: Path) -> tuple[str, dict]:
    """(markdown, results) of the report that `write_report` writes at `report`: a function of raw_dir only."""
    import os

    raw = Raw.load(raw_dir)
    if not raw.runs:
        return "# JREG at laptop scale\n\nNo measured runs yet.\n", {}
    stem = report.stem
    names = {"zeta": f"{stem}_zeta.png", "psi": f"{stem}_psi.png", "ce": f"{stem}_ce.png",
             "raw": os.path.relpath(raw_dir.resolve(), report.parent.resolve())}
    results = analyse(raw)
    command = f"python experiments/study/study_report.py --raw {_shown(raw_dir)} --report {_shown(report)}"
    return render(raw, results, names, command), results


def write_report(raw_dir: Path, report: Path, plots: bool = True) -> dict:
    """report (markdown), REPORT_results.json and plots beside it, from raw_dir only."""
    text, results = report_text(raw_dir, report)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(text, encoding="utf-8")
    if results:
        (report.parent / f"{report.stem}_results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        if plots:
            plot(Raw.load(raw_dir), report.parent, report.stem)
    return results


SFT_MARKERS = ("<!-- study:sft -->", "<!-- /study:sft -->")


def sft_section(report_text: str) -> str:
    """The body of the report's "SFT analogue" section (empty when the report has none)."""
    if "## SFT analogue\n" not in report_text:
        return ""
    body = report_text.split("## SFT analogue\n", 1)[1]
    return body.split("\n## ", 1)[0].strip("\n")


def sft_block(doc_text: str) -> str:
    """What a document (docs/sft.md) holds between SFT_MARKERS."""
    start, end = SFT_MARKERS
    if start not in doc_text or end not in doc_text:
        raise ValueError(f"no {start} … {end} block")
    return doc_text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def write_sft_block(doc: Path, report_text: str) -> None:
    """Put the report's SFT section between the document's markers, so both say the same."""
    text = doc.read_text(encoding="utf-8")
    sft_block(text)  # both markers are there
    start, end = SFT_MARKERS
    before, rest = text.split(start, 1)
    after = rest.split(end, 1)[1]
    section = sft_section(report_text)
    doc.write_text(f"{before}{start}\n{section}\n{end}{after}" if section else f"{before}{start}\n{end}{after}",
                   encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, required=True, help="the raw results folder (OUTPUT/raw or raw_v2)")
    p.add_argument("--report", type=Path, required=True, help="the markdown report; plots and results.json beside it")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument("--merge", type=Path, help="first add the runs of this raw folder (from `study.py --runs`) to "
                   "--raw: new runs copied in, re-runs of committed ones compared with them (study.json)")
    p.add_argument("--sft-doc", type=Path, help=f"also copy the SFT section between {SFT_MARKERS[0]} and "
                   f"{SFT_MARKERS[1]} of this document (docs/sft.md)")
    args = p.parse_args(argv)
    if not (args.raw / "study.json").is_file():
        print(f"study_report.py: error: --raw {args.raw}: no study.json there (run experiments/study/study.py first)",
              file=sys.stderr)
        return 2
    if args.sft_doc is not None:
        try:
            sft_block(args.sft_doc.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            print(f"study_report.py: error: --sft-doc {args.sft_doc}: {e}; add the two markers where the section "
                  "goes", file=sys.stderr)
            return 2
    if args.merge is not None:
        if not (args.merge / "study.json").is_file():
            print(f"study_report.py: error: --merge {args.merge}: no study.json there", file=sys.stderr)
            return 2
        try:
            for line in merge_raw(args.merge, args.raw):
                print(f"[study] {line}")
        except ValueError as e:
            print(f"study_report.py: error: --merge {args.merge}: {e}", file=sys.stderr)
            return 2
    design = json.loads((args.raw / "study.json").read_text())["config"].get("design", "v2")
    if design == "v2":
        write_report(args.raw, args.report, plots=not args.no_plots)
    else:  # v3 and later: the design's own report, on its pre-registered analysis
        import importlib

        importlib.import_module(f"study_{design}_report").write_report(args.raw.resolve(), args.report,
                                                                         plots=not args.no_plots)
    print(f"[study] report: {args.report}")
    if args.sft_doc is not None:
        write_sft_block(args.sft_doc, args.report.read_text(encoding="utf-8"))
        print(f"[study] SFT section copied into {args.sft_doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
