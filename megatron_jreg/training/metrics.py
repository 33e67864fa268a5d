"""Where JREG's numbers go besides Megatron-LM's console line: `--metrics-file`, TensorBoard, W&B, progress.

Megatron-LM's own writers are used (its TensorBoard writer on the last rank, its W&B run); this module
adds JREG's scalars to them, writes `--metrics-file` (one JSON object per record; fields below) and a
progress bar on terminals.

Training records, one per console line of Megatron-LM: iteration, consumed_samples, lm_loss and
iteration_ms (the console's own numbers: its `lm loss` window — which, after its extra line for the first
iteration, still starts at iteration 1 — and its `elapsed time per iteration`), jreg_loss (L_cos = Σ w_ℓ Ψ_ℓ
under the training distance, before λ), psi [Ψ_1..Ψ_L] (angular), zeta_L, zeta_L-1, zeta_L-2, lr,
grad_norm, tokens_per_sec, tflops_per_rank (from iteration_ms, as Megatron-LM's throughput). Ψ and ζ are
measured on the logged iteration's batch. Validation records, one per evaluation: iteration, split
("valid" | "test"), final (false for the evaluations every --eval-interval; true for the ones Megatron-LM
runs after training, "at iteration N on validation/test set", on further batches at the same iteration),
set (with --multiple-validation-sets: the set's name), val_loss, jreg_loss, psi, zeta_*.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

from tqdm import tqdm

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


class _MegatronRateBar(tqdm):
    """tqdm whose rate (and so its s/it and ETA) is Megatron-LM's elapsed time per iteration, once known."""

    seconds_per_iteration: float | None = None

    @property
    def format_dict(self) -> dict:
        values = super().format_dict
        if self.seconds_per_iteration:
            values["rate"] = 1.0 / self.seconds_per_iteration
        return values


class _AboveBar:
    """sys.stdout / sys.stderr while the bar is drawn: each complete line is written above the bar (the bar is
    cleared, the line written, the bar redrawn), so Megatron-LM's log lines and the bar never overwrite each
    other on a terminal; a line's start waits for its end. Everything else is the wrapped stream's."""

    def __init__(self, stream, bar: tqdm) -> None:  # noqa: ANN001 - a text stream
        self._stream, self._bar, self._pending = stream, bar, ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            self._bar.clear()
            self._stream.write(lines + "\n")
            self._stream.flush()
            self._bar.refresh()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def release(self):  # noqa: ANN201 - the wrapped stream, with any unfinished line written
        self._stream.write(self._pending)
        self._pending = ""
        return self._stream

    def __getattr__(self, name: str):  # noqa: ANN204 - fileno, isatty, encoding, ...
        return getattr(self._stream, name)


class Progress:
    """A progress bar on stderr: iterations done of --train-iters, with Megatron-LM's elapsed time per
    iteration (its last console line's) as the rate and the ETA from it.

    Default: on when stderr is a terminal and Megatron-LM does not print every iteration itself
    (--log-interval > 1). While it is drawn, stdout, stderr and the logging handlers that write to them
    (Megatron-LM's warnings) pass through it line by line (`_AboveBar`).
    """

    def __init__(self, enabled: bool | None, train_iters: int | None, log_interval: int = 1) -> None:
        default = sys.stderr.isatty() and log_interval > 1
        self.enabled = bool(default if enabled is None else enabled) and bool(train_iters)
        self.train_iters = train_iters or 0
        self._bar: _MegatronRateBar | None = None
        self._streams: tuple | None = None
        self._handlers: list[tuple[logging.StreamHandler, object]] = []

    def start(self, iteration: int) -> None:
        """At the run's first step (after setup; `iteration` > 0 on a resume)."""
        if not self.enabled or self._bar is not None:
            return
        self._streams = (sys.stdout, sys.stderr)
        self._bar = _MegatronRateBar(total=self.train_iters, initial=iteration, desc="train", unit="it",
                                     file=sys.stderr, dynamic_ncols=True, mininterval=0.5, leave=True)
        above = {id(s): _AboveBar(s, self._bar) for s in self._streams}
        sys.stdout, sys.stderr = above[id(self._streams[0])], above[id(self._streams[1])]
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for handler in {h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}:
            if isinstance(handler, logging.StreamHandler) and id(vars(handler).get("stream")) in above:
                self._handlers.append((handler, handler.setStream(above[id(handler.stream)])))

    def update(self, iteration: int, seconds_per_iteration: float | None = None) -> None:
        if self._bar is None:
            return
        if seconds_per_iteration:  # rounded as the console prints it ("(ms): 76.9"), so both show one rate
            self._bar.seconds_per_iteration = round(seconds_per_iteration * 1000, 1) / 1000 or seconds_per_iteration
        self._bar.update(iteration - self._bar.n)
        if iteration >= self.train_iters:
            self.close()

    def close(self) -> None:
        if self._bar is None:
            return
        self._bar.close()
        self._bar = None
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._handlers.clear()
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, _AboveBar):
                stream.release()
        sys.stdout, sys.stderr = self._streams
