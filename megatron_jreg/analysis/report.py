"""Console table, results.json and the CSV files of an analysis (plots are in plot.py).

The table has the paper's Table 1 / Table 2 columns: L, ζ_L, ζ_{L−1}, ζ_{L−2}, Ψ_L and the median Ψ
of the middle layers, one row per model (for a checkpoint series, one row per checkpoint in step order).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from megatron_jreg.analysis.measure import ModelResult

TABLE_COLUMNS = ("model", "step", "L", "zeta_L", "zeta_L-1", "zeta_L-2", "psi_L", "psi_mid_median", "tokens")
_HEADERS = ("model", "step", "L", "ζ_L", "ζ_L-1", "ζ_L-2", "Ψ_L", "median Ψ mid", "tokens")


def _finite(x: object) -> object:
    """NaN/inf → None, so results.json stays valid JSON; anything else unchanged."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def summary_row(result: ModelResult) -> dict:
    """The table row of one model, keyed by TABLE_COLUMNS."""
    jumps = result.final_jumps
    return {
        "model": result.label,
        "step": result.step,
        "L": result.num_layers,
        "zeta_L": jumps["zeta_L"],
        "zeta_L-1": jumps["zeta_L-1"],
        "zeta_L-2": jumps["zeta_L-2"],
        "psi_L": result.psi[-1],
        "psi_mid_median": result.psi_mid_median,
        "tokens": result.tokens,
    }


def format_table(results: list[ModelResult]) -> str:
    """A fixed-width text table (ζ with 2 decimals, Ψ with 4)."""

    def cell(key: str, value: object) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            if math.isnan(value):
                return "n/a"
            return f"{value:.4f}" if key.startswith("psi") else f"{value:.2f}"
        return str(value)

    rows = [[cell(k, summary_row(r)[k]) for k in TABLE_COLUMNS] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(_HEADERS)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(_HEADERS), line(["-" * w for w in widths])] + [line(row) for row in rows]
    conventions = sorted({r.convention for r in results})
    out.append(f"Ψ: {', '.join(conventions)}")
    return "\n".join(out)


def result_record(result: ModelResult) -> dict:
    """The results.json entry of one model: the table row plus every layer's Ψ and ζ and the raw totals."""
    return {
        **{key: _finite(value) for key, value in summary_row(result).items()},
        "path": result.path,
        "kind": result.kind,
        "model_class": result.model_class,
        "convention": result.convention,
        "psi": [_finite(x) for x in result.psi],
        "zeta_layers": list(range(2, result.num_layers + 1)),
        "zeta": [_finite(x) for x in result.zeta],
        "middle_layers": list(result.middle_layers) if result.middle_layers else None,
        "tokens_per_layer": result.counts,
        "displacement_sums": result.sums,
        "samples": result.samples,
        "truncated_samples": result.truncated_samples,
        "streamed": result.streamed,
        "peak_memory_bytes": result.peak_memory_bytes,
    }


def write_results(results: list[ModelResult], settings: dict, output: Path) -> list[Path]:
    """Write results.json, results.csv (the table) and layers.csv (Ψ_ℓ, ζ_ℓ per model and layer)."""
    output.mkdir(parents=True, exist_ok=True)
    paths = [output / "results.json", output / "results.csv", output / "layers.csv"]
    payload = {"settings": settings, "models": [result_record(r) for r in results]}
    paths[0].write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    with open(paths[1], "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=TABLE_COLUMNS)
        writer.writeheader()
        writer.writerows(summary_row(r) for r in results)
    with open(paths[2], "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "step", "layer", "layer_normalized", "psi", "zeta", "tokens"])
        for r in results:
            zeta = [None, *r.zeta]
            for layer, (psi, z, n) in enumerate(zip(r.psi, zeta, r.counts), start=1):
                writer.writerow([r.label, r.step, layer, normalized_depth(layer, r.num_layers), psi, z, n])
    return paths


def normalized_depth(layer: int, num_layers: int) -> float:
    """ℓ ↦ (ℓ − 1) / (L − 1) ∈ [0, 1], so models of different depth share one axis."""
    return 0.0 if num_layers == 1 else (layer - 1) / (num_layers - 1)
