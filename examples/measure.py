"""Held-out cross-entropy, Ψ_ℓ and ζ of checkpoints on the same tokens (the demo's and experiments/study's measure).

Every checkpoint of every run is measured on the same token windows, so two numbers from two runs always
differ by the model only:
- `core`: the first `core_windows` windows of the held-out articles, at every checkpoint (the series);
- `heldout`: every window of the held-out articles (~107K tokens), at the final checkpoint (the endpoints);
- `train`: `train_windows` windows spread over the training articles, at the final checkpoint (the
  train–held-out gap).
A window is seq_length + 1 consecutive tokens of the dataset's token stream (documents in order, each ending
in its EOD, as Megatron-LM's GPTDataset packs them): inputs and next-token targets. Cross-entropy is in nats
per target token over the true vocabulary; Ψ is the paper's angular Ψ recorded by `JregPlugin` (the code that
logs Ψ in training), on the same forward pass.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch


def token_windows(prefix: Path, seq_length: int, limit: int | None = None) -> torch.Tensor:
    """windows[n, seq_length + 1] int64 of a Megatron-LM indexed dataset; `limit` spreads n evenly over it."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    stream = np.concatenate([np.asarray(ds[i], dtype=np.int64) for i in range(len(ds))])
    n = (len(stream) - 1) // seq_length
    starts = np.arange(n) * seq_length
    if limit is not None and limit < n:
        starts = starts[np.linspace(0, n - 1, limit).round().astype(np.int64)]
    return torch.from_numpy(np.stack([stream[s : s + seq_length + 1] for s in starts]))


def summarize(ce_sum: float, tokens: int, psi: list[float]) -> dict:
    """The figures of one measurement: CE, Ψ_ℓ, ζ_L..ζ_{L-2} and Ψ_L over the median middle-layer Ψ."""
    from megatron_jreg.analysis.measure import ModelResult

    result = ModelResult(label="", path="", kind="megatron", model_class="", convention="layer_io", step=None,
                         sums=[p * tokens for p in psi], counts=[tokens] * len(psi), samples=0,
                         truncated_samples=0)
    mid = result.psi_mid_median
    return {"tokens": tokens, "ce": ce_sum / tokens, "psi": psi, **result.final_jumps,
            "psi_mid_median": mid, "psi_L_over_mid": psi[-1] / mid if mid else math.nan}


class Measurer:
    """One loaded checkpoint; `measure(windows)` → per-window CE sums and Ψ sums in one forward pass each."""

    def __init__(self, path: Path, batch_size: int = 32, iteration: int | None = None) -> None:
        from megatron_jreg.checkpoints import load_megatron_model

        self.loaded = load_megatron_model(path, iteration=iteration, load_tokenizer=False)
        self.batch_size = batch_size

    @torch.no_grad()
    def totals(self, windows: torch.Tensor) -> tuple[float, int, list[float]]:
        """(Σ CE, target tokens, Ψ_ℓ) over windows[n, t + 1]; Ψ is a mean over every input token."""
        from megatron_jreg.plugin import JregConfig, JregPlugin

        plugin = JregPlugin([self.loaded.model], JregConfig(lam=0.0, distance="angular"))
        ce_sum, tokens = 0.0, 0
        psi_sum = torch.zeros(self.loaded.num_layers, dtype=torch.float64)
        try:
            for batch in windows.split(self.batch_size):
                plugin.start_step(1, record=True)
                logits = self.loaded.logits(batch[:, :-1])
                stats = plugin.finish_step()
                targets = batch[:, 1:].reshape(-1)
                ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets,
                                                       reduction="sum")
                ce_sum += float(ce)
                tokens += targets.numel()
                psi_sum += torch.tensor(stats.psi, dtype=torch.float64) * targets.numel()
        finally:
            plugin.remove_hooks()
        if not math.isfinite(ce_sum):
            raise ValueError(f"{self.loaded.path}: non-finite held-out cross-entropy")
        return ce_sum, tokens, (psi_sum / tokens).tolist()

    def measure(self, windows: torch.Tensor) -> dict:
        return summarize(*self.totals(windows))


def measure_series(checkpoints: list[Path], core: torch.Tensor, heldout: torch.Tensor,
                   train: torch.Tensor) -> list[dict]:
    """[{iteration, core, (final only) heldout, train}] in step order; the last checkpoint is the final model.

    `core` must be the first rows of `heldout` (its windows are reused for the final `heldout` figure).
    """
    out = []
    for i, path in enumerate(checkpoints):
        m = Measurer(path)
        rec: dict = {"iteration": m.loaded.iteration}
        core_totals = m.totals(core)
        rec["core"] = summarize(*core_totals)
        if i == len(checkpoints) - 1:
            rest = m.totals(heldout[len(core):]) if len(heldout) > len(core) else (0.0, 0, [0.0] * len(core_totals[2]))
            tokens = core_totals[1] + rest[1]
            psi = [(a * core_totals[1] + b * rest[1]) / tokens for a, b in zip(core_totals[2], rest[2])]
            rec["heldout"] = summarize(core_totals[0] + rest[0], tokens, psi)
            rec["train"] = m.measure(train)
        out.append(rec)
        del m
    return out
