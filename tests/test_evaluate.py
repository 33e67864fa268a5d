"""`megatron-jreg evaluate` on a tiny Hugging Face model: the built-in LAMBADA against a direct computation,
the lm-eval adapter against lm-eval's own HF model, and lm-eval end to end offline on local data.

One tiny model for the module: a BPE tokenizer trained here on the vendored WikiText text and a random
2-layer Llama. Random weights get LAMBADA's real targets wrong, so the passage file also holds passages
whose target is the model's own greedy continuation (one to three tokens, one word): correct by
construction, which makes the accuracy checks non-trivial (both outcomes, multi-token targets).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from megatron_jreg.data.text import lambada_passages

REPO = Path(__file__).resolve().parent.parent
WIKITEXT = REPO / "examples" / "data" / "wikitext-2" / "valid.txt"
N_PASSAGES = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The model's matmuls are tiny: with several threads on shared cores, thread spinning costs 10x
    the arithmetic."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _offline_flags_restored(monkeypatch):
    """`evaluate` switches the HF libraries offline for its process; undo that after each test."""
    import datasets
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(WIKITEXT.read_text(encoding="utf-8")[:100_000].split("\n"), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids, one full forward per token (the slow, obvious way)."""
    import torch

    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def _own_continuation(model, tokenizer, context: str) -> str | None:
    """The longest (up to 3 tokens) greedy continuation of `context` that is one word after a space and
    tokenizes back to the same tokens after the context, or None."""
    ids = tokenizer.encode(context)
    tokens = _greedy(model, ids, 3)
    for k in (3, 2, 1):
        text = tokenizer.decode(tokens[:k])
        word = text[1:]
        if (
            text.startswith(" ")
            and word
            and not any(c.isspace() for c in word)
            and tokenizer.encode(context + text)[len(ids) :] == tokens[:k]
        ):
            return text
    return None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    _train_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(1)  # a seed whose greedy continuations include multi-token words (see passages_file)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def passages_file(model_dir, tmp_path_factory) -> Path:
    """Short real LAMBADA passages; every other one ends in the model's own greedy word instead."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_jreg.evaluate.lambada import split_passage

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    passages = []
    for i, text in enumerate(lambada_passages()[: 2 * N_PASSAGES]):
        short = " ".join(text.split(" ")[-25:])
        if i % 2:
            context = split_passage(short)[0]
            own = _own_continuation(model, tokenizer, context)
            if own is None:
                continue
            short = context + own
        passages.append(short)
    path = tmp_path_factory.mktemp("lambada") / "passages.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages[:N_PASSAGES]), encoding="utf-8")
    return path


def _direct(model_dir: Path, passages: list[str]) -> list[tuple[float, bool, int]]:
    """LAMBADA per passage straight from the HF model: (target log-prob, greedy reproduces it, n tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for text in passages:
        context, target = text.rsplit(" ", 1)[0], " " + text.rsplit(" ", 1)[1]
        ctx = tokenizer.encode(context)
        whole = tokenizer.encode(context + target)
        target_ids = whole[len(ctx) :]
        with torch.no_grad():
            logp = model(torch.tensor([whole[:-1]])).logits[0].double().log_softmax(-1)
        rows = logp[len(ctx) - 1 :]
        logprob = float(sum(rows[i, t] for i, t in enumerate(target_ids)))
        greedy = _greedy(model, ctx, len(target_ids)) == target_ids
        out.append((logprob, greedy, len(target_ids)))
    return out


def test_lambada_accuracy_equals_direct_computation(model_dir, passages_file):
    from megatron_jreg.evaluate.lambada import evaluate_lambada, score_lambada
    from megatron_jreg.evaluate.models import load_hf_lm

    passages = lambada_passages(passages_file)
    direct = _direct(model_dir, passages)
    hits = [g for _, g, _ in direct]
    assert any(hits) and not all(hits), "the passage file must hold both outcomes"
    assert any(g and n > 1 for _, g, n in direct), "a multi-token target must be reproduced somewhere"

    lm = load_hf_lm(model_dir)
    metrics = evaluate_lambada(lm, passages, batch_size=5)
    assert metrics["acc"] == sum(hits) / len(hits)
    mean_nll = -sum(lp for lp, _, _ in direct) / len(direct)
    assert metrics["perplexity"] == pytest.approx(math.exp(mean_nll), rel=1e-4)
    acc = metrics["acc"]
    assert metrics["acc_stderr"] == pytest.approx(math.sqrt(acc * (1 - acc) / (len(hits) - 1)))

    # batching with right padding changes nothing, per passage
    one = score_lambada(lm, passages, batch_size=1)
    many = score_lambada(lm, passages, batch_size=7)
    assert [s.greedy for s in one] == [s.greedy for s in many] == hits
    assert [s.n_tokens for s in many] == [n for _, _, n in direct]
    for a, b, (lp, _, _) in zip(one, many, direct):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.logprob == pytest.approx(lp, abs=1e-3)


class _MergingTokenizerLM:
    """A stand-in CausalLM whose tokenizer adds a BOS and merges "x y" across a word boundary, so the
    encoding of context+target is not the concatenation of the two encodings."""

    eod, prefix_token, vocab_size, max_length = 0, 1, 300, 64

    def encode(self, text: str, special: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("x y", i):
                ids.append(299)
                i += 3
            else:
                ids.append(ord(text[i]))
                i += 1
        return ([1] if special else []) + ids

    def decode(self, ids: list[int]) -> str:
        return "".join("x y" if i == 299 else chr(i) for i in ids if i > 1)


def test_encode_pair_follows_lm_eval():
    """LAMBADA's split of (context, target) is the adapter's, and the adapter (lm-eval's TemplateLM over our
    tokenizer) conditions an empty context on the prefix token."""
    from lm_eval.api.instance import Instance

    from megatron_jreg.evaluate.harness import HarnessLM
    from megatron_jreg.evaluate.scoring import encode_pair

    lm = _MergingTokenizerLM()

    class Tokens(HarnessLM):
        """The adapter's tokenization of loglikelihood requests, returned instead of scored."""

        def _loglikelihood_tokens(self, requests, **kwargs):
            return [(ctx, cont) for _, ctx, cont in requests]

    pairs = [
        ("ab", " cd"),
        ("ab ", "cd"),
        ("ab  ", " cd"),
        ("ax", " yz"),
        ("ax", " y"),
        ("", "ab"),
        ("", "x y"),
    ]
    requests = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    adapter = Tokens(lm, progress=False).loglikelihood(requests)
    assert [encode_pair(lm, *p) for p in pairs[:5]] == [tuple(e) for e in adapter[:5]]
    # what that means: BOS + context, then the target's own tokens; trailing spaces join the target
    assert encode_pair(lm, "ab ", "cd") == ([1, 97, 98], [32, 99, 100])
    # a merge across the boundary: the continuation is whole[len(ctx):], not encode(" yz")
    assert lm.encode("ax yz") == [1, 97, 299, 122] and encode_pair(lm, "ax", " yz") == ([1, 97, 120], [122])
    # empty context: conditioned on the prefix token, continuation without special tokens
    assert adapter[5:] == [([1], [97, 98]), ([1], [299])]


def test_adapter_matches_lm_eval_hf_model(model_dir):
    """HarnessLM over our CausalLM answers like lm-eval's own HFLM on the same folder."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from megatron_jreg.evaluate.harness import HarnessLM
    from megatron_jreg.evaluate.models import load_hf_lm

    text = WIKITEXT.read_text(encoding="utf-8")[2000:2600]

    def requests(kind: str, args: list[tuple]) -> list[Instance]:
        return [Instance(kind, {}, a, i) for i, a in enumerate(args)]

    ll = [("The game", " was released"), ("", "Hello there"), (text, " end"), ("A b ", "c")]
    rolling = [(text,), ("short text",)]
    gen = [
        ("The game was", {"until": ["."], "max_gen_toks": 8}),
        ("In 1990", {"until": ["\n"], "max_gen_toks": 5}),
        (text, {"until": ["\n\n"], "max_gen_toks": 8}),  # cut on the left; batched with the first, longer
        ("She", {"until": [], "max_gen_toks": 8}),
    ]

    ours = HarnessLM(load_hf_lm(model_dir, max_length=32), batch_size=3)
    ref = HFLM(pretrained=str(model_dir), device="cpu", batch_size=1, max_length=32)
    for (a_lp, a_g), (b_lp, b_g) in zip(
        ours.loglikelihood(requests("loglikelihood", ll)), ref.loglikelihood(requests("loglikelihood", ll))
    ):
        assert a_lp == pytest.approx(b_lp, abs=1e-3) and a_g == b_g
    for a, b in zip(
        ours.loglikelihood_rolling(requests("loglikelihood_rolling", rolling)),
        ref.loglikelihood_rolling(requests("loglikelihood_rolling", rolling)),
    ):
        assert a == pytest.approx(b, abs=1e-2)
    answers = ours.generate_until(requests("generate_until", gen))
    assert answers == ref.generate_until(requests("generate_until", gen))
    # the KV-cache decoder gives the tokens of the obvious way: the whole sequence again for every token
    model, tokenizer = ours.model.model, ours.model.tokenizer
    for (context, kwargs), answer in zip(gen, answers):
        new = _greedy(model, tokenizer.encode(context)[-(32 - kwargs["max_gen_toks"]) :], kwargs["max_gen_toks"])
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id)]
        expected = tokenizer.decode(new)
        for stop in kwargs["until"]:
            expected = expected.split(stop)[0]
        assert answer == expected


LAMBADA_TASK_YAML = """\
task: lambada_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _rows(n: int, make) -> str:
    return "".join(json.dumps(make(i)) + "\n" for i in range(n))


def _sciq_row(i: int) -> dict:
    wrong = {"distractor1": "a rock", "distractor2": "the sun", "distractor3": "water"}
    return {"question": f"What is {i}?", **wrong, "correct_answer": "an atom", "support": f"Fact {i}."}


def _arc_row(i: int) -> dict:
    choices = {"text": ["heat", "light", "sound", "wind"], "label": ["A", "B", "C", "D"]}
    return {"id": str(i), "question": f"Which is energy {i}?", "choices": choices, "answerKey": "B"}


def _cache_as_hub_dataset(tmp: Path, cache: Path, repo: str, rows: str) -> None:
    """Put a dataset into `cache` where `datasets` keeps a Hub download (<ns>___<name>/<config>/<version>/
    <hash>/<name>-<split>.arrow): built here from JSON since nothing may be downloaded."""
    import datasets

    files = {}
    for split in ("train", "validation", "test"):
        files[split] = tmp / f"{split}.jsonl"
        files[split].write_text(rows, encoding="utf-8")
    datasets.load_dataset(
        "json", data_files={k: str(v) for k, v in files.items()}, cache_dir=str(tmp / "build")
    )
    built = next((tmp / "build" / "json").glob("*/0.0.0/*/dataset_info.json")).parent
    namespace, name = repo.split("/")
    target = cache / f"{namespace}___{name}" / "default" / "0.0.0" / built.name
    shutil.copytree(built, target)
    for arrow in target.glob("json-*.arrow"):
        arrow.rename(target / arrow.name.replace("json-", f"{name}-"))
    info = json.loads((target / "dataset_info.json").read_text())
    info.update(config_name="default", dataset_name=name)
    (target / "dataset_info.json").write_text(json.dumps(info))


def _repo_copy(root: Path, config: str, rows: str) -> Path:
    """A dataset repository as `hf download --repo-type dataset` leaves it: data files + README configs."""
    (root / config).mkdir(parents=True)
    lines = ["---", "configs:", f"- config_name: {config}", "  data_files:"]
    for split in ("train", "validation", "test"):
        (root / config / f"{split}.jsonl").write_text(rows, encoding="utf-8")
        lines += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    (root / "README.md").write_text("\n".join(lines + ["---", ""]), encoding="utf-8")
    return root


@pytest.fixture
def empty_datasets_cache(tmp_path, monkeypatch) -> Path:
    import datasets

    cache = tmp_path / "datasets-cache"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def test_evaluate_end_to_end_offline(
    model_dir, passages_file, tmp_path, empty_datasets_cache, monkeypatch, capfd
):
    """One run: built-in LAMBADA, the same LAMBADA as an lm-eval task over the JSONL, SciQ from the datasets
    cache, ARC-Easy from a local repository copy, all through lm-eval's simple_evaluate with our adapter; run
    outside a git repository, with progress bars: one per task kind, and no "fatal: not a git repository"
    (lm-eval ran `git describe` to record the working folder's commit)."""
    from megatron_jreg.evaluate import cli
    from megatron_jreg.evaluate.results import EvalResults

    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / "lambada_local.yaml").write_text(
        LAMBADA_TASK_YAML.format(path=passages_file), encoding="utf-8"
    )
    _cache_as_hub_dataset(tmp_path, empty_datasets_cache, "allenai/sciq", _rows(6, _sciq_row))
    arc = _repo_copy(tmp_path / "ai2_arc", "ARC-Easy", _rows(6, _arc_row))
    out = tmp_path / "results.json"
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # lm-eval bootstraps perplexity's stderr in-process
    argv = ["--hf", str(model_dir), "--tasks", "lambada,lambada_local,sciq,arc_easy"]
    argv += [
        "--lambada-file",
        str(passages_file),
        "--include-path",
        str(tasks_dir),
        "--task-data",
        f"arc_easy={arc}",
    ]
    argv += [
        "--limit",
        "20",
        "--batch-size",
        "4",
        "--bootstrap-iters",
        "20",
        "--seed",
        "3",
        "--output",
        str(out),
        "--progress",
    ]
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 0

    saved = EvalResults.read(out)
    assert list(saved.results) == ["lambada", "lambada_local", "sciq", "arc_easy"]
    assert saved.samples == {"lambada": 20, "lambada_local": 20, "sciq": 6, "arc_easy": 6}
    assert saved.seed == 3 and saved.model["kind"] == "hf"
    builtin, harness = saved.results["lambada"], saved.results["lambada_local"]
    assert 0 < builtin["acc"] < 1
    assert harness["acc"] == builtin["acc"]
    assert harness["perplexity"] == pytest.approx(builtin["perplexity"], rel=1e-5)
    assert harness["acc_stderr"] == pytest.approx(builtin["acc_stderr"], rel=1e-12)
    assert harness["perplexity_stderr"] > 0  # bootstrapped by lm-eval, delta method in ours
    for task in ("sciq", "arc_easy"):
        metrics = saved.results[task]
        assert set(metrics) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
        assert 0 <= metrics["acc"] <= 1 and metrics["acc_stderr"] is not None
    table, err = capfd.readouterr()
    assert "lambada_local  acc" in table and "arc_easy       acc_norm" in table
    assert "fatal" not in err and "not a git repository" not in err, err
    assert "lambada: 100%" in err and "20/20" in err  # the built-in task's bar, by passage
    assert "lm-eval loglikelihood: 100%" in err  # lm-eval's requests, by request


def test_help_gives_defaults_and_a_note_explains_a_slow_tokenizer(model_dir, monkeypatch, capsys):
    """`--help` says what each flag defaults to (--batch-size had no help at all; every command's flags:
    tests/test_cli.py, test_every_flag_says_its_default_in_help); a tokenizer.json that takes transformers
    minutes to load (1.5M added tokens: 308 s without a line) is announced first (the size that counts as slow
    lowered here to the tiny model's)."""
    from megatron_jreg.evaluate import cli, models

    text = " ".join(cli.build_parser().format_help().split())
    assert "memory and speed do (default: 8)" in text and "(default: lambada)" in text
    monkeypatch.setattr(models, "BIG_TOKENIZER_BYTES", 1)
    models.load_hf_lm(model_dir, "cpu", "float32")
    err = capsys.readouterr().err
    assert f"note: --hf {model_dir}: loading its tokenizer (1 added tokens," in err and "takes transformers" in err


def test_missing_datasets_stop_before_the_model_loads(
    model_dir, tmp_path, empty_datasets_cache, monkeypatch, capsys
):
    from megatron_jreg.evaluate import cli

    def no_model(*_args):
        raise AssertionError("the model must not load when data is missing")

    monkeypatch.setattr(cli, "load_hf_lm", no_model)
    empty = tmp_path / "not-a-dataset"
    empty.mkdir()
    argv = [
        "--hf",
        str(model_dir),
        "--tasks",
        "lambada,boolq,arc_easy,hellaswag",
        "--task-data",
        f"arc_easy={empty}",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "boolq: needs the Hugging Face dataset aps/super_glue (config boolq)" in err
    assert (
        "hellaswag: needs the Hugging Face dataset Rowan/hellaswag, which is not in the datasets cache" in err
    )
    assert "--task-data hellaswag=DIR" in err and "lambada:" not in err
    assert f"arc_easy: --task-data arc_easy={empty} does not load" in err
    assert "hf download --repo-type dataset allenai/ai2_arc --local-dir DIR" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give exactly one model"),
        (["--hf", "/nonexistent"], "--hf /nonexistent: no config.json"),
        (["--hf", "{model}", "--limit", "0"], "--limit 0: must be at least 1"),
        (
            ["--hf", "{model}", "--task-data", "boolq=/tmp"],
            "--task-data boolq=/tmp: boolq is not an lm-eval task",
        ),
        (["--hf", "{model}", "--task-data", "boolq"], "write TASK=PATH"),
        (["--hf", "{model}", "--lambada-file", "/nonexistent.jsonl"], "--lambada-file /nonexistent.jsonl"),
        (["--load", "{model}", "--tasks", "lambada"], "not a Megatron-LM checkpoint directory"),
    ],
)
def test_flag_errors_name_the_flag(model_dir, argv, message, capsys):
    from megatron_jreg.evaluate import cli

    assert cli.main([a.format(model=model_dir) for a in argv]) == 2
    assert message in capsys.readouterr().err


def test_results_table_and_round_trip(tmp_path):
    from megatron_jreg.evaluate.results import EvalResults

    results = EvalResults(model={"kind": "hf", "path": "/m"}, seed=1)
    results.add("lambada", {"acc": 0.5, "acc_stderr": 0.1, "perplexity": 12.0, "perplexity_stderr": None}, 10)
    results.write(tmp_path / "r.json")
    again = EvalResults.read(tmp_path / "r.json")
    assert again == results
    assert again.table().splitlines() == [
        "task     metric      value    stderr",
        "lambada  acc         0.5000   0.1000",
        "lambada  perplexity  12.0000  -",
    ]


@pytest.mark.slow  # three processes that load torch and lm-eval
def test_entry_processes_let_openmp_threads_sleep(monkeypatch):
    """evaluate, generate and the lm-eval wrapper set OMP_WAIT_POLICY=PASSIVE before torch loads libgomp
    (process_env.py: libgomp's spinning threads cost several times the CPU on shared cores); a wait the
    user chose is kept."""
    import os
    import subprocess
    import sys

    from megatron_jreg.process_env import sleep_while_waiting

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    probe = ("import os, sys, megatron_jreg.cli; assert 'torch' not in sys.modules; import {}; "
             "assert 'torch' in sys.modules; print(os.environ.get('OMP_WAIT_POLICY'))")
    for module in ("megatron_jreg.evaluate.cli", "megatron_jreg.generate.cli", "megatron_jreg.evaluate.lm_eval_model"):
        done = subprocess.run([sys.executable, "-c", probe.format(module)], env=env, capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0 and done.stdout.strip() == "PASSIVE", (module, done.stderr[-2000:])

    monkeypatch.delitem(sys.modules, "torch")  # as in a process that has not loaded it yet
    for chosen, expected in (({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"), ({"GOMP_SPINCOUNT": "300000"}, None)):
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
        for name, value in chosen.items():
            monkeypatch.setenv(name, value)
        sleep_while_waiting()
        assert os.environ.get("OMP_WAIT_POLICY") == expected
