"""Is a committed study run reproducible here? Re-train it from its raw file's command for the first N steps, twice
side by side, and compare the loss curves with each other and with the committed curve.

    python experiments/study/study_reproduce.py --raw experiments/study/raw_v2/baseline-small__seed-3.json --steps 120

The data comes from examples/laptop_scale.py (the study's own preparation, into --work); the run's command is
replayed as recorded, with `--exit-interval N` (the schedule stays the committed run's) and without its
checkpoints. Prints each logged iteration's loss for the committed run and both re-runs, the first iteration at
which they differ, and ends with one `key=value` line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(HERE)]

from laptop_scale import child_env, prepare_data  # noqa: E402

_DROPPED = ("--save", "--load", "--save-interval", "--metrics-file")  # the re-runs write none of these


def replay_command(command: str, out: Path, steps: int, metrics: Path) -> list[str]:
    """The committed command with $OUT = `out`, stopped after `steps` by --exit-interval, metrics to `metrics`."""
    words = shlex.split(command.replace("$OUT", str(out)))
    kept, skip = [], False
    for word in words[1:]:  # words[0] is "python"
        if skip:
            skip = False
        elif word in _DROPPED:
            skip = True
        else:
            kept.append(word)
    return [sys.executable, *kept, "--exit-interval", str(steps), "--metrics-file", str(metrics)]


def curve(path: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, path.read_text().splitlines())
            if r.get("lm_loss") is not None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, required=True, help="one run's raw file (raw_v2/<arm>__seed-<s>.json)")
    p.add_argument("--steps", type=int, default=120, help="re-train this many steps (default 120)")
    p.add_argument("--work", type=Path, default=Path("study_reproduce"), help="data and logs (default study_reproduce)")
    args = p.parse_args(argv)
    rec = json.loads(args.raw.read_text())
    if rec["spec"].get("parent") is not None:
        raise SystemExit(f"study_reproduce.py: error: --raw {args.raw}: an SFT run; give a pretraining run")
    committed = {int(it): loss for it, loss, _ in rec["train_curve"] if it <= args.steps}
    prepare_data(args.work.resolve())
    procs, files = [], []
    for name in ("a", "b"):
        metrics = args.work / f"rerun-{name}.jsonl"
        metrics.unlink(missing_ok=True)
        log = open(args.work / f"rerun-{name}.log", "w")  # noqa: SIM115 - closed below
        cmd = replay_command(rec["command"], args.work.resolve(), args.steps, metrics)
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                       cwd=ROOT), log))
        files.append(metrics)
    for proc, log in procs:
        rc = proc.wait()
        log.close()
        if rc != 0:
            raise SystemExit(f"study_reproduce.py: error: a re-run failed (exit {rc}); see {log.name}")
    a, b = (curve(f) for f in files)
    print(f"run {rec['run']}, committed at {rec['attempts'][0].get('commit', 'unknown')[:12]}; "
          f"re-runs a and b here, {args.steps} steps")
    print("iteration  committed        re-run a         re-run b")
    for it in sorted(committed):
        print(f"{it:>9}  {committed[it]:.9f}  {a.get(it, float('nan')):.9f}  {b.get(it, float('nan')):.9f}")
    # the first window's value is a console window Megatron-LM and the metrics file count differently across
    # versions (iteration 1..N vs 2..N): compare from the second logged window on
    shared = sorted(set(committed) & set(a) & set(b))[2:]
    same_ab = all(a[it] == b[it] for it in shared)
    differ = [it for it in shared if abs(committed[it] - a[it]) > 1e-6]
    first = differ[0] if differ else None
    print(f"re-runs identical to each other: {same_ab}; first iteration where the committed curve differs "
          f"by more than 1e-6: {first}")
    print(f"reruns_identical={int(same_ab)} first_divergence={first if first is not None else 'none'} "
          f"max_abs_diff={max((abs(committed[it] - a[it]) for it in shared), default=0.0):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
