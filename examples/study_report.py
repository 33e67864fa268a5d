"""The study's results: per-run numbers collected from its folders, `compare` per α and metric, plots, and a
markdown report with the paper's Tables 3, 5 and 13 at this scale (examples/study.py runs it).

Sources per run (runs/<arm>/seed-<s>/):
- analysis/results.json (`megatron-jreg analyze` on the checkpoint series, held-out WikiText-2 test
  paragraphs): Ψ_ℓ and ζ_L, ζ_{L−1}, ζ_{L−2} at every checkpoint; the last one is the final model;
- metrics.jsonl (`--metrics-file`): ζ_L on each logged training batch, the final lm loss, and Megatron-LM's
  validation loss of the final weights on the WikiText-2 test split;
- eval.json (`megatron-jreg evaluate`): lm-eval's wikitext task on the local WikiText-2 test (word perplexity,
  bits per byte) and LAMBADA top-1.
Every number in the tables is a mean over seeds with its per-seed values; Δ is JREG − baseline of the same seed.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

# the paper's numbers quoted by the report (Shibata et al. 2026; issue 14)
PAPER = {
    "alphas": (0.0, 0.1, 0.3, 0.5, 1.0, 3.0),
    "growth": "170M: ζ_L 1.93 at 20K steps → 7.24 at 200K",
    "removal": "1B: baseline ζ_L 6.42 → 0.00 with JREG (λ = 1, α = 1)",
    "significance": "10 seeds: mean downstream gain +0.41 points, one-sided paired t-test p = 0.034",
}


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    lower_better: bool
    fmt: str
    tested: bool  # given to `compare` (one-sided paired t-test)


METRICS = (
    Metric("zeta_L", "ζ_L", True, "{:.2f}", True),
    Metric("zeta_L-1", "ζ_L−1", True, "{:.2f}", False),
    Metric("zeta_L-2", "ζ_L−2", True, "{:.2f}", False),
    Metric("val_loss", "val loss", True, "{:.3f}", True),
    Metric("word_perplexity", "word ppl", True, "{:.1f}", False),
    Metric("bits_per_byte", "bits/byte", True, "{:.4f}", True),
    Metric("lambada_acc", "LAMBADA acc", False, "{:.4f}", True),
)
BY_KEY = {m.key: m for m in METRICS}


# ----------------------------------------------------------------------------------------------------------
# collecting


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def load_run(run, steps: int, save_interval: int) -> dict:
    """One run's numbers; missing pieces stay None (an unfinished run shows up as missing in the tables)."""
    rec: dict = {"arm": run.arm, "alpha": run.alpha, "seed": run.seed, "dir": str(run.dir),
                 "trained": (run.dir / "train.done").exists(), "analysed": (run.dir / "post.done").exists()}
    records = _jsonl(run.dir / "metrics.jsonl")
    train = {r["iteration"]: r for r in records if "lm_loss" in r}  # a resume repeats steps: the last wins
    steps_logged = sorted(train)
    rec["train_curve"] = {"steps": steps_logged, "zeta_L": [train[s].get("zeta_L") for s in steps_logged],
                          "lm_loss": [train[s]["lm_loss"] for s in steps_logged]}
    valid = [r for r in records if r.get("split") == "valid" and r.get("iteration") == steps]
    final: dict = {k: None for k in BY_KEY}
    final.update(lm_loss=train[steps]["lm_loss"] if steps in train else None, val_loss=None, psi=None)
    if valid:
        final["val_loss"] = valid[-1]["val_loss"]
    analysis = _json(run.dir / "analysis" / "results.json")
    series = {"steps": [], "zeta_L": [], "zeta_L-1": [], "zeta_L-2": [], "psi": []}
    if analysis:
        models = sorted((m for m in analysis["models"] if m.get("step") is not None), key=lambda m: m["step"])
        for m in models:  # the series at the save interval (a SIGTERM'd run also keeps an odd-step checkpoint)
            if m["step"] % save_interval == 0 or m["step"] == steps:
                series["steps"].append(m["step"])
                for key in ("zeta_L", "zeta_L-1", "zeta_L-2", "psi"):
                    series[key].append(m[key])
        if series["steps"] and series["steps"][-1] == steps:
            for key in ("zeta_L", "zeta_L-1", "zeta_L-2", "psi"):
                final[key] = series[key][-1]
    rec["series"] = series
    ev = _json(run.dir / "eval.json")
    if ev:
        wiki = ev["results"].get("wikitext2_local", {})
        lam = ev["results"].get("lambada", {})
        final.update(word_perplexity=wiki.get("word_perplexity"), bits_per_byte=wiki.get("bits_per_byte"),
                     lambada_acc=lam.get("acc"), lambada_perplexity=lam.get("perplexity"))
        rec["eval_samples"] = ev.get("samples", {})
    rec["final"] = final
    attempts = _jsonl(run.dir / "attempts.jsonl")
    rec["wall_s"] = {kind: sum(a["wall_s"] for a in attempts if a["kind"] == kind) for kind in ("train", "post")}
    rec["resumed"] = any(a["kind"] == "train" and a["from_iteration"] > 0 for a in attempts)
    rec["first_start"] = min((a["start"] for a in attempts), default=None)
    return rec


def _stats(values: dict[int, float | None]) -> dict:
    """{mean, sd, seeds: {seed: value}} over the seeds that have a value."""
    got = {s: v for s, v in values.items() if v is not None}
    vals = list(got.values())
    return {"mean": statistics.fmean(vals) if vals else None,
            "sd": statistics.stdev(vals) if len(vals) > 1 else None, "seeds": got}


def summarize(cfg, records: list[dict]) -> dict:
    arms = [a for a, _ in cfg.arms()]
    by = {(r["arm"], r["seed"]): r for r in records}
    seeds = sorted({r["seed"] for r in records})
    summary = {arm: {m.key: _stats({s: by[arm, s]["final"][m.key] for s in seeds if (arm, s) in by})
                     for m in METRICS} for arm in arms}
    for arm in arms:
        summary[arm]["val_ppl"] = _stats({s: math.exp(v) for s, v in summary[arm]["val_loss"]["seeds"].items()})
    psi = {arm: {s: by[arm, s]["final"]["psi"] for s in seeds if (arm, s) in by and by[arm, s]["final"]["psi"]}
           for arm in arms}
    delta = {}
    for arm in arms[1:]:
        per_seed = {s: [j - b for j, b in zip(psi[arm][s], psi["baseline"][s])]
                    for s in psi[arm] if s in psi["baseline"]}
        delta[arm] = {"seeds": per_seed, "mean": _mean_lists(list(per_seed.values()))}
    psi_summary = {arm: {"seeds": psi[arm], "mean": _mean_lists(list(psi[arm].values())),
                         "sd": _sd_lists(list(psi[arm].values()))} for arm in arms}
    return {"final": summary, "psi": psi_summary, "delta": delta}


def _mean_lists(rows: list[list[float]]) -> list[float] | None:
    return [statistics.fmean(col) for col in zip(*rows)] if rows else None


def _sd_lists(rows: list[list[float]]) -> list[float] | None:
    return [statistics.stdev(col) for col in zip(*rows)] if len(rows) > 1 else None


# ----------------------------------------------------------------------------------------------------------
# significance: `megatron-jreg compare` per α and metric


def run_compare(cfg, records: list[dict], out: Path) -> dict:
    """One-sided paired t-test (H1: JREG better) of every tested metric, JREG α vs baseline, over the seeds
    where both runs are finished: `megatron-jreg compare` on score files in `evaluate`'s format, one task
    per file. Lower-is-better metrics are given to it negated, and turned back here: `diff` is always
    JREG − baseline in the metric's own sense, `bound` the 95% one-sided bound on that difference."""
    from megatron_jreg.evaluate import compare
    from megatron_jreg.evaluate.results import EvalResults

    by = {(r["arm"], r["seed"]): r for r in records}
    results: dict = {}
    for arm, _ in cfg.arms()[1:]:
        results[arm] = {}
        for m in (m for m in METRICS if m.tested):
            pairs = sorted(s for (a, s), r in by.items() if a == arm and r["final"][m.key] is not None
                           and ("baseline", s) in by and by["baseline", s]["final"][m.key] is not None)
            base = [by["baseline", s]["final"][m.key] for s in pairs]
            jreg = [by[arm, s]["final"][m.key] for s in pairs]
            entry = {"n": len(pairs), "seeds": pairs, "baseline": base, "jreg": jreg,
                     "diffs": [j - b for j, b in zip(jreg, base)]}
            results[arm][m.key] = entry
            if len(pairs) < 2:
                entry["skipped"] = "fewer than 2 seed pairs: no t-test"
                continue
            if m.key == "lambada_acc" and not any(base + jreg):
                entry["skipped"] = "LAMBADA top-1 is 0 in every run: nothing to test"
                continue
            folder = out / "compare" / arm / m.key
            folder.mkdir(parents=True, exist_ok=True)
            sign = -1.0 if m.lower_better else 1.0
            files = {"baseline": [], "jreg": []}
            for s, b, j in zip(pairs, base, jreg):
                for side, value in (("baseline", b), ("jreg", j)):
                    path = folder / f"{side}-seed-{s}.json"
                    EvalResults(results={m.key: {"score": sign * value}}, samples={m.key: 1}, seed=s,
                                config={"num_fewshot": None}).write(path)
                    files[side].append(str(path))
            text = io.StringIO()
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                rc = compare.main(["--baseline", *files["baseline"], "--jreg", *files["jreg"], "--metric", "score",
                                   "--output", str(folder / "compare.json")])
            (folder / "compare.txt").write_text(text.getvalue())
            if rc != 0:
                entry["skipped"] = f"compare failed: {text.getvalue().strip()}"
                continue
            row = json.loads((folder / "compare.json").read_text())["rows"][m.key]
            entry.update(diff=sign * row["mean_diff"], p_value=row["p_value"], t=row["t"],
                         bound=None if row["lower_bound"] is None else sign * row["lower_bound"],
                         jreg_better=row["jreg_better"], compare=str(folder / "compare.json"))
    return results


# ----------------------------------------------------------------------------------------------------------
# plots


def _arm_label(arm: str, alpha: float | None) -> str:
    return "baseline (λ = 0)" if alpha is None else f"JREG α = {alpha:g}"


def plot_all(cfg, records: list[dict], summary: dict, folder: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_jreg.jreg import layer_weights

    arms = cfg.arms()
    colors = {arm: plt.cm.tab10(i) for i, (arm, _) in enumerate(arms)}
    files = {name: folder / f"study_{name}.png" for name in ("zeta_steps", "psi", "delta", "weights")}

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for arm, alpha in arms:
        runs = [r for r in records if r["arm"] == arm]
        for key, ax in (("series", ax1), ("train_curve", ax2)):
            curves = [(r[key]["steps"], r[key]["zeta_L"]) for r in runs if r[key]["steps"]]
            for steps, z in curves:
                ax.plot(steps, z, color=colors[arm], alpha=0.25, lw=0.8)
            common = sorted(set.intersection(*(set(s) for s, _ in curves))) if curves else []
            if common:
                mean = [statistics.fmean(dict(zip(s, z))[t] for s, z in curves) for t in common]
                ax.plot(common, mean, color=colors[arm], lw=2, marker="o" if key == "series" else None, ms=3,
                        label=_arm_label(arm, alpha))
    ax1.set_title("ζ_L on held-out WikiText-2 (analyze, checkpoint series)")
    ax2.set_title("ζ_L on the logged training batches (metrics file)")
    for ax in (ax1, ax2):
        ax.set_xlabel("training step")
        ax.set_ylabel("ζ_L")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle("Jump rate against training steps: mean over seeds (thick), each seed (thin)", fontsize=10)
    fig.tight_layout()
    fig.savefig(files["zeta_steps"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, alpha in arms:
        p = summary["psi"][arm]
        if p["mean"]:
            layers = range(1, len(p["mean"]) + 1)
            ax.errorbar(layers, p["mean"], yerr=p["sd"], color=colors[arm], marker="o", ms=4, capsize=3,
                        label=_arm_label(arm, alpha))
    _finish(fig, ax, "Ψ_ℓ (angular)", "Displacement per layer, final checkpoints (mean ± sd over seeds)", files["psi"])

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, alpha in arms[1:]:
        d = summary["delta"].get(arm)
        if d and d["mean"]:
            layers = list(range(1, len(d["mean"]) + 1))
            ax.plot(layers, d["mean"], color=colors[arm], marker="o", ms=4, label=_arm_label(arm, alpha))
            for values in d["seeds"].values():
                ax.scatter(layers, values, color=colors[arm], s=8, alpha=0.4)
    ax.axhline(0, color="k", lw=0.8)
    _finish(fig, ax, "Δ_ℓ = Ψ_ℓ(JREG) − Ψ_ℓ(baseline)", "Change of each layer's displacement (mean; dots: seeds)",
            files["delta"])

    num_layers = _num_layers(records)
    fig, ax = plt.subplots(figsize=(6, 4))
    shown = sorted(set(PAPER["alphas"]) | set(cfg.alphas))
    for alpha in shown:
        trained = alpha in cfg.alphas
        w = layer_weights(num_layers, alpha).tolist()
        color = colors[f"jreg-a{alpha:g}"] if trained else "0.6"
        ax.plot(range(1, num_layers + 1), w, color=color, marker="o", ms=4, lw=2 if trained else 1,
                ls="-" if trained else "--", label=f"α = {alpha:g}" + ("" if trained else " (not trained)"))
    _finish(fig, ax, "w_ℓ = softmax(α·ℓ)", f"JREG's layer weights, L = {num_layers}", files["weights"])
    return files


def _finish(fig, ax, ylabel: str, title: str, path: Path) -> None:
    """Label a per-layer plot, save it and free it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("layer ℓ")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num_layers(records: list[dict]) -> int:
    for r in records:
        if r["final"]["psi"]:
            return len(r["final"]["psi"])
    return 6


# ----------------------------------------------------------------------------------------------------------
# the markdown report


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else spec.format(value)


def _cell(stats: dict, spec: str, seeds: bool = True) -> str:
    """`mean ± sd` and, below it, the per-seed values in seed order."""
    if stats["mean"] is None:
        return "–"
    head = _fmt(stats["mean"], spec) + (f" ± {_fmt(stats['sd'], spec)}" if stats["sd"] is not None else "")
    if not seeds or len(stats["seeds"]) < 2:
        return head
    return head + "<br>(" + ", ".join(_fmt(stats["seeds"][s], spec) for s in sorted(stats["seeds"])) + ")"


def _p(p: float | None) -> str:
    return "–" if p is None else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def render(cfg, records: list[dict], summary: dict, tests: dict, plots: dict[str, Path], report: Path,
           invocations: list[dict], code: dict) -> str:
    arms = cfg.arms()
    seeds = sorted({r["seed"] for r in records})
    final = summary["final"]
    L = _num_layers(records)
    done = sum(r["analysed"] for r in records)
    lines = ["# JREG at laptop scale: α sweep over seeds, ζ against training steps, per-layer Δ, significance", ""]
    lines += _provenance(cfg, records, invocations, done, code)
    lines += ["", "## What came out", ""] + _findings(cfg, records, summary, tests) + [""]

    lines += ["## ζ_L against training steps (the paper's §3 growth, at this scale)", "",
              f"![ζ_L against steps]({_rel(plots['zeta_steps'], report)})", "",
              "ζ_L measured by `megatron-jreg analyze` on held-out WikiText-2 test paragraphs at each checkpoint; "
              "mean over seeds, the seeds below.", ""]
    steps = sorted({t for r in records for t in r["series"]["steps"]})
    rows = []
    for t in steps:
        row = [str(t)]
        for arm, _ in arms:
            vals = {r["seed"]: dict(zip(r["series"]["steps"], r["series"]["zeta_L"])).get(t)
                    for r in records if r["arm"] == arm}
            row.append(_cell(_stats(vals), "{:.2f}"))
        rows.append(row)
    lines += _table(["step"] + [_arm_label(a, al) for a, al in arms], rows) + [""]

    lines += ["## Table 3 at this scale: every α against the baseline", "",
              "Final checkpoints. ζ from `analyze` (held-out WikiText-2 test paragraphs); val loss: Megatron-LM's "
              "validation of the final weights on the WikiText-2 test split; word ppl and bits/byte: lm-eval's "
              "`wikitext` task over the local WikiText-2 test (rolling windows of the model's 128-token context); "
              "LAMBADA: top-1 on its first passages. Mean ± sd over seeds, then each seed "
              f"({', '.join(map(str, seeds))}).", ""]
    cols = [m for m in METRICS]
    rows = [[_arm_label(arm, alpha)] + [_cell(final[arm][m.key], m.fmt) for m in cols] for arm, alpha in arms]
    lines += _table(["setting"] + [m.label for m in cols], rows) + [""]

    lines += ["## Table 5 at this scale: displacement per layer and its change under JREG", "",
              f"![Ψ per layer]({_rel(plots['psi'], report)}) ![Δ per layer]({_rel(plots['delta'], report)})", "",
              "Ψ_ℓ of the baseline (angular, final checkpoints, held-out text) and Δ_ℓ = Ψ_ℓ(JREG) − Ψ_ℓ(baseline) "
              "of the same seed, mean over seeds and each seed; w_ℓ: the weight JREG puts on layer ℓ.", ""]
    header = ["ℓ", "Ψ_ℓ baseline"] + [f"Δ_ℓ α = {al:g} (w_ℓ)" for _, al in arms[1:]]
    weights = _weights(cfg, L)
    rows = []
    for i in range(L):
        row = [str(i + 1), _cell(_col(summary["psi"]["baseline"], i), "{:.4f}")]
        for arm, alpha in arms[1:]:
            d = summary["delta"].get(arm)
            cell = "–"
            if d and d["mean"]:
                per = {s: v[i] for s, v in d["seeds"].items()}
                cell = _fmt(d["mean"][i], "{:+.4f}") + (
                    "<br>(" + ", ".join(_fmt(per[s], "{:+.4f}") for s in sorted(per)) + ")" if len(per) > 1 else "")
            row.append(cell + f"<br>w = {weights[alpha][i]:.3f}")
        rows.append(row)
    lines += _table(header, rows) + ["", f"![w_ℓ against ℓ]({_rel(plots['weights'], report)})", ""]

    lines += ["## Table 13 at this scale: per-seed scores and the one-sided paired t-test", "",
              "`megatron-jreg compare` per α and metric (H1: JREG better, i.e. lower ζ_L / loss / bits per byte, "
              "higher LAMBADA accuracy), paired by seed. Δ = JREG − baseline (mean over seeds); 95% bound: the "
              "one-sided confidence bound on Δ (for ζ_L, loss and bits per byte Δ lies below it with 95% "
              "confidence, for accuracy above it): JREG is better at 5% when the bound is on JREG's side of 0.", ""]
    for m in (m for m in METRICS if m.tested):
        lines += [f"**{m.label}**", ""]
        rows = []
        for arm, alpha in arms:
            vals = final[arm][m.key]
            row = [_arm_label(arm, alpha)] + [_fmt(vals["seeds"].get(s), m.fmt) for s in seeds]
            row.append(_fmt(vals["mean"], m.fmt))
            t = tests.get(arm, {}).get(m.key) if alpha is not None else None
            if t is None:
                row += ["", "", "", ""]
            elif "skipped" in t:
                row += [_fmt(statistics.fmean(t["diffs"]) if t["diffs"] else None, "{:+.4f}"), t["skipped"], "", ""]
            else:
                row += [_fmt(t["diff"], "{:+.4f}"), _p(t["p_value"]), _fmt(t["bound"], "{:+.4f}"),
                        "yes" if t["jreg_better"] else "no"]
            rows.append(row)
        lines += _table(["setting"] + [f"seed {s}" for s in seeds] + ["mean", "Δ", "p (one-sided)", "95% bound",
                                                                         "JREG better at 5%"], rows) + [""]
    lines += _setup(cfg, records)
    return "\n".join(lines) + "\n"


def _col(stats: dict, i: int) -> dict:
    per = {s: v[i] for s, v in stats["seeds"].items()}
    return _stats(per)


def _weights(cfg, num_layers: int) -> dict[float, list[float]]:
    from megatron_jreg.jreg import layer_weights

    return {alpha: layer_weights(num_layers, alpha).tolist() for alpha in cfg.alphas}


def _rel(path: Path, report: Path) -> str:
    try:
        return str(path.relative_to(report.parent))
    except ValueError:
        return str(path)


def _provenance(cfg, records: list[dict], invocations: list[dict], done: int, code: dict) -> list[str]:
    commits = list(dict.fromkeys(i.get("commit") or "unknown" for i in invocations))
    dirty = sorted({f for i in invocations for f in i.get("dirty_files", [])})
    wall = sum(i.get("wall_s") or 0.0 for i in invocations)
    train = sum(r["wall_s"]["train"] for r in records)
    post = sum(r["wall_s"]["post"] for r in records)
    cmds = list(dict.fromkeys(" ".join(["python", "examples/study.py", *i["argv"][1:]]) for i in invocations))
    out = ["Generated by `examples/study.py` (report: `examples/study_report.py`) from the runs in "
           f"`{cfg.output.name}/`.", ""]
    if cmds:
        out.append("- command: " + "; then ".join(f"`{c}`" for c in cmds))
        out.append("- code that trained and measured: commit " + ", ".join(f"`{c}`" for c in commits) + (
            f" with local changes to {', '.join(dirty)}" if dirty else " (no local changes to the study, the demo "
                                                                       "or megatron_jreg)"))
        killed = sum(i.get("wall_s") is None for i in invocations)
        if killed:
            out.append(f"- {killed} invocation(s) ended without recording their end (killed); their time is not "
                       "in the wall time below")
    else:
        out.append("- command: none recorded yet")
    first = min((i["start"] for i in invocations), default=math.inf)
    unrecorded = [f"{r['arm']}/seed-{r['seed']}" for r in records if r["first_start"] and r["first_start"] < first]
    if unrecorded:
        out.append(f"- {len(unrecorded)} run(s) started under an invocation that is not recorded (killed before "
                   "invocations were recorded at their start; its commit is not known): "
                   + ", ".join(unrecorded))
    out.append(f"- this report: `{' '.join(['python', 'examples/study.py', *code.get('argv', [])[1:]])}` at commit "
               f"`{code.get('commit')}`"
               + (f" with local changes to {', '.join(code['dirty_files'])}" if code.get("dirty_files") else ""))
    out.append(f"- runs: {done} of {len(records)} finished ({cfg.seeds} seed(s) × baseline + "
               f"{len(cfg.alphas)} α); wall time {wall / 60:.0f} min over {len(invocations)} invocation(s) with "
               f"--jobs {cfg.jobs} on {_cores()} cores (training {train / 60:.0f} core-min, analysis + evaluation "
               f"{post / 60:.0f} core-min)")
    if any(r["resumed"] for r in records):
        out.append("- resumed from checkpoints: " + ", ".join(f"{r['arm']}/seed-{r['seed']}" for r in records
                                                               if r["resumed"]))
    out.append(f"- generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    return out


def _cores() -> int:
    import os

    return os.cpu_count() or 1


def _setup(cfg, records: list[dict]) -> list[str]:
    samples = next((r.get("eval_samples") for r in records if r.get("eval_samples")), {})
    model = "the 4 × 64 Llama of --quick" if cfg.quick else "`make demo`'s Llama: 6 layers × 192, 6 heads, FFN 512"
    return [
        "## Setup", "",
        f"- model: {model}, RoPE, RMSNorm, SwiGLU, untied embeddings, context 128, BPE vocabulary 4,096 "
        "trained on WikiText-2 valid (examples/demo.py);",
        f"- training: WikiText-2 valid (307K tokens), {cfg.steps} steps × {cfg.batch_size} × 128 tokens, AdamW "
        "lr 1e-3 → 1e-4 cosine, 5% warm-up, weight decay 0.1, clip 1.0 (the demo's recipe), Megatron-LM's loop, "
        "one core per run; `--seed s --init-mode layout-independent`, so the arms of a seed share initial weights "
        "and batches;",
        f"- JREG: λ = {cfg.lam:g}, α ∈ {{{', '.join(f'{a:g}' for a in cfg.alphas)}}}, `--jreg-distance "
        f"{cfg.distance}`; the baseline is `--jreg-lambda 0`. Ψ and ζ are always the paper's angular ones;",
        f"- checkpoints every {cfg.save_interval} steps; `analyze` on each with {cfg.analysis_samples} WikiText-2 "
        "test paragraphs (`--data text:`, held out: never trained on);",
        f"- evaluation of the final checkpoint: Megatron-LM's validation ({cfg.eval_iters} batches of the WikiText-2 "
        f"test split), lm-eval's `wikitext` task over the local WikiText-2 test ({samples.get('wikitext2_local', '?')} "
        f"articles), LAMBADA top-1 ({samples.get('lambada', '?')} passages).",
    ]


def _growth(records: list[dict]) -> dict | None:
    """The baseline's ζ_L against steps: held-out (checkpoint series) and on the logged training batches."""
    base = [r for r in records if r["arm"] == "baseline" and len(r["series"]["steps"]) > 1]
    if not base:
        return None
    from scipy import stats

    steps = base[0]["series"]["steps"]
    curves = [dict(zip(r["series"]["steps"], r["series"]["zeta_L"])) for r in base]
    common = [t for t in steps if all(t in c for c in curves)]
    mean = [statistics.fmean(c[t] for c in curves) for t in common]
    rho = float(stats.spearmanr(common, mean).statistic) if len(common) > 2 else math.nan
    k = max(1, len(common) // 3)
    early, late = statistics.fmean(mean[:k]), statistics.fmean(mean[-k:])
    rose = sum(statistics.fmean(list(c.values())[-k:]) > statistics.fmean(list(c.values())[:k]) for c in curves)
    train = []
    for r in base:
        pts = [(t, z) for t, z in zip(r["train_curve"]["steps"], r["train_curve"]["zeta_L"]) if z is not None]
        if len(pts) >= 6:
            third = len(pts) // 3
            train.append((statistics.fmean(z for _, z in pts[:third]), statistics.fmean(z for _, z in pts[-third:])))
    return {"steps": common, "mean": mean, "rho": rho, "k": k, "early": early, "late": late, "rose": rose,
            "seeds": len(base), "train": train}


def _findings(cfg, records: list[dict], summary: dict, tests: dict) -> list[str]:
    """(ii)–(iv) from the measured numbers, each set against the paper's claim, then where they disagree."""
    out, disagree = [], []
    g = _growth(records)
    if g:
        first, last = g["steps"][0], g["steps"][-1]
        text = (f"- **(ii) Does ζ_L grow with training?** Paper: {PAPER['growth']}. Here (baseline, held-out text, "
                f"mean over {g['seeds']} seed(s)): ζ_L {g['mean'][0]:.2f} at step {first} → {g['mean'][-1]:.2f} at "
                f"step {last}; mean of the first {g['k']} checkpoints {g['early']:.2f}, of the last {g['k']} "
                f"{g['late']:.2f} (higher late in {g['rose']} of {g['seeds']} seeds); Spearman ρ(step, ζ_L) = "
                f"{g['rho']:+.2f}.")
        if g["train"]:
            e = statistics.fmean(a for a, _ in g["train"])
            late = statistics.fmean(b for _, b in g["train"])
            text += (f" On the logged training batches: {e:.2f} over the first third of the logged steps, "
                     f"{late:.2f} over the last third.")
        grows = g["late"] > g["early"] and g["rose"] == g["seeds"]
        text += ((" Agrees: the jump is there from the first checkpoint and grows." if g["mean"][0] > 0.05 else
                  " Agrees: the jump appears and grows.") if grows else " The growth is not clear at this length.")
        if not grows:
            disagree.append(f"ζ_L growth (ii): held-out ζ_L {g['early']:.2f} early vs {g['late']:.2f} late, "
                            f"higher late in only {g['rose']} of {g['seeds']} seeds")
        out.append(text)
    f = summary["final"]
    if f["baseline"]["zeta_L"]["mean"] is not None:
        parts, not_removed = [], []
        for arm, alpha in cfg.arms()[1:]:
            z = f[arm]["zeta_L"]
            if z["mean"] is None:
                continue
            vals = [z["seeds"][s] for s in sorted(z["seeds"])]
            series = [v for r in records if r["arm"] == arm for v in r["series"]["zeta_L"]]
            t = tests.get(arm, {}).get("zeta_L", {})
            state = "removed" if max(vals) < 0.005 else ("reduced" if z["mean"] < f["baseline"]["zeta_L"]["mean"]
                                                        else "not reduced")
            if state != "removed":
                not_removed.append(f"α = {alpha:g} ({state}: final ζ_L {z['mean']:.2f})")
            parts.append(f"α = {alpha:g}: {z['mean']:.2f} ({', '.join(f'{v:.2f}' for v in vals)}; {state}"
                         + (f", p = {_p(t['p_value'])}" if "p_value" in t else "")
                         + (f"; at most {max(series):.2f} at any checkpoint" if series else "") + ")")
        b = f["baseline"]["zeta_L"]
        out.append(f"- **(iii) Does JREG remove the jump for every α?** Paper: {PAPER['removal']}, and for every α of "
                   f"{{{', '.join(f'{a:g}' for a in PAPER['alphas'])}}}. Here, final ζ_L (held-out): baseline "
                   f"{b['mean']:.2f} ({', '.join(f'{b['seeds'][s]:.2f}' for s in sorted(b['seeds']))}); "
                   + "; ".join(parts) + ".")
        if not_removed:
            disagree.append("removal (iii): " + ", ".join(not_removed))
        notes = []
        for arm, alpha in cfg.arms()[1:]:
            d = summary["delta"].get(arm)
            if d and d["mean"]:
                n = len(d["mean"])
                up = [str(i + 1) for i, v in enumerate(d["mean"]) if v > 0]
                notes.append(f"α = {alpha:g}: Δ_L {d['mean'][n - 1]:+.4f}, "
                             f"Δ_ℓ > 0 in layer(s) {', '.join(up) or 'none'}")
        if notes:
            out.append("  Per layer (Table 5): " + "; ".join(notes) + ". The paper's reading, a more balanced use of "
                       "the middle layers, would show as Δ_ℓ > 0 between the first and the last layer.")
    sig, n_tests = [], 0
    for arm, alpha in cfg.arms()[1:]:
        for key in ("val_loss", "bits_per_byte", "lambada_acc"):
            t = tests.get(arm, {}).get(key)
            if t and "p_value" in t:
                n_tests += 1
                sig.append(f"α = {alpha:g} {BY_KEY[key].label} Δ {t['diff']:+.4f} (p = {_p(t['p_value'])}"
                           + (", significant" if t["jreg_better"] else "") + ")")
    lam = [t for a in tests.values() if (t := a.get("lambada_acc")) and t.get("skipped", "").startswith("LAMBADA")]
    if sig:
        n_sig = sum("significant" in s for s in sig)
        out.append(f"- **(iv) Is JREG better downstream, significantly?** Paper: {PAPER['significance']}. Here the "
                   f"downstream numbers are held-out language modelling (LAMBADA top-1 is "
                   + ("0 in every run" if lam else "measured") + f" at this scale): {n_sig} of {n_tests} one-sided "
                   f"tests favour JREG at 5%. " + "; ".join(sig) + ".")
        if n_sig == 0:
            disagree.append("significance (iv): no metric is significantly better with JREG at 5%")
    else:
        out.append("- **(iv) downstream**: no t-test (it needs at least 2 finished seed pairs per α).")
    if disagree:
        out += ["", "Where this differs from the paper: " + "; ".join(disagree) + ". Scale: a 6-layer model trained "
                f"{cfg.steps} steps on 0.3M tokens against 170M–3.4B models trained 200K steps on 100B tokens."]
    return out


# ----------------------------------------------------------------------------------------------------------


def write_all(cfg, runs: list, report: Path, code: dict) -> dict:
    """Collect, compare, plot and write results.json and the report; returns the results."""
    out = cfg.output
    records = [load_run(r, cfg.steps, cfg.save_interval) for r in runs if r.dir.exists()]
    if not records:
        raise SystemExit(f"study.py: error: no runs in {out}/runs yet")
    summary = summarize(cfg, records)
    tests = run_compare(cfg, records, out)
    report.parent.mkdir(parents=True, exist_ok=True)
    plots = plot_all(cfg, records, summary, report.parent)
    invocations = list({i["start"]: i for i in _jsonl(out / "invocations.jsonl")}.values())  # the last per start
    results = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
               "invocations": invocations, "runs": records, "summary": summary, "compare": tests,
               "plots": {k: str(v) for k, v in plots.items()}, "report": str(report)}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report.write_text(render(cfg, records, summary, tests, plots, report, invocations, code), encoding="utf-8")
    return results
