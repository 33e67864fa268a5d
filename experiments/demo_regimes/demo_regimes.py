"""Which laptop-scale regime gives `make demo` a baseline whose very last layer jumps on held-out text, seed after seed?

Exploratory, and labelled so: it chose the demo's model (issue 19) after the study (docs/study.md) showed that
its 12 × 128 model ends with a final-layer jump in one seed of four; the study's verdicts do not use it.
Each regime × seed is one baseline (λ = 0) `megatron-jreg train` run on the demo's data
(examples/laptop_scale.py: same split, tokenizer, recipe), checkpoints every `save` steps, each measured on
every held-out window (examples/measure.py: CE, Ψ_ℓ, ζ). The table gives ζ_L at every checkpoint, the
final ζ_L−1, the layer with the upper half's largest Ψ and the CE, and per regime how many seeds end with
ζ_L ≥ 1.

    # train and measure:
    python experiments/demo_regimes/demo_regimes.py --output regimes_output --runs 12x64:1 12x64:2 12x128:1
    # the table from the committed raw results:
    python experiments/demo_regimes/demo_regimes.py --raw experiments/demo_regimes/raw

Resumable: a run whose raw result exists is not trained again. Raw results (one small JSON per run, with its
command and commit): --output/raw, copied to experiments/demo_regimes/raw (the table: regimes.txt).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(HERE.parent / "study")]

from laptop_scale import DEMO_REGIME, SEQ_LENGTH, Model, Regime, child_env, data_flags, prepare_data  # noqa: E402

WIDE, NARROW = Model(12, 128, 4, 352), DEMO_REGIME.model
REGIMES = {
    "12x128": Regime(WIDE, 4, 2000, 1000, 250, why="the demo until issue 19's fix: the study's model and seed-1 "
                     "run, stopped at step 1,000 of 2,000"),
    "12x128-lr3e-3": Regime(WIDE, 4, 2000, 1000, 250, lr=3e-3, why="faster learning in the same steps"),
    "12x128-wd0": Regime(WIDE, 4, 2000, 1000, 250, weight_decay=0.0, why="weights free to grow"),
    "12x128-batch2": Regime(WIDE, 2, 4000, 2000, 500, why="the paper's (ii): twice the steps, same tokens"),
    "12x64": DEMO_REGIME,
    "12x64-tied": Regime(NARROW, 4, 3000, 3000, 500, tied=True,
                         why="the output reads the input's embedding space, so the top must leave it"),
}


def train_command(regime: Regime, seed: int, data, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "megatron_jreg.train", *regime.model_flags(), *regime.recipe_flags(),
            *data_flags(data),
            "--seed", str(seed), "--init-mode", "layout-independent", "--log-interval", "50",
            "--eval-interval", str(regime.train_iters + 1), "--eval-iters", "1",
            "--exit-interval", str(regime.stop_at), "--save", str(run_dir / "ckpt"),
            "--save-interval", str(regime.save), "--metrics-file", str(run_dir / "metrics.jsonl"),
            "--no-progress", "--jreg-lambda", "0"]


def recorded(cmd: list[str], out: Path) -> str:
    """The command as the raw results keep it: `python`, and $OUT for the output folder."""
    return " ".join(["python", *cmd[1:]]).replace(str(out), "$OUT")


def measure(run_dir: Path, regime: Regime, heldout) -> list[dict]:
    """Every checkpoint of the run on every held-out window."""
    import logging
    import warnings

    from measure import Measurer

    warnings.filterwarnings("ignore")  # megatron-core's CPU notes at every load; the run's train.log keeps them
    logging.getLogger("megatron").setLevel(logging.ERROR)
    return [{"iteration": it, **Measurer(run_dir / "ckpt", iteration=it).measure(heldout)}
            for it in range(regime.save, regime.stop_at + 1, regime.save)]


def run(out: Path, name: str, seed: int) -> Path:
    """Train and measure one regime × seed unless its raw result exists; returns the raw result's path."""
    from study import git_state

    raw = out / "raw" / f"{name}__seed-{seed}.json"
    if raw.exists():
        return raw
    regime = REGIMES[name]
    data = prepare_data(out)
    run_dir = out / "runs" / f"{name}__seed-{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = train_command(regime, seed, data, run_dir)
    code, start = git_state(), time.time()
    with open(run_dir / "train.log", "w", encoding="utf-8") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    if rc:
        raise SystemExit(f"[regimes] {name} seed {seed}: training failed ({rc}), see {run_dir / 'train.log'}")
    wall = time.time() - start
    from measure import token_windows

    series = measure(run_dir, regime, token_windows(data.heldout_prefix, SEQ_LENGTH))
    record = {"regime": name, "seed": seed, "spec": asdict(regime), "train_wall_s": round(wall, 1), **code,
              "command": recorded(cmd, out), "series": series}
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(record, indent=1) + "\n")
    return raw


def top_layer(psi: list[float]) -> str:
    """Where the upper half's largest Ψ is, as L, L-1, ...: the layer that carries the top jump."""
    n = len(psi)
    top = max(range(n // 2, n), key=lambda i: psi[i])
    return "L" if top == n - 1 else f"L-{n - 1 - top}"


def table(records: list[dict]) -> str:
    """Per run: ζ_L at every checkpoint, final ζ_L−1 and CE; per regime: seeds ending with ζ_L ≥ 1."""
    lines = []
    for name, regime in REGIMES.items():
        runs = sorted((r for r in records if r["regime"] == name), key=lambda r: r["seed"])
        if not runs:
            continue
        m = regime.model
        lines.append(f"{name}: {m.layers} × {m.hidden}, batch {regime.batch} × {SEQ_LENGTH}, {regime.stop_at} of "
                     f"{regime.train_iters} scheduled steps, lr {regime.lr:g}, weight decay {regime.weight_decay:g}"
                     + (", tied embeddings" if regime.tied else "") + f" ({regime.why})")
        lines.append("  seed  ζ_L at steps " + " ".join(f"{s['iteration']:>5}" for s in runs[0]["series"])
                     + "   final ζ_L-1   top Ψ at   held-out CE   train s")
        for r in runs:
            final = r["series"][-1]
            lines.append(f"  {r['seed']:>4}  {'':13}" + " ".join(f"{s['zeta_L']:5.2f}" for s in r["series"])
                         + f"   {final['zeta_L-1']:11.2f}   {top_layer(final['psi']):>8}   {final['ce']:11.3f}"
                         f"   {r['train_wall_s']:7.0f}")
        finals = [r["series"][-1]["zeta_L"] for r in runs]
        lines.append(f"  final ζ_L ≥ 1 in {sum(z >= 1 for z in finals)} of {len(finals)} seeds; "
                     f"mean {sum(finals) / len(finals):.2f}, min {min(finals):.2f}")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=Path("regimes_output"), help="data, runs and raw results")
    p.add_argument("--runs", nargs="*", default=[], metavar="REGIME:SEED",
                   help=f"runs to train and measure; regimes: {', '.join(REGIMES)}")
    p.add_argument("--raw", type=Path, help="print the table from this folder's raw results (nothing is trained)")
    args = p.parse_args(argv)
    jobs = []
    for spec in args.runs:
        name, _, seed = spec.partition(":")
        if name not in REGIMES or not seed.isdigit():
            p.error(f"--runs {spec}: give REGIME:SEED with REGIME one of {', '.join(REGIMES)} (e.g. 12x64:1)")
        jobs.append((name, int(seed)))
    if args.raw is not None and jobs:
        p.error("--raw prints committed results and trains nothing: give it without --runs")
    if args.raw is None and not jobs:
        p.error("nothing to do: give --runs REGIME:SEED ... to train, or --raw DIR to print a table")
    raw_dir = args.raw if args.raw is not None else args.output.resolve() / "raw"
    for name, seed in jobs:
        print(f"[regimes] {name} seed {seed}: {run(args.output.resolve(), name, seed)}", flush=True)
    files = sorted(raw_dir.glob("*.json"))
    if not files:
        p.error(f"--raw {raw_dir}: no raw results (*.json) there")
    print(table([json.loads(f.read_text()) for f in files]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
