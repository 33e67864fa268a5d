"""PNG plots in the paper's style: Ψ_ℓ against normalised depth (Figure 2 / Figure 3), ζ per model or checkpoint,
and the layer-redundancy views: ΔCE per removed layer beside Ψ, the distance between any two layers
(Gromov et al.'s heat-map), and residual-stream norms.

Uses matplotlib's object API with the Agg canvas, so no display or pyplot global state is involved. Every
plot names the distance (angular or cosine) and the tokens measured.
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_jreg.analysis.measure import ModelResult
from megatron_jreg.analysis.report import POSITIONS, measure_label, normalized_depth

MAX_HEATMAPS = 8
_LINE = {"marker": "o", "markersize": 3, "linewidth": 1.4}


def _figure(width: float = 6.4, height: float = 4.2, layout: str | None = "tight"):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=150, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:  # noqa: ANN001 - a matplotlib Figure
    fig.savefig(path)
    return path


def _curves(ax, results: list[ModelResult], x, y, suffix=lambda r: "") -> None:  # noqa: ANN001 - Axes, callables
    """One line per model: x(r) against y(r), coloured and labelled by `_colors` (plus suffix(r))."""
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
    ax.set_xlabel(r"normalised layer index $(\ell - 1) / (L - 1)$")
    ax.set_ylabel(r"$\Psi_\ell$ = mean $d(h_{\ell-1}, h_\ell)$")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    conventions = sorted({r.convention for r in results})
    ax.set_title(r"$\Psi_\ell$ per decoder layer" + f"\nd: {measure_label(results)}"
                 + ("" if len(conventions) > 1 else f"\n{conventions[0]}"), fontsize=8)
    ax.legend(fontsize=7, loc="best", title="checkpoint" if _is_series(results) else None, title_fontsize=7)
    return _save(ax.figure, path)


_JUMP_LABELS = {"zeta_L": r"$\zeta_L$", "zeta_L-1": r"$\zeta_{L-1}$", "zeta_L-2": r"$\zeta_{L-2}$"}


def plot_zeta_series(results: list[ModelResult], path: Path) -> Path:
    """ζ_L, ζ_{L−1}, ζ_{L−2} per model: lines over the step for a checkpoint series (the paper's Table 2
    as a figure), grouped bars for unrelated models. Zeros stay visible: the y axis starts below 0 and
    keeps a height of at least 1, and a plot whose every ζ is 0 says so."""
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
    ax.grid(True, alpha=0.3)
    if keys:
        ax.legend(fontsize=8)
    return _save(ax.figure, path)


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
    left.set_ylabel(r"$\Psi_\ell$")
    left.set_ylim(bottom=0)
    left.set_title(r"$\Psi_\ell$ per decoder layer" + f"\nd: {measure_label(measured)}", fontsize=8)
    right.axhline(0.0, color="0.5", linewidth=0.8)
    right.set_ylabel(r"$\Delta$CE (nats per predicted token)")
    right.set_title("cross-entropy increase when layer ℓ is skipped (output := input)", fontsize=8)
    for ax in (left, right):
        ax.set_xlabel(r"decoder layer $\ell$")
        _integer_ticks(ax, "x")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="best")
    return _save(fig, path)


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
    return _save(layer_distances_figure(results), path)


def layer_distances_figure(results: list[ModelResult]):  # noqa: ANN201 - a matplotlib Figure
    """`plot_layer_distances`' figure; its title wraps to the figure's width (one panel is 4.6 inches wide, narrower
    than the measure's label for --positions last)."""
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
    fig.suptitle(f"distance between hidden states h_ℓ and h_ℓ+n{note}\nd: {measure_label(results)}", fontsize=8,
                 wrap=True)
    return fig


def plot_residual_norms(results: list[ModelResult], path: Path) -> Path:
    """Mean ‖h_ℓ‖ against ℓ = 0..L, one curve per model; a log axis when the norms span more than 20×."""
    ax = _figure().add_subplot()
    _curves(ax, results, lambda r: range(r.num_layers + 1), lambda r: r.residual_norms)
    values = [v for r in results for v in r.residual_norms if math.isfinite(v) and v > 0]
    if values and max(values) / min(values) > 20:
        ax.set_yscale("log")
    ax.set_xlabel(r"hidden state $h_\ell$ ($\ell$ = 0: embeddings; $\ell$: output of layer $\ell$)")
    _integer_ticks(ax, "x")
    ax.set_ylabel(r"mean $\Vert h_\ell \Vert$")
    positions = ", ".join(POSITIONS[p] for p in sorted({r.positions for r in results}))
    ax.set_title(f"residual-stream norm per layer (over {positions})", fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _save(ax.figure, path)


def write_plots(results: list[ModelResult], output: Path) -> list[Path]:
    """psi_profiles.png, layer_distances.png and residual_norms.png always; zeta_series.png for several models
    or checkpoints; removal.png with layer removal."""
    output.mkdir(parents=True, exist_ok=True)
    paths = [plot_psi_profiles(results, output / "psi_profiles.png")]
    if len(results) > 1:
        paths.append(plot_zeta_series(results, output / "zeta_series.png"))
    if any(r.removal is not None for r in results):
        paths.append(plot_removal(results, output / "removal.png"))
    paths.append(plot_layer_distances(results, output / "layer_distances.png"))
    paths.append(plot_residual_norms(results, output / "residual_norms.png"))
    return paths
