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
  add them to its TensorBoard and W&B writers, write `--metrics-file` with the line's own loss window and
  elapsed time (read from Megatron-LM's accumulators and its `interval-time` timer as the line is made),
  advance the progress bar, and name the iteration and the last good checkpoint when the rerun machine
  stops on NaN/Inf;
- `evaluate` / `evaluate_and_print_results`: record Ψ on the validation batches, and report it likewise,
  one record per evaluation.

Every wrapper calls Megatron-LM's function with the arguments it got; nothing else changes.
"""

from __future__ import annotations

import argparse

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
        self.cfg = JregConfig.from_args(args)
        self.plugin: JregPlugin | None = None
        self.stats: JregStats | None = None  # Ψ of the last recorded training iteration
        self.evaluations: list[tuple[JregStats, float | None]] = []  # (Ψ, lm loss) of each `evaluate` call
        self.first_step = True
        is_logging_rank = args.rank == args.world_size - 1  # Megatron-LM prints its log on the last rank
        self.metrics = MetricsFile(args.metrics_file, is_logging_rank)
        self.progress = Progress(args.progress if is_logging_rank else False, args.train_iters, args.log_interval)
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
        self.progress.close()
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
        if self.first_step:
            self.progress.start(iteration or 0)
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
        from megatron.training import get_timers, training

        is_first = kwargs.get("is_first_iteration", False)
        logging_now = iteration % self.args.log_interval == 0 or is_first
        stats = self.stats if logging_now else None
        lm_loss = _console_lm_loss(loss_dict, total_loss_dict, skipped_iter) if logging_now else None
        iterations = total_loss_dict.get(_ADVANCED, 0) + total_loss_dict.get(_SKIPPED, 0) + 1  # in its window
        original_print = training.print_rank_last
        if stats is not None:
            training.print_rank_last = lambda message: original_print(message + console_suffix(stats))
        timer, elapsed = get_timers()("interval-time"), []
        if logging_now:  # the seconds Megatron-LM divides by the window's iterations for its console line
            read = timer.elapsed
            timer.elapsed = lambda *a, **k: elapsed.append(read(*a, **k)) or elapsed[-1]
        try:
            result = self._originals["training_log"](loss_dict, total_loss_dict, learning_rate, iteration, loss_scale,
                                                     report_memory_flag, skipped_iter, grad_norm, *args, **kwargs)
        finally:
            training.print_rank_last = original_print
            vars(timer).pop("elapsed", None)
        seconds = elapsed[0] / iterations if elapsed else None
        if logging_now:
            self._log_record(iteration, learning_rate, grad_norm, stats, lm_loss, seconds, kwargs)
        self.first_step = False
        self.progress.update(iteration, seconds)
        return result

    def _log_record(self, iteration: int, lr, grad_norm, stats: JregStats | None, lm_loss: float | None,
                    seconds: float | None, log_kwargs: dict) -> None:
        """One --metrics-file record per console line, with the line's loss window and elapsed time; tokens/s
        and TFLOP/s follow from that time as Megatron-LM's throughput does."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training.training import num_floating_point_operations

        args = self.args
        batch = (args.micro_batch_size * args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1)
                 * get_num_microbatches())
        flops = num_floating_point_operations(
            args, batch, seqlen_squared_sum_in_batch=log_kwargs.get("seqlen_squared_sum_in_batch"),
            total_real_tokens_in_batch=log_kwargs.get("total_real_tokens_in_batch"))
        timed = seconds is not None and seconds > 0
        record = {
            "iteration": iteration, "consumed_samples": args.consumed_train_samples, "lm_loss": lm_loss,
            "lr": lr, "grad_norm": grad_norm, "iteration_ms": 1000 * seconds if seconds is not None else None,
            "tokens_per_sec": batch * args.seq_length / seconds if timed else None,
            "tflops_per_rank": flops / seconds / 1e12 / args.world_size if timed else None,
        }
        if stats is not None:
            record.update(jreg_fields(stats))
            write_scalars(stats, iteration, "jreg")
        self.metrics.write(record)

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
        stats = self.plugin.finish_step()
        losses = result[0] or {}
        self.evaluations.append((stats, float(losses["lm loss"]) if "lm loss" in losses else None))
        return result

    def evaluate_and_print_results(self, prefix, forward_step_func, data_iterator, model, iteration, *args, **kwargs):
        """One record per evaluation: Megatron-LM evaluates every --eval-interval (`prefix` "iteration N") and once
        more after training on further batches at the same iteration ("iteration N on validation set" / "on test
        set": `final`), each validation set in turn with --multiple-validation-sets."""
        from megatron.training import print_rank_last

        self.evaluations = []
        result = self._originals["evaluate_and_print_results"](prefix, forward_step_func, data_iterator, model,
                                                               iteration, *args, **kwargs)
        split = "test" if "on test set" in str(prefix) else "valid"
        final = "on validation set" in str(prefix) or split == "test"
        several = getattr(self.args, "multiple_validation_sets", False)
        names = getattr(self.args, "validation_set_names", None) or [str(i) for i in range(len(self.evaluations))]
        for index, (stats, val_loss) in enumerate(self.evaluations):
            name = names[index] if several else None
            print_rank_last(f" validation{f'-{name}' if name else ''} JREG at {prefix} |{console_suffix(stats)}")
            self.metrics.write({"iteration": iteration, "split": split, "final": final,
                                **({"set": name} if name else {}), "val_loss": val_loss, **jreg_fields(stats)})
            # W&B keeps one value per key and step: the post-training validation gets keys of its own
            group = "jreg-test" if split == "test" else "jreg-validation-final" if final else "jreg-validation"
            write_scalars(stats, iteration, f"{group}-{name}" if name else group)
        self.evaluations = []
        return result


_ADVANCED, _SKIPPED = "advanced iterations", "skipped iterations"  # Megatron-LM's training_log counters


def _console_lm_loss(loss_dict: dict, total_loss_dict: dict, skipped: int) -> float | None:
    """The `lm loss` Megatron-LM's training_log is about to print: its window's sum (its accumulator plus this
    iteration, unless skipped) over the window's advanced iterations, read before it resets them."""
    if "lm loss" not in loss_dict and "lm loss" not in total_loss_dict:
        return None
    total = total_loss_dict.get("lm loss", 0.0)
    if not skipped:
        total = total + loss_dict["lm loss"]
    return float(total) / max(1, total_loss_dict.get(_ADVANCED, 0) + (0 if skipped else 1))
