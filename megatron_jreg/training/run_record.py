"""megatron_jreg.json, the run record beside each save: the one place a checkpoint's settings, their history and
Adam's step are written and read, so a resume can refuse what would change the checkpoint's meaning."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_jreg.checkpoints import CheckpointError, install_safe_checkpoint_reader, load_metadata, read_tracker
from megatron_jreg.checkpoints import resolve as resolve_checkpoint
from megatron_jreg.checkpoints.args import flag
from megatron_jreg.checkpoints.files import check_storage_paths, read_legacy_state
from megatron_jreg.data.tokenizers import file_sha256
from megatron_jreg.errors import UsageError
from megatron_jreg.fileio import atomic_write
from megatron_jreg.model_files import open_regular

if TYPE_CHECKING:
    from megatron_jreg.plugin import JregConfig

SIDECAR = "megatron_jreg.json"


def read_sidecar(ckpt: Path) -> dict | None:
    path = Path(ckpt) / SIDECAR
    if not path.is_file():
        return None
    try:
        with open_regular(path) as f:
            record = json.loads(f.read().decode())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); restore it or remove it") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: not a JSON object; restore it or remove it")
    return record


def write_sidecar(ckpt: Path, record: dict) -> None:
    with atomic_write(Path(ckpt) / SIDECAR) as f:
        f.write(json.dumps(record, indent=2))


@dataclass(frozen=True)
class Start:
    """The checkpoint a run starts from, resolved once and handed down; `root`: the folder Megatron-LM loads."""

    root: str
    option: str  # "--load" or "--pretrained-checkpoint"
    ckpt: Path
    iteration: int
    sidecar: dict


def _has_checkpoint(root: str | None) -> bool:
    try:
        return root is not None and Path(root).is_dir() and read_tracker(root) is not None
    except CheckpointError:
        return True  # a damaged tracker: reported when it is resolved


def find_start(args: argparse.Namespace) -> Start | None:
    """The checkpoint Megatron-LM will load, checked safe to read before any work (Megatron-LM exits 0 on a bad
    tracker; torch unpickles `.metadata`); None: a fresh start."""
    install_safe_checkpoint_reader()
    pretrained = args.pretrained_checkpoint is not None and not _has_checkpoint(args.load)
    root, option = (args.pretrained_checkpoint, "--pretrained-checkpoint") if pretrained else (args.load, "--load")
    if pretrained and not _has_checkpoint(root):
        raise UsageError(f"--pretrained-checkpoint {root}: no checkpoint there (a folder with "
                         "latest_checkpointed_iteration.txt, as --save writes)")
    if root is None or not Path(root).is_dir():
        return None
    try:
        if read_tracker(root) is None and args.ckpt_step is None:
            return None  # Megatron-LM: "could not find the metadata file ... will start from random"
        ckpt, iteration = resolve_checkpoint(root, args.ckpt_step)
        if (ckpt / ".metadata").is_file():
            check_storage_paths(load_metadata(ckpt / ".metadata"), ckpt)
        return Start(root, option, ckpt, iteration, read_sidecar(ckpt) or {})
    except CheckpointError as e:
        raise UsageError(f"{option}: {e}") from None


def tokenizer_sha256(args: argparse.Namespace) -> str | None:
    """SHA-256 of the run's tokenizer files as preprocess records it in a manifest."""
    if args.tokenizer_type == "NullTokenizer":
        return None
    if args.tokenizer_type == "GPT2BPETokenizer":
        files = [args.vocab_file, args.merge_file]
    else:
        model = Path(args.tokenizer_model or "")
        files = [model / "tokenizer.json" if model.is_dir() else model]
    if not all(f and Path(f).is_file() for f in files):
        return None
    return _sha256_of(*(str(Path(f).resolve()) for f in files))


_sha256_of = functools.lru_cache(maxsize=4)(file_sha256)


def run_settings(args: argparse.Namespace, jreg: JregConfig) -> dict:
    """What a checkpoint's meaning depends on, as this run sets it (megatron_jreg.json's `run`)."""
    from megatron.training import get_tokenizer

    return {"padded_vocab_size": args.padded_vocab_size, "vocab_size": get_tokenizer().vocab_size,
            "tokenizer_sha256": tokenizer_sha256(args), "global_batch_size": args.global_batch_size,
            "rampup_batch_size": args.rampup_batch_size, "seq_length": args.seq_length, "seed": args.seed,
            "layernorm_scaling": bool(args.layernorm_scaling), "jreg": jreg.record()}


def saved_settings(ckpt: Path) -> dict | None:
    """run_settings of the run that saved `ckpt`: its megatron_jreg.json, else the args Megatron-LM saved."""
    recorded = (read_sidecar(ckpt) or {}).get("run")
    if isinstance(recorded, dict):
        return recorded
    if not (ckpt / ".metadata").is_file():
        state = read_legacy_state(ckpt)
    else:
        from megatron.core import dist_checkpointing
        from megatron.core.safe_globals import register_safe_globals

        register_safe_globals()
        try:
            state = dist_checkpointing.load_common_state_dict(str(ckpt))  # no_dist: no process group needed
        except Exception:  # noqa: BLE001 - an unreadable common state is reported by the load itself
            return None
    saved = state.get("args") if isinstance(state, dict) else None
    if not isinstance(saved, argparse.Namespace):
        return None
    from megatron_jreg.plugin import JregConfig

    names = ("padded_vocab_size", "vocab_size", "global_batch_size", "rampup_batch_size", "seq_length", "seed")
    settings = {name: getattr(saved, name, None) for name in names}  # vocab_size: --vocab-size when given
    settings["layernorm_scaling"] = bool(getattr(saved, "layernorm_scaling", False))
    if getattr(saved, "jreg_lambda", None) is not None:
        settings["jreg"] = JregConfig.from_args(saved).record()
    return settings


# flag, why a resume must keep it
_KEPT_ON_RESUME = {
    "global_batch_size": ("--global-batch-size", "the iteration count and the data order are in its samples"),
    "rampup_batch_size": ("--rampup-batch-size", "the consumed samples follow its ramp"),
    "seq_length": ("--seq-length", "the data's samples and positions are cut at it"),
}
_RECORDED = {"seed": "--seed", "layernorm_scaling": "--layernorm-scaling"}  # and every JREG setting (`flag_of`)


def flag_of(key: str) -> str:
    """"jreg.min-weight" → "--jreg-min-weight"."""
    return _RECORDED.get(key) or flag(key.replace(".", "_"))


def _flat(settings: dict) -> dict:
    return {**{k: v for k, v in settings.items() if k != "jreg"},
            **{f"jreg.{k}": v for k, v in (settings.get("jreg") or {}).items()}}


def _value(value: object) -> str:
    if value is None:
        return "(not set)"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def compare(ckpt: Path, saved: dict, now: dict, fresh: bool, vocab_flag: str) -> dict:
    """UsageError for a setting that must not change; {setting: [checkpoint's, this run's]} for those recorded."""
    old, new = _flat(saved), _flat(now)

    def known(key: str) -> bool:
        return old.get(key) is not None and new.get(key) is not None and old[key] != new[key]

    if known("padded_vocab_size") or known("vocab_size"):
        raise UsageError(f"{vocab_flag}: this run's vocabulary is {new['vocab_size']} tokens (embedding "
                         f"{new['padded_vocab_size']} rows), {ckpt}'s {old.get('vocab_size') or '?'} "
                         f"({old.get('padded_vocab_size')} rows): Megatron-LM would load the embedding partly and "
                         "train on; give the checkpoint's tokenizer (or --vocab-size)")
    if known("tokenizer_sha256"):
        raise UsageError(f"--tokenizer-model: this run's tokenizer (sha256 {new['tokenizer_sha256'][:12]}…) is not the "
                         f"one {ckpt} was trained with ({old['tokenizer_sha256'][:12]}…): its embedding rows would "
                         "mean other tokens; give that tokenizer")
    changes = {}
    was, now_ = bool(old.get("layernorm_scaling")), bool(new.get("layernorm_scaling"))  # absent: saved before it
    if was != now_:
        if not fresh:
            raise UsageError(f"{'--layernorm-scaling' if now_ else 'no --layernorm-scaling'}: {ckpt} was trained "
                             f"{'with' if was else 'without'} it and a resume must keep it (every layer's norm "
                             f"outputs scaled by 1/√ℓ or not: another model); {'add' if was else 'leave out'} "
                             "--layernorm-scaling, or start a new run from its weights with --finetune")
        changes["layernorm_scaling"] = [was, now_]
    for key, (option, why) in _KEPT_ON_RESUME.items():
        if old.get(key) != new.get(key) and key in saved:
            if not fresh:
                was = old.get(key)
                given = f"no {option}" if new.get(key) is None else f"{option} {_value(new.get(key))}"
                trained, keep = ((f"without {option}", f"leave out {option}") if was is None
                                 else (f"with {option} {_value(was)}", f"give {option} {_value(was)}"))
                raise UsageError(f"{given}: {ckpt} was trained {trained} and a resume must keep it ({why}): {keep}, "
                                 "or start a new run from its weights with --finetune")
            changes[key] = [old.get(key), new.get(key)]
    for key in [*_RECORDED, *(k for k in old if k.startswith("jreg."))]:  # every JREG setting the checkpoint kept
        if key in old and old[key] != new.get(key):
            changes[key] = [old[key], new.get(key)]
    return changes


class RunRecord:
    """This run's megatron_jreg.json: built from the checkpoint it starts from, written by each save."""

    def __init__(self, args: argparse.Namespace, jreg: JregConfig, start: Start | None) -> None:
        self.args, self.jreg, self.start = args, jreg, start
        self.base = start.sidecar if start else {}  # the record of the checkpoint this run starts from
        self.history: list[dict] = list(self.base.get("history") or [])
        self.loop_fields: Callable[[], dict] | None = None
        if start is not None:
            self._continue(start)

    def _continue(self, start: Start) -> None:
        from megatron.training import print_rank_0

        args = self.args
        # Megatron-LM's load_checkpoint starts a release checkpoint (an import, a published model) at iteration 0,
        # as --finetune does: its batch and sequence length are not a resume's to keep
        fresh = bool(args.finetune) or start.option == "--pretrained-checkpoint" or start.ckpt.name == "release"
        first = 0 if fresh else start.iteration  # the iteration this run's steps count from
        vocab_flag = (f"--vocab-size {args.vocab_size}" if args.vocab_size is not None
                      else f"--tokenizer-model {args.tokenizer_model}")
        try:
            saved = saved_settings(start.ckpt) or {}
        except CheckpointError as e:
            raise UsageError(f"{start.option}: {e}") from None
        changes = compare(start.ckpt, saved, self.settings, fresh, vocab_flag)
        same_folder = args.save is not None and Path(args.save).resolve() == Path(start.root).resolve()
        if changes or not same_folder:
            self.history.append({"iteration": first, "from": str(start.ckpt), "changes": changes})
        if changes:
            what = ", ".join(f"{flag_of(k)} {_value(old)} → {_value(new)}" for k, (old, new) in changes.items())
            print_rank_0(f"megatron-jreg: {start.ckpt} (iteration {start.iteration}) continues with changed settings "
                         f"from iteration {first}: {what}; recorded in each checkpoint's megatron_jreg.json `history`")

    @functools.cached_property
    def settings(self) -> dict:
        """Computed when first needed: a run that neither loads nor saves needs none."""
        return run_settings(self.args, self.jreg)

    def sidecar(self, torch_adam_step: int | None) -> dict:
        return {"torch_adam_step": torch_adam_step, "jreg": self.settings["jreg"], "run": self.settings,
                "history": self.history, **(self.loop_fields() if self.loop_fields is not None else {})}
