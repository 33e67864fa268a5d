"""What an analysis writes: the console table with its reading, results.json, the CSV files and the PNG plots
(matplotlib's object API on Agg: no display, no pyplot state)."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

from megatron_jreg.analysis.measure import ModelResult
from megatron_jreg.fileio import atomic_write, write_json

TABLE_COLUMNS = ("model", "step", "L", "zeta_L", "zeta_L-1", "zeta_L-2", "psi_L", "psi_mid_median", "psi_L_over_mid",
                 "largest_rise_layer", "largest_rise", "residual_growth", "tokens", "distance", "positions")
_HEADERS = {"zeta_L": "ζ_L", "zeta_L-1": "ζ_L-1", "zeta_L-2": "ζ_L-2", "psi_L": "Ψ_L", "psi_mid_median": "median Ψ mid",
            "psi_L_over_mid": "Ψ_L/mid", "largest_rise_layer": "rise at", "largest_rise": "rise",
            "residual_growth": "‖h_L‖/‖h_0‖", "base_ce": "CE"}  # other columns: their key
DISTANCES = {"angular": "angular distance arccos(cos)/π (the paper's Ψ)", "cosine": "cosine distance 1 − cos"}
POSITIONS = {"all": "all real tokens", "last": "the last token of each sample"}
JUMP_RATIO = 1.5  # the reading's rule for a jump at the top of the stack (docs/analysis.md)
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
    """NaN/inf → None, in lists and dicts too, so results.json stays valid JSON; anything else unchanged."""
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    return None if isinstance(x, float) and not math.isfinite(x) else x


def summary_row(result: ModelResult) -> dict:
    """The table row of one model, keyed by TABLE_COLUMNS (plus base_ce and delta_ce_top_k with removal)."""
    rise_layer, rise = result.largest_rise
    row = {"model": result.label, "step": result.step, "L": result.num_layers, **result.final_jumps,
           "psi_L": result.psi[-1], "psi_mid_median": result.psi_mid_median, "psi_L_over_mid": result.psi_ratio,
           "largest_rise_layer": rise_layer, "largest_rise": rise, "residual_growth": result.residual_growth,
           "tokens": result.tokens, "distance": result.distance, "positions": result.positions}
    if result.removal is not None:
        row["base_ce"] = result.removal["base_ce"]
        for k, delta in zip(result.removal["top_k"], result.removal["delta_ce_top"]):
            row[f"delta_ce_top{k}"] = delta
    return row


def reading(result: ModelResult) -> str:
    """One sentence: Ψ_L against the middle layers, where Ψ rises most and whether that is a top-of-stack jump
    (JUMP_RATIO), plus layer removal's costs."""
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
    """The costliest single layer, the cheapest block measured, and the smallest-Ψ layer's cost when that is not it
    (moving least is not being cheap to remove)."""
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
    headers = [_HEADERS.get(k, k.replace("delta_ce_top", "ΔCE top")) for k in keys]
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
    return _finite({
        **summary_row(result), "path": result.path, "kind": result.kind, "revision": result.revision,
        "model_class": result.model_class, "convention": result.convention, "psi": result.psi,
        "zeta_layers": list(range(2, result.num_layers + 1)), "zeta": result.zeta,
        "middle_layers": list(result.middle_layers) if result.middle_layers else None,
        "largest_rise": {"layer": rise_layer, "value": rise}, "reading": reading(result),
        "residual_norms": result.residual_norms, "zero_tokens": result.zero_tokens,
        "layer_distances": result.layer_distances, "layer_removal": result.removal,
        "tokens_per_layer": result.counts, "displacement_sums": result.sums, "samples": result.samples,
        "truncated_samples": result.truncated_samples, "truncated_to": result.truncated_to,
        "streamed": result.streamed, "peak_memory_bytes": result.peak_memory_bytes,
    })


def write_results(results: list[ModelResult], settings: dict, output: Path) -> list[Path]:
    """Write results.json, the CSV files (the table, per layer, per layer and span) and the plots; their paths."""
    output.mkdir(parents=True, exist_ok=True)
    paths = [output / "results.json", output / "results.csv", output / "layers.csv", output / "layer_distances.csv"]
    write_json(paths[0], {"settings": settings, "definitions": DEFINITIONS, "reference": REFERENCE,
                          "models": [result_record(r) for r in results]})
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
    return paths + write_plots(results, output)


def _layer_rows(results: list[ModelResult]) -> Iterator[list]:
    for r in results:
        empty = [None] * r.num_layers
        columns = zip(r.psi, [None, *r.zeta], r.counts, r.residual_norms[1:] or empty,
                      r.removal["delta_ce"] if r.removal else empty)
        for layer, (psi, zeta, tokens, norm, delta) in enumerate(columns, start=1):
            yield [r.label, r.step, layer, normalized_depth(layer, r.num_layers), psi, zeta, tokens, norm, delta,
                   r.distance, r.positions]


def _write_csv(path: Path, header: list[str], rows: Iterable[list]) -> None:
    with atomic_write(path) as f:
        csv.writer(f).writerows([header, *rows])


def normalized_depth(layer: int, num_layers: int) -> float:
    """ℓ ↦ (ℓ − 1) / (L − 1) ∈ [0, 1], so models of different depth share one axis."""
    return 0.0 if num_layers == 1 else (layer - 1) / (num_layers - 1)


# --------------------------------------------------------------------------------------------------
# Plots.

MAX_HEATMAPS = 8
_LINE = {"marker": "o", "markersize": 3, "linewidth": 1.4}


def _figure(width: float = 6.4, height: float = 4.2, layout: str | None = "tight"):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=150, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _finish(path: Path, *axes, **legend) -> Path:  # noqa: ANN001 - matplotlib Axes
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if legend:
            ax.legend(**legend)
    axes[0].figure.savefig(path)
    return path


def _curves(ax, results: list[ModelResult], x, y, suffix=lambda r: "") -> None:  # noqa: ANN001 - Axes, callables
    colors, labels = _colors(results)
    for r, color, label in zip(results, colors, labels):
        ax.plot(x(r), y(r), color=color, label=label + suffix(r), **_LINE)


def _is_series(results: list[ModelResult]) -> bool:
    """Checkpoints of one run: every result has a step (from --checkpoints, --revision or the checkpoint), each a
    different one (two runs' final checkpoints at the same step are two models, not a series)."""
    steps = [r.step for r in results]
    return len(results) > 1 and None not in steps and len(set(steps)) == len(steps)


def _colors(results: list[ModelResult]) -> tuple[list, list[str]]:
    """(colour, legend label) per model: a checkpoint series coloured by step, other models by the default cycle."""
    from matplotlib import colormaps

    if _is_series(results):
        cmap = colormaps["viridis"]
        return ([cmap(i / max(len(results) - 1, 1) * 0.9) for i in range(len(results))],
                [f"step {r.step}" for r in results])
    return [None] * len(results), [f"{r.label} (L={r.num_layers}" + (f", step {r.step})" if r.step is not None else ")")
                                   for r in results]


def plot_psi_profiles(results: list[ModelResult], path: Path) -> Path:
    """Ψ_ℓ against (ℓ − 1)/(L − 1), one curve per model; a checkpoint series is coloured by step."""
    ax = _figure().add_subplot()
    _curves(ax, results, lambda r: [normalized_depth(ell, r.num_layers) for ell in range(1, r.num_layers + 1)],
            lambda r: r.psi)
    ax.set(xlabel=r"normalised layer index $(\ell - 1) / (L - 1)$", xlim=(-0.02, 1.02), ylim=(0, None),
           ylabel=r"$\Psi_\ell$ = mean $d(h_{\ell-1}, h_\ell)$")
    conventions = sorted({r.convention for r in results})
    ax.set_title(r"$\Psi_\ell$ per decoder layer" + f"\nd: {measure_label(results)}"
                 + ("" if len(conventions) > 1 else f"\n{conventions[0]}"), fontsize=8)
    return _finish(path, ax, fontsize=7, loc="best", title="checkpoint" if _is_series(results) else None,
                   title_fontsize=7)


_JUMP_LABELS = {"zeta_L": r"$\zeta_L$", "zeta_L-1": r"$\zeta_{L-1}$", "zeta_L-2": r"$\zeta_{L-2}$"}


def plot_zeta_series(results: list[ModelResult], path: Path) -> Path:
    """ζ_L, ζ_{L−1}, ζ_{L−2}: lines over the step for a checkpoint series, else grouped bars; zeros stay visible."""
    ax = _figure().add_subplot()
    series = _is_series(results)
    keys = [k for k in _JUMP_LABELS if not all(math.isnan(r.final_jumps[k]) for r in results)]
    values = []
    for j, key in enumerate(keys):
        y = [r.final_jumps[key] for r in results]
        values += [v for v in y if not math.isnan(v)]
        if series:
            # decreasing, hollow markers and distinct dashes: curves that coincide (e.g. all 0) stay visible
            ax.plot([r.step for r in results], y, marker="os^"[j], markersize=(10, 7, 4)[j], linewidth=1.4,
                    linestyle=("-", "--", ":")[j], markerfacecolor="none" if j < 2 else None, markeredgewidth=1.4,
                    label=_JUMP_LABELS[key], zorder=3 + j)
        else:
            width = 0.8 / len(keys)
            x = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(results))]
            bars = ax.bar(x, [0.0 if math.isnan(v) else v for v in y], width=width, label=_JUMP_LABELS[key])
            ax.bar_label(bars, labels=["n/a" if math.isnan(v) else f"{v:.2f}" for v in y], fontsize=6,
                         padding=1)  # a bar of height 0 is otherwise invisible
    if series:
        ax.set_xlabel("training step")
    else:
        ax.set_xticks(range(len(results)), [r.label for r in results], rotation=20, ha="right", fontsize=7)
    top = max([*values, 0.0])
    ax.set_ylim(-0.05 * max(top, 1.0), max(top, 1.0) * 1.1)
    ax.axhline(0.0, color="0.5", linewidth=0.8, zorder=1)
    ax.set_ylabel(r"jump rate $\zeta$ (100 × total rise of $\Psi$)")
    title = r"jump rates $\zeta_L$, $\zeta_{L-1}$, $\zeta_{L-2}$" + f"\nd: {measure_label(results)}"
    if values and all(v == 0 for v in values):
        title += "\nevery ζ is 0: Ψ never rises over the layer below in the top layers"
    ax.set_title(title, fontsize=8)
    return _finish(path, ax, **({"fontsize": 8} if keys else {}))


def plot_removal(results: list[ModelResult], path: Path) -> Path:
    """Ψ_ℓ (left) beside ΔCE when layer ℓ is skipped (right), against the layer index, one curve per model
    with layer removal; the top-k costs in the legend."""
    measured = [r for r in results if r.removal is not None]
    fig = _figure(11.0, 4.4)
    left, right = fig.subplots(1, 2)
    layers = lambda r: range(1, r.num_layers + 1)
    _curves(left, measured, layers, lambda r: r.psi)
    _curves(right, measured, layers, lambda r: r.removal["delta_ce"], lambda r: "; " + ", ".join(
        f"top {k} {d:+.4f}" for k, d in zip(r.removal["top_k"], r.removal["delta_ce_top"])))
    left.set(ylabel=r"$\Psi_\ell$", ylim=(0, None))
    left.set_title(r"$\Psi_\ell$ per decoder layer" + f"\nd: {measure_label(measured)}", fontsize=8)
    right.axhline(0.0, color="0.5", linewidth=0.8)
    right.set_ylabel(r"$\Delta$CE (nats per predicted token)")
    right.set_title("cross-entropy increase when layer ℓ is skipped (output := input)", fontsize=8)
    for ax in (left, right):
        ax.set_xlabel(r"decoder layer $\ell$")
        _integer_ticks(ax, "x")
    return _finish(path, left, right, fontsize=6, loc="best")


def _integer_ticks(ax, *axes_names: str) -> None:  # noqa: ANN001 - a matplotlib Axes
    from matplotlib.ticker import MaxNLocator

    for name in axes_names:
        getattr(ax, f"{name}axis").set_major_locator(MaxNLocator(integer=True))


def _shown(results: list[ModelResult]) -> list[ModelResult]:
    """At most MAX_HEATMAPS models, evenly spread, the first and last included."""
    if len(results) <= MAX_HEATMAPS:
        return results
    picks = sorted({round(i * (len(results) - 1) / (MAX_HEATMAPS - 1)) for i in range(MAX_HEATMAPS)})
    return [results[i] for i in picks]


def plot_layer_distances(results: list[ModelResult], path: Path) -> Path:
    """Gromov et al.'s heat-map per model: x = the first layer ℓ (h_ℓ, 0 = embeddings), y = the span n,
    colour = mean d(h_ℓ, h_{ℓ+n}); the bottom row (n = 1) is Ψ. One colour scale for all panels."""
    import numpy as np

    shown = _shown(results)
    cols = min(len(shown), 4)
    rows = math.ceil(len(shown) / cols)
    fig = _figure(3.6 * cols + 1.0, 3.2 * rows + 0.9, layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    top = max((v for r in shown for row in r.layer_distances for v in row if math.isfinite(v)), default=1.0)
    image = None
    for ax, r in zip(axes, shown):
        size = r.num_layers
        grid = np.full((size, size), np.nan)  # [n − 1, ℓ], ℓ = 0..L − n
        for n, row in enumerate(r.layer_distances, start=1):
            grid[n - 1, : len(row)] = row
        image = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0.0, vmax=top,
                          extent=(-0.5, size - 0.5, 0.5, size + 0.5), interpolation="nearest")
        _integer_ticks(ax, "x", "y")
        ax.set_title(f"{r.label}" + (f" (step {r.step})" if r.step is not None else ""), fontsize=8)
        ax.set_xlabel(r"first layer $\ell$ (0 = embeddings)", fontsize=7)
        ax.set_ylabel(r"span $n$: $d(h_\ell, h_{\ell+n})$", fontsize=7)
        ax.tick_params(labelsize=6)
    for ax in axes[len(shown):]:
        ax.set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=list(axes[: len(shown)]), shrink=0.85, label="mean d")
    note = "" if len(shown) == len(results) else f" ({len(shown)} of {len(results)} models, evenly spaced)"
    # wraps to the figure's width: one panel is narrower than the measure's label for --positions last
    fig.suptitle(f"distance between hidden states h_ℓ and h_ℓ+n{note}\nd: {measure_label(results)}", fontsize=8,
                 wrap=True)
    fig.savefig(path)
    return path


def plot_residual_norms(results: list[ModelResult], path: Path) -> Path:
    """Mean ‖h_ℓ‖ against ℓ = 0..L, one curve per model; a log axis when the norms span more than 20×."""
    ax = _figure().add_subplot()
    _curves(ax, results, lambda r: range(r.num_layers + 1), lambda r: r.residual_norms)
    values = [v for r in results for v in r.residual_norms if math.isfinite(v) and v > 0]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.set(xlabel=r"hidden state $h_\ell$ ($\ell$ = 0: embeddings; $\ell$: output of layer $\ell$)",
           ylabel=r"mean $\Vert h_\ell \Vert$")
    _integer_ticks(ax, "x")
    positions = ", ".join(POSITIONS[p] for p in sorted({r.positions for r in results}))
    ax.set_title(f"residual-stream norm per layer (over {positions})", fontsize=8)
    return _finish(path, ax, fontsize=7, loc="best")


def write_plots(results: list[ModelResult], output: Path) -> list[Path]:
    """The plots of `results`: zeta_series.png for several models only, removal.png with layer removal only."""
    paths = [plot_psi_profiles(results, output / "psi_profiles.png")]
    if len(results) > 1:
        paths.append(plot_zeta_series(results, output / "zeta_series.png"))
    if any(r.removal is not None for r in results):
        paths.append(plot_removal(results, output / "removal.png"))
    paths.append(plot_layer_distances(results, output / "layer_distances.png"))
    paths.append(plot_residual_norms(results, output / "residual_norms.png"))
    return paths
