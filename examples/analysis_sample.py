"""The sample of docs/analysis.md: `megatron-jreg analyze` over one run's checkpoint series, in a few minutes.

1. The laptop-scale data of examples/laptop_scale.py (BPE tokenizer and indexed datasets from the bundled
   WikiText-2, held-out articles kept out of training).
2. One baseline `megatron-jreg train` run (λ = 0) of a small Llama, saving a checkpoint every --save-interval.
3. `megatron-jreg analyze --checkpoints` on 100 bundled LAMBADA passages (Ψ on the decoder layers' own
   inputs and outputs), then the final checkpoint again with `--include-final-norm` (the convention of
   transformers' `output_hidden_states`, whose last entry has the final norm applied).

Both analyze tables are printed; docs/results/analysis_sample.txt is this script's output
(`python benchmarks/record.py docs/results/analysis_sample.txt -- python examples/analysis_sample.py`).

    python examples/analysis_sample.py [--output analysis_sample_output] [--train-iters 240]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from laptop_scale import VOCAB_SIZE, Model, child_env, data_flags, prepare_data, recipe_flags  # noqa: E402

MODEL = Model(layers=6, hidden=128, heads=4, ffn=352)


def run(cmd: list[str], log: Path | None = None) -> str:
    """Run a megatron-jreg command with one thread; its stdout (or, with `log`, nothing: all of it goes there)."""
    if log is None:
        return subprocess.run(cmd, env=child_env(), check=True, stdout=subprocess.PIPE, text=True).stdout
    with open(log, "w", encoding="utf-8") as f:
        status = subprocess.run(cmd, env=child_env(), stdout=f, stderr=subprocess.STDOUT).returncode
    if status != 0:
        sys.stderr.write(log.read_text(encoding="utf-8")[-3000:])
        raise SystemExit(f"analysis_sample: {cmd[2]} failed (exit {status}): see {log}")
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=Path("analysis_sample_output"))
    p.add_argument("--train-iters", type=int, default=240)
    p.add_argument("--save-interval", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--num-samples", type=int, default=100)
    args = p.parse_args(argv)
    out = args.output.resolve()
    data = prepare_data(out)
    ckpt = out / "baseline" / "checkpoints"
    if ckpt.parent.exists():  # a fresh run every time: no stale checkpoint is analysed
        shutil.rmtree(ckpt.parent)
    ckpt.parent.mkdir(parents=True)
    train = [sys.executable, "-m", "megatron_jreg.train", *MODEL.flags(),
             *recipe_flags(args.batch_size, args.train_iters), *data_flags(data),
             "--seed", "1", "--log-interval", str(args.save_interval), "--eval-interval", str(args.train_iters + 1),
             "--eval-iters", "1", "--save", str(ckpt), "--save-interval", str(args.save_interval),
             "--no-progress", "--jreg-lambda", "0"]
    print(f"model: {MODEL.describe()}, vocabulary {VOCAB_SIZE} (BPE on the training articles), untied embeddings")
    print(f"training: {args.train_iters} steps of {args.batch_size} × 128 tokens, λ = 0, checkpoint every "
          f"{args.save_interval} steps (recipe: examples/laptop_scale.py)", flush=True)
    run(train, log=ckpt.parent / "train.log")
    analyze = [sys.executable, "-m", "megatron_jreg.cli", "analyze", "--data", "lambada",
               "--num-samples", str(args.num_samples)]
    print(f"\n$ megatron-jreg analyze --checkpoints 'baseline/checkpoints/iter_*' --data lambada "
          f"--num-samples {args.num_samples}", flush=True)
    print(run([*analyze, "--checkpoints", str(ckpt / "iter_*"), "--output", str(out / "analysis")]), flush=True)
    final = sorted(ckpt.glob("iter_*"))[-1]
    print(f"$ megatron-jreg analyze --model baseline/checkpoints/{final.name} --data lambada "
          f"--num-samples {args.num_samples} --include-final-norm", flush=True)
    print(run([*analyze, "--model", str(final), "--include-final-norm", "--output", str(out / "analysis_norm")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
