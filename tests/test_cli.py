"""`megatron-jreg`: every command's --help prints and ends with one example; --version; unknown commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_jreg import __version__, cli

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


@pytest.mark.slow
def test_train_help_is_megatron_lms_with_ours_and_exits_0():
    """megatron-core 0.19.2's help for --moe-paged-stash-buffer-size-factor-cuda holds a bare `%` that makes
    argparse raise (Megatron-LM's pretrain_gpt.py --help too); ours prints, with Megatron-LM's flags."""
    proc = subprocess.run([sys.executable, "-m", "megatron_jreg.cli", "train", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for flag in ("--moe-paged-stash-buffer-size-factor-cuda", "(e.g. 1.10 = 10%)", "--tensor-model-parallel-size",
                 "--jreg-lambda", "--metrics-file"):
        assert flag in proc.stdout, flag
    _ends_with_example(proc.stdout, "train")


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
    assert "unknown command 'no-such-command'" in capsys.readouterr().err
