"""The plots stay readable in the cases that used to hide their content: every ζ exactly 0 (JREG's series)."""

from __future__ import annotations

import pytest


def test_zeta_series_of_zeros_shows_every_curve(tmp_path):
    """ζ_L = ζ_{L−1} = ζ_{L−2} = 0 at every step: the three curves coincide on the zero line, yet each one's
    colour is on the canvas (hollow markers of decreasing size), above the bottom axis."""
    import numpy as np
    from matplotlib import colors
    from matplotlib.image import imread

    from megatron_jreg.analysis.measure import ModelResult
    from megatron_jreg.analysis.report import plot_zeta_series

    falling = [0.3, 0.2, 0.1, 0.05]  # Ψ never rises: every ζ is 0
    results = [ModelResult(label=f"iter_{s}", path="", kind="megatron", model_class="", convention="hooks", step=s,
                           sums=[p * 10 for p in falling], counts=[10] * 4, samples=1, truncated_samples=0)
               for s in (100, 200, 300)]
    assert all(v == 0 for r in results for v in r.final_jumps.values())
    image = imread(plot_zeta_series(results, tmp_path / "zeta.png"))[..., :3]
    for name in ("C0", "C1", "C2"):
        rgb = np.array(colors.to_rgb(name))
        assert (np.abs(image - rgb).max(-1) < 0.06).sum() > 20, f"no {name} curve visible"


@pytest.mark.parametrize("models", [1, 11])
def test_layer_distance_heatmaps_fit_any_number_of_models(tmp_path, models):
    """One panel per model, eight at most (evenly spaced, first and last included)."""
    from matplotlib.image import imread

    from megatron_jreg.analysis.measure import ModelResult
    from megatron_jreg.analysis.report import MAX_HEATMAPS, _shown, plot_layer_distances

    size = 4
    results = [ModelResult(label=f"m{i}", path="", kind="hf", model_class="", convention="hooks", step=i,
                           sums=[1.0] * (size - 1), counts=[4] * (size - 1), samples=1, truncated_samples=0,
                           norm_sums=[4.0] * size, distance_sums=[[0.1 * (j - i) if j > i else 0.0 for j in range(size)]
                                                                  for i in range(size)])
               for i in range(models)]
    shown = _shown(results)
    assert len(shown) == min(models, MAX_HEATMAPS) and shown[0] is results[0] and shown[-1] is results[-1]
    image = imread(plot_layer_distances(results, tmp_path / "d.png"))
    assert image.shape[0] > 300 and image[..., :3].std() > 0.05


def test_two_runs_at_the_same_step_are_two_models_not_a_series():
    from megatron_jreg.analysis.measure import ModelResult
    from megatron_jreg.analysis.report import _colors, _is_series

    def result(label: str, step: int | None) -> ModelResult:
        return ModelResult(label=label, path="", kind="megatron", model_class="", convention="hooks", step=step,
                           sums=[1.0, 2.0], counts=[4, 4], samples=1, truncated_samples=0)

    finals = [result("baseline", 3000), result("jreg", 3000)]
    assert not _is_series(finals)
    assert _colors(finals)[1] == ["baseline (L=2, step 3000)", "jreg (L=2, step 3000)"]
    series = [result("iter_10", 10), result("iter_20", 20)]
    assert _is_series(series) and _colors(series)[1] == ["step 10", "step 20"]


def test_heatmap_title_fits_one_panel_with_positions_last(tmp_path):
    """issue 46.6: with --positions last the measure's label ("... over the last token of each sample") is wider
    than one heat-map panel, and the title was cut at both edges of the figure; it wraps to the figure instead
    (no dark pixel in the outer columns of the title rows)."""
    from matplotlib.image import imread

    from megatron_jreg.analysis.measure import ModelResult
    from megatron_jreg.analysis.report import plot_layer_distances

    size = 4
    result = ModelResult(label="m", path="", kind="hf", model_class="", convention="hooks", step=None,
                         positions="last", sums=[1.0] * (size - 1), counts=[4] * (size - 1), samples=1,
                         truncated_samples=0, norm_sums=[4.0] * size,
                         distance_sums=[[0.1 * (j - i) if j > i else 0.0 for j in range(size)] for i in range(size)])
    image = imread(plot_layer_distances([result], tmp_path / "d.png"))[..., :3]
    title = image[: image.shape[0] // 8]  # the figure's top eighth: the title, above the panel
    dark = (title < 0.5).any(-1)
    assert dark.any(), "no title drawn"
    assert not dark[:, :4].any() and not dark[:, -4:].any(), "the title runs off the figure"
