"""JREG inside Megatron-LM's training loop: the one place where megatron-jreg touches `megatron.training`.

The penalty itself needs no loop change: `JregPlugin` hooks every TransformerLayer (attached to the
wrapped model by a post-wrap hook of the model builder) and its term enters backward on the stage that
owns the layer. Two things cannot live inside the pipeline schedule, whose `forward_step` runs per
microbatch and only on some stages: where a step starts (the plugin's loss scale and microbatch count)
and the one collective that reduces Ψ over all ranks (inside `forward_step` it would deadlock under PP).
Megatron-LM has no step-begin/step-end callback, so `install()` wraps four module-level functions of
`megatron.training.training` that its `train()` looks up at call time:

- `train_step`: start the plugin's step before it, reduce Ψ after it on logging iterations;
- `training_log`: append Ψ/ζ/L_cos to Megatron-LM's own iteration line (its `lm loss` field unchanged),
  add them to its TensorBoard and W&B writers, write `--metrics-file`, draw the progress line, and name
  the iteration and the last good checkpoint when the rerun machine stops on NaN/Inf;
- `evaluate` / `evaluate_and_print_results`: record Ψ on the validation batches, and report it likewise.

Every wrapper calls Megatron-LM's function with the arguments it got; nothing else changes.
"""

from __future__ import annotations

import argparse
import time

from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
)

from megatron_jreg.plugin import JregConfig, JregPlugin, JregStats
from megatron_jreg.training.metrics import MetricsFile, Progress, console_suffix, jreg_fields, write_scalars


class JregLoop:
    """The plugin and the JREG telemetry across one `pretrain` call."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg = JregConfig(lam=args.jreg_lambda, alpha=args.jreg_alpha, distance=args.jreg_distance,
                              layers=args.jreg_layers)
        self.plugin: JregPlugin | None = None
        self.stats: JregStats | None = None  # Ψ of the last recorded training iteration
        self.val_stats: JregStats | None = None
        self.val_loss: float | None = None
        self.first_step = True
        self._lm_sum = 0.0
        self._lm_count = 0
        self._last_log = (time.time(), None)  # (time, iteration) of the previous logged line
        is_logging_rank = args.rank == args.world_size - 1  # Megatron-LM prints its log on the last rank
        self.metrics = MetricsFile(args.metrics_file, is_logging_rank)
        self.progress = Progress(args.progress if is_logging_rank else False, args.train_iters)
        self._originals: dict = {}

    # -- model builder hook --------------------------------------------------------------------------
    def attach(self, model_chunks: list) -> list:
        """Post-wrap hook of the model builder: JREG on this rank's (DDP-wrapped) chunks."""
        self.plugin = JregPlugin(model_chunks, self.cfg)
        return model_chunks

    # -- wrappers --------------------------------------------------------------------------------------
    def install(self) -> None:
        from megatron.training import training

        for name in ("train_step", "training_log", "evaluate", "evaluate_and_print_results"):
            self._originals[name] = getattr(training, name)
            setattr(training, name, getattr(self, name))

    def uninstall(self) -> None:
        from megatron.training import training

        for name, fn in self._originals.items():
            setattr(training, name, fn)
        self._originals.clear()
        self.metrics.close()
        if self.plugin is not None:
            self.plugin.remove_hooks()

    def _records(self, iteration: int) -> bool:
        """Megatron-LM prints iteration `iteration + 1` (1-based) when this is true."""
        return self.first_step or (iteration + 1) % self.args.log_interval == 0

    def train_step(self, *args, **kwargs):
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        iteration = kwargs.get("iteration")
        record = self._records(iteration if iteration is not None else 0)
        if self._last_log[1] is None:  # the run's first step: timings start here, not at setup
            self._last_log = (time.time(), iteration or 0)
        self.plugin.start_step(get_num_microbatches(), record=record)
        result = self._originals["train_step"](*args, **kwargs)
        self.stats = self.plugin.finish_step() if record else None
        should_exit, exit_code = result[3], result[4]
        if should_exit and exit_code in (EXIT_CODE_FAILED_ON_RESULT_VALIDATION, EXIT_CODE_RESUME_TO_DISAMBIGUATE):
            self._report_divergence((iteration or 0) + 1, exit_code)
        return result

    def _report_divergence(self, iteration: int, exit_code: int) -> None:
        """Megatron-LM's rerun machine stops on NaN/Inf: exit 16 after saving a checkpoint when the result
        reproduced on this device (resume, ideally on another node, to tell a fault from a divergence),
        exit 17 once it is confirmed. Say so in one line, with the checkpoint to resume from."""
        from megatron.training import print_rank_0
        from megatron.training.checkpointing import checkpoint_exists, get_checkpoint_tracker_filename

        last = "none (no checkpoint saved yet)"
        for root in (self.args.save, self.args.load):
            if root and checkpoint_exists(root):
                with open(get_checkpoint_tracker_filename(root)) as f:
                    last = f"{root} (iteration {f.read().strip()})"
                break
        if exit_code == EXIT_CODE_RESUME_TO_DISAMBIGUATE:
            advice = (f"exit {exit_code}: resume with --load (on another node if you suspect the hardware) to tell a "
                      "fault from a divergence")
        else:
            advice = f"exit {exit_code}: the divergence is confirmed; lower --lr (or check the data) and resume"
        print_rank_0(f"megatron-jreg train: NaN/Inf loss or gradient at iteration {iteration}; last good checkpoint: "
                     f"{last}; {advice}")

    def training_log(self, loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
        from megatron.training import training

        is_first = kwargs.get("is_first_iteration", False)
        logging_now = iteration % self.args.log_interval == 0 or is_first
        if not skipped_iter and "lm loss" in loss_dict:
            self._lm_sum = self._lm_sum + loss_dict["lm loss"].detach()
            self._lm_count += 1
        stats = self.stats if logging_now else None
        original_print = training.print_rank_last
        if stats is not None:
            training.print_rank_last = lambda message: original_print(message + console_suffix(stats))
        try:
            result = self._originals["training_log"](loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                                                     report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)
        finally:
            training.print_rank_last = original_print
        if logging_now:
            self._log_record(iteration, learning_rate, grad_norm, stats)
        self.first_step = False
        self.progress.update(iteration)
        return result

    def _log_record(self, iteration: int, lr, grad_norm, stats: JregStats | None) -> None:
        """One --metrics-file record; lm_loss and timings cover the iterations since the previous record."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training.training import num_floating_point_operations

        args = self.args
        now = time.time()
        prev_time, prev_iter = self._last_log
        iters = iteration - prev_iter
        seconds = (now - prev_time) / max(iters, 1)
        batch = args.micro_batch_size * args.data_parallel_size * get_num_microbatches()
        record = {
            "iteration": iteration, "consumed_samples": args.consumed_train_samples,
            "lm_loss": float(self._lm_sum / self._lm_count) if self._lm_count else None,
            "lr": lr, "grad_norm": grad_norm, "iteration_ms": 1000 * seconds,
            "tokens_per_sec": batch * args.seq_length / seconds if seconds > 0 else None,
            "tflops_per_rank": num_floating_point_operations(args, batch) / seconds / 1e12 / args.world_size
            if seconds > 0 else None,
        }
        if stats is not None:
            record.update(jreg_fields(stats))
            write_scalars(stats, iteration, "jreg")
        self.metrics.write(record)
        self._lm_sum, self._lm_count = 0.0, 0
        self._last_log = (now, iteration)

    def evaluate(self, forward_step_func, data_iterator, model, process_non_loss_data_func, config, *args, **kwargs):
        a = self.args
        eval_iters = kwargs.get("eval_iters")
        if eval_iters is None:
            eval_iters = args[3] if len(args) > 3 else a.eval_iters
        microbatches = a.eval_global_batch_size // (a.eval_micro_batch_size * a.data_parallel_size
                                                    * a.gtp_weight_remat_size)
        self.plugin.start_step(microbatches * eval_iters, record=True)
        result = self._originals["evaluate"](forward_step_func, data_iterator, model, process_non_loss_data_func,
                                             config, *args, **kwargs)
        self.val_stats = self.plugin.finish_step()
        losses = result[0] or {}
        self.val_loss = float(losses["lm loss"]) if "lm loss" in losses else None
        return result

    def evaluate_and_print_results(self, prefix, forward_step_func, data_iterator, model, iteration, *args, **kwargs):
        from megatron.training import print_rank_last

        self.val_stats = None
        result = self._originals["evaluate_and_print_results"](prefix, forward_step_func, data_iterator, model,
                                                               iteration, *args, **kwargs)
        stats = self.val_stats
        if stats is not None:
            split = "test" if "test set" in str(prefix) else "valid"
            print_rank_last(f" validation JREG at {prefix} |{console_suffix(stats)}")
            self.metrics.write({"iteration": iteration, "split": split, "val_loss": self.val_loss,
                                **jreg_fields(stats)})
            write_scalars(stats, iteration, "jreg-validation" if split == "valid" else "jreg-test")
        return result
