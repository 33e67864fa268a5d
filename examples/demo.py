"""`make demo`: JREG against the plain baseline on a laptop-class CPU, end to end, in minutes.

1. WikiText-2 (vendored in examples/data) → JSONL documents (one per article).
2. A byte-level BPE tokenizer (vocabulary 4,096) trained on the valid split.
3. Indexed datasets (.bin/.idx) with `megatron-jreg preprocess`: train = WikiText-2 valid,
   validation = WikiText-2 test.
4. Two `megatron-jreg train` runs side by side (one CPU core each; Megatron-LM's own training loop), same
   seed and data: a 6-layer × 192 Llama, baseline (λ = 0) and JREG (λ = 1, α = 1, 1 − cos penalty).
5. A table (final lm loss, validation loss, ζ_L, ζ_{L−1}, ζ_{L−2}) and a plot of Ψ_ℓ per layer.

Everything lands in --output (default demo_output/): metrics.jsonl and train.log per run, psi.png,
summary.json, and each run's last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT_TOKENS = ("<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
WIKITEXT = HERE / "data" / "wikitext-2"

RUNS = {
    "baseline": ["--jreg-lambda", "0"],
    # the pilot's setting: the smooth 1 − cos penalty (Ψ and ζ are still reported with the angular Ψ)
    "jreg": ["--jreg-lambda", "1", "--jreg-alpha", "1", "--jreg-distance", "cosine"],
}


def prepare_data(out: Path, vocab_size: int) -> tuple[str, Path]:
    """Tokenizer + indexed datasets from the vendored WikiText-2; reused when already there."""
    from megatron_jreg.data.preprocess import PreprocessConfig, preprocess
    from megatron_jreg.data.text import wikitext_articles
    from megatron_jreg.data.train_tokenizer import train_tokenizer

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, source in (("train", "valid.txt"), ("valid", "test.txt")):
        jsonl = data / f"{split}.jsonl"
        if not jsonl.exists():
            with open(jsonl, "w", encoding="utf-8") as f:
                for article in wikitext_articles(WIKITEXT / source):
                    f.write(json.dumps({"text": article}) + "\n")
    tokenizer = data / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        print(f"[demo] training a BPE tokenizer (vocabulary {vocab_size}) on WikiText-2 valid", flush=True)
        # chat markers and a pad token reserved now, so the checkpoints fine-tune (examples/sft) unchanged
        train_tokenizer([str(data / "train.jsonl")], str(tokenizer), vocab_size, kind="hf-bpe",
                        special_tokens=CHAT_TOKENS)
    for split in ("train", "valid"):
        prefix = data / f"{split}_text_document"
        if not Path(str(prefix) + ".idx").exists():
            preprocess(PreprocessConfig(
                input=[str(data / f"{split}.jsonl")], output_prefix=str(data / split),
                tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer), append_eod=True,
                workers=2, log_interval=10_000,
            ))
    return str(tokenizer), data


def train_args(args: argparse.Namespace, tokenizer: str, data: Path, run_dir: Path) -> list[str]:
    """Megatron-LM's flags: a Llama (RoPE, RMSNorm, SwiGLU, no biases or dropout) and the pilot's recipe."""
    return [
        "--num-layers", "6", "--hidden-size", "192", "--num-attention-heads", "6", "--ffn-hidden-size", "512",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--untie-embeddings-and-output-weights",
        "--seq-length", "128", "--max-position-embeddings", "128", "--transformer-impl", "local",
        "--micro-batch-size", str(args.batch_size), "--global-batch-size", str(args.batch_size),
        "--train-iters", str(args.train_iters), "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", str(max(1, args.train_iters // 20)), "--lr-decay-style", "cosine",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--seed", "1234", "--num-workers", "0",
        "--train-data-path", str(data / "train_text_document"), "--valid-data-path", str(data / "valid_text_document"),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
        "--log-interval", str(args.log_interval), "--eval-interval", str(args.train_iters // 3),
        "--eval-iters", str(args.eval_iters), "--metrics-file", str(run_dir / "metrics.jsonl"),
        "--save", str(run_dir / "checkpoints"), "--save-interval", str(args.train_iters), "--no-progress",
    ]


def launch(args: argparse.Namespace, tokenizer: str, data: Path, out: Path) -> dict[str, Path]:
    """Start both runs as separate processes (one thread each) and wait, printing progress."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "ignore"}
    procs = {}
    for name, extra in RUNS.items():
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("metrics.jsonl",):
            (run_dir / stale).unlink(missing_ok=True)
        log = open(run_dir / "train.log", "w", encoding="utf-8")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", "megatron_jreg.train", *train_args(args, tokenizer, data, run_dir), *extra]
        (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log, run_dir)
    start = time.time()
    while any(p.poll() is None for p, _, _ in procs.values()):
        time.sleep(10)
        status = []
        for name, (_, _, run_dir) in procs.items():
            recs = _records(run_dir / "metrics.jsonl")
            last = next((r for r in reversed(recs) if "lm_loss" in r), None)
            status.append(f"{name}: " + (f"iter {last['iteration']}/{args.train_iters} lm loss {last['lm_loss']:.3f}"
                                         f" ζ_L {last.get('zeta_L', float('nan')):.2f}" if last else "starting"))
        print(f"[demo] {time.time() - start:5.0f}s  " + " | ".join(status), flush=True)
    failed = []
    for name, (proc, log, run_dir) in procs.items():
        log.close()
        if proc.returncode != 0:
            failed.append(name)
            print((run_dir / "train.log").read_text()[-3000:], file=sys.stderr)
    if failed:
        raise SystemExit(f"[demo] training failed for {', '.join(failed)}: see {out}/<run>/train.log")
    return {name: run_dir for name, (_, _, run_dir) in procs.items()}


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(runs: dict[str, Path], out: Path) -> dict:
    """Final training loss (last logged interval), final validation record (Ψ, ζ on held-out text)."""
    summary = {}
    for name, run_dir in runs.items():
        recs = _records(run_dir / "metrics.jsonl")
        train = [r for r in recs if "lm_loss" in r][-1]
        val = [r for r in recs if r.get("split") == "valid"][-1]
        summary[name] = {
            "lm_loss": train["lm_loss"], "val_loss": val["val_loss"], "psi": val["psi"],
            "zeta_L": val["zeta_L"], "zeta_L-1": val["zeta_L-1"], "zeta_L-2": val["zeta_L-2"],
            "iteration": val["iteration"],
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def print_table(summary: dict) -> None:
    cols = [("final lm loss", "lm_loss", "{:.3f}"), ("val loss", "val_loss", "{:.3f}"), ("ζ_L", "zeta_L", "{:.2f}"),
            ("ζ_L-1", "zeta_L-1", "{:.2f}"), ("ζ_L-2", "zeta_L-2", "{:.2f}")]
    print("\n" + f"{'run':<10}" + "".join(f"{c[0]:>15}" for c in cols))
    for name, s in summary.items():
        print(f"{name:<10}" + "".join(f"{fmt.format(s[key]):>15}" for _, key, fmt in cols))
    print("(Ψ and ζ measured on the validation split (WikiText-2 test) with the final weights.)")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, s in summary.items():
        layers = range(1, len(s["psi"]) + 1)
        ax.plot(layers, s["psi"], marker="o", label=f"{name} (ζ_L = {s['zeta_L']:.2f})")
    ax.set_xlabel("layer ℓ")
    ax.set_ylabel("Ψ_ℓ = mean arccos(cos(h_ℓ-1, h_ℓ)) / π")
    ax.set_title("Displacement per layer, WikiText-2 test")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="demo_output", help="where everything is written")
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=25)
    p.add_argument("--vocab-size", type=int, default=4096)
    args = p.parse_args(argv)
    out = Path(args.output).resolve()
    t0 = time.time()
    tokenizer, data = prepare_data(out, args.vocab_size)
    print(f"[demo] data ready in {time.time() - t0:.0f}s; training baseline and JREG "
          f"({args.train_iters} steps each, in parallel)", flush=True)
    runs = launch(args, tokenizer, data, out)
    summary = summarize(runs, out)
    print_table(summary)
    plot(summary, out / "psi.png")
    print(f"\n[demo] done in {time.time() - t0:.0f}s. Outputs in {out}:")
    print(f"  {out / 'psi.png'}   Ψ per layer, both runs")
    print(f"  {out / 'summary.json'}   the table above")
    print(f"  {out}/{{baseline,jreg}}/metrics.jsonl, train.log, checkpoints/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
