"""The paper's §5.3 at laptop scale: fine-tune the two `make demo` checkpoints on chat data, then look for the
jump again and write answers for a judge.

1. `megatron-jreg prepare-chat`: the vendored chat data (examples/sft/data, built from WikiText-2) checked
   for Megatron-LM's SFTDataset, and a copy of the demo tokenizer with a chat template (its chat markers
   and pad token were reserved when it was trained, so the embedding does not change).
2. `megatron-jreg train --sft --pretrained-checkpoint` (Megatron-LM's SFT: packed conversations, the loss on
   assistant tokens) from each demo checkpoint, both runs side by side (one CPU core each), both with plain
   cross-entropy (λ = 0), as the paper fine-tunes with Hugging Face transformers (its A.3); linear decay,
   Adam β = (0.9, 0.95). `--jreg-lambda 1` keeps JREG on during SFT instead (not the paper's setting).
3. `megatron-jreg analyze` on the pretrained and the fine-tuned checkpoints (the held-out WikiText-2
   articles of `make demo`): ζ before and after SFT.
4. `megatron-jreg generate`: greedy answers to the vendored questions in FastChat's MT-bench answer format
   (`OUT/<run>/answers.jsonl`), ready for FastChat's judge; no judge is called here.

    python examples/sft/sft_demo.py [--demo-output demo_output] [--output sft_output] [--train-iters 300]

The paper's comparison over seeds (both models fine-tuned at λ = 0, ζ before and after on held-out text) is
the SFT part of experiments/study/study.py (study v2; docs/sft.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]
from demo import MODEL  # noqa: E402 - the demo's architecture, kept in one place
from laptop_scale import SEQ_LENGTH, child_env  # noqa: E402

RUNS = ("baseline", "jreg")


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "megatron_jreg.cli", *argv]


def run(cmd: list[str], log: Path | None = None) -> None:
    with open(log, "w") if log else open(os.devnull, "w") as out:  # noqa: SIM115
        proc = subprocess.run(cmd, stdout=out if log else None, stderr=subprocess.STDOUT if log else None)
    if proc.returncode != 0:
        raise SystemExit(f"[sft] failed ({proc.returncode}): {' '.join(cmd)}" + (f"; see {log}" if log else ""))


def sft_args(args: argparse.Namespace, demo: Path, out: Path, name: str) -> list[str]:
    jreg = ["--jreg-lambda", f"{args.jreg_lambda:g}"]
    if args.jreg_lambda:
        jreg += ["--jreg-alpha", "1", "--jreg-distance", "angular"]
    return [
        *MODEL.flags(),
        "--sft", "--tokenizer-type", "SFTTokenizer", "--sft-tokenizer-prompt-format", "default",
        "--tokenizer-model", str(out / "chat_tokenizer"), "--data-path", str(out / "chat.jsonl"),
        "--split", "95,5,0", "--no-create-attention-mask-in-dataloader", "--num-workers", "0",
        "--pretrained-checkpoint", str(demo / name / "checkpoints"),
        "--micro-batch-size", str(args.batch_size), "--global-batch-size", str(args.batch_size),
        "--train-iters", str(args.train_iters), "--lr", str(args.lr), "--min-lr", "0", "--lr-decay-style", "linear",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0", "--seed", "1",
        "--log-interval", "25", "--eval-interval", str(args.train_iters + 1), "--eval-iters", "5",
        "--save", str(out / name / "checkpoints"), "--load", str(out / name / "checkpoints"),
        "--save-interval", str(args.train_iters), "--metrics-file", str(out / name / "metrics.jsonl"),
        "--no-progress", *jreg,
    ]


def fine_tune(args: argparse.Namespace, demo: Path, out: Path) -> None:
    env = child_env()
    procs = {}
    for name in RUNS:
        if (out / name).exists():  # a fresh fine-tuning every time
            shutil.rmtree(out / name)
        (out / name).mkdir(parents=True)
        log = open(out / name / "train.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "megatron_jreg.train", *sft_args(args, demo, out, name)]
        (out / name / "command.txt").write_text(" ".join(cmd) + "\n")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
    start = time.time()
    while any(p.poll() is None for p, _ in procs.values()):
        time.sleep(15)
        status = []
        for name in procs:
            path = out / name / "metrics.jsonl"
            recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
            last = next((r for r in reversed(recs) if "lm_loss" in r), None)
            status.append(f"{name}: " + (f"iter {last['iteration']}/{args.train_iters} loss {last['lm_loss']:.3f}"
                                         if last else "starting"))
        print(f"[sft] {time.time() - start:5.0f}s  " + " | ".join(status), flush=True)
    for name, (proc, log) in procs.items():
        log.close()
        if proc.returncode != 0:
            print((out / name / "train.log").read_text()[-3000:], file=sys.stderr)
            raise SystemExit(f"[sft] fine-tuning {name} failed: see {out / name / 'train.log'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo-output", default="demo_output", help="the `make demo` output folder")
    p.add_argument("--output", default="sft_output")
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--jreg-lambda", type=float, default=0.0,
                   help="JREG during SFT (default 0: plain cross-entropy, the paper's SFT)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    demo, out = Path(args.demo_output).resolve(), Path(args.output).resolve()
    missing = [str(demo / n / "checkpoints") for n in RUNS if not (demo / n / "checkpoints").is_dir()]
    if missing:
        raise SystemExit(f"[sft] {', '.join(missing)} not found: run `make demo` first (or give --demo-output)")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    run(cli("prepare-chat", "--input", str(HERE / "data" / "wikitext_chat.jsonl"), "--output", str(out / "chat.jsonl"),
            "--tokenizer", str(demo / "data" / "tokenizer"), "--tokenizer-output", str(out / "chat_tokenizer"),
            "--seq-length", str(SEQ_LENGTH)), out / "prepare_chat.log")
    print(f"[sft] chat data ready ({out / 'chat.jsonl'}); fine-tuning baseline and JREG "
          f"({args.train_iters} steps each, in parallel)", flush=True)
    fine_tune(args, demo, out)
    models = [str(demo / n / "checkpoints") for n in RUNS] + [str(out / n / "checkpoints") for n in RUNS]
    run(cli("analyze", *[a for m in models for a in ("--model", m)], "--data",
            f"jsonl:{demo / 'data' / 'heldout.jsonl'}:text", "--num-samples", "all", "--output", str(out / "analysis"),
            "--no-progress"), out / "analysis.log")
    for name in RUNS:
        run(cli("generate", "--load", str(out / name / "checkpoints"), "--prompts",
                str(HERE / "data" / "wikitext_questions.jsonl"), "--output", str(out / name / "answers.jsonl"),
                "--max-new-tokens", str(args.max_new_tokens), "--model-id", f"demo-{name}-sft", "--no-progress"),
            out / name / "generate.log")
    table = (out / "analysis.log").read_text().split("model ", 1)
    print("\nmodel" + table[1].split("Ψ:")[0] if len(table) == 2 else (out / "analysis.log").read_text())
    print(f"[sft] done in {time.time() - t0:.0f}s: {out}/analysis (ζ before and after SFT), "
          f"{out}/{{baseline,jreg}}/answers.jsonl (MT-bench answer format), metrics.jsonl, train.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
