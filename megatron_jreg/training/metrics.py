"""Training logs: console lines (Megatron-LM style), a progress line on terminals, TensorBoard scalars and
a Ψ histogram, optional Weights & Biases, and `--metrics-file` (one JSON object per record).

Record fields: iteration, lm_loss, jreg_loss (L_cos before λ), psi (layers 1..L), zeta_L, zeta_L-1,
zeta_L-2, lr, grad_norm, tokens_per_sec, tflops_per_rank; validation records have val_loss (and psi).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from megatron_jreg.config import LoggingConfig, ModelConfig


def flops_per_iteration(model: ModelConfig, vocab_size: int, global_batch: int, recompute_full: bool) -> float:
    """Model FLOPs of one training iteration (forward + backward, ×4/3 with full recompute).

    Per token and layer, forward: 2·h·(h + 2·h_kv) for QKV, 2·h·h for the output projection, 2·s·h
    for QKᵀ and attention·V each (causal, half of 4·s·h), 2·3·h·f for SwiGLU (2·2·h·f for GELU);
    plus 2·h·V for the logits. Backward is twice the forward.
    """
    h, s, f, L = model.hidden_size, model.seq_length, model.ffn_hidden_size, model.num_layers
    heads = model.num_attention_heads
    kv = h * (model.num_query_groups or heads) // heads
    per_layer = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * s * h + (6 if model.swiglu else 4) * h * f
    forward = global_batch * s * (L * per_layer + 2 * h * vocab_size)
    return forward * (4 if recompute_full else 3)


class MetricsLogger:
    """Writes the records of rank 0; every other rank gets a logger that does nothing."""

    def __init__(self, cfg: LoggingConfig, train_iters: int, active: bool, run_config: dict | None = None) -> None:
        self.cfg = cfg
        self.train_iters = train_iters
        self.active = active
        self.progress = active and (cfg.progress if cfg.progress is not None else sys.stdout.isatty())
        self.start = time.time()
        self._tb = None
        self._wandb = None
        self._file = None
        if not active:
            return
        if cfg.metrics_file:
            Path(cfg.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(cfg.metrics_file, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(cfg.tensorboard_dir)
        if cfg.wandb_project:
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name, dir=cfg.wandb_save_dir,
                                     config=run_config)

    def info(self, message: str) -> None:
        if self.active:
            self._clear_progress()
            print(message, flush=True)

    def train(self, record: dict) -> None:
        if not self.active:
            return
        it = record["iteration"]
        parts = [f" iteration {it:8d}/{self.train_iters:8d}"]
        for key, label, fmt in (
            ("consumed_samples", "consumed samples", "{:12d}"),
            ("iteration_ms", "elapsed time per iteration (ms)", "{:.1f}"),
            ("lr", "learning rate", "{:.6E}"),
            ("lm_loss", "lm loss", "{:.6E}"),
            ("jreg_loss", "jreg loss", "{:.6E}"),
            ("zeta_L", "zeta_L", "{:.3f}"),
            ("zeta_L-1", "zeta_L-1", "{:.3f}"),
            ("zeta_L-2", "zeta_L-2", "{:.3f}"),
            ("grad_norm", "grad norm", "{:.3f}"),
            ("tokens_per_sec", "tokens/s", "{:.0f}"),
            ("tflops_per_rank", "TFLOP/s/rank", "{:.2f}"),
        ):
            value = record.get(key)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                parts.append(f"{label}: {fmt.format(value)}")
        self.info(" | ".join(parts))
        self._write(record)
        if self._tb is not None:
            for key in ("lm_loss", "jreg_loss", "zeta_L", "zeta_L-1", "zeta_L-2", "lr", "grad_norm",
                        "tokens_per_sec", "tflops_per_rank"):
                if record.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", record[key], it)
            if record.get("psi"):
                self._psi_histogram(record["psi"], it)
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in record.items() if isinstance(v, (int, float))}, step=it)

    def _psi_histogram(self, psi: list[float], step: int) -> None:
        """Ψ per layer in TensorBoard: a scalar per layer, and a histogram whose bucket ℓ holds Ψ_ℓ."""
        for ell, value in enumerate(psi, 1):
            self._tb.add_scalar(f"psi/layer_{ell:03d}", value, step)
        total = sum(psi)
        if total <= 0:
            return
        self._tb.add_histogram_raw(
            "psi/per_layer", min=1, max=len(psi), num=len(psi),
            sum=float(sum(ell * p for ell, p in enumerate(psi, 1))),
            sum_squares=float(sum(ell * ell * p for ell, p in enumerate(psi, 1))),
            bucket_limits=[ell + 0.5 for ell in range(1, len(psi) + 1)], bucket_counts=[float(p) for p in psi],
            global_step=step,
        )

    def validation(self, record: dict) -> None:
        if not self.active:
            return
        it = record["iteration"]
        ppl = math.exp(min(record["val_loss"], 20.0))
        extra = "".join(f" | {k}: {record[k]:.3f}" for k in ("zeta_L", "zeta_L-1", "zeta_L-2")
                        if k in record and not math.isnan(record[k]))
        self.info(f" validation at iteration {it} | lm loss: {record['val_loss']:.6E} | lm loss PPL: {ppl:.3f}{extra}")
        self._write(record)
        if self._tb is not None:
            self._tb.add_scalar("validation/lm_loss", record["val_loss"], it)
        if self._wandb is not None:
            self._wandb.log({"validation/lm_loss": record["val_loss"]}, step=it)

    def step(self, iteration: int) -> None:
        """The terminal progress line (rate and ETA), redrawn every iteration."""
        if not self.progress:
            return
        elapsed = time.time() - self.start
        done = iteration / max(self.train_iters, 1)
        eta = elapsed / max(done, 1e-9) * (1 - done)
        bar = "#" * int(30 * done)
        sys.stdout.write(f"\r[{bar:<30}] {iteration}/{self.train_iters} ({100 * done:.0f}%) ETA {eta:6.0f}s")
        sys.stdout.flush()
        self._drawn = True

    def _clear_progress(self) -> None:
        if getattr(self, "_drawn", False):
            sys.stdout.write("\r\033[K")
            self._drawn = False

    def _write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._clear_progress()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
