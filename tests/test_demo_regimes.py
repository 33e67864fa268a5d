"""experiments/demo_regimes: the committed table (experiments/demo_regimes/regimes.txt) is what its raw results give,
every raw result's command is the one the script builds, and bad --runs/--raw are one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "experiments" / "demo_regimes")]

import demo_regimes  # noqa: E402
from laptop_scale import Data  # noqa: E402

RAW = ROOT / "experiments" / "demo_regimes" / "raw"
RESULTS = ROOT / "experiments" / "demo_regimes" / "regimes.txt"


def _records() -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(RAW.glob("*.json"))]


def test_committed_table_is_the_raw_results():
    printed = [line for line in RESULTS.read_text(encoding="utf-8").splitlines() if not line.startswith("# ")]
    assert demo_regimes.table(_records()).splitlines() == printed, \
        "regenerate: python benchmarks/record.py experiments/demo_regimes/regimes.txt -- " \
        "python experiments/demo_regimes/demo_regimes.py --raw experiments/demo_regimes/raw"


def test_raw_commands_are_the_scripts():
    out = Path("/out")
    data = Data(out / "data", str(out / "data" / "tokenizer"), out / "data" / "train_text_document",
                out / "data" / "heldout_text_document")
    records = _records()
    assert {r["regime"] for r in records} <= set(demo_regimes.REGIMES)
    for r in records:
        regime = demo_regimes.REGIMES[r["regime"]]
        cmd = demo_regimes.train_command(regime, r["seed"], data, out / "runs" / f"{r['regime']}__seed-{r['seed']}")
        assert demo_regimes.recorded(cmd, out) == r["command"], r["regime"]
        assert [s["iteration"] for s in r["series"]] == list(range(regime.save, regime.stop_at + 1, regime.save))


def test_the_demo_trains_the_chosen_regime():
    import demo

    assert demo.MODEL == demo_regimes.REGIMES["12x64"].model
    assert any(r["regime"] == "12x64" for r in _records())


@pytest.mark.parametrize("argv, names", [
    (["--runs", "12x96:1"], "--runs 12x96:1"),
    (["--runs", "12x64"], "--runs 12x64"),
    ([], "--runs"),
    (["--raw", "experiments/demo_regimes/raw", "--runs", "12x64:1"], "--raw"),
])
def test_bad_arguments_are_one_line(argv, names, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        demo_regimes.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert names in err, err


def test_empty_raw_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        demo_regimes.main(["--raw", str(tmp_path)])
    assert e.value.code == 2
    assert f"--raw {tmp_path}: no raw results" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_trains_measures_every_checkpoint_and_resumes(tmp_path, monkeypatch):
    """A tiny regime through the real path: Megatron-LM training, every checkpoint measured, raw result written
    with its command; a second call finds the raw result and trains nothing."""
    from megatron.core import parallel_state

    tiny = demo_regimes.Regime(demo_regimes.Model(2, 32, 2, 64), batch=2, train_iters=4, stop_at=4, save=2)
    monkeypatch.setitem(demo_regimes.REGIMES, "tiny", tiny)
    try:
        raw = demo_regimes.run(tmp_path, "tiny", 3)
    finally:  # the in-process checkpoint loads leave megatron-core's parallel state for the next test
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    rec = json.loads(raw.read_text())
    assert (rec["regime"], rec["seed"]) == ("tiny", 3)
    assert [s["iteration"] for s in rec["series"]] == [2, 4]
    assert all(len(s["psi"]) == 2 and s["ce"] > 0 for s in rec["series"])
    assert rec["command"].startswith("python -m megatron_jreg.train --num-layers 2 ") and "$OUT/runs/tiny__seed-3" in \
        rec["command"] and "--seed 3" in rec["command"]
    stamp = raw.stat().st_mtime_ns
    assert demo_regimes.run(tmp_path, "tiny", 3) == raw and raw.stat().st_mtime_ns == stamp
    assert "tiny: 2 × 32" in demo_regimes.table([rec])
