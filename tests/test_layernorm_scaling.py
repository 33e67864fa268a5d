"""`--layernorm-scaling` (LayerNorm Scaling, Sun et al. 2025): the same losses at 1 rank, TP=2 and PP=2 (layer ℓ
numbered globally across stages), recorded in the checkpoint and refused on a changed resume, folded into the Hugging
Face export, which imports without the flag with the same logits; refused in one line where it cannot apply."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests._train_runs import TINY, records, train
from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

LNS = [*TINY, "--layernorm-scaling"]
RTOL = 1e-5


def _losses(path: Path) -> list[tuple[int, float, float]]:
    return [(r["iteration"], r["lm_loss"], r["jreg_loss"]) for r in records(path) if "lm_loss" in r]


def convert(argv: list[str]) -> tuple[int, str, str]:
    """`megatron-jreg convert ARGV` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from megatron_jreg.convert.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def two_rank_runs(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for name, extra in (("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                        ("pp2", ["--pipeline-model-parallel-size", "2"])):
        out[name] = train(LNS + extra + ["--metrics-file", f"{tmp}/{name}.jsonl"])[0]
    return out


def single_rank_runs(rank: int, world: int, tmp: str) -> dict:
    import torch

    from megatron_jreg.checkpoints.model import load_megatron_model

    out: dict = {}
    out["one"] = train(LNS + ["--metrics-file", f"{tmp}/one.jsonl", "--save", f"{tmp}/lns", "--save-interval", "4"])[0]
    out["plain"] = train(TINY + ["--metrics-file", f"{tmp}/plain.jsonl", "--save", f"{tmp}/plain",
                                 "--save-interval", "4"])[0]
    more = ["--train-iters", "6", "--save-interval", "2"]
    out["resume_without"] = train(TINY + more + ["--load", f"{tmp}/lns", "--save", f"{tmp}/lns"])
    out["resume_with"] = train(LNS + more + ["--load", f"{tmp}/plain", "--save", f"{tmp}/plain"])
    out["finetune_without"] = train(TINY + ["--load", f"{tmp}/lns", "--finetune", "--train-iters", "2",
                                            "--save", f"{tmp}/finetuned", "--save-interval", "1"])
    out["te"] = train([a for a in LNS if a not in ("--transformer-impl", "local")])
    # an untrained model: --lr 0 keeps every weight at its initialisation (norm weights 1)
    out["untrained"] = train(LNS + ["--lr", "0", "--min-lr", "0", "--train-iters", "2", "--save", f"{tmp}/untrained",
                                    "--save-interval", "2"])
    for name in ("untrained", "lns"):
        out[f"export_{name}"] = convert(["mcore-to-hf", "--load", f"{tmp}/{name}", "--output", f"{tmp}/hf_{name}",
                                         "--no-tokenizer", "--verify"])
    out["import"] = convert(["hf-to-mcore", "--hf", f"{tmp}/hf_lns", "--output", f"{tmp}/imported", "--seq-length",
                             "32"])
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        source = load_megatron_model(f"{tmp}/lns").logits(tokens)
        imported_model = load_megatron_model(f"{tmp}/imported")
        out["imported_scaling"] = bool(getattr(imported_model.args, "layernorm_scaling", False))
        imported = imported_model.logits(tokens)[..., : source.shape[-1]]
        plain = load_megatron_model(f"{tmp}/plain").logits(tokens)
    out["import_diff"] = float((source - imported).abs().max())
    out["plain_diff"] = float((source - plain).abs().max())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lns")
    two = run_ranks(two_rank_runs, 2, str(tmp), timeout=1200)
    one = run_ranks(single_rank_runs, 1, str(tmp), timeout=1200)[0]
    return {"tmp": tmp, "two": two[1], "one": one}


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_same_losses_at_one_rank_tp2_and_pp2(runs, layout):
    assert runs["one"]["one"] == 0 and runs["two"][layout] == 0
    ref, got = _losses(runs["tmp"] / "one.jsonl"), _losses(runs["tmp"] / f"{layout}.jsonl")
    assert [r[0] for r in got] == [1, 2, 3, 4]
    for (_, lm_ref, j_ref), (_, lm, j) in zip(ref, got):
        assert lm == pytest.approx(lm_ref, rel=RTOL) and j == pytest.approx(j_ref, rel=RTOL)


def test_scaling_changes_the_model(runs):
    assert runs["one"]["plain"] == 0
    lns, plain = _losses(runs["tmp"] / "one.jsonl"), _losses(runs["tmp"] / "plain.jsonl")
    assert lns[0][1] != pytest.approx(plain[0][1], rel=1e-4)  # the same weights, another function
    assert runs["one"]["plain_diff"] > 1e-3


@pytest.mark.parametrize("case, needle", [
    ("resume_without", "no --layernorm-scaling: "),
    ("resume_with", "--layernorm-scaling: "),
])
def test_a_resume_that_changes_the_scaling_is_one_line(runs, case, needle):
    rc, _, err = runs["one"][case]  # in process: Megatron-LM's warnings of the earlier runs may print beside it
    lines = [line for line in err.splitlines() if line.startswith("megatron-jreg train: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"megatron-jreg train: error: {needle}") and "--finetune" in lines[0]


def test_finetune_may_change_it(runs):
    rc, _, err = runs["one"]["finetune_without"]
    assert rc == 0, err


def test_transformer_engine_spec_is_refused_in_one_line(runs):
    rc, _, err = runs["one"]["te"]
    assert rc == 2 and "--layernorm-scaling with --transformer-impl transformer_engine" in err


def test_export_folds_the_factor_into_the_norm_weights(runs):
    from safetensors.torch import load_file

    assert runs["one"]["untrained"][0] == 0, runs["one"]["untrained"][2]
    assert runs["one"]["export_untrained"][0] == 0, runs["one"]["export_untrained"][2]
    tensors = {}
    for shard in (runs["tmp"] / "hf_untrained").glob("*.safetensors"):
        tensors.update(load_file(shard))
    for i in range(4):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = tensors[f"model.layers.{i}.{norm}.weight"]
            assert w.eq(1 / math.sqrt(i + 1)).all(), (i, norm, w[:4])
    assert tensors["model.norm.weight"].eq(1).all()  # the final norm is not a layer's


def test_export_verifies_and_imports_without_the_flag_with_the_same_logits(runs):
    rc, out, err = runs["one"]["export_lns"]
    assert rc == 0, err
    assert runs["one"]["import"][0] == 0, runs["one"]["import"][2]
    assert runs["one"]["imported_scaling"] is False
    assert runs["one"]["import_diff"] < 1e-4
