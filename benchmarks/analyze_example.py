"""The worked example of docs/analysis.md: every measure of `megatron-jreg analyze` on a model the tests build.

    python benchmarks/analyze_example.py [--output DIR]

Builds the Llama of tests/test_analysis_removal.py (random, untied, initial weights of std 0.15 so that each layer
matters; here 6 layers of hidden 32 and the tests' 320-token tokenizer) and runs the CLI on 20 LAMBADA passages
(64 tokens at most) twice: over all tokens, and over the last token of each sample (`--positions last`), both with
`--remove-layers`. Prints each run's table and reading, then the n = 1..3 rows of the distance between layers and
the residual norms from results.json. Nothing is timed; the figures are exact for this seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from megatron_jreg.data.text import lambada_passages

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/_toy.py


def build(folder: Path) -> Path:
    from transformers import LlamaConfig

    from tests._toy import save_random_model, train_tokenizer

    tokenizer = train_tokenizer(lambada_passages()[:200], vocab_size=320)
    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.15, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    return save_random_model(config, folder, tokenizer)


def main(argv: list[str] | None = None) -> int:
    from megatron_jreg.analysis.cli import main as analyze

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, help="keep the outputs here (default: a temporary folder)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.output or Path(tmp)
        model = build(root / "tiny-llama")
        for positions in ("all", "last"):
            out = root / f"analysis-{positions}"
            print(f"$ megatron-jreg analyze --model tiny-llama --num-samples 20 --max-length 64 --remove-layers "
                  f"--positions {positions}")
            rc = analyze(["--model", str(model), "--num-samples", "20", "--max-length", "64", "--remove-layers",
                          "--positions", positions, "--no-progress", "--output", str(out)])
            if rc:
                return rc
            record = json.loads((out / "results.json").read_text())["models"][0]
            for n, row in enumerate(record["layer_distances"][:3], start=1):
                print(f"layer_distances n={n}: " + " ".join(f"{v:.4f}" for v in row))
            print("residual_norms: " + " ".join(f"{v:.3f}" for v in record["residual_norms"]))
            print("delta_ce: " + " ".join(f"{v:+.4f}" for v in record["layer_removal"]["delta_ce"]))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
