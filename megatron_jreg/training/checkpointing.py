"""What megatron-jreg adds to Megatron-LM's checkpointing when training (the format stays Megatron-LM's).

- Before any work, `--load` is checked (`check_load`): a malformed tracker, a missing or incomplete
  iteration directory, or hostile `.metadata` stop with one line (Megatron-LM exits 0 on a bad tracker,
  and torch unpickles `.metadata` with plain pickle).
- `install` wraps `megatron.training.training.load_checkpoint` (the name `setup_model_and_optimizer`
  calls): the checkpoint's SHA-256 manifest is verified first when it has one (Megatron-LM's own
  --verify-integrity would refuse checkpoints saved without it, e.g. by Megatron-LM's defaults), and
  the loaded checkpoint is reported.
- Saves record the manifest: `--verify-integrity` is on by default here (`--no-verify-integrity`).
- Without apex or Transformer Engine (CPU, plain PyTorch images) megatron-core's DistributedOptimizer
  keeps torch Adam's `step` in torch's per-parameter state, which exists only after a first step:
  describing the state for loading then fails (`assert len(steps) == 1`), and the load gives every
  parameter one shared `step` tensor that Adam then increments once per parameter, breaking its bias
  correction after a resume; its dp_reshardable format does not store the count either (the loaded
  value is the pre-load one). The wrappers give an unstepped optimizer its state first (megatron's own
  zero-gradient helper; the load overwrites what it touches), record the count at save in
  `iter_*/megatron_jreg.json` (with the JREG settings, as provenance), and put it back after the load,
  one tensor per parameter.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from megatron_jreg.checkpoints import (
    CheckpointError,
    failure_text,
    install_safe_checkpoint_reader,
    load_metadata,
    read_tracker,
    resolve,
    verify_integrity,
)
from megatron_jreg.training.arguments import UsageError

SIDECAR = "megatron_jreg.json"
_originals: dict = {}


def _load_dir(args: argparse.Namespace) -> str | None:
    """The folder Megatron-LM's load_checkpoint reads: --load when it holds a checkpoint, else
    --pretrained-checkpoint (fine-tuning starts there; its requeued jobs resume from --load)."""
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained is not None and not _has_checkpoint(args.load):
        return pretrained
    return args.load


def _has_checkpoint(root: str | None) -> bool:
    try:
        return root is not None and Path(root).is_dir() and read_tracker(root) is not None
    except CheckpointError:
        return True  # a damaged tracker: reported when it is read


def check_load(args: argparse.Namespace) -> None:
    """--load names nothing yet (start from scratch, as Megatron-LM) or a checkpoint we can read safely."""
    install_safe_checkpoint_reader()
    root = _load_dir(args)
    option = "--pretrained-checkpoint" if root is not None and root == args.pretrained_checkpoint else "--load"
    if option == "--pretrained-checkpoint" and not _has_checkpoint(root):
        raise UsageError(f"--pretrained-checkpoint {root}: no checkpoint there (a folder with "
                         "latest_checkpointed_iteration.txt, as --save writes)")
    if root is None or not Path(root).is_dir():
        return
    try:
        if read_tracker(root) is None and args.ckpt_step is None:
            return  # Megatron-LM: "could not find the metadata file ... will start from random"
        ckpt, _ = resolve(root, args.ckpt_step)
        if (ckpt / ".metadata").is_file():
            load_metadata(ckpt / ".metadata")
    except CheckpointError as e:
        raise UsageError(f"{option}: {e}") from None


def install(args: argparse.Namespace) -> None:
    from megatron.training import training

    if not _originals:
        _originals["load_checkpoint"], training.load_checkpoint = training.load_checkpoint, _load_checkpoint
        _originals["save_checkpoint"], training.save_checkpoint = training.save_checkpoint, _save_checkpoint


def uninstall() -> None:
    from megatron.training import training

    for name, fn in _originals.items():
        setattr(training, name, fn)
    _originals.clear()


def _save_checkpoint(iteration, model, optimizer, *a, **k):
    """Megatron-LM's save_checkpoint, then megatron_jreg.json (Adam's step count, JREG settings) beside it."""
    import torch
    from megatron.training import get_args
    from megatron.training.checkpointing import get_checkpoint_name

    result = _originals["save_checkpoint"](iteration, model, optimizer, *a, **k)
    args = get_args()
    steps = [_adam_step(o) for o in _torch_adam_distributed(optimizer)]
    if torch.distributed.get_rank() == 0 and not k.get("non_persistent_ckpt", False):
        ckpt = Path(get_checkpoint_name(args.save, iteration, return_base_dir=True))
        ckpt.mkdir(parents=True, exist_ok=True)
        record = {"torch_adam_step": next((s for s in steps if s is not None), None),
                  "jreg": {"lambda": args.jreg_lambda, "alpha": args.jreg_alpha, "distance": args.jreg_distance,
                           "layers": args.jreg_layers}}
        tmp = ckpt / (SIDECAR + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        os.replace(tmp, ckpt / SIDECAR)
    return result


def _adam_step(opt) -> int | None:
    import torch

    for state in opt.optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            return int(state["step"].item())
    return None


def _saved_adam_step(args: argparse.Namespace) -> int | None:
    try:
        ckpt, _ = resolve(_load_dir(args), args.ckpt_step)
        return json.loads((ckpt / SIDECAR).read_text()).get("torch_adam_step")
    except (CheckpointError, OSError, ValueError, AttributeError):
        return None


def _load_checkpoint(*a, **k):
    """Megatron-LM's load_checkpoint, after verifying the checkpoint's digests (rank 0 reads, all raise)."""
    import torch
    from megatron.training import get_args, print_rank_0

    args = get_args()
    root = _load_dir(args)
    verified: list = [None]
    resuming = root is not None and Path(root).is_dir() and read_tracker(root) is not None
    if resuming and not args.jreg_no_verify_integrity:
        if torch.distributed.get_rank() == 0:
            try:
                ckpt, _ = resolve(root, args.ckpt_step)
                count = verify_integrity(ckpt)
                verified = [f"verified {count} file(s) of {ckpt} against integrity.json" if count is not None
                            else f"{ckpt} has no integrity.json (saved without --verify-integrity): loading "
                                 "it unverified"]
            except CheckpointError as e:
                verified = [e]
        torch.distributed.broadcast_object_list(verified, src=0)
        if isinstance(verified[0], Exception):
            raise UsageError(f"--load: {verified[0]}")
        print_rank_0(f"megatron-jreg: {verified[0]}")
    optimizer = a[1] if len(a) > 1 else k.get("optimizer")
    torch_adam = _torch_adam_distributed(optimizer) if resuming else []
    for opt in torch_adam:
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    saved, args.verify_integrity = args.verify_integrity, False  # verified above (or deliberately not)
    try:
        with torch.no_grad():  # copies into leaf (main) parameters; Megatron-LM relies on apex/TE paths here
            result = _originals["load_checkpoint"](*a, **k)
    except UsageError:
        raise
    except AssertionError as e:
        if str(e).startswith("OptimizerParamScheduler:"):
            raise UsageError(_scheduler_mismatch(root, str(e))) from None
        raise UsageError(f"--load {root}: Megatron-LM could not load the checkpoint ({failure_text(e)}); is it "
                         "truncated, or saved for another model or layout?") from None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - many types for unreadable checkpoints
        detail = failure_text(e)
        raise UsageError(f"--load {root}: Megatron-LM could not load the checkpoint ({type(e).__name__}: {detail}); "
                         "is it truncated, or saved for another model or layout?") from None
    finally:
        args.verify_integrity = saved
    if torch_adam and not args.no_load_optim and not args.finetune:
        step = _saved_adam_step(args)
        if step is None:
            print_rank_0("megatron-jreg: the checkpoint does not record torch Adam's step count (saved by "
                         "Megatron-LM without apex/TE); Adam's bias correction restarts")
        for opt in torch_adam:
            for state in opt.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    value = state["step"] if step is None else torch.tensor(float(step))
                    state["step"] = value.to(state["step"]).clone()
    return result


def _scheduler_mismatch(root: str | None, message: str) -> str:
    """Megatron-LM's scheduler check (`OptimizerParamScheduler: class input value X and checkpointvalue Y for
    NAME do not match`) as the fix it wants: e.g. a resume with a larger --train-iters (which also sets
    --lr-decay-iters) changes the schedule's total iterations."""
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
    """The DistributedOptimizers whose inner optimizer is torch's (no apex / TE fused Adam)."""
    if optimizer is None:
        return []
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in chained if isinstance(o, distrib_optimizer.DistributedOptimizer)]
