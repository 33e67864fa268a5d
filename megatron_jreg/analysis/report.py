"""Console table, the reading, results.json and the CSV files of an analysis (plots are in plot.py).

The table has the paper's Table 1 / Table 2 columns (L, ζ_L, ζ_{L−1}, ζ_{L−2}, Ψ_L, the median Ψ of the
middle layers), then what a reader needs to act on them: Ψ_L over that median, where Ψ rises most, and with
`--remove-layers` the cross-entropy cost of removing the top k layers. One row per model (for a checkpoint
series, one row per checkpoint in step order). Every output names the distance (angular or cosine) and the
tokens measured (all, or each sample's last).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

from megatron_jreg.analysis.measure import ModelResult

TABLE_COLUMNS = ("model", "step", "L", "zeta_L", "zeta_L-1", "zeta_L-2", "psi_L", "psi_mid_median", "psi_L_over_mid",
                 "largest_rise_layer", "largest_rise", "residual_growth", "tokens", "distance", "positions")
_HEADERS = {"model": "model", "step": "step", "L": "L", "zeta_L": "ζ_L", "zeta_L-1": "ζ_L-1", "zeta_L-2": "ζ_L-2",
            "psi_L": "Ψ_L", "psi_mid_median": "median Ψ mid", "psi_L_over_mid": "Ψ_L/mid",
            "largest_rise_layer": "rise at", "largest_rise": "rise", "residual_growth": "‖h_L‖/‖h_0‖",
            "tokens": "tokens", "base_ce": "CE"}
DISTANCES = {"angular": "angular distance arccos(cos)/π (the paper's Ψ)", "cosine": "cosine distance 1 − cos"}
POSITIONS = {"all": "all real tokens", "last": "the last token of each sample"}
JUMP_RATIO = 1.5
"""A rise in the top three layers counts as a jump when that layer's Ψ is at least this many times the median
middle-layer Ψ (the reading's rule, documented in docs/analysis.md)."""
REFERENCE = ("Shibata et al. 2026, Suppressing Final Layer Hidden State Jumps in Transformer Pretraining (Findings "
             "of EACL 2026, arXiv 2601.18302), Table 2: their 1B Llama baseline ζ_L 6.42, with JREG (λ = 1, α = 1) "
             "0.00 (angular Ψ, all tokens)")
DEFINITIONS = {
    "psi": "Ψ_ℓ = mean over the measured tokens of d(h_{ℓ−1}, h_ℓ), ℓ = 1..L (h_{ℓ−1}, h_ℓ: decoder layer ℓ's "
           "input and output; Shibata et al. 2026, §3)",
    "zeta": "ζ_ℓ = 100 · Σ_{k=ℓ..L} max(0, Ψ_k − Ψ_{k−1}), ℓ = 2..L (Shibata et al. 2026, §3)",
    "psi_mid_median": "median Ψ_ℓ over the middle layers (the central half of the stack, layers 1 and L excluded)",
    "psi_L_over_mid": "Ψ_L / psi_mid_median: 1 = the last layer moves like a middle layer",
    "largest_rise": "max over ℓ = 2..L of 100 · (Ψ_ℓ − Ψ_{ℓ−1}) (ζ's units) and the ℓ where it is reached",
    "residual_norms": "mean ‖h_ℓ‖ over the measured tokens, ℓ = 0..L (h_0: the embeddings entering layer 1); "
                      "the residual-stream growth of 'The Curse of Depth in LLMs' (Sun et al. 2025)",
    "residual_growth": "residual_norms[L] / residual_norms[0]: how many times the mean ‖h_ℓ‖ grew from the "
                       "embeddings to the last layer's output (the table's summary of residual_norms)",
    "layer_distances": "layer_distances[n−1][ℓ] = mean d(h_ℓ, h_{ℓ+n}), ℓ = 0..L−n, n = 1..L (Gromov et al. 2024, "
                       "The Unreasonable Ineffectiveness of the Deeper Layers, who use the angular distance at the "
                       "last token: --positions last); the n = 1 row equals psi",
    "zero_tokens": "measured tokens whose h_ℓ is the zero vector, ℓ = 0..L (d counts them as orthogonal)",
    "layer_removal": "increase of the mean next-token cross-entropy (nats per predicted token) when a decoder layer "
                     "is skipped (its output := its input), and when the top k layers L−k+1..L are skipped "
                     "(ShortGPT, Men et al. 2024; Gromov et al. 2024)",
}


def _finite(x: object) -> object:
    """NaN/inf → None, so results.json stays valid JSON; anything else unchanged."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def summary_row(result: ModelResult) -> dict:
    """The table row of one model, keyed by TABLE_COLUMNS (plus base_ce and delta_ce_top_k with removal)."""
    jumps = result.final_jumps
    rise_layer, rise = result.largest_rise
    row = {
        "model": result.label,
        "step": result.step,
        "L": result.num_layers,
        "zeta_L": jumps["zeta_L"],
        "zeta_L-1": jumps["zeta_L-1"],
        "zeta_L-2": jumps["zeta_L-2"],
        "psi_L": result.psi[-1],
        "psi_mid_median": result.psi_mid_median,
        "psi_L_over_mid": result.psi_ratio,
        "largest_rise_layer": rise_layer,
        "largest_rise": rise,
        "residual_growth": result.residual_growth,
        "tokens": result.tokens,
        "distance": result.distance,
        "positions": result.positions,
    }
    if result.removal is not None:
        row["base_ce"] = result.removal["base_ce"]
        for k, delta in zip(result.removal["top_k"], result.removal["delta_ce_top"]):
            row[f"delta_ce_top{k}"] = delta
    return row


def reading(result: ModelResult) -> str:
    """One sentence: Ψ_L against the middle layers, where Ψ rises most, whether that is a top-of-stack jump
    (rule: the largest rise is in layers L−2..L and that layer's Ψ ≥ JUMP_RATIO × the median middle Ψ), and
    with layer removal which single layer costs most and what removing the top k costs."""
    psi, mid = result.psi, result.psi_mid_median
    layer, rise = result.largest_rise
    L = result.num_layers
    if layer is None or not math.isfinite(mid):
        text = f"{result.label}: {L} layer(s), too few for a middle layer to compare Ψ_L with"
    else:
        text = (f"{result.label}: Ψ_L = {result.psi_ratio:.2f} × the median middle-layer Ψ ({psi[-1]:.4f} vs "
                f"{mid:.4f}); the largest rise of Ψ is at layer {layer} of {L} ({rise:+.2f} in ζ units)")
        if rise <= 0:
            text += " — Ψ never rises over the layer below: no jump"
        elif layer >= L - 2 and psi[layer - 1] >= JUMP_RATIO * mid:
            text += f" — a jump at the top of the stack (layer {layer}'s Ψ is {psi[layer - 1] / mid:.2f} × the middle)"
        elif layer >= L - 2:
            text += f" — a rise at the top, under {JUMP_RATIO} × the middle-layer Ψ: no clear jump"
        else:
            text += " — below the top three layers: no top-of-stack jump"
    if result.removal is not None:
        text += f". {_removal_reading(result)}"
    return text


def _removal_reading(result: ModelResult) -> str:
    """Which single layer costs most, which contiguous block of those measured (each layer alone, the top k) is
    cheapest to remove, and what the layer of smallest Ψ costs when that is not it: the layer that moves the
    hidden state least (Gromov et al.'s pick for a block of one) is not necessarily cheap to remove
    (docs/analysis.md, "The reading")."""
    removal, L = result.removal, result.num_layers
    delta = removal["delta_ce"]

    def low(value: float) -> float:  # a NaN is never the cheapest
        return value if math.isfinite(value) else math.inf

    worst = max(range(L), key=lambda i: -low(-delta[i]))  # a NaN is never the costliest either
    blocks = [(delta[i], f"layer {i + 1} alone ({delta[i]:+.4f})") for i in range(L)]  # the top 1 is layer L alone
    blocks += [(d, f"layers {L - k + 1}-{L}, the top {k} ({d:+.4f})")
               for k, d in zip(removal["top_k"], removal["delta_ce_top"]) if k > 1]
    cheapest = min(blocks, key=lambda b: low(b[0]))[1]
    text = (f"Layer removal (CE {removal['base_ce']:.4f} nats): layer {worst + 1} costs most ({delta[worst]:+.4f}); "
            f"the cheapest block measured is {cheapest}")
    still = min(range(L), key=lambda i: low(result.psi[i]))
    if not cheapest.startswith(f"layer {still + 1} alone"):
        text += f", not layer {still + 1} of the smallest Ψ ({delta[still]:+.4f})"
    tops = ", ".join(f"top {k}: {d:+.4f}" for k, d in zip(removal["top_k"], removal["delta_ce_top"]))
    return f"{text}; {tops}"


def measure_label(results: list[ModelResult]) -> str:
    """"angular distance arccos(cos)/π …; over all real tokens": the distance and the tokens measured."""
    distances = ", ".join(DISTANCES[d] for d in sorted({r.distance for r in results}))
    return f"{distances}; over {', '.join(POSITIONS[p] for p in sorted({r.positions for r in results}))}"


def _removal_columns(rows: list[dict]) -> list[str]:
    """The `summary_row` columns of layer removal: base_ce and delta_ce_top{k}, k ascending (none without it)."""
    deltas = sorted({k for row in rows for k in row if k.startswith("delta_ce_top")}, key=lambda k: int(k[12:]))
    return ["base_ce", *deltas] if deltas else []


def _cell(key: str, value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if key.startswith("psi_L_over"):
            return f"{value:.2f}"
        if key.startswith(("psi", "delta_ce", "base_ce")):
            return f"{value:.4f}"
        return f"{value:+.2f}" if key == "largest_rise" else f"{value:.2f}"
    return str(value)


def format_table(results: list[ModelResult]) -> str:
    """A fixed-width text table (ζ with 2 decimals, Ψ and CE with 4), the measure's labels and the reading."""
    rows = [summary_row(r) for r in results]
    extra = _removal_columns(rows)
    keys = [k for k in TABLE_COLUMNS if k not in ("distance", "positions", "tokens")] + extra + ["tokens"]
    headers = [_HEADERS.get(k, f"ΔCE top{k[12:]}") for k in keys]
    cells = [[_cell(k, row.get(k)) for k in keys] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = lambda cs: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cs, widths)))
    out = [f"Ψ: {measure_label(results)}; h_ℓ: {', '.join(sorted({r.convention for r in results}))}",
           line(headers), line(["-" * w for w in widths]), *(line(c) for c in cells)]
    if extra:
        out.append("ΔCE: increase of next-token CE (nats per predicted token) with the top k layers skipped")
    out += ["", "Reading (rule in docs/analysis.md):", *(f"- {reading(r)}" for r in results),
            f"Reference: {REFERENCE}"]
    return "\n".join(out)


def result_record(result: ModelResult) -> dict:
    """The results.json entry of one model: the table row, every layer's figures and the raw totals."""
    rise_layer, rise = result.largest_rise
    return {
        **{key: _finite(value) for key, value in summary_row(result).items()},
        "path": result.path,
        "kind": result.kind,
        "revision": result.revision,
        "model_class": result.model_class,
        "convention": result.convention,
        "psi": [_finite(x) for x in result.psi],
        "zeta_layers": list(range(2, result.num_layers + 1)),
        "zeta": [_finite(x) for x in result.zeta],
        "middle_layers": list(result.middle_layers) if result.middle_layers else None,
        "largest_rise": {"layer": rise_layer, "value": _finite(rise)},
        "reading": reading(result),
        "residual_norms": [_finite(x) for x in result.residual_norms],
        "zero_tokens": result.zero_tokens,
        "layer_distances": [[_finite(x) for x in row] for row in result.layer_distances],
        "layer_removal": _removal_record(result.removal),
        "tokens_per_layer": result.counts,
        "displacement_sums": result.sums,
        "samples": result.samples,
        "truncated_samples": result.truncated_samples,
        "truncated_to": result.truncated_to,
        "streamed": result.streamed,
        "peak_memory_bytes": result.peak_memory_bytes,
    }


def _removal_record(removal: dict | None) -> dict | None:
    if removal is None:
        return None
    return {k: [_finite(x) for x in v] if isinstance(v, list) else _finite(v) for k, v in removal.items()}


def write_results(results: list[ModelResult], settings: dict, output: Path) -> list[Path]:
    """Write results.json, results.csv (the table), layers.csv (per model and layer) and layer_distances.csv
    (per model, layer ℓ and span n)."""
    output.mkdir(parents=True, exist_ok=True)
    paths = [output / "results.json", output / "results.csv", output / "layers.csv", output / "layer_distances.csv"]
    payload = {"settings": settings, "definitions": DEFINITIONS, "reference": REFERENCE,
               "models": [result_record(r) for r in results]}
    paths[0].write_text(json.dumps(payload, indent=2, allow_nan=False, ensure_ascii=False) + "\n", encoding="utf-8")
    rows = [summary_row(r) for r in results]
    columns = list(TABLE_COLUMNS) + _removal_columns(rows)
    _write_csv(paths[1], columns, ([row.get(c) for c in columns] for row in rows))
    _write_csv(paths[2], ["model", "step", "layer", "layer_normalized", "psi", "zeta", "tokens", "residual_norm",
                          "delta_ce", "distance", "positions"],
               _layer_rows(results))
    _write_csv(paths[3], ["model", "step", "layer", "n", "distance_value", "distance", "positions"],
               ([r.label, r.step, layer, n, value, r.distance, r.positions]
                for r in results for n, row in enumerate(r.layer_distances, start=1)
                for layer, value in enumerate(row)))
    return paths


def _layer_rows(results: list[ModelResult]) -> Iterator[list]:
    for r in results:
        empty = [None] * r.num_layers
        columns = zip(r.psi, [None, *r.zeta], r.counts, r.residual_norms[1:] or empty,
                      r.removal["delta_ce"] if r.removal else empty)
        for layer, (psi, zeta, tokens, norm, delta) in enumerate(columns, start=1):
            yield [r.label, r.step, layer, normalized_depth(layer, r.num_layers), psi, zeta, tokens, norm, delta,
                   r.distance, r.positions]


def _write_csv(path: Path, header: list[str], rows: Iterable[list]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def normalized_depth(layer: int, num_layers: int) -> float:
    """ℓ ↦ (ℓ − 1) / (L − 1) ∈ [0, 1], so models of different depth share one axis."""
    return 0.0 if num_layers == 1 else (layer - 1) / (num_layers - 1)
