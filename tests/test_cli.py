"""`megatron-jreg`: every command's --help prints and ends with one example; --version; unknown commands."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_jreg import __version__, cli
from megatron_jreg.usage import example

ROOT = Path(__file__).resolve().parent.parent
IN_PROCESS = [name for name in cli.COMMANDS if name not in ("train", "lm-eval")] + [
    "convert mcore-to-hf", "convert hf-to-mcore",
]


def _help(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main([*argv, "--help"])
    except SystemExit as e:  # argparse's --help
        rc = e.code
    return rc, capsys.readouterr().out


def _ends_with_example(text: str, command: str) -> None:
    lines = text.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line == "example:")
    example = " ".join(line.strip().rstrip("\\") for line in lines[start + 1:])
    assert example.startswith(f"megatron-jreg {command} "), text[-800:]


@pytest.mark.parametrize("command", IN_PROCESS)
def test_every_command_help_ends_with_an_example(command, capsys):
    rc, out = _help(command.split(), capsys)
    assert rc == 0
    _ends_with_example(out, command.split()[0] if command.startswith("convert") else command)


def _parser(command: str) -> argparse.ArgumentParser:
    """The parser of `megatron-jreg COMMAND` (`convert mcore-to-hf`: that direction's)."""
    import importlib

    name, _, direction = command.partition(" ")
    parser = importlib.import_module(cli.COMMANDS[name][0]).build_parser()
    if direction:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[direction]
    return parser


def _without_default(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags whose --help does not say what they default to. Needing no word: required flags, a switch that
    is off unless given (--no-tokenizer), one of a mutually exclusive choice (--hf | --load), a repeatable flag
    that adds nothing unless given, subcommands."""
    chosen = {id(a) for group in parser._mutually_exclusive_groups for a in group._group_actions}
    silent = (argparse._HelpAction, argparse._SubParsersAction)
    missing = []
    for a in parser._actions:
        switch = isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction) and a.default is not a.const
        repeatable = isinstance(a, argparse._AppendAction) and not a.default
        if a.help == argparse.SUPPRESS or isinstance(a, silent) or a.required or switch or repeatable \
                or id(a) in chosen:
            continue
        if "default" not in (a.help or ""):
            missing.append(a)
    return missing



@pytest.mark.parametrize("command", IN_PROCESS)
def test_every_flag_says_its_default_in_help(command):
    """issue 33: several `--help` entries lacked their defaults (evaluate --batch-size and train-tokenizer --kind
    had no help at all). Megatron-LM's own tokenizer flags in preprocess are as Megatron-LM wrote them, as train's."""
    missing = _without_default(_parser(command))
    if command == "preprocess":
        from megatron_jreg.data.tokenizers import tokenizer_defaults

        missing = [a for a in missing if a.dest not in tokenizer_defaults()]
    assert [a.option_strings[0] for a in missing] == []


@pytest.mark.slow
def test_train_help_is_megatron_lms_with_ours_quiet_and_then_quick_at_any_width(tmp_path):
    """megatron-core 0.19.2's help for --moe-paged-stash-buffer-size-factor-cuda holds a bare `%` that makes
    argparse raise (Megatron-LM's pretrain_gpt.py --help too); ours prints, with Megatron-LM's flags, without
    the dozen apex/Transformer Engine warnings of importing megatron.training; the next time from the cache,
    without importing it, also in a terminal of another width (issue 33: ≤ 5 s; the kept copy was the text at
    one width, so a 137-column terminal built it again, ~27 s; the times are in docs/results/train_help.txt)."""
    import time

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("PYTHONWARNINGS", None)
    runs = []
    for columns in ("100", "137"):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "megatron_jreg.cli", "train", "--help"], capture_output=True,
                              text=True, cwd=ROOT, timeout=300, check=False, env={**env, "COLUMNS": columns})
        runs.append((proc, time.perf_counter() - start))
    (cold, _), (warm, warm_s) = runs
    for proc in (cold, warm):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stderr == "", proc.stderr[-2000:]  # no warning lines
    for flag in ("--moe-paged-stash-buffer-size-factor-cuda", "(e.g. 1.10 = 10%)", "--tensor-model-parallel-size",
                 "--jreg-lambda", "--metrics-file", "--allow-cpu"):
        assert flag in " ".join(cold.stdout.split()), flag
    _ends_with_example(cold.stdout, "train")
    assert "".join(warm.stdout.split()) == "".join(cold.stdout.split())  # the same help,
    assert warm.stdout != cold.stdout  # wrapped at the new width (docs/results/train_help.txt: 137 columns)
    assert len(list((tmp_path / "megatron-jreg").glob("train-help-*.json"))) == 1
    assert warm_s < 5, warm_s  # a Python start, a file read and argparse; a guard against importing torch


@pytest.mark.slow
def test_train_help_from_the_kept_layout_is_megatron_lms_help_at_every_width(monkeypatch):
    """The kept layout, formatted at any width, is what Megatron-LM's parser with our flags prints there."""
    import contextlib
    import io
    import json
    import warnings

    from megatron_jreg import train

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron_jreg.training.flags import parse_args

        layout = json.loads(json.dumps(train.help_layout(train._train_parser())))
    for columns in ("60", "80", "137", "300"):
        monkeypatch.setenv("COLUMNS", columns)
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
            parse_args(["--help"])
        assert train.render_help(layout) == text.getvalue(), columns


def _tricky_parser() -> argparse.ArgumentParser:
    """What argparse's help can hold: positionals, %-fields, choices, metavar tuples, --x/--no-x, suppressed
    flags, required and optional mutually exclusive groups, a titled group, the raw epilog of every command."""
    p = argparse.ArgumentParser(prog="megatron-jreg x", description="%(prog)s does x", allow_abbrev=False,
                                **example("megatron-jreg x IN --a 1"))
    p.add_argument("input", help="a positional")
    p.add_argument("--a", type=int, default=3, help="50%% of it (default: %(default)s, a %(type)s)")
    p.add_argument("--b", choices=[1, 2], help="one of %(choices)s")
    p.add_argument("--c", nargs=2, metavar=("X", "Y"), help="two values " * 12)
    p.add_argument("--d", action=argparse.BooleanOptionalAction, default=None, help="on or off")
    p.add_argument("--e", help=argparse.SUPPRESS)
    p.add_argument("--f", nargs="*", required=True, help="many")
    one = p.add_mutually_exclusive_group(required=True)
    one.add_argument("--g", action="store_true", help="g")
    one.add_argument("--h2", type=float, help="h2")
    group = p.add_argument_group("mine", "my own flags")
    group.add_argument("--i", action="append", default=[], help="repeatable")
    either = group.add_mutually_exclusive_group()
    either.add_argument("--j", nargs="?", const=1)
    either.add_argument("--k", action="count")
    return p


@pytest.mark.parametrize("columns", ["30", "80", "137", "250"])
def test_help_layout_formats_as_argparse_at_any_width(columns, monkeypatch):
    """`train --help` keeps its parser's layout, not its text (width-free, JSON): formatted again it is
    argparse's own help at the terminal's width."""
    import json

    from megatron_jreg import train

    parser = _tricky_parser()
    layout = json.loads(json.dumps(train.help_layout(parser)))
    monkeypatch.setenv("COLUMNS", columns)
    assert train.render_help(layout) == parser.format_help()


def test_train_help_cache_key_follows_megatron_core_and_our_flags_not_the_width(tmp_path, monkeypatch):
    from megatron_jreg import train

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    first = train._help_cache()
    assert first.parent == tmp_path / "megatron-jreg" and first == train._help_cache()
    monkeypatch.setenv("COLUMNS", "140")
    assert train._help_cache() == first  # one kept layout serves every width
    monkeypatch.setattr(train, "_HELP_SOURCES", train._HELP_SOURCES[:-1])  # another set of flag sources
    assert train._help_cache() != first


def test_lm_eval_help_is_lm_evals_then_our_example(capsys):
    rc, out = _help(["lm-eval"], capsys)
    assert rc == 0 and "Language Model Evaluation Harness" in out
    _ends_with_example(out, "lm-eval")


def test_version_and_top_level_usage(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"megatron-jreg {__version__} (megatron-core 0.19.2)")
    assert cli.main([]) == 0
    _ends_with_example(capsys.readouterr().out, "analyze")
    assert cli.main(["no-such-command"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'no-such-command'" in err and "did you mean" not in err


@pytest.mark.parametrize("typo,meant", [("trian", "train"), ("analyse", "analyze"), ("convrt", "convert"),
                                        ("preprocces", "preprocess"), ("lm_eval", "lm-eval")])
def test_mistyped_command_gets_did_you_mean(capsys, typo, meant):
    assert cli.main([typo, "--help"]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first == f"megatron-jreg: unknown command {typo!r}; did you mean {meant!r}?"


def test_a_data_worker_ending_mid_handover_while_stopping_is_no_traceback(capsys, monkeypatch):
    """Once a command stops (Ctrl-C), a data worker that ends mid-way through handing a shared tensor to the main
    process makes multiprocessing's resource-sharer thread report a ConnectionResetError through sys.excepthook
    (a traceback after the command's one line: seen with Ctrl-C pressed on); it is dropped, other errors are not."""
    import signal

    from megatron_jreg.errors import ignore_further_interrupts

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    previous = signal.getsignal(signal.SIGINT)
    try:
        ignore_further_interrupts()
        ignore_further_interrupts()  # wrapped once
        for code, name in (("raise ConnectionResetError(104, 'reset')", "multiprocessing/resource_sharer.py"),
                           ("raise ConnectionResetError(104, 'elsewhere')", "elsewhere.py"),
                           ("raise ValueError('not a connection')", "multiprocessing/resource_sharer.py")):
            try:
                exec(compile(code, name, "exec"))
            except Exception:  # noqa: BLE001
                sys.excepthook(*sys.exc_info())
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert "reset" not in err and "elsewhere" in err and "not a connection" in err, err
