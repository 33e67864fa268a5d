"""`generate --hf` against `generate --load` on the same weights, as a user runs them: one process each, side by side.

One random Llama of SmolLM2-135M's shape (30 layers × 576, 9 heads / 3 KV heads, FFN 1,536, 49,152 embedding
rows, a 4,000-token BPE trained here) saved as a Hugging Face folder and imported with `convert hf-to-mcore`;
then `megatron-jreg generate` answers the same questions from each, the runs alternating so that the machine's
load hits all alike. Issue 33 measured 1.7-1.9 tokens/s for --hf against 7.6 for --load on a SmolLM2 model.
Each path runs twice: as `generate` runs now (its OpenMP threads sleep while they wait, megatron_jreg/
process_env.py), and with libgomp's default spin-then-sleep wait (GOMP_SPINCOUNT=300000), as before.
Reported per run: the new tokens per second generate prints (its decoding loop; the model load excluded),
the process's CPU seconds, and whether --hf and --load gave identical answers.

    python benchmarks/generate_hf_vs_load.py                 # 4 questions x 2 turns, 16 new tokens, 2 rounds
    python benchmarks/generate_hf_vs_load.py --threads 1     # the children with OMP_NUM_THREADS=1

Children run with torch's default thread count unless --threads is given (record.py sets OMP_NUM_THREADS=1
for its command; this script removes it from its children, as a user's shell would not have it).
Last line: hf_tokens_per_s=… load_tokens_per_s=… hf_vs_load=… (medians as generate runs now, --hf / --load),
then the same for libgomp's default wait (…_spin).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
QUESTIONS = ROOT / "examples" / "sft" / "data" / "wikitext_questions.jsonl"


def build_models(tmp: Path) -> tuple[Path, Path]:
    """The Hugging Face folder and its `convert hf-to-mcore` import."""
    from transformers import LlamaConfig

    from tests._toy import save_random_model, train_tokenizer

    texts = (ROOT / "examples/data/wikitext-2/valid.txt").read_text(encoding="utf-8")[:200_000].splitlines()
    tokenizer = train_tokenizer(texts, vocab_size=4000)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0, bos_token_id=0, eos_token_id=0)
    hf = save_random_model(config, tmp / "hf", tokenizer)
    done = subprocess.run([sys.executable, "-m", "megatron_jreg.cli", "convert", "hf-to-mcore", "--hf", str(hf),
                           "--output", str(tmp / "mcore"), "--no-verify"], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"convert hf-to-mcore failed:\n{done.stderr[-3000:]}")
    return hf, tmp / "mcore"


def generate(flag: str, model: Path, questions: Path, out: Path, new: int, env: dict) -> tuple[float, float, int]:
    """(tokens/s generate printed, CPU seconds of the process, new tokens) of one `generate` run."""
    out.unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "megatron_jreg.cli", "generate", flag, str(model), "--prompts",
                           str(questions), "--output", str(out), "--max-new-tokens", str(new), "--model-id", "m",
                           "--no-progress"], capture_output=True, text=True, cwd=ROOT, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"generate {flag} failed:\n{done.stderr[-3000:]}")
    found = re.search(r"(\d+) tokens in ([\d.]+)s \(([\d.]+) tokens/s\)", done.stdout)
    if found is None:
        raise SystemExit(f"generate {flag}: no summary line in\n{done.stdout}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return float(found[3]), cpu, int(found[1])


def answers(path: Path) -> dict:
    return {r["question_id"]: r["choices"][0]["turns"] for r in map(json.loads, path.read_text().splitlines())}


ARMS = (("--hf", {}), ("--load", {}), ("--hf", {"GOMP_SPINCOUNT": "300000"}), ("--load", {"GOMP_SPINCOUNT": "300000"}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--new", type=int, default=16, help="--max-new-tokens (a random model never stops early)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the generate processes (default: torch's)")
    args = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        started = time.perf_counter()
        hf, mcore = build_models(tmp)
        questions = tmp / "questions.jsonl"
        questions.write_text("".join(QUESTIONS.read_text().splitlines(keepends=True)[: args.questions]))
        print(f"SmolLM2-135M-shaped random Llama (30 x 576, 49,152 embedding rows), {args.questions} questions "
              f"x 2 turns, {args.new} new tokens a turn, one batch, greedy, threads: "
              f"{args.threads or 'torch default'}; models built in {time.perf_counter() - started:.0f} s")
        rates: dict[str, list[float]] = {}
        outputs = {}
        for round_ in range(args.rounds):
            for flag, extra in ARMS:
                label = flag + (" (libgomp default wait)" if extra else "")
                out = tmp / "answers.jsonl"
                rate, cpu, tokens = generate(flag, hf if flag == "--hf" else mcore, questions, out, args.new,
                                             {**env, **extra})
                rates.setdefault(label, []).append(rate)
                outputs[label] = answers(out)
                print(f"round {round_ + 1} {label:31s} {rate:6.1f} tokens/s  {cpu:6.1f} CPU s for the process "
                      f"({tokens} tokens)", flush=True)
    medians = {label: statistics.median(values) for label, values in rates.items()}
    for label, median in medians.items():
        print(f"{label:31s} median {median:6.1f} tokens/s")
    print(f"answers identical (--hf, --load, either wait): {len({json.dumps(o) for o in outputs.values()}) == 1}")
    hf_rate, load_rate = medians["--hf"], medians["--load"]
    hf_spin, load_spin = medians["--hf (libgomp default wait)"], medians["--load (libgomp default wait)"]
    print(f"hf_tokens_per_s={hf_rate:.1f} load_tokens_per_s={load_rate:.1f} hf_vs_load={hf_rate / load_rate:.2f} "
          f"hf_tokens_per_s_spin={hf_spin:.1f} load_tokens_per_s_spin={load_spin:.1f} "
          f"hf_vs_load_spin={hf_spin / load_spin:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
