"""The logs as Megatron-LM users read them: --metrics-file holds the console's own numbers, one validation record
per evaluation, and the progress bar never writes over Megatron-LM's lines.

One spawned rank trains the tiny model once (--log-interval 3, evaluations every 3 iterations, then Megatron-LM's
final validation and test), with stdout and stderr in one buffer as on a terminal and the progress bar on.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from tests._train_runs import TINY, records
from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

LINE = re.compile(r"iteration +(\d+)/ *\d+ \|.*? elapsed time per iteration \(ms\): ([0-9.]+) \|.*? lm loss: "
                  r"([0-9.E+-]+) \|")


def _run(rank: int, world: int, tmp: str) -> dict:
    from megatron_jreg.train import main

    argv = [a for a in TINY if a != "--no-progress"] + [
        "--train-iters", "6", "--log-interval", "3", "--eval-interval", "3", "--progress",
        "--metrics-file", f"{tmp}/metrics.jsonl"]
    terminal = io.StringIO()  # both streams, as a terminal shows them
    with contextlib.redirect_stdout(terminal), contextlib.redirect_stderr(terminal):
        rc = main(argv)
    return {"rc": rc, "terminal": terminal.getvalue(), "records": records(f"{tmp}/metrics.jsonl")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = run_ranks(_run, 1, str(tmp_path_factory.mktemp("logs")))[0]
    assert out["rc"] == 0, out["terminal"][-3000:]
    return out


def _shown(terminal: str) -> list[str]:
    """What each terminal line shows at the end: the text after its last carriage return (a log line written
    over the bar would show as the bar's text followed by it)."""
    return [segment.rpartition("\r")[2] for segment in terminal.split("\n")]


def test_metrics_file_has_the_console_loss_window_and_elapsed_time(run):
    """Megatron-LM's line after its first covers iterations 1-3 (its first line does not reset the window)."""
    console = {int(it): (float(ms), float(loss)) for it, ms, loss in LINE.findall(run["terminal"])}
    train = {r["iteration"]: r for r in run["records"] if "lm_loss" in r}
    assert sorted(console) == sorted(train) == [1, 3, 6]
    for it, (ms, loss) in console.items():
        assert train[it]["lm_loss"] == pytest.approx(loss, rel=1e-6), it
        assert train[it]["iteration_ms"] == pytest.approx(ms, abs=0.051), it


def test_one_validation_record_per_evaluation(run):
    val = [(r["iteration"], r["split"], r["final"]) for r in run["records"] if "val_loss" in r]
    assert val == [(3, "valid", False), (6, "valid", False), (6, "valid", True), (6, "test", True)]
    assert len(re.findall(r" validation loss at iteration", run["terminal"])) == len(val)
    assert len(set(val)) == len(val)


def test_progress_bar_never_writes_over_megatron_lm_lines(run):
    shown = _shown(run["terminal"])
    megatron = [line for line in shown if re.search(r"iteration +\d+/", line)]
    assert len(megatron) == 3 and all(line.startswith(" [20") for line in megatron), megatron  # each line intact
    bar = [line for line in shown if "%|" in line]
    assert bar and all(re.fullmatch(r"train: +\d+%\|.*\]", line) for line in bar), bar  # nothing written after it
    assert bar and "6/6" in bar[-1]  # the bar's last state, on its own line at the end
    ms = float(LINE.findall(run["terminal"])[-1][1])  # its rate is Megatron-LM's last elapsed time per iteration
    rate = f"{ms / 1000:5.2f}s/it" if ms > 1000 else f"{1000 / ms:5.2f}it/s"
    assert rate in bar[-1], (rate, bar[-1])
