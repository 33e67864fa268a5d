"""Preprocessed WikiText → `train` → the checkpoint read directly by `analyze` and `evaluate`.

One spawned rank does the whole chain (megatron-core needs its process group):
- the training CLI trains on `preprocess` output (issue 4's end-to-end check);
- Ψ/ζ that `analyze` measures on the checkpoint equal what the training run logged for the same weights
  and the same validation samples (one definition, one implementation);
- `evaluate --load` runs LAMBADA and an lm-eval task on the megatron model, offline.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest

from tests.distributed import run_ranks

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2"
LAMBADA = REPO / "megatron_jreg" / "resources" / "lambada_test.jsonl"


def _validation_tokens(argv: list[str], count: int):
    """The first `count` validation samples of a run, as Megatron-LM's loop validates them: its datasets
    provider on the run's own flags (the valid sampler starts at sample 0)."""
    import torch
    from megatron.core import parallel_state
    from megatron.training.training import get_train_valid_test_num_samples

    from megatron_jreg.training.data import train_valid_test_datasets_provider
    from megatron_jreg.training.run import parse_and_validate, teardown

    try:
        parse_and_validate(argv)
        parallel_state.initialize_model_parallel()
        _, valid_ds, _ = train_valid_test_datasets_provider(get_train_valid_test_num_samples())
        return torch.stack([torch.as_tensor(valid_ds[i]["tokens"]) for i in range(count)])
    finally:
        teardown()


def _chain(rank: int, world: int, tmp: str) -> dict:
    import torch

    from megatron_jreg.analysis.megatron_source import load_megatron_source
    from megatron_jreg.data.preprocess import PreprocessConfig, preprocess
    from megatron_jreg.data.text import wikitext_articles
    from megatron_jreg.data.train_tokenizer import train_tokenizer
    from megatron_jreg.train import main as train_main

    out: dict = {}
    root = Path(tmp)
    for split, source in (("train", "valid.txt"), ("valid", "test.txt")):
        with open(root / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for article in wikitext_articles(WIKITEXT / source)[:6]:
                f.write(json.dumps({"text": article}) + "\n")
    tokenizer = train_tokenizer([str(root / "train.jsonl")], str(root / "tok"), 512, kind="hf-bpe")
    for split in ("train", "valid"):
        preprocess(PreprocessConfig(input=[str(root / f"{split}.jsonl")], output_prefix=str(root / split),
                                    tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tokenizer,
                                    append_eod=True, workers=1))
    argv = (
        "--model-preset tiny --num-layers 3 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
        "--num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --transformer-impl local "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 3e-3 --log-interval 1 --eval-interval 3 "
        "--eval-iters 2 --jreg-lambda 1 --no-progress --tokenizer-type HuggingFaceTokenizer --save-interval 3"
    ).split() + [
        "--tokenizer-model", tokenizer, "--train-data-path", f"{tmp}/train_text_document",
        "--valid-data-path", f"{tmp}/valid_text_document", "--save", f"{tmp}/ckpt",
        "--metrics-file", f"{tmp}/metrics.jsonl",
    ]
    out["train_rc"] = train_main(argv)
    records = [json.loads(x) for x in Path(f"{tmp}/metrics.jsonl").read_text().splitlines()]
    out["logged"] = [r for r in records if "val_loss" in r][0]  # the validation at iteration 3

    # The same validation samples, measured on the checkpoint by the analysis source.
    tokens = _validation_tokens(argv, 2 * 4)
    source = load_megatron_source(Path(f"{tmp}/ckpt"), label="ckpt", dtype=torch.float32, device="cpu")
    sums, counts = source.layer_sums(tokens, torch.ones_like(tokens), "angular")
    out["analyzed_psi"] = (sums / counts).tolist()
    # Padding invariance on the megatron path: one padded batch equals the rows measured alone.
    rows = [source.encode(["The quick brown fox jumps over the lazy dog ."])[0], source.encode(["Hello world"])[0]]
    width = max(map(len, rows))
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    batch_s, _ = source.layer_sums(ids, mask, "angular")
    alone = sum(source.layer_sums(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long), "angular")[0]
                for r in rows)
    out["padding"] = (batch_s.tolist(), alone.tolist())
    source.close()

    # The CLIs on the checkpoint.
    from megatron_jreg.analysis.cli import main as analyze_main
    from megatron_jreg.convert.cli import main as convert_main
    from megatron_jreg.evaluate.cli import main as evaluate_main
    from tests.test_evaluate import LAMBADA_TASK_YAML

    passages = root / "lambada16.jsonl"
    passages.write_text("".join(LAMBADA.read_text(encoding="utf-8").splitlines(keepends=True)[:16]), encoding="utf-8")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "lambada_local.yaml").write_text(LAMBADA_TASK_YAML.format(path=passages), encoding="utf-8")
    os.environ["DISABLE_MULTIPROC"] = "1"  # lm-eval's perplexity stderr bootstrap, in-process
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out["analyze_rc"] = analyze_main(["--model", f"{tmp}/ckpt", "--data", f"lambada:{LAMBADA}", "--num-samples",
                                          "8", "--output", f"{tmp}/analysis", "--no-progress"])
        out["evaluate_rc"] = evaluate_main(["--load", f"{tmp}/ckpt", "--tasks", "lambada,lambada_local",
                                            "--lambada-file", str(passages), "--include-path", str(tasks),
                                            "--output", f"{tmp}/eval.json"])
        out["convert_rc"] = convert_main(["mcore-to-hf", "--load", f"{tmp}/ckpt", "--output", f"{tmp}/hf"])
        out["evaluate_hf_rc"] = evaluate_main(["--hf", f"{tmp}/hf", "--tasks", "lambada", "--lambada-file",
                                               str(passages), "--output", f"{tmp}/eval_hf.json"])
    out["stdout"] = buf.getvalue()
    return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chain")
    return run_ranks(_chain, 1, str(tmp))[0], tmp


def test_training_cli_trains_on_preprocessed_data(chain):
    out, _ = chain
    assert out["train_rc"] == 0
    assert out["logged"]["iteration"] == 3 and out["logged"]["val_loss"] < 7.0  # below ln(512) ≈ 6.24 + slack


def test_analyze_of_checkpoint_equals_training_log(chain):
    out, _ = chain
    assert out["analyzed_psi"] == pytest.approx(out["logged"]["psi"], rel=1e-5)


def test_megatron_source_ignores_padding(chain):
    out, _ = chain
    batch, alone = out["padding"]
    assert batch == pytest.approx(alone, rel=1e-5)


def test_analyze_and_evaluate_clis_read_the_checkpoint(chain):
    out, tmp = chain
    assert out["analyze_rc"] == 0, out["stdout"]
    results = json.loads((tmp / "analysis" / "results.json").read_text())
    assert results and "zeta_L" in json.dumps(results)
    assert out["evaluate_rc"] == 0, out["stdout"]
    record = json.loads((tmp / "eval.json").read_text())
    assert record["model"]["iteration"] == 3  # the latest, read from the checkpoint (none was asked for)
    lambada = record["results"]["lambada"]
    assert 0.0 <= lambada["acc"] <= 1.0 and lambada["perplexity"] > 1.0


def test_lm_eval_task_runs_offline_on_the_megatron_checkpoint(chain):
    out, tmp = chain
    evaluated = json.loads((tmp / "eval.json").read_text())["results"]
    builtin, harness = evaluated["lambada"], evaluated["lambada_local"]
    assert harness["acc"] == pytest.approx(builtin["acc"])  # the same 16 passages through lm-eval
    assert harness["perplexity"] == pytest.approx(builtin["perplexity"], rel=1e-4)


def test_megatron_checkpoint_and_its_hf_export_score_the_same(chain):
    out, tmp = chain
    assert out["convert_rc"] == 0 and out["evaluate_hf_rc"] == 0, out["stdout"]
    megatron = json.loads((tmp / "eval.json").read_text())["results"]["lambada"]
    hf = json.loads((tmp / "eval_hf.json").read_text())["results"]["lambada"]
    assert hf["acc"] == megatron["acc"]
    assert hf["perplexity"] == pytest.approx(megatron["perplexity"], rel=1e-4)
