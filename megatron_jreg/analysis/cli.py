"""`megatron-jreg analyze`: parsing only; the settings are validated by `run.AnalyzeConfig`, the work is done by
`run.run_analysis` (usage: `megatron-jreg analyze --help`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from megatron_jreg import jreg
from megatron_jreg.analysis.run import DTYPES, POSITIONS, AnalyzeConfig, Interrupted, run_analysis
from megatron_jreg.errors import run_command
from megatron_jreg.usage import example


def _samples(value: str) -> int | None:
    if value == "all":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number or 'all', got {value!r}") from e


def _ints(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas (e.g. 1,2,3), got {value!r}") \
            from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-jreg analyze",
        description="Measure the per-layer displacement Ψ_ℓ and the jump rates ζ_ℓ (Shibata et al. 2026, §3), the "
        "distance between any two layers (Gromov et al. 2024), residual norms and, with --remove-layers, the "
        "cross-entropy cost of removing each layer (ShortGPT).",
        **example("megatron-jreg analyze --model path/to/hf-model --data lambada --num-samples 100 "
                  "--output jump_analysis"),
    )
    p.add_argument("--model", dest="models", action="append", metavar="PATH",
                   help="HF model folder or hub id (org/name, read from the local cache), GGUF file, or megatron-jreg "
                   "checkpoint directory (repeatable)")
    p.add_argument("--revision", dest="revisions", type=lambda v: [r.strip() for r in v.split(",")], metavar="A,B,...",
                   help="revisions of each --model hub id, read from the local cache (e.g. Pythia's "
                   "step1000,step2000): a series whose step is read from each name; nothing downloads (default: none)")
    p.add_argument("--checkpoints", metavar="GLOB",
                   help="checkpoints of one run, measured in step order (default: none)")
    p.add_argument("--data", metavar="SPEC",
                   help="lambada[:FILE] | wikitext:FILE | jsonl:FILE:KEY | text:FILE (default: bundled LAMBADA)")
    p.add_argument("--num-samples", type=_samples, metavar="N|all",
                   help="the first N samples of --data, or all (default: %(default)s)")
    p.add_argument("--batch-size", type=int, help="samples per forward pass (default: %(default)s)")
    p.add_argument("--max-length", type=int, metavar="T",
                   help="truncate samples to T tokens (default: the model's context length)")
    p.add_argument("--dtype", choices=DTYPES, help="(default: %(default)s)")
    p.add_argument("--distance", choices=jreg.DISTANCES,
                   help="angular: arccos(cos)/π (the paper's Ψ); cosine: 1 − cos (default: %(default)s)")
    p.add_argument("--positions", choices=POSITIONS,
                   help="measure over all real tokens, or only each sample's last token, as Gromov et al. do "
                   "(layer removal then scores the prediction of each sample's last token) (default: %(default)s)")
    p.add_argument("--remove-layers", action="store_true",
                   help="also measure layer removal: the increase of next-token cross-entropy when each decoder layer "
                   "is skipped (output := input), and when the top k layers are; costs about L/2 forward passes per "
                   "batch")
    p.add_argument("--top-k", type=_ints, metavar="K,K,...",
                   help="with --remove-layers: the top k layers skipped together (default: 1,2,3, those up to the "
                        "model's number of layers)")
    p.add_argument("--include-final-norm", action="store_true",
                   help="the output_hidden_states convention: Ψ_L measured after the final norm")
    p.add_argument("--output", type=Path, metavar="DIR",
                   help="folder for results.json, the CSV files and the plots (default: %(default)s)")
    p.add_argument("--device", help="auto (cuda if available), cpu, cuda:0, ... (default: %(default)s)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer folder for models that carry none (default: the model's own)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction,
                   help="read the safetensors one decoder layer at a time, any family (memory: one layer + the "
                   "samples' hidden states); default: stream only when the weights do not fit in free memory")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction,
                   help="progress bars on stderr (default: when stderr is a terminal)")
    # The defaults are AnalyzeConfig's, said once: one config field per flag (and padding_side, which has none).
    p.set_defaults(**{f.name: f.default_factory() if f.default is MISSING else f.default
                      for f in fields(AnalyzeConfig)})
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    measured: list = []  # (results, files written)

    def body() -> int:
        from megatron_jreg.checkpoints.model import quiet_megatron

        # torch's "No CUDA runtime is found", megatron-core's fallbacks: about this machine, not the models measured
        with quiet_megatron():
            measured.extend(run_analysis(AnalyzeConfig(**vars(args))))  # one config field per flag
        return 0

    try:
        code = run_command("megatron-jreg analyze", body)
    except Interrupted as e:
        print(f"\nmegatron-jreg analyze: {e}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\nmegatron-jreg analyze: interrupted before any model was measured; nothing written", file=sys.stderr)
        return 130
    if measured:  # the table and its reading on stdout, then where the files went
        from megatron_jreg.analysis.report import format_table

        results, files = measured
        print(format_table(results))
        print("wrote " + ", ".join(str(p) for p in files))
    return code


if __name__ == "__main__":
    sys.exit(main())
