"""Where JREG's numbers go besides Megatron-LM's console line: `--metrics-file`, TensorBoard, W&B, progress.

Megatron-LM's own writers are used (its TensorBoard writer on the last rank, its W&B run); this module
adds JREG's scalars to them, writes `--metrics-file` (one JSON object per record; fields below) and a
progress line on terminals.

Training records: iteration, consumed_samples, lm_loss (mean over the iterations since the previous record;
Megatron-LM's console also folds its extra first-iteration line into the next one), jreg_loss
(L_cos = Σ w_ℓ Ψ_ℓ under the training distance, before λ), psi [Ψ_1..Ψ_L] (angular), zeta_L, zeta_L-1,
zeta_L-2, lr, grad_norm, iteration_ms, tokens_per_sec, tflops_per_rank. Validation records: iteration,
split, val_loss, jreg_loss, psi, zeta_*. Ψ and ζ are measured on the logged iteration's batch.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from megatron_jreg.plugin import JregStats


def jreg_fields(stats: JregStats) -> dict:
    return {"jreg_loss": stats.jreg_loss, "psi": stats.psi, **stats.zeta}


def console_suffix(stats: JregStats) -> str:
    """What megatron-jreg appends to Megatron-LM's iteration line (its fields stay as they are)."""
    parts = [f" jreg loss: {stats.jreg_loss:.6E} |"]
    parts += [f" {key}: {value:.3f} |" for key, value in stats.zeta.items()]
    parts.append(" psi: " + ",".join(f"{p:.4f}" for p in stats.psi) + " |")
    return "".join(parts)


def write_scalars(stats: JregStats, step: int, prefix: str) -> None:
    """JREG scalars into Megatron-LM's TensorBoard writer (Ψ per layer and a Ψ histogram) and W&B run."""
    from megatron.training import get_tensorboard_writer, get_wandb_writer

    scalars = {f"{prefix}/jreg_loss": stats.jreg_loss, **{f"{prefix}/{k}": v for k, v in stats.zeta.items()}}
    scalars.update({f"{prefix}/psi_layer_{ell:03d}": p for ell, p in enumerate(stats.psi, 1)})
    writer = get_tensorboard_writer()
    if writer is not None:
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
        total = sum(stats.psi)
        if total > 0:
            psi = stats.psi
            writer.add_histogram_raw(
                f"{prefix}/psi_per_layer", min=1, max=len(psi), num=len(psi),
                sum=float(sum(ell * p for ell, p in enumerate(psi, 1))),
                sum_squares=float(sum(ell * ell * p for ell, p in enumerate(psi, 1))),
                bucket_limits=[ell + 0.5 for ell in range(1, len(psi) + 1)], bucket_counts=[float(p) for p in psi],
                global_step=step,
            )
    wandb_writer = get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.log(scalars, step)


class MetricsFile:
    """`--metrics-file`: appended JSON lines, written by one rank (the one that prints Megatron-LM's log)."""

    def __init__(self, path: str | None, active: bool) -> None:
        self._file = None
        if path and active:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict) -> None:
        if self._file is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self._file.write(json.dumps(clean) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Progress:
    """A progress line (iteration, rate, ETA) on stderr when it is a terminal, redrawn every iteration."""

    def __init__(self, enabled: bool | None, train_iters: int | None, start_iteration: int = 0) -> None:
        self.enabled = bool(sys.stderr.isatty() if enabled is None else enabled) and bool(train_iters)
        self.train_iters = train_iters or 0
        self.start_iteration = start_iteration
        self.start = time.time()

    def update(self, iteration: int) -> None:
        if not self.enabled:
            return
        done = iteration - self.start_iteration
        elapsed = time.time() - self.start
        left = max(self.train_iters - iteration, 0)
        eta = elapsed / max(done, 1) * left
        frac = iteration / max(self.train_iters, 1)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r[{bar:<30}] {iteration}/{self.train_iters} ({100 * frac:.0f}%) "
                         f"{elapsed / max(done, 1):.2f} s/it, ETA {eta:,.0f} s\033[K")
        if left == 0:
            sys.stderr.write("\n")
        sys.stderr.flush()
