"""The pretraining loop on megatron-core: model, DDP, optimizer, LR schedule, JREG, data, checkpoints, logs.

All pieces are megatron-core's own (GPTModel, DistributedDataParallel, get_megatron_optimizer,
OptimizerParamScheduler, the forward-backward schedules, dist_checkpointing); this module wires them.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron_jreg.compat import device
from megatron_jreg.config import ConfigError, TrainConfig
from megatron_jreg.plugin import JregPlugin
from megatron_jreg.training import checkpoint as ckpt
from megatron_jreg.training.data import BatchLoader, build_datasets, check_vocabulary, tokenizer_for
from megatron_jreg.training.distributed import init_model_parallel, init_process_group, world_from_env
from megatron_jreg.training.metrics import MetricsLogger, flops_per_iteration
from megatron_jreg.training.model import build_model_chunks, resolve_transformer_impl, transformer_config
from megatron_jreg.training.sharding import init_layout_independent


class TrainingDiverged(RuntimeError):
    """NaN/inf in the loss or the gradients."""


def lm_loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Megatron's 3-tuple loss: (sum over real label tokens, token count, reporting [sum, count])."""
    mask = loss_mask.float()
    total = (output.float() * mask).sum()
    count = mask.sum()
    return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count.detach()])}


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.stop_requested = False
        self.last_checkpoint: Path | None = None

    # -- setup ---------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        _, world, _ = world_from_env()
        cfg.validate(world)  # everything checkable from flags alone, before any work
        self.transformer_impl = resolve_transformer_impl(cfg.precision)
        self.tokenizer, ds_tokenizer = tokenizer_for(cfg)
        cfg.model.vocab_size = ds_tokenizer.vocab_size
        if not cfg.data.mock_data:
            check_vocabulary(cfg, ds_tokenizer.vocab_size)
        self.ds_tokenizer = ds_tokenizer

        self.rank, self.world = init_process_group()
        init_model_parallel(cfg.model, cfg.parallel, cfg.seed)
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.num_microbatches = cfg.optim.microbatches(self.dp_size)
        self.global_batch = self.num_microbatches * cfg.optim.micro_batch_size * self.dp_size
        self.log = MetricsLogger(cfg.logging, cfg.optim.train_iters, self.rank == 0, dataclasses.asdict(cfg))
        self.log.info(
            f"megatron-jreg: {self.world} rank(s), TP={cfg.parallel.tensor_model_parallel_size} "
            f"PP={cfg.parallel.pipeline_model_parallel_size} CP={cfg.parallel.context_parallel_size} "
            f"DP={self.dp_size}, "
            f"{self.transformer_impl} layers on {device().type}, global batch {self.global_batch} "
            f"({self.num_microbatches} microbatch(es) of {cfg.optim.micro_batch_size}), "
            f"JREG λ={cfg.jreg.lam} α={cfg.jreg.alpha} ({cfg.jreg.distance})"
        )
        self._build_model()
        self._build_optimizer()
        self.plugin = JregPlugin(self.model, cfg.jreg)
        self.iteration = 0
        self._maybe_load()  # sets iteration and consumed_samples when resuming
        self._build_data(self.consumed_samples)
        if cfg.checkpoint.exit_signal_handler:
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _build_model(self) -> None:
        cfg = self.cfg
        o = cfg.optim
        recompute = {}
        if o.recompute_granularity:
            recompute = {"recompute_granularity": o.recompute_granularity, "recompute_method": o.recompute_method,
                         "recompute_num_layers": o.recompute_num_layers}
            if o.recompute_granularity == "selective":
                recompute = {"recompute_granularity": "selective"}
        self.tconfig = transformer_config(
            cfg.model, cfg.parallel, cfg.precision, fused=self.transformer_impl == "transformer_engine",
            calculate_per_token_loss=o.calculate_per_token_loss, **recompute,
        )
        self.padded_vocab = cfg.model.padded_vocab_size(cfg.parallel.tensor_model_parallel_size)
        chunks = build_model_chunks(self.tconfig, cfg.model, self.padded_vocab, self.transformer_impl)
        if cfg.init_mode == "layout-independent":
            init_layout_independent(chunks, self.tconfig, cfg.seed)
        if torch.cuda.is_available():
            chunks = [c.cuda(torch.cuda.current_device()) for c in chunks]
        if cfg.precision.bf16 or cfg.precision.fp16:
            chunks = [Float16Module(self.tconfig, c) for c in chunks]
        p = cfg.parallel
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=p.use_distributed_optimizer,
            overlap_grad_reduce=p.overlap_grad_reduce, overlap_param_gather=p.overlap_param_gather,
            fp8_param_gather=cfg.precision.fp8_param_gather, check_for_nan_in_grad=False,
        )
        self.model = [
            DistributedDataParallel(self.tconfig, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)
        ]
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        if p.overlap_grad_reduce:  # as Megatron-LM: the schedule defers grad sync to the last microbatch
            no_sync = [c.no_sync for c in self.model]
            self.tconfig.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
            grad_sync = [c.start_grad_sync for c in self.model]
            self.tconfig.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
        n_params = sum(p.numel() for c in chunks for p in c.parameters())
        self.log.info(f"model: {cfg.model.num_layers} layers × {cfg.model.hidden_size}, vocabulary "
                      f"{cfg.model.vocab_size} (padded {self.padded_vocab}), {n_params / 1e6:.2f}M parameters "
                      "on rank 0")

    def _build_optimizer(self) -> None:
        cfg, o = self.cfg, self.cfg.optim
        opt_config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=cfg.precision.bf16,
            fp16=cfg.precision.fp16, params_dtype=self.tconfig.params_dtype, initial_loss_scale=o.initial_loss_scale,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        )
        from megatron.core.optimizer import get_standard_config_overrides

        self.optimizer = get_megatron_optimizer(opt_config, self.model,
                                                config_overrides=get_standard_config_overrides(opt_config))
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        decay_iters = o.lr_decay_iters or o.train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_iters,
            lr_decay_steps=max(decay_iters, o.lr_warmup_iters + 1), lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max(decay_iters, 1),
            wd_incr_style="constant",
        )

    def _maybe_load(self) -> None:
        c = self.cfg.checkpoint
        self.consumed_samples = 0
        if not c.load:
            return
        if ckpt.latest_iteration(c.load) is None and not Path(c.load, "metadata.json").is_file():
            self.log.info(f"--load {c.load}: no checkpoint yet, starting from scratch")
            return
        weights_only = c.finetune
        try:
            state = ckpt.load_checkpoint(
                c.load, self.model,
                optimizer=None if (weights_only or c.no_load_optim) else self.optimizer,
                scheduler=None if weights_only else self.scheduler,
                load_rng=not (weights_only or c.no_load_rng),
            )
        except ckpt.CheckpointMismatch as e:
            raise ConfigError(f"--load: {e}") from None
        self.last_checkpoint = state.path
        if (weights_only or c.no_load_optim) and (self.cfg.precision.bf16 or self.cfg.precision.fp16):
            self.optimizer.reload_model_params()  # fp32 main params from the loaded weights (as Megatron-LM)
        if not weights_only:
            self.iteration, self.consumed_samples = state.iteration, state.consumed_train_samples
        self.log.info(f"loaded {state.path} ({'weights only' if weights_only else f'iteration {state.iteration}'})")

    def _build_data(self, consumed: int) -> None:
        cfg = self.cfg
        lg = cfg.logging
        evaluating = lg.eval_interval is not None and lg.eval_iters > 0
        eval_samples = lg.eval_iters * self.global_batch if evaluating else 0
        sizes = [cfg.optim.train_iters * self.global_batch, eval_samples, eval_samples]
        train_ds, valid_ds, _ = build_datasets(cfg, self.ds_tokenizer, sizes)
        b = cfg.optim.micro_batch_size
        self.train_loader = BatchLoader(train_ds, b, self.dp_rank, self.dp_size, consumed)
        self.valid_ds = valid_ds if evaluating else None
        if evaluating and valid_ds is None:
            self.log.info("no validation split (check --split / --valid-data-path): evaluation disabled")

    def _on_sigterm(self, signum, frame) -> None:  # noqa: ANN001
        self.stop_requested = True

    # -- steps ---------------------------------------------------------------------------------------
    def _to_device(self, micro: list[dict]) -> list[dict]:
        dev = device()
        return [{k: v.to(dev, non_blocking=True) for k, v in mb.items()} for mb in micro]

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        if self.cfg.parallel.context_parallel_size > 1:
            from megatron.core.utils import get_batch_on_this_cp_rank

            batch = get_batch_on_this_cp_rank(batch, False, parallel_state.get_context_parallel_group())
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(lm_loss_func, batch["loss_mask"])

    def _run(self, micro: list[dict], forward_only: bool):
        iterators = [iter(micro) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model,
            num_microbatches=len(micro),
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.optim.micro_batch_size,
            forward_only=forward_only,
        )

    def _reduce_lm_loss(self, losses: list[dict]) -> float:
        """Mean over microbatches (and CP slices) of the per-token loss, averaged over DP; every rank."""
        counting = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and (
            parallel_state.get_tensor_model_parallel_rank() == 0
        )
        buf = torch.zeros(2, dtype=torch.float64, device=device())
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and losses:
            pairs = torch.stack([x["lm loss"].double() for x in losses])
            if self.cfg.parallel.context_parallel_size > 1:
                dist.all_reduce(pairs, group=parallel_state.get_context_parallel_group())
            if counting and parallel_state.get_context_parallel_rank() == 0:
                buf[0] = (pairs[:, 0] / pairs[:, 1].clamp_min(1)).mean()
                buf[1] = 1.0
        dist.all_reduce(buf)
        return (buf[0] / buf[1].clamp_min(1)).item()

    def train_step(self, record: bool) -> dict:
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro = self._to_device(self.train_loader.microbatches(self.num_microbatches))
        self.plugin.start_step(self.num_microbatches, record=record)
        losses = self._run(micro, forward_only=False)
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        result = {"lm_loss": self._reduce_lm_loss(losses), "grad_norm": grad_norm, "updated": updated}
        if record:
            result["jreg"] = self.plugin.finish_step()
        return result

    def evaluate(self) -> dict:
        """lm loss and Ψ on the validation samples (the same samples at every evaluation)."""
        for chunk in self.model:
            chunk.eval()
        loader = BatchLoader(self.valid_ds, self.cfg.optim.micro_batch_size, self.dp_rank, self.dp_size, 0)
        iters = self.cfg.logging.eval_iters
        self.plugin.start_step(self.num_microbatches * iters, record=True)
        total = 0.0
        with torch.no_grad():
            for _ in range(iters):
                losses = self._run(self._to_device(loader.microbatches(self.num_microbatches)), forward_only=True)
                total += self._reduce_lm_loss(losses)
        stats = self.plugin.finish_step()
        for chunk in self.model:
            chunk.train()
        return {"val_loss": total / iters, "psi": stats.psi, "jreg_loss": stats.jreg_loss, **stats.zeta}

    def save(self) -> None:
        if not self.cfg.checkpoint.save:
            return
        t0 = time.time()
        self.last_checkpoint = ckpt.save_checkpoint(
            self.cfg.checkpoint.save, self.iteration, self.model, self.optimizer, self.scheduler,
            self.train_loader.consumed, dataclasses.asdict(self.cfg),
        )
        self.log.info(f"saved checkpoint {self.last_checkpoint} in {time.time() - t0:.1f}s")

    def _check_finite(self, result: dict) -> None:
        bad = None
        if not math.isfinite(result["lm_loss"]):
            bad = "loss"
        elif not self.cfg.precision.fp16 and result["grad_norm"] is not None and not math.isfinite(result["grad_norm"]):
            bad = "gradients"  # fp16 overflow is handled by the loss scaler (the step is skipped)
        if bad:
            last = str(self.last_checkpoint) if self.last_checkpoint else "none (no checkpoint saved yet)"
            raise TrainingDiverged(
                f"NaN/inf in the {bad} at iteration {self.iteration}; stopping. Last good checkpoint: {last}"
            )

    def _stop_signal(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # -- loop ----------------------------------------------------------------------------------------
    def train(self) -> int:
        cfg = self.cfg
        lg, o = cfg.logging, cfg.optim
        flops = flops_per_iteration(cfg.model, self.padded_vocab, self.global_batch,
                                    o.recompute_granularity == "full")
        tokens_per_iter = self.global_batch * cfg.model.seq_length
        interval_loss, interval_iters, t_interval = 0.0, 0, time.perf_counter()
        if lg.skip_train:
            if self.valid_ds is None:
                raise ConfigError("--skip-train evaluates the validation split: give --eval-iters > 0 and a "
                                  "validation split (--split or --valid-data-path)")
            self.log.validation({"iteration": self.iteration, **self.evaluate()})
            return 0
        while self.iteration < o.train_iters:
            record = (self.iteration + 1) % lg.log_interval == 0 or self.iteration + 1 == o.train_iters
            result = self.train_step(record)
            self.iteration += 1
            self._check_finite(result)
            interval_loss += result["lm_loss"]
            interval_iters += 1
            self.log.step(self.iteration)
            if record:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t_interval
                stats = result["jreg"]
                self.log.train({
                    "iteration": self.iteration,
                    "consumed_samples": self.train_loader.consumed,
                    "lm_loss": interval_loss / interval_iters,
                    "jreg_loss": stats.jreg_loss,
                    "psi": stats.psi,
                    **stats.zeta,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "grad_norm": result["grad_norm"],
                    "iteration_ms": 1000 * elapsed / interval_iters,
                    "tokens_per_sec": tokens_per_iter * interval_iters / elapsed,
                    "tflops_per_rank": flops * interval_iters / elapsed / self.world / 1e12,
                })
                interval_loss, interval_iters, t_interval = 0.0, 0, time.perf_counter()
            if self.valid_ds is not None and lg.eval_interval and (
                self.iteration % lg.eval_interval == 0 or self.iteration == o.train_iters
            ):
                self.log.validation({"iteration": self.iteration, **self.evaluate()})
                t_interval = time.perf_counter()
            c = cfg.checkpoint
            if c.save_interval and self.iteration % c.save_interval == 0 and self.iteration < o.train_iters:
                self.save()
                t_interval = time.perf_counter()
            if self._stop_signal():
                self.log.info(f"SIGTERM received: saving at iteration {self.iteration} and exiting")
                self.save()
                return 0
            if c.exit_interval and self.iteration % c.exit_interval == 0 and self.iteration < o.train_iters:
                self.log.info(f"--exit-interval {c.exit_interval}: saving and exiting at iteration {self.iteration}")
                self.save()
                return 0
        self.save()
        self.log.info(f"training finished at iteration {self.iteration}")
        return 0


def run(cfg: TrainConfig) -> int:
    """Set up, train, tear down; a bad configuration raises ConfigError before any work."""
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        log = getattr(trainer, "log", None)
        if log is not None:
            log.close()


__all__ = ["Trainer", "run", "ConfigError", "TrainingDiverged"]
