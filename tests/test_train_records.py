"""What a training run records, without training: --metrics-file's loss windows (Megatron-LM's float32 sums, kept
across a checkpoint), its rows after a resume, non-finite values, and where JREG saw hidden states turn NaN.

Unit tier: plain tensors and files."""

from __future__ import annotations

import json
from pathlib import Path


def test_loss_window_is_megatron_lm_s_sum_and_survives_a_checkpoint():
    """--metrics-file's window: float32 sums as Megatron-LM's training_log makes them; a state restored from JSON
    continues with the same bits; skipped iterations counted apart, a window of only skipped ones has no loss."""
    import torch

    from megatron_jreg.training.metrics import LossWindow

    losses = [torch.tensor(x, dtype=torch.float32) for x in (6.2354936599731445, 6.254260540008545, 6.1944842338)]
    megatron = torch.tensor([0.0])
    for loss in losses:
        megatron = megatron + loss
    whole = LossWindow()
    for loss in losses:
        whole.add(loss, skipped=False)
    assert whole.mean() == float(megatron) / 3
    part = LossWindow()
    part.add(losses[0], skipped=False)
    part.add(None, skipped=True)
    resumed = LossWindow.restore(json.loads(json.dumps(part.state())))
    for loss in losses[1:]:
        resumed.add(loss, skipped=False)
    assert resumed.mean() == whole.mean() and resumed.skipped == 1 and resumed.advanced == 3
    skipped = LossWindow()
    skipped.add(losses[0], skipped=True)
    assert skipped.mean() is None and skipped.skipped == 1


def test_metrics_file_after_a_resume_holds_one_row_per_iteration(tmp_path, capsys):
    """Rows past the iteration a run resumes from (lost work, replayed next) move to PATH.replaced; nothing is
    dropped; a first open without earlier rows changes nothing."""
    from megatron_jreg.training.metrics import MetricsFile

    path = tmp_path / "m.jsonl"
    rows = [{"iteration": i, "lm_loss": 1.0 / i} for i in (1, 2, 3, 4, 5)] + [{"iteration": 4, "split": "valid"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = MetricsFile(str(path), active=True)
    metrics.open(3)
    metrics.write({"iteration": 4, "lm_loss": float("nan"), "psi": [0.5, float("inf")], "lr": 0.1})
    metrics.close()
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in kept] == [1, 2, 3, 4] and kept[-1]["lm_loss"] is None
    assert kept[-1]["psi"] == [0.5, None] and kept[-1]["nonfinite"] == ["lm_loss", "psi"]
    moved = [json.loads(line) for line in Path(f"{path}.replaced").read_text().splitlines()]
    assert moved == rows[3:]
    assert "3 row(s) after iteration 3" in capsys.readouterr().out
    fresh = MetricsFile(str(tmp_path / "new.jsonl"), active=True)
    fresh.open(0)
    fresh.close()
    assert (tmp_path / "new.jsonl").read_text() == "" and not Path(f"{tmp_path / 'new.jsonl'}.replaced").exists()


def test_the_first_non_finite_layer_is_on_the_console_line_and_in_the_row():
    from megatron_jreg.plugin import JregStats
    from megatron_jreg.training.metrics import console_suffix, jreg_fields

    nan = float("nan")
    stats = JregStats(psi=[0.1, nan, nan], jreg_loss=nan, zeta={"zeta_L": nan}, first_nonfinite_layer=2)
    assert jreg_fields(stats)["first_nonfinite_layer"] == 2
    assert console_suffix(stats).endswith(" psi: 0.1000,nan,nan | first non-finite layer: 2 |")
    finite = JregStats(psi=[0.1, 0.2], jreg_loss=0.1, zeta={"zeta_L": 10.0})
    assert "first_nonfinite_layer" not in jreg_fields(finite) and "non-finite" not in console_suffix(finite)


def test_metrics_file_with_bytes_that_are_not_utf8_is_resumed_and_kept(tmp_path):
    """issue 46.9: a --metrics-file holding a line that is not UTF-8 (a damaged row) stopped the resume with a
    UnicodeDecodeError traceback; its bytes stay where they were, later rows still move aside."""
    from megatron_jreg.training.metrics import MetricsFile

    path = tmp_path / "m.jsonl"
    damaged = b'{"iteration": 2, "note": "\xff\xfe"}\n'
    path.write_bytes(b'{"iteration": 1}\n' + damaged + b'\x80garbage\n{"iteration": 3}\n{"iteration": 4}\n')
    metrics = MetricsFile(str(path), active=True)
    metrics.open(3)
    metrics.write({"iteration": 4, "lm_loss": 1.0})
    metrics.close()
    assert path.read_bytes() == (b'{"iteration": 1}\n' + damaged + b'\x80garbage\n{"iteration": 3}\n'
                                 b'{"iteration": 4, "lm_loss": 1.0}\n')
    assert Path(f"{path}.replaced").read_bytes() == b'{"iteration": 4}\n'
