"""PNG plots in the paper's style: Ψ_ℓ against normalised depth (Figure 2 / Figure 3) and ζ per checkpoint.

Uses matplotlib's object API with the Agg canvas, so no display or pyplot global state is involved.
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_jreg.analysis.measure import ModelResult
from megatron_jreg.analysis.report import normalized_depth


def _figure(width: float = 6.4, height: float = 4.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=150)
    FigureCanvasAgg(fig)
    return fig


def _is_series(results: list[ModelResult]) -> bool:
    """Checkpoints of one run: every result has a step (from --checkpoints)."""
    return len(results) > 1 and all(r.step is not None for r in results)


def plot_psi_profiles(results: list[ModelResult], path: Path) -> Path:
    """Ψ_ℓ against (ℓ − 1)/(L − 1), one curve per model; a checkpoint series is coloured by step."""
    from matplotlib import colormaps

    fig = _figure()
    ax = fig.add_subplot()
    series = _is_series(results)
    cmap = colormaps["viridis"]
    for i, r in enumerate(results):
        x = [normalized_depth(layer, r.num_layers) for layer in range(1, r.num_layers + 1)]
        color = cmap(i / max(len(results) - 1, 1) * 0.9) if series else None
        label = f"step {r.step}" if series else f"{r.label} (L={r.num_layers})"
        ax.plot(x, r.psi, marker="o", markersize=3, linewidth=1.4, color=color, label=label)
    ax.set_xlabel(r"normalised layer index $(\ell - 1) / (L - 1)$")
    ax.set_ylabel(r"$\Psi_\ell$")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    conventions = sorted({r.convention for r in results})
    ax.set_title(r"$\Psi_\ell$ per decoder layer" + ("" if len(conventions) > 1 else f"\n{conventions[0]}"), fontsize=9)
    ax.legend(fontsize=7, loc="best", title="checkpoint" if series else None, title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


_JUMP_LABELS = {"zeta_L": r"$\zeta_L$", "zeta_L-1": r"$\zeta_{L-1}$", "zeta_L-2": r"$\zeta_{L-2}$"}


def plot_zeta_series(results: list[ModelResult], path: Path) -> Path:
    """ζ_L, ζ_{L−1}, ζ_{L−2} per model: lines over the step for a checkpoint series (the paper's Table 2
    as a figure), grouped bars for unrelated models."""
    fig = _figure()
    ax = fig.add_subplot()
    series = _is_series(results)
    keys = [k for k in _JUMP_LABELS if not all(math.isnan(r.final_jumps[k]) for r in results)]
    for j, key in enumerate(keys):
        y = [r.final_jumps[key] for r in results]
        if series:
            ax.plot([r.step for r in results], y, marker="os^"[j], linewidth=1.4, label=_JUMP_LABELS[key])
        else:
            width = 0.8 / len(keys)
            x = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(results))]
            ax.bar(x, [0.0 if math.isnan(v) else v for v in y], width=width, label=_JUMP_LABELS[key])
    if series:
        ax.set_xlabel("training step")
    else:
        ax.set_xticks(range(len(results)), [r.label for r in results], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel(r"jump rate $\zeta$")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_plots(results: list[ModelResult], output: Path) -> list[Path]:
    """psi_profiles.png always; zeta_series.png when there are several models or checkpoints."""
    output.mkdir(parents=True, exist_ok=True)
    paths = [plot_psi_profiles(results, output / "psi_profiles.png")]
    if len(results) > 1:
        paths.append(plot_zeta_series(results, output / "zeta_series.png"))
    return paths
