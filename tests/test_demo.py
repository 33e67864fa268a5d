"""`make demo`'s own lines (examples/demo.py): what it will take before it starts, an ETA while it trains, and a
CE difference of one seed printed as one seed's. The training itself is examples/demo.py end to end (~15 min of
two cores), recorded in docs/results/demo.txt; here the parts that print."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples")]

import demo  # noqa: E402


def _result(name: str, pattern: str) -> str:
    return re.search(pattern, (ROOT / "docs" / "results" / name).read_text(encoding="utf-8"), re.M).group(1)


def test_the_estimate_is_the_recorded_run():
    """Wall time and disk use come from the results files the README cites (a re-recorded run must update both)."""
    assert demo.RECORDED_WALL_S == int(_result("demo.txt", r"^# wall: (\d+) s"))
    steps, scheduled = _result("demo.txt", r"\((\d+ of \d+) scheduled steps").split(" of ")
    assert demo.RECORDED_STEPS == int(steps) == int(scheduled) == demo.REGIME.train_iters
    assert demo.RECORDED_DISK_MB == int(_result("demo_disk.txt", r"^disk_mb=(\d+)$"))
    line = demo.estimate(demo.REGIME.train_iters)
    assert line.startswith("about 11 min on 2 CPU cores") and "32 MB of disk" in line
    assert "about 1 min" in demo.estimate(20)  # never "0 min"
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"{demo.RECORDED_WALL_S} s on two shared CPU cores" in readme and f"{demo.RECORDED_DISK_MB} MB of disk" \
        in readme


def test_progress_gives_an_eta_at_the_slower_runs_pace_after_start_up():
    progress = demo.Progress(3000)
    record = lambda iteration: {"iteration": iteration, "lm_loss": 5.0}  # noqa: E731
    assert progress.line(30, {"baseline": (False, None), "jreg": (False, None)}).endswith(
        "baseline: starting | jreg: starting")
    # the first records seen: the pace is not known yet (start-up is behind them, not part of it)
    first = progress.line(60, {"baseline": (False, record(50)), "jreg": (False, record(1))})
    assert "ETA" not in first and "baseline: iter 50/3000 lm loss 5.000" in first
    # 100 s later: baseline 500 steps (0.2 s each), jreg 400 (0.25 s each): jreg's 2,599 left take 649.75 s
    later = progress.line(160, {"baseline": (False, record(550)), "jreg": (False, record(401))})
    assert later.endswith("ETA 10:49"), later
    done = progress.line(700, {"baseline": (True, record(3000)), "jreg": (False, record(2801))})
    assert done.endswith("ETA 0:45") and "baseline: finished" in done  # 640 s / 2,800 steps × 199 left


def test_the_ce_difference_is_printed_as_one_seeds():
    line = demo.ce_difference({"baseline": {"ce": 4.343}, "jreg": {"ce": 4.345}})
    assert line.startswith("JREG − baseline held-out CE: +0.05 % (one seed: not a measure of JREG's effect on CE;")
    assert "docs/study.md" in line and "finds JREG α = 1 worse" in line
    # what the line says the study finds is what the README's summary of the study says
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert re.search(r"JREG α = 1 is \*\*worse\*\* on held-out CE", readme), "update demo.ce_difference's summary"
