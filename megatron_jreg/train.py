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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in (["-h"], ["--help"]):
        from megatron_jreg.training.arguments import parse_args

        parse_args(argv)  # argparse prints Megatron-LM's help with our group, then exits
        return 0
    debug = "--debug" in argv or os.environ.get("MEGATRON_JREG_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    _single_process_env()
    from megatron_jreg.patches import PatchError
    from megatron_jreg.training.arguments import UsageError
    from megatron_jreg.training.checkpointing import RankLost, SaveError
    from megatron_jreg.training.run import run

    try:
        return run(argv)
    except (UsageError, SaveError, RankLost, PatchError) as e:  # PatchError: a Megatron-LM it was not written for
        if debug:
            import traceback

            traceback.print_exception(e.__cause__ or e, file=sys.stderr)
        # one line per run, not per rank; a lost rank is reported by every survivor (rank 0 may be the lost one)
        if debug or os.environ.get("RANK", "0") == "0" or isinstance(e, RankLost):
            print(f"megatron-jreg train: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    sys.exit(main())
