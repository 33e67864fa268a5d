"""`megatron-jreg train` / `python -m megatron_jreg.train`: Megatron-LM's `pretrain_gpt.py` with JREG.

Megatron-LM's own parser, validation, model builder, datasets, training loop, checkpoints and logs
(`megatron.training.pretrain`); megatron-jreg hands it four providers — model config (training/model.py),
datasets (training/data.py), forward step and loss (training/step.py) — and adds its flags, JREG's
telemetry (training/loop.py) and checkpoint safety (training/checkpointing.py). Launch with torchrun or
Slurm exactly like pretrain_gpt.py; a plain single process also works.

A bad flag or input is one line, `megatron-jreg train: error: …` (exit 2; a failed checkpoint save: exit 1),
printed by rank 0 only; a rank that died mid-collective is one line from each survivor naming the checkpoint
to resume (exit 1); `--debug` (or MEGATRON_JREG_DEBUG=1) prints the traceback behind it on every rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _single_process_env() -> None:
    """A plain `python -m megatron_jreg.train` is a world of one (torchrun sets these itself)."""
    if "MASTER_ADDR" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)


# The files that shape `train --help` besides megatron-core itself (its version is part of the cache key).
_HELP_SOURCES = ("training/arguments.py", "plugin.py", "usage.py", "train.py")


def _help_cache() -> Path:
    """Where `train --help` is kept: one file per megatron-core version, help sources and terminal width."""
    import hashlib
    import shutil
    from importlib.metadata import PackageNotFoundError, version

    try:
        core = version("megatron-core")
    except PackageNotFoundError:
        core = "none"
    here = Path(__file__).resolve().parent
    key = hashlib.sha256(core.encode())
    for name in _HELP_SOURCES:
        key.update((here / name).read_bytes())
    key.update(str(shutil.get_terminal_size().columns).encode())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-jreg"
    return root / f"train-help-{key.hexdigest()[:16]}.txt"


def print_help() -> None:
    """Megatron-LM's help with our group. Importing megatron.training costs 5-10 s and prints a dozen warnings
    about absent apex/Transformer Engine, none of which the help needs: the text is built once, quietly, and
    kept in the user's cache (a new megatron-core, a changed flag or another terminal width builds it anew)."""
    cache = _help_cache()
    if cache.is_file():
        sys.stdout.write(cache.read_text(encoding="utf-8"))
        return
    import contextlib
    import io
    import logging
    import warnings

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron_jreg.training.arguments import parse_args

        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
            parse_args(["--help"])  # argparse prints the help, then exits
    sys.stdout.write(text.getvalue())
    with contextlib.suppress(OSError):  # a read-only home just means no cache
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text.getvalue(), encoding="utf-8")
        partial.replace(cache)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        print_help()
        return 0
    debug = "--debug" in argv or os.environ.get("MEGATRON_JREG_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    _single_process_env()
    from megatron_jreg.process_env import huge_pages_for_cpu_training

    huge_pages_for_cpu_training()  # before torch loads (process_env.py)
    from megatron_jreg.errors import JregError, report
    from megatron_jreg.training.checkpointing import RankLost
    from megatron_jreg.training.run import run

    try:
        return run(argv)
    except JregError as e:  # only ours: anything else is a failure whose traceback every rank shows
        # one line per run, not per rank; a lost rank is reported by every survivor (rank 0 may be the lost one)
        if debug or os.environ.get("RANK", "0") == "0" or isinstance(e, RankLost):
            return report("megatron-jreg train", e, debug)
        return e.exit_code


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    sys.exit(main())
