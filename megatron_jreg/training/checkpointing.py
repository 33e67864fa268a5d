"""Megatron-LM's save and load, wrapped for a run (its format kept): every rank digests what it wrote, no save of
NaN/Inf, a failed save or load is one line, and torch Adam's step count survives a resume (DEVELOPERS.md)."""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from megatron_jreg import patches
from megatron_jreg.checkpoints import CheckpointError, failure_text, verify_integrity, write_integrity
from megatron_jreg.checkpoints.files import TRACKER, checkpoint_files, digest_files, iteration_dir, share
from megatron_jreg.compat import device
from megatron_jreg.errors import Failed, JregError, UsageError, limit_reached
from megatron_jreg.training.run_folder import tracked
from megatron_jreg.training.run_record import RunRecord, Start, write_sidecar


class SaveError(Failed, RuntimeError):
    """A checkpoint save that failed (disk full, write error); the message is one line (exit 1)."""


class RankLost(Failed, RuntimeError):
    """Another rank died during a collective; the message is one line naming the checkpoint to resume (exit 1)."""


def rank_lost(args: argparse.Namespace, error: BaseException) -> RankLost | None:
    """RankLost naming where to resume when `error` is a collective's report of a dead peer; else None."""
    text = str(error)
    if isinstance(error, SaveError) or not any(s in text for s in PEER_LOST):
        return None
    seen = " ".join(re.sub(r"^\[[^\]]*\] ", "", text.split(". This is typically")[0]).split())[:160]
    last = tracked(args.save)
    resume = (f"the last complete checkpoint in --save {args.save} is iteration {last}: find why that rank stopped "
              f"(its log, the OOM killer), then rerun the same command with --load {args.save} to resume from it"
              if last is not None else "no checkpoint was saved (no --save, or none yet): this run's progress is lost")
    return RankLost(f"another rank stopped (rank {os.environ.get('RANK', '0')} saw: {seen}); {resume}")


def patch_makers(record: RunRecord) -> dict:
    pending: dict = {}  # save_checkpoint's record for the dist_checkpointing.save it calls
    load, save = "megatron.training.training.load_checkpoint", "megatron.training.training.save_checkpoint"
    return {load: lambda orig: functools.partial(_load_checkpoint, orig, record.start),
            save: lambda orig: functools.partial(_save_checkpoint, orig, record, pending),
            DIST_SAVE: lambda orig: functools.partial(_dist_save, orig, pending)}


DIST_SAVE = "megatron.core.dist_checkpointing.save"


def _dist_save(original, pending: dict, *a, **k):  # noqa: ANN001
    """dist_checkpointing.save without its rank-0 manifest, then `finish_save` (now, or when --async-save finalizes)."""
    call = patches.arguments(original, a, k)
    call["verify_integrity"] = False
    result = original(**call)
    from megatron.training import get_args

    finish = functools.partial(finish_save, Path(call["checkpoint_dir"]), pending.pop("record", None),
                               not get_args().jreg_no_verify_integrity)
    if result is None:
        finish()
    else:
        result.add_finalize_fn(finish)
    return result


def _all_gather(value: object) -> list:
    if torch.distributed.get_world_size() == 1:
        return [value]
    values: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def digest_threads() -> int:
    """Digest threads per rank: the CPUs of this process shared by the ranks of its node."""
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def finish_save(ckpt: Path, sidecar: dict | None, digest: bool) -> None:
    """Before the tracker names a save: megatron_jreg.json, then (with `digest`) each rank digests its `share`
    (still in its page cache) and rank 0 writes integrity.json; a failure on any rank raises on all."""
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    listed: list = [None]
    if rank == 0:
        try:
            if sidecar is not None:
                write_sidecar(ckpt, sidecar)
            listed = [checkpoint_files(ckpt)]
        except OSError as e:
            listed = [f"[Errno {e.errno}] {e.strerror}: {e.filename}"]
    if world > 1:
        dist.broadcast_object_list(listed, src=0)
    if isinstance(listed[0], str):
        raise OSError(listed[0])
    if not digest:
        return
    try:
        mine: dict | str = digest_files(ckpt, share(listed[0], rank, world), digest_threads())
    except OSError as e:
        mine = f"[Errno {e.errno}] {e.strerror}: {e.filename}"
    gathered = _all_gather(mine)
    failed = next((v for v in gathered if isinstance(v, str)), None)  # the first rank's error
    if failed is not None:
        raise OSError(f"digesting the saved files failed ({failed})")
    if rank == 0:
        write_integrity(ckpt, {name: digest for part in gathered for name, digest in part.items()})
    if world > 1:
        dist.barrier()


def _save_checkpoint(original, record: RunRecord, pending: dict, *a, **k):  # noqa: ANN001
    """Megatron-LM's save_checkpoint with the run record; skipped without --save or with non-finite tensors."""
    from megatron.training import get_args, print_rank_0
    from megatron.training.checkpointing import get_checkpoint_name

    args = get_args()
    call = patches.arguments(original, a, k)
    iteration, model, optimizer = call["iteration"], call["model"], call["optimizer"]
    if args.save is None:
        return None  # Megatron-LM's NaN and signal exits save even without --save
    persistent = not call.get("non_persistent_ckpt", False)
    previous = tracked(args.save)
    (weights, state), name = _nonfinite(model, optimizer)
    if weights or state:
        what = " and ".join(text for count, text in ((weights, f"{weights} weight tensor(s)"),
                                                     (state, f"{state} optimizer state tensor(s)")) if count)
        print_rank_0(f"megatron-jreg train: iteration {iteration} not saved: {what} hold NaN/Inf "
                     f"(first: {name}); {TRACKER} in {args.save} still names "
                     f"{'iteration ' + str(previous) if previous is not None else 'no checkpoint'}")
        return None
    ckpt = Path(get_checkpoint_name(args.save, iteration, return_base_dir=True))
    steps = [int(states[0]["step"].item()) for o in _torch_adam_distributed(optimizer) if (states := _adam_states(o))]
    sidecar = record.sidecar(steps[0] if steps else None) if persistent else None
    writer, errors = logging.getLogger(_WRITER_LOG), []

    def collect(record: logging.LogRecord) -> bool:
        """The writer's error records, kept off the console: the only place its OSError text survives (Megatron-LM
        re-raises "<class 'OSError'>")."""
        if record.levelno >= logging.ERROR:
            errors.append(record.getMessage())
        return record.levelno < logging.ERROR

    writer.addFilter(collect)
    pending["record"] = sidecar
    try:
        result = original(*a, **k)
        if persistent and args.ckpt_format != "torch_dist":  # the legacy torch format: no dist_checkpointing.save
            finish_save(ckpt, sidecar, not args.jreg_no_verify_integrity)
    except JregError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        if not persistent:
            raise
        cause = errors[0].rsplit("error: ", 1)[-1] if errors else failure_text(e)
        raise SaveError(_save_failure(args.save, iteration, ckpt, previous, cause, model, optimizer)) from e
    finally:
        pending.clear()
        writer.removeFilter(collect)
    for message in errors:  # logged without failing the save: show them after all
        writer.error(message)
    return result


def _nonfinite(model, optimizer) -> tuple[tuple[int, int], str | None]:  # noqa: ANN001 - Megatron-LM objects
    """((weight, optimizer state) tensors holding NaN/Inf over all ranks, the first's name), in one reduction; the
    optimizer's state counts too: an inf exp_avg_sq leaves the weights finite yet the checkpoint useless."""
    dist = torch.distributed
    named = _named_parameters(model)
    state = _optimizer_tensors(optimizer, {id(p): n for n, p in named})
    flags = [~torch.isfinite(t.detach()).all() for _, t in named + state]
    counts = torch.zeros(2, dtype=torch.int64, device=device())
    for part, items in enumerate((flags[:len(named)], flags[len(named):])):
        by_device: dict = {}  # an offloaded optimizer keeps its state on the host
        for flag in items:
            by_device.setdefault(flag.device, []).append(flag)
        for group in by_device.values():
            counts[part] += torch.stack(group).sum().to(counts.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(counts)
    weights, moments = counts.tolist()
    if not weights and not moments:
        return (0, 0), None
    first = next((n for (n, _), flag in zip(named + state, flags, strict=True) if bool(flag)), None)
    return (weights, moments), next((n for n in _all_gather(first) if n is not None), None)


# a main parameter's model parameter: (the model's group lists, the optimizer's main groups), Megatron-LM's
# Float16OptimizerWithFloat16Params and DistributedOptimizer (megatron/core/optimizer, core_v0.19.0)
_MAIN_OF = (("float16_groups", "fp32_from_float16_groups"), ("model_float16_groups", "shard_fp32_from_float16_groups"),
            ("model_fp32_groups", "shard_fp32_groups"))


def _named_parameters(model) -> list:  # noqa: ANN001 - a model chunk or Megatron-LM's list of them
    return [(n, p) for chunk in (model if isinstance(model, list) else [model]) for n, p in chunk.named_parameters()]


def _optimizers(optimizer) -> list:  # noqa: ANN001 - Megatron-LM's optimizer, chained or not
    return getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else [])


def _optimizer_tensors(optimizer, names: dict[int, str]) -> list[tuple[str, object]]:  # noqa: ANN001
    found: list[tuple[str, object]] = []
    for opt in _optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        owner = {id(main): model for models, mains in _MAIN_OF
                 for group, main_group in zip(getattr(opt, models, None) or [], getattr(opt, mains, None) or [],
                                              strict=False)
                 for model, main in zip(group, main_group, strict=False) if main is not None}
        for g, group in enumerate(inner.param_groups):
            for i, param in enumerate(group["params"]):
                name = names.get(id(owner.get(id(param), param)), f"parameter {i} of group {g}")
                if id(param) not in names:
                    found.append((f"main parameter of {name}", param))
                found += [(f"optimizer {key} of {name}", value) for key, value in inner.state.get(param, {}).items()
                          if isinstance(value, torch.Tensor) and value.is_floating_point()]
    return found


_WRITER_LOG = "megatron.core.dist_checkpointing.strategies.filesystem_async"
# How gloo and NCCL report a collective whose peer process died (kill -9, the OOM killer, a lost node).
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def _checkpoint_bytes(model, optimizer) -> int:
    """About the bytes of one checkpoint of this run (no earlier save to measure)."""
    from megatron.core import parallel_state

    params = {id(p): p.numel() * p.element_size() for _, p in _named_parameters(model)}
    state = 0
    for opt in _optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        tensors = [p for g in getattr(inner, "param_groups", []) for p in g["params"] if id(p) not in params]
        tensors += [t for st in getattr(inner, "state", {}).values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0]
        shard = parallel_state.get_data_parallel_world_size() if "Distributed" in type(opt).__name__ else 1
        state += shard * sum(t.numel() * t.element_size() for t in tensors)
    world = torch.distributed.get_world_size()
    model_parallel = world // max(parallel_state.get_data_parallel_world_size(with_context_parallel=True), 1)
    return model_parallel * (sum(params.values()) + state)


def _save_failure(save: str, iteration: int, ckpt: Path, previous, text: str, model, optimizer) -> str:
    removed = False
    if int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank())) == 0 and ckpt.exists() and previous != iteration:
        shutil.rmtree(ckpt, ignore_errors=True)
        removed = not ckpt.exists()
    last = iteration_dir(save, previous) if previous is not None else None
    if last is not None and last.is_dir():
        need, basis = sum(p.stat().st_size for p in last.rglob("*") if p.is_file()), f"the size of {last.name}"
    else:
        need, basis = _checkpoint_bytes(model, optimizer), "this run's parameters and optimizer state"
    free = shutil.disk_usage(next(p for p in [Path(save), *Path(save).absolute().parents] if p.exists())).free
    full = free < need or any(s in text for s in (f"Errno {errno.ENOSPC}]", f"Errno {errno.EDQUOT}]"))
    if any(s in text for s in PEER_LOST):
        cause = f"another rank stopped during the save: {text}"
    elif (limit := limit_reached(OSError(text))) is not None:  # EFBIG: ulimit -f, not the disk
        cause = str(limit)
    elif full:
        if "No space left on device" not in text:  # torch's zip writer reports ENOSPC as "enforce fail ... pos"
            text = f"no space left on the device; the writer said: {text}"
        cause = (f"{text}: {free / 2**20:.1f} MiB free, a checkpoint needs about {need / 2**20:.1f} MiB ({basis}); "
                 "free space or choose another --save")
    else:
        cause = f"{text}; check the folder and the disk"
    partial = (f"the partial {ckpt.name} was removed" if removed else f"{ckpt} is incomplete: delete it"
               if ckpt.exists() else f"nothing of {ckpt.name} was written")
    kept = f"{TRACKER} still names iteration {previous}" if previous is not None else "no checkpoint was written"
    return f"--save {save}: saving iteration {iteration} failed ({cause}); {partial}; {kept}"


def _adam_states(opt) -> list[dict]:  # noqa: ANN001 - a DistributedOptimizer over torch's Adam
    return [state for state in opt.optimizer.state.values() if isinstance(state.get("step"), torch.Tensor)]


def _load_checkpoint(original, start: Start | None, *a, **k):  # noqa: ANN001
    """Megatron-LM's load_checkpoint after every rank verified its share of the digests."""
    from megatron.training import get_args, print_rank_0

    args = get_args()
    root = start.root if start else args.load
    if start and not args.jreg_no_verify_integrity:
        dist = torch.distributed
        try:
            outcome: int | str | None = verify_integrity(start.ckpt, dist.get_rank(), dist.get_world_size(),
                                                         digest_threads())
        except CheckpointError as e:
            outcome = str(e)
        gathered = _all_gather(outcome)
        failed = next((v for v in gathered if isinstance(v, str)), None)  # the first rank's error
        if failed is not None:
            raise UsageError(f"--load: {failed}")
        if gathered[0] is None:
            print_rank_0(f"megatron-jreg: {start.ckpt} has no integrity.json (saved without --verify-integrity): "
                         "loading it unverified")
        else:
            print_rank_0(f"megatron-jreg: verified {sum(gathered)} file(s) of {start.ckpt} against integrity.json"
                         f"{f' ({len(gathered)} ranks)' if len(gathered) > 1 else ''}")
    optimizer = patches.arguments(original, a, k)["optimizer"]
    torch_adam = _torch_adam_distributed(optimizer) if start else []
    for opt in torch_adam:
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    try:
        with torch.no_grad():  # copies into leaf (main) parameters; Megatron-LM relies on apex/TE paths here
            result = original(*a, **k)
    except JregError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - many types for unreadable checkpoints
        if isinstance(e, AssertionError) and str(e).startswith("OptimizerParamScheduler:"):
            raise UsageError(_scheduler_mismatch(root, str(e))) from None
        raise UsageError(f"--load {root}: Megatron-LM could not load the checkpoint ({failure_text(e)}); is it "
                         "truncated, or saved for another model or layout?") from None
    if torch_adam and not args.no_load_optim and not args.finetune:
        step = start.sidecar.get("torch_adam_step")
        if step is None:
            print_rank_0("megatron-jreg: the checkpoint does not record torch Adam's step count (saved by "
                         "Megatron-LM without apex/TE); Adam's bias correction restarts")
        for state in (state for opt in torch_adam for state in _adam_states(opt)):
            value = state["step"] if step is None else torch.tensor(float(step))
            state["step"] = value.to(state["step"]).clone()
    return result


def _scheduler_mismatch(root: str | None, message: str) -> str:
    """Megatron-LM's scheduler mismatch as the fix it wants (e.g. a larger --train-iters on resume)."""
    found = re.search(r"class input value (\S+) and checkpoint ?value (\S+) for (.+?) do not match", message)
    what = message
    if found:
        unit = " (samples)" if "iterations" in found[3] else ""  # Megatron-LM's scheduler counts samples
        what = f"{found[3]}: {found[2]} in the checkpoint, {found[1]} from these flags{unit}"
    return (f"--load {root}: the learning-rate schedule differs from the checkpoint's ({what}; e.g. a changed "
            "--train-iters, --lr-decay-iters, --lr-warmup-iters, --lr or --min-lr). Add --override-opt_param-scheduler "
            "to use these flags' schedule from the checkpoint's iteration on, or --use-checkpoint-opt_param-scheduler "
            "to keep the checkpoint's (Megatron-LM's flags)")


def _torch_adam_distributed(optimizer) -> list:
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return [o for o in _optimizers(optimizer) if isinstance(o, distrib_optimizer.DistributedOptimizer)]
