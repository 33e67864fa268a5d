"""Where JREG's numbers go besides Megatron-LM's console line: --metrics-file, TensorBoard, W&B, the progress bar;
the file equals an uninterrupted run's across resumes (fields: docs/training.md; design: DEVELOPERS.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from megatron_jreg.fileio import atomic_write

if TYPE_CHECKING:
    from megatron_jreg.plugin import JregStats


def jreg_fields(stats: JregStats) -> dict:
    fields = {"jreg_loss": stats.jreg_loss, "psi": stats.psi, **stats.zeta}
    if stats.first_nonfinite_layer is not None:  # where NaN/Inf hidden states start (Ψ, ζ are NaN from there)
        fields["first_nonfinite_layer"] = stats.first_nonfinite_layer
    return fields


def console_suffix(stats: JregStats) -> str:
    parts = [f" jreg loss: {stats.jreg_loss:.6E} |"]
    parts += [f" {key}: {value:.3f} |" for key, value in stats.zeta.items()]
    parts.append(" psi: " + ",".join(f"{p:.4f}" for p in stats.psi) + " |")
    if stats.first_nonfinite_layer is not None:
        parts.append(f" first non-finite layer: {stats.first_nonfinite_layer} |")
    return "".join(parts)


def write_scalars(stats: JregStats, step: int, prefix: str) -> None:
    from megatron.training import get_tensorboard_writer, get_wandb_writer

    scalars = {f"{prefix}/jreg_loss": stats.jreg_loss, **{f"{prefix}/{k}": v for k, v in stats.zeta.items()}}
    scalars.update({f"{prefix}/psi_layer_{ell:03d}": p for ell, p in enumerate(stats.psi, 1)})
    writer = get_tensorboard_writer()
    if writer is not None:
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
        psi = stats.psi
        if sum(psi) > 0:
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


class LossWindow:
    """Megatron-LM's `lm loss` sum over one --metrics-file window, kept as a tensor (no host sync per step)."""

    def __init__(self, loss=None, advanced: int = 0, skipped: int = 0) -> None:  # noqa: ANN001 - a tensor
        self.loss, self.advanced, self.skipped = loss, advanced, skipped

    def add(self, loss, skipped: bool) -> None:  # noqa: ANN001 - the iteration's reduced loss tensor, or None
        if skipped:
            self.skipped += 1
        elif loss is not None:
            import torch

            start = self.loss if self.loss is not None else torch.zeros(1, dtype=torch.float, device=loss.device)
            self.loss = start + loss
            self.advanced += 1

    def mean(self) -> float | None:
        return float(self.loss) / self.advanced if self.advanced else None

    def state(self) -> dict:
        """JSON for a checkpoint (the exact float32 value: the resumed sum is the same bits)."""
        return {"lm_loss_sum": float(self.loss) if self.loss is not None else None, "advanced": self.advanced,
                "skipped": self.skipped}

    @classmethod
    def restore(cls, state: dict) -> LossWindow:
        import torch

        value, device = state.get("lm_loss_sum"), "cuda" if torch.cuda.is_available() else "cpu"
        loss = torch.tensor([value], dtype=torch.float, device=device) if value is not None else None
        return cls(loss, int(state.get("advanced", 0)), int(state.get("skipped", 0)))


class MetricsFile:
    """`--metrics-file`: JSON lines, written by one rank (the one that prints Megatron-LM's log)."""

    def __init__(self, path: str | None, active: bool) -> None:
        self.path = Path(path) if path and active else None
        self._file = None
        self.opened = self.path is None

    def open(self, start: int) -> None:
        """Rows after `start` (work past the checkpoint resumed from, about to be redone) move to PATH.replaced."""
        self.opened = True
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():  # bytes: a line that is not UTF-8 (a damaged or foreign row) is kept as it is
            lines = self.path.read_bytes().splitlines(keepends=True)
            later = [line for line in lines if _iteration(line) > start]
            if later:
                with open(f"{self.path}.replaced", "ab") as f:
                    f.writelines(later)
                with atomic_write(self.path, "wb") as f:
                    f.writelines(line for line in lines if _iteration(line) <= start)
                print(f"megatron-jreg: --metrics-file {self.path}: {len(later)} row(s) after iteration {start} (not "
                      f"in the checkpoint this run starts from) moved to {self.path}.replaced", flush=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict) -> None:
        if self._file is not None:
            clean = {k: _finite(v) for k, v in record.items()}
            nonfinite = [k for k, v in record.items() if clean[k] != v]
            if nonfinite:  # JSON has no NaN/Inf: null, and the keys named (a skipped window's null is not one)
                clean["nonfinite"] = nonfinite
            self._file.write(json.dumps(clean) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _iteration(line: bytes) -> int:
    """A row's iteration (-1 for a line that is not a record: kept)."""
    try:
        value = json.loads(line).get("iteration")
    except (ValueError, AttributeError):  # UnicodeDecodeError is a ValueError
        return -1
    return value if isinstance(value, int) else -1


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
    """sys.stdout / sys.stderr while the bar is drawn: each complete line goes above the bar."""

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

    def release(self) -> None:
        self._stream.write(self._pending)
        self._pending = ""

    def __getattr__(self, name: str):  # noqa: ANN204 - fileno, isatty, encoding, ...
        return getattr(self._stream, name)


class Progress:
    """A progress bar on stderr at Megatron-LM's own rate (default: stderr a terminal and --log-interval > 1)."""

    def __init__(self, enabled: bool | None, train_iters: int | None, log_interval: int = 1) -> None:
        default = sys.stderr.isatty() and log_interval > 1
        self.enabled = bool(default if enabled is None else enabled) and bool(train_iters)
        self.train_iters = train_iters or 0
        self._bar: _MegatronRateBar | None = None
        self._restore = contextlib.ExitStack()  # the streams and logging handlers as they were

    def start(self, iteration: int) -> None:
        if not self.enabled or self._bar is not None:
            return
        self._bar = _MegatronRateBar(total=self.train_iters, initial=iteration, desc="train", unit="it",
                                     file=sys.stderr, dynamic_ncols=True, mininterval=0.5, leave=True)
        above = {id(s): _AboveBar(s, self._bar) for s in (sys.stdout, sys.stderr)}
        for stream in above.values():
            self._restore.callback(stream.release)
        self._restore.enter_context(contextlib.redirect_stdout(above[id(sys.stdout)]))
        self._restore.enter_context(contextlib.redirect_stderr(above[id(sys.stderr)]))
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for handler in {h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}:
            if isinstance(handler, logging.StreamHandler) and id(vars(handler).get("stream")) in above:
                self._restore.callback(handler.setStream, handler.setStream(above[id(handler.stream)]))

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
        self._restore.close()


_ADVANCED, _SKIPPED = "advanced iterations", "skipped iterations"  # Megatron-LM's training_log counters


class Telemetry:
    """One run's --metrics-file, TensorBoard/W&B scalars and progress bar, fed by JregLoop's events."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        is_logging_rank = args.rank == args.world_size - 1  # Megatron-LM prints its log on the last rank
        self.metrics = MetricsFile(args.metrics_file, is_logging_rank)
        self.window = LossWindow()  # --metrics-file's lm loss since its last row
        self.progress = Progress(args.progress if is_logging_rank else False, args.train_iters, args.log_interval)
        self.start = 0  # the iteration this run's steps count from
        self._line: dict = {}  # what on_log_start read for the line training_log is making

    def begin(self, start: int, sidecar: dict) -> None:
        self.start = start
        self.progress.start(start)
        saved = sidecar.get("metrics_window") or {}
        if start and saved.get("iteration") == start:  # the window the checkpoint was saved in
            self.window = LossWindow.restore(saved)

    def checkpoint_fields(self, iteration: int) -> dict:
        """--metrics-file's open window, kept in each checkpoint so a run resumed from it writes the same rows."""
        return {"metrics_window": {"iteration": iteration, **self.window.state()}}

    def on_log_start(self, log: Mapping[str, Any], stats: JregStats | None) -> str | None:
        """Before Megatron-LM's training_log (which resets the window's count): its console line's suffix, if any."""
        iteration, total = log["iteration"], log["total_loss_dict"]
        self.window.add(log["loss_dict"].get("lm loss"), bool(log["skipped_iter"]))
        on_grid = iteration % self.args.log_interval == 0
        logging_now = on_grid or log["is_first_iteration"]  # Megatron-LM prints a line then
        stats = stats if logging_now else None
        self._line = {
            "logging_now": logging_now, "stats": stats,
            # --metrics-file: one row per --log-interval iterations (and a fresh run's first), whatever the resumes
            "row": on_grid or (log["is_first_iteration"] and not self.start), "on_grid": on_grid,
            "iterations": total.get(_ADVANCED, 0) + total.get(_SKIPPED, 0) + 1,  # in its window
        }
        return console_suffix(stats) if stats is not None else None

    def on_log(self, log: Mapping[str, Any], window_seconds: float | None) -> None:
        """After Megatron-LM's training_log; `window_seconds`: its line's `interval-time`."""
        line, iteration = self._line, log["iteration"]
        seconds = window_seconds / line["iterations"] if window_seconds is not None and line["logging_now"] else None
        if line["row"]:
            self._log_record(log, line["stats"], seconds)
            if line["on_grid"]:
                self.window = LossWindow()
        self.progress.update(iteration, seconds)

    def _log_record(self, log: Mapping[str, Any], stats: JregStats | None, seconds: float | None) -> None:
        """One --metrics-file record, its time and throughput the console line's, as Megatron-LM computes them."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training.training import num_floating_point_operations

        args = self.args
        batch = (args.micro_batch_size * args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1)
                 * get_num_microbatches())
        flops = num_floating_point_operations(
            args, batch, seqlen_squared_sum_in_batch=log.get("seqlen_squared_sum_in_batch"),
            total_real_tokens_in_batch=log.get("total_real_tokens_in_batch"))
        timed, iteration = seconds is not None and seconds > 0, log["iteration"]
        record = {
            "iteration": iteration, "consumed_samples": args.consumed_train_samples, "lm_loss": self.window.mean(),
            "lr": log["learning_rate"], "grad_norm": log["grad_norm"],
            "iteration_ms": 1000 * seconds if seconds is not None else None,
            "tokens_per_sec": batch * args.seq_length / seconds if timed else None,
            "tflops_per_rank": flops / seconds / 1e12 / args.world_size if timed else None,
        }
        if self.window.skipped:
            record["skipped_iterations"] = self.window.skipped
        if stats is not None:
            record.update(jreg_fields(stats))
            write_scalars(stats, iteration, "jreg")
        self._write(record)

    def _write(self, record: dict) -> None:
        if not self.metrics.opened:
            self.metrics.open(getattr(self.args, "iteration", 0) or 0)
        self.metrics.write(record)

    def evaluation_records(self, prefix: str, iteration: int,
                           evaluations: list[tuple[JregStats, float | None]]) -> None:
        """One record per evaluation and validation set; the one after training is `final`."""
        from megatron.training import print_rank_last

        split = "test" if "on test set" in str(prefix) else "valid"
        final = "on validation set" in str(prefix) or split == "test"
        several = getattr(self.args, "multiple_validation_sets", False)
        names = getattr(self.args, "validation_set_names", None) or [str(i) for i in range(len(evaluations))]
        for index, (stats, val_loss) in enumerate(evaluations):
            name = names[index] if several else None
            print_rank_last(f" validation{f'-{name}' if name else ''} JREG at {prefix} |{console_suffix(stats)}")
            self._write({"iteration": iteration, "split": split, "final": final,
                         **({"set": name} if name else {}), "val_loss": val_loss, **jreg_fields(stats)})
            # W&B keeps one value per key and step: the post-training validation gets keys of its own
            group = "jreg-test" if split == "test" else "jreg-validation-final" if final else "jreg-validation"
            write_scalars(stats, iteration, f"{group}-{name}" if name else group)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
