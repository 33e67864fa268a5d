"""`megatron-jreg train` / `python -m megatron_jreg.train`: Megatron-LM's `pretrain_gpt.py` with JREG, launched like
it: its parser, loop, checkpoints and logs, our providers, flags and loop events (DEVELOPERS.md, "The train entry")."""

from __future__ import annotations

import argparse
import contextlib
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
_HELP_SOURCES = ("training/flags.py", "checkpoints/args.py", "plugin.py", "layer_spec.py", "usage.py", "train.py")


def _help_cache() -> Path:
    """Where `train --help`'s layout is kept: one file per megatron-core version and help sources."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        core = version("megatron-core")
    except PackageNotFoundError:
        core = "none"
    here = Path(__file__).resolve().parent
    key = hashlib.sha256(core.encode())
    for name in _HELP_SOURCES:
        key.update((here / name).read_bytes())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-jreg"
    return root / f"train-help-{key.hexdigest()[:16]}.json"


def help_layout(parser: argparse.ArgumentParser) -> dict:
    """What `parser.format_help()` reads, as JSON free of the terminal width (so one cache serves every terminal), help
    fields filled in; for formatters that print help as given (`usage.example`'s), a parser without subcommands."""
    formatter = parser._get_formatter()
    group_of = {id(a): i for i, g in enumerate(parser._action_groups) for a in g._group_actions}
    mutex = [m for m in parser._mutually_exclusive_groups if m._group_actions]
    mutex_of = {id(a): j for j, m in enumerate(mutex) for a in m._group_actions}
    actions = []
    for a in parser._actions:
        text = a.help
        if isinstance(text, str) and text is not argparse.SUPPRESS:
            text = formatter._expand_help(a).replace("%", "%%")
        actions.append({"flags": a.option_strings, "dest": a.dest, "nargs": a.nargs, "metavar": a.metavar,
                        "choices": None if a.choices is None else [str(c) for c in a.choices],
                        "required": a.required, "help": text, "usage": a.format_usage() if a.option_strings else None,
                        "group": group_of[id(a)], "mutex": mutex_of.get(id(a))})
    return {"prog": parser.prog, "usage": parser.usage, "description": parser.description, "epilog": parser.epilog,
            "formatter": parser.formatter_class.__name__,
            "groups": [[g.title, g.description] for g in parser._action_groups],
            "mutex": [[group_of[id(m._group_actions[0])], m.required] for m in mutex], "actions": actions}


class _Shown(argparse.Action):
    """A flag as `help_layout` kept it: enough for argparse's formatter, nothing to parse with."""

    def __init__(self, usage: str | None, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._usage = usage

    def format_usage(self) -> str:  # BooleanOptionalAction's `--x | --no-x`
        return self._usage or ""


def render_help(layout: dict) -> str:
    """`help_layout`'s parser's `format_help()`, wrapped for this terminal (argparse's own formatter)."""

    def kept(value: object) -> object:  # argparse tests SUPPRESS by identity
        return argparse.SUPPRESS if value == argparse.SUPPRESS else value

    parser = argparse.ArgumentParser(prog=layout["prog"], usage=kept(layout["usage"]),
                                     description=layout["description"], epilog=layout["epilog"],
                                     formatter_class=getattr(argparse, layout["formatter"]), add_help=False,
                                     allow_abbrev=False)
    parser._action_groups = []
    groups = [parser.add_argument_group(kept(title), kept(text)) for title, text in layout["groups"]]
    mutex = [groups[g].add_mutually_exclusive_group(required=required) for g, required in layout["mutex"]]
    for a in layout["actions"]:
        metavar = tuple(a["metavar"]) if isinstance(a["metavar"], list) else kept(a["metavar"])
        action = _Shown(a["usage"], option_strings=a["flags"], dest=kept(a["dest"]), nargs=kept(a["nargs"]),
                        metavar=metavar, choices=a["choices"], required=a["required"], help=kept(a["help"]))
        (groups[a["group"]] if a["mutex"] is None else mutex[a["mutex"]])._add_action(action)
    return parser.format_help()


class _ParserBuilt(Exception):
    """Stops Megatron-LM's parse_args once the parser holds every flag, before it parses anything."""


def _train_parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser with our flags, built as `megatron-jreg train` builds it (parse_args)."""
    from megatron.training import arguments

    from megatron_jreg.training.flags import add_jreg_args

    built: list[argparse.ArgumentParser] = []

    def capture(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        built.append(add_jreg_args(parser))
        raise _ParserBuilt

    try:
        arguments.parse_args(extra_args_provider=capture)
    except _ParserBuilt:
        pass
    return built[0]


def print_help() -> None:
    """Megatron-LM's help with our group; importing megatron.training costs 5-10 s, so its layout is cached."""
    import json

    cache = _help_cache()
    try:
        layout = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        layout = None
    if layout is None:
        import logging
        import warnings

        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layout = help_layout(_train_parser())
        with contextlib.suppress(OSError):  # a read-only home just means no cache
            from megatron_jreg.fileio import atomic_write

            cache.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(cache, fsync=False) as f:
                f.write(json.dumps(layout))
    sys.stdout.write(render_help(layout))


def _import_megatron_quietly() -> None:
    """Megatron-LM's training module without the dozen notices its import prints on every rank."""
    from megatron_jreg.checkpoints.model import quiet_megatron

    with quiet_megatron():
        import megatron.training.training  # noqa: F401 - optimizer, models, fused kernels: the noisy imports


def main(argv: list[str] | None = None) -> int:
    from megatron_jreg.errors import keep_output, output_code

    keep_output("megatron-jreg train")  # a closed or full stdout does not stop the run (errors.py)
    return output_code(_main(list(sys.argv[1:] if argv is None else argv)))


def _main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print_help()
        return 0
    debug = "--debug" in argv or os.environ.get("MEGATRON_JREG_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    _single_process_env()
    from megatron_jreg.process_env import huge_pages_for_cpu_training

    huge_pages_for_cpu_training()  # before torch loads (process_env.py)
    _import_megatron_quietly()
    from megatron_jreg.errors import Interrupted, JregError, ignore_further_interrupts, report
    from megatron_jreg.training.checkpointing import RankLost
    from megatron_jreg.training.run import run

    try:
        return run(argv)
    except KeyboardInterrupt:  # Ctrl-C before the run's own handler (startup) or past it: one line, not a traceback
        ignore_further_interrupts()
        return report("megatron-jreg train", Interrupted("interrupted (Ctrl-C); rerun to start again (with --load "
                                                         "of --save to resume from a checkpoint it holds)"), debug)
    except JregError as e:  # only ours: anything else is a failure whose traceback every rank shows
        # one line per run, not per rank; a lost rank is reported by every survivor (rank 0 may be the lost one)
        if debug or os.environ.get("RANK", "0") == "0" or isinstance(e, RankLost):
            return report("megatron-jreg train", e, debug)
        return e.exit_code


if __name__ == "__main__":  # dist_checkpointing's writer processes re-import __main__
    sys.exit(main())
