"""JREG's events in Megatron-LM's loop, which has no step callbacks: `MegatronLoopAdapter` wraps four of its
functions and alone knows their arguments and return tuples; `JregLoop` handles the events (DEVELOPERS.md)."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
)

from megatron_jreg import patches
from megatron_jreg.errors import Interrupted, ignore_further_interrupts
from megatron_jreg.plugin import JregConfig, JregPlugin, JregStats
from megatron_jreg.training.metrics import Telemetry
from megatron_jreg.training.run_folder import RunFolder, resume_hint, tracked

TRAIN_STEP = "megatron.training.training.train_step"
TRAINING_LOG = "megatron.training.training.training_log"
EVALUATE = "megatron.training.training.evaluate"
EVALUATE_AND_PRINT = "megatron.training.training.evaluate_and_print_results"
PRINT_RANK_LAST = "megatron.training.training.print_rank_last"
TIMER_ELAPSED = "megatron.core.timers.Timer.elapsed"

# The tuples Megatron-LM returns, megatron/training/training.py at core_v0.19.0 (as in the 0.19.2 wheel): train_step's
# (lines 2336-2565; the names train() unpacks it into, 3847-3856) and evaluate's (4160-4339).
TRAIN_STEP_RESULT = ("loss_dict", "skipped_iter", "should_checkpoint", "should_exit", "exit_code", "grad_norm",
                     "num_zeros_in_grad", "max_attention_logit")
EVALUATE_RESULT = ("total_loss_dict", "collected_non_loss_data", "timelimit")


class JregLoop:
    """The plugin across one `pretrain` call, with the run's Ctrl-C and divergence line."""

    def __init__(self, args: argparse.Namespace, cfg: JregConfig, folder: RunFolder) -> None:
        self.args, self.cfg, self.folder = args, cfg, folder
        folder.record.loop_fields = lambda: self.telemetry.checkpoint_fields(self._iteration)
        self.plugin: JregPlugin | None = None
        self.stats: JregStats | None = None  # Ψ of the last recorded training iteration
        self.evaluations: list[tuple[JregStats, float | None]] = []  # (Ψ, lm loss) of each `evaluate` call
        self.first_step = True
        self.start: int | None = None  # the iteration this run's steps count from (set at its first step)
        self.telemetry = Telemetry(args)  # --metrics-file, TensorBoard/W&B, the progress bar (metrics.py)
        self._record = False  # this training step records Ψ
        self._interrupted = False  # Ctrl-C seen: stop at the end of the step (with several ranks: a logging step)
        self._zero_warned = False  # the all-zero hidden states warning was printed
        self._iteration = 0  # the last completed iteration
        self._nonfinite: tuple[int, int] | None = None  # (iteration, layer) of the first non-finite hidden states
        self._sigint = None
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            self._sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def attach(self, model_chunks: list) -> list:
        self.plugin = JregPlugin(model_chunks, self.cfg)
        return model_chunks

    def patch_makers(self) -> dict[str, Callable]:
        return MegatronLoopAdapter(self).makers()

    def close(self) -> None:
        if self._sigint is not None:
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # stopping for a Ctrl-C: ignored until exit
                signal.signal(signal.SIGINT, self._sigint)
            self._sigint = None
        self.telemetry.close()
        if self.plugin is not None:
            self.plugin.remove_hooks()

    def _on_sigint(self, signum: int, frame: object) -> None:
        """Ctrl-C: stop at the end of the step, all ranks alike (before training, or pressed again: at once)."""
        if os.getpid() != self._pid:  # a forked data worker (Ctrl-C reaches the whole process group): keep serving
            return  # batches until the step ends; the run's exit ends the workers
        if self.first_step or self._interrupted:
            ignore_further_interrupts()
            raise Interrupted(self._interrupted_line())
        self._interrupted = True
        when = "this iteration"
        if _ranks() > 1:  # the ranks agree on stopping where they log (no collective on the steps between)
            when = f"iteration {-(-(self._iteration + 1) // self.args.log_interval) * self.args.log_interval}"
        print(f"megatron-jreg train: Ctrl-C: stopping at the end of {when} (press again to stop at once)",
              file=sys.stderr, flush=True)

    def _stop_if_interrupted(self, agree: bool = True) -> None:
        """Interrupted on every rank if any saw Ctrl-C; the collective (a host sync) only where ranks log."""
        stop = self._interrupted
        if _ranks() > 1:
            if not agree:
                return
            flag = torch.tensor([int(stop)], device="cuda" if torch.cuda.is_available() else "cpu")
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            ignore_further_interrupts()
            raise Interrupted(self._interrupted_line())

    def _interrupted_line(self) -> str:
        where = (f"at iteration {self._iteration}" if not self.first_step
                 else f"before training started (iteration {self.start or 0})")
        return f"interrupted (Ctrl-C) {where}; {resume_hint(self.args)}"

    def on_train_step_start(self, iteration: int | None) -> None:
        # Megatron-LM prints iteration `iteration + 1` (1-based) then
        self._record = self.first_step or ((iteration or 0) + 1) % self.args.log_interval == 0
        if self.first_step:
            self.start = self._iteration = iteration or 0
            self.telemetry.begin(self.start, self.folder.record.base)
        self.plugin.start_step(get_num_microbatches(), record=self._record)

    def on_train_step_end(self, iteration: int | None, model: list, result: Mapping[str, Any]) -> None:
        done = (iteration or 0) + 1  # the iteration Megatron-LM prints (1-based)
        self.stats = self.plugin.finish_step() if self._record else None
        self._warn_zero_states(self.stats)
        if self._nonfinite is None and self.stats is not None and self.stats.first_nonfinite_layer is not None:
            self._nonfinite = (done, self.stats.first_nonfinite_layer)  # where NaN/Inf states began
        if result["should_exit"] and result["exit_code"] in (EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                                                             EXIT_CODE_RESUME_TO_DISAMBIGUATE):
            self._report_divergence(done, result["exit_code"])
            return
        self._iteration = done
        self.first_step = False
        self._stop_if_interrupted(agree=self._record)

    def _warn_zero_states(self, stats: JregStats | None) -> None:
        if stats is None or self._zero_warned or not stats.zero_layers:
            return
        from megatron.training import print_rank_last

        self._zero_warned = True
        print_rank_last(zero_state_warning(stats))

    def _report_divergence(self, iteration: int, exit_code: int) -> None:
        """One line for Megatron-LM's NaN/Inf stop (exit 16: resume to tell a fault from a divergence)."""
        from megatron.training import print_rank_0

        found = [(root, it) for root in (self.args.save, self.args.load) if (it := tracked(root)) is not None]
        last = f"{found[0][0]} (iteration {found[0][1]})" if found else "none (no checkpoint saved yet)"
        seen, advice = "", None
        if self._nonfinite is not None:  # the hidden states went first: where, and what that rules out
            began, layer = self._nonfinite
            fresh = began == (self.start or 0) + 1  # before any update of this run: not the learning rate
            seen = (f"; hidden states non-finite from iteration {began}, first at layer {layer}"
                    f"{' (before any update: not the learning rate)' if fresh else ''}")
            then = (", then rerun (no --save, so nothing to resume from)" if not self.args.save
                    else ", then start again" if fresh or not found else f", then resume with --load {found[0][0]}")
            if self.args.fp16:
                advice = (f"exit {exit_code}: the forward overflows float16 (--fp16 ends at 65,504), not a fault of "
                          f"the hardware: train with --bf16 (float32's range) or smaller activations (e.g. a smaller "
                          f"--init-method-std){then}")
            elif fresh:
                advice = f"exit {exit_code}: check the initialization (--init-method-std) and the data{then}"
        if advice is None and not self.args.save:
            advice = (f"exit {exit_code}: no --save, so nothing to resume from; rerun with --save (on another node if "
                      "you suspect the hardware), or lower --lr")
        elif advice is None and exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE:
            advice = (f"exit {exit_code}: resume with --load (on another node if you suspect the hardware) to tell a "
                      "fault from a divergence")
        elif advice is None:
            advice = f"exit {exit_code}: the divergence is confirmed; lower --lr (or check the data) and resume"
        print_rank_0(f"megatron-jreg train: NaN/Inf loss or gradient at iteration {iteration}{seen}; last good "
                     f"checkpoint: {last}; {advice}")

    def on_eval_start(self, eval_iters: int | None) -> None:
        a = self.args
        microbatches = a.eval_global_batch_size // (a.eval_micro_batch_size * a.data_parallel_size
                                                    * a.gtp_weight_remat_size)
        self.plugin.start_step(microbatches * (a.eval_iters if eval_iters is None else eval_iters), record=True)

    def on_eval_end(self, result: Mapping[str, Any]) -> None:
        stats = self.plugin.finish_step()
        self._warn_zero_states(stats)
        losses = result["total_loss_dict"] or {}
        self.evaluations.append((stats, float(losses["lm loss"]) if "lm loss" in losses else None))
        if not self.first_step:
            self._stop_if_interrupted()

    def on_eval_report_start(self, prefix: str, iteration: int) -> None:
        self.evaluations = []

    def on_eval_report_end(self, prefix: str, iteration: int) -> None:
        self.telemetry.evaluation_records(prefix, iteration, self.evaluations)
        self.evaluations = []


def _ranks() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def zero_state_warning(stats: JregStats) -> str:
    fraction = stats.zero_fraction
    where = ", ".join(f"{ell} ({'every token' if fraction[ell - 1] >= 1 else f'{100 * fraction[ell - 1]:.3g} %'})"
                      for ell in stats.zero_layers)
    return (f"megatron-jreg train: warning: hidden states that are the zero vector at layer(s) {where}: Ψ reads 0.5 "
            "there (the angle to a zero vector is undefined; it has no gradient) and ζ is not computed (nan); check "
            "the initialisation (--init-method-std) and the weights")


class MegatronLoopAdapter:
    """Megatron-LM's loop functions → `JregLoop`'s events: arguments read by name, results by the *_RESULT names."""

    def __init__(self, events: JregLoop) -> None:
        self.events = events

    def makers(self) -> dict[str, Callable]:
        return {TRAIN_STEP: self.train_step, TRAINING_LOG: self.training_log, EVALUATE: self.evaluate,
                EVALUATE_AND_PRINT: self.evaluate_and_print_results}

    def train_step(self, original: Callable) -> Callable:
        e = self.events
        return _around(original, lambda call: e.on_train_step_start(call["iteration"]),
                       lambda call, result: e.on_train_step_end(call["iteration"], call["model"],
                                                                _named(TRAIN_STEP, TRAIN_STEP_RESULT, result)))

    def training_log(self, original: Callable) -> Callable:
        events = self.events

        @functools.wraps(original)
        def training_log(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            from megatron.training import get_timers

            log = patches.arguments(original, args, kwargs)
            suffix = events.telemetry.on_log_start(log, events.stats)
            elapsed: list[float] = []

            def read_elapsed(read: Callable) -> Callable:  # the seconds training_log divides for its line
                return lambda *a, **k: elapsed.append(read(*a, **k)) or elapsed[-1]

            makers: dict[str, Callable] = {TIMER_ELAPSED: read_elapsed}
            if suffix is not None:
                makers[PRINT_RANK_LAST] = lambda print_: lambda message: print_(message + suffix)
            with patches.patched(makers, objects={TIMER_ELAPSED: get_timers()("interval-time")}):
                result = original(*args, **kwargs)
            events.telemetry.on_log(log, elapsed[0] if elapsed else None)
            return result

        return training_log

    def evaluate(self, original: Callable) -> Callable:
        e = self.events
        return _around(original, lambda call: e.on_eval_start(call["eval_iters"]),
                       lambda call, result: e.on_eval_end(_named(EVALUATE, EVALUATE_RESULT, result)))

    def evaluate_and_print_results(self, original: Callable) -> Callable:
        e = self.events
        return _around(original, lambda call: e.on_eval_report_start(call["prefix"], call["iteration"]),
                       lambda call, _: e.on_eval_report_end(call["prefix"], call["iteration"]))


def _around(original: Callable, before: Callable[[dict], None], after: Callable[[dict, Any], None]) -> Callable:

    @functools.wraps(original)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        call = patches.arguments(original, args, kwargs)
        before(call)
        result = original(*args, **kwargs)
        after(call, result)
        return result

    return wrapper


def _named(function: str, names: tuple[str, ...], result: tuple) -> dict[str, Any]:
    if len(result) != len(names):
        raise patches.PatchError(f"{function} returned {len(result)} values; megatron-jreg was written for "
                                 f"{len(names)} ({', '.join(names)}; {patches.WRITTEN_FOR})")
    return dict(zip(names, result, strict=True))


