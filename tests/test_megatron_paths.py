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

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2"
LAMBADA = REPO / "megatron_jreg" / "resources" / "lambada_test.jsonl"


def _chain(rank: int, world: int, tmp: str) -> dict:
    import torch

    from megatron_jreg.analysis.megatron_source import load_megatron_source
    from megatron_jreg.config import train_config_from_dict
    from megatron_jreg.data.preprocess import PreprocessConfig, preprocess
    from megatron_jreg.data.text import wikitext_articles
    from megatron_jreg.data.train_tokenizer import train_tokenizer
    from megatron_jreg.train import main as train_main
    from megatron_jreg.training import checkpoint as ckpt
    from megatron_jreg.training.data import BatchLoader, build_datasets, tokenizer_for

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
        "--num-layers 3 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
        "--global-batch-size 4 --train-iters 3 --lr 3e-3 --log-interval 1 --eval-interval 3 --eval-iters 2 "
        "--jreg-lambda 1 --no-progress --tokenizer-type HuggingFaceTokenizer"
    ).split() + [
        "--tokenizer-model", tokenizer, "--train-data-path", f"{tmp}/train_text_document",
        "--valid-data-path", f"{tmp}/valid_text_document", "--save", f"{tmp}/ckpt",
        "--metrics-file", f"{tmp}/metrics.jsonl",
    ]
    out["train_rc"] = train_main(argv)
    records = [json.loads(x) for x in Path(f"{tmp}/metrics.jsonl").read_text().splitlines()]
    out["logged"] = [r for r in records if "val_loss" in r][-1]

    # The same validation samples, measured on the checkpoint by the analysis source.
    cfg = train_config_from_dict(ckpt.read_run_config(f"{tmp}/ckpt"))
    _, ds_tok = tokenizer_for(cfg)
    gbs, evals = 4, 2
    _, valid_ds, _ = build_datasets(cfg, ds_tok, [3 * gbs, evals * gbs, evals * gbs])
    source = load_megatron_source(Path(f"{tmp}/ckpt"), label="ckpt", dtype=torch.float32, device="cpu")
    loader = BatchLoader(valid_ds, 2, 0, 1, 0)
    sums = counts = 0
    for _ in range(evals):
        for mb in loader.microbatches(2):
            s, c = source.layer_sums(mb["tokens"], torch.ones_like(mb["tokens"]), "angular")
            sums, counts = sums + s, counts + c
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
    evaluated = json.loads((tmp / "eval.json").read_text())["results"]
    lambada = evaluated["lambada"]
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
