"""What a resume compares with the checkpoint it starts from (training/run_record.py's `compare`): every JREG
setting the checkpoint recorded is reported when it changes, under its own flag; a setting a resume must keep is
refused in one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

SAVED = {"padded_vocab_size": 512, "vocab_size": 512, "global_batch_size": 4, "seq_length": 32, "seed": 1234,
         "layernorm_scaling": False,
         "jreg": {"lambda": 1.0, "alpha": 1.0, "distance": "angular", "layers": None, "min-weight": 0.0}}


def _now(**jreg: object) -> dict:
    return {**SAVED, "jreg": {**SAVED["jreg"], **jreg}}


def test_every_recorded_jreg_setting_is_compared_min_weight_included():
    from megatron_jreg.training.run_record import compare, flag_of

    changes = compare(Path("ckpt"), SAVED, _now(**{"min-weight": 0.01, "lambda": 0.5}), False, "--vocab-size 512")
    assert changes == {"jreg.lambda": [1.0, 0.5], "jreg.min-weight": [0.0, 0.01]}
    assert [flag_of(k) for k in changes] == ["--jreg-lambda", "--jreg-min-weight"]
    assert compare(Path("ckpt"), SAVED, _now(), False, "--vocab-size 512") == {}
    # a checkpoint saved before --jreg-min-weight existed recorded none: nothing to compare
    before = {**SAVED, "jreg": {k: v for k, v in SAVED["jreg"].items() if k != "min-weight"}}
    assert compare(Path("ckpt"), before, _now(**{"min-weight": 0.01}), False, "--vocab-size 512") == {}


def test_a_resume_must_keep_the_global_batch():
    from megatron_jreg.errors import UsageError
    from megatron_jreg.training.run_record import compare

    with pytest.raises(UsageError, match=r"--global-batch-size 8: ckpt was trained with --global-batch-size 4"):
        compare(Path("ckpt"), SAVED, {**SAVED, "global_batch_size": 8}, False, "--vocab-size 512")
    assert compare(Path("ckpt"), SAVED, {**SAVED, "global_batch_size": 8}, True, "--vocab-size 512") == {
        "global_batch_size": [4, 8]}
