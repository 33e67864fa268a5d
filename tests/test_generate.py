"""`megatron-jreg generate`: greedy answers equal a step-by-step argmax reference (batched, multi-turn), a
megatron checkpoint answers as its Hugging Face original, FastChat's answer format, resume by question id,
reproducible seeded sampling, and each kind of bad input refused in one line before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_jreg.data.chat import SIMPLE_STOP_TEXTS, SIMPLE_TEMPLATE

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2" / "valid.txt"
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write the first sentence of an article about lobsters.",
                                                         "Continue."]},
    {"question_id": 2, "category": "extraction", "turns": ["Continue this text: The bridge is one of two ."]},
    {"question_id": "q3", "category": "stem", "turns": ["What is a species?", "Give an example.", "Another one."]},
    {"question_id": 4, "category": "roleplay", "turns": ["Hello"]},
    {"question_id": 5, "category": "humanities", "turns": ["Why do historians read old newspapers and letters?",
                                                           "Why?"]},
]
MAX_NEW = 10


def write_questions(path: Path, questions: list[dict] = QUESTIONS) -> Path:
    path.write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    return path


def answers(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def turns_of(path: Path) -> dict:
    return {a["question_id"]: a["choices"][0]["turns"] for a in answers(path)}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama (untied, so answers vary) with a 300-token BPE and no chat template."""
    import torch

    from tests._toy import save_random_llama

    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other on a shared machine
    folder = tmp_path_factory.mktemp("gen") / "tiny-llama"
    texts = WIKITEXT.read_text(encoding="utf-8")[:20000].splitlines()
    return save_random_llama(folder, texts, layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=300, tied=False)


def reference_answers(folder: Path, questions: list[dict], max_new: int) -> dict:
    """One question at a time, one token at a time: argmax of the full forward pass at the last position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = {}
    for q in questions:
        history, texts = [], []
        for turn in q["turns"]:
            history.append({"role": "user", "content": turn})
            ids = tok.apply_chat_template(history, chat_template=SIMPLE_TEMPLATE, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            new = []
            for _ in range(max_new):
                with torch.no_grad():
                    nxt = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
            text = tok.decode(new, skip_special_tokens=True)
            cut = min((text.find(s) for s in SIMPLE_STOP_TEXTS if s in text), default=len(text))
            texts.append(text[:cut].strip())
            history.append({"role": "assistant", "content": texts[-1]})
        out[q["question_id"]] = texts
    return out


def run(*argv: str) -> int:
    from megatron_jreg.generate.cli import main

    return main([str(a) for a in argv])


def test_greedy_equals_step_by_step_argmax_and_fastchat_format(hf_model, tmp_path, capsys):
    prompts = write_questions(tmp_path / "question.jsonl")
    out = tmp_path / "model_answer" / "tiny.jsonl"
    assert run("--hf", hf_model, "--prompts", prompts, "--output", out, "--max-new-tokens", MAX_NEW,
               "--batch-size", 3) == 0
    report = capsys.readouterr().out
    assert "5 new answers" in report and "chat template: simple" in report
    got = answers(out)
    assert [a["question_id"] for a in got] == [q["question_id"] for q in QUESTIONS]  # the question file's order
    for a, q in zip(got, QUESTIONS):  # FastChat gen_model_answer.py's fields and types
        assert set(a) == {"question_id", "answer_id", "model_id", "choices", "tstamp"}
        assert a["model_id"] == "tiny-llama" and isinstance(a["answer_id"], str) and isinstance(a["tstamp"], float)
        assert a["choices"] == [{"index": 0, "turns": a["choices"][0]["turns"]}]
        assert len(a["choices"][0]["turns"]) == len(q["turns"])
    assert turns_of(out) == reference_answers(hf_model, QUESTIONS, MAX_NEW)
    assert any(t for turns in turns_of(out).values() for t in turns)  # not all empty: a real comparison


def test_generation_config_eos_ends_answers_too(hf_model, tmp_path):
    """A Hugging Face folder's generation_config.json may list more end tokens (Llama-3's <|eot_id|>): each stops."""
    import shutil

    from megatron_jreg.generate.runner import GenerateConfig, load_chat_model

    folder = tmp_path / "model"
    shutil.copytree(hf_model, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    cfg = GenerateConfig(prompts=write_questions(tmp_path / "q.jsonl"), output=tmp_path / "a.jsonl", hf=folder)
    model = load_chat_model(cfg)
    assert {7, 9, model.tokenizer.eos_token_id} <= model.stop_ids


def test_answer_file_is_readable_by_others_and_no_deprecation_is_printed(hf_model, tmp_path, capfd):
    """The answer file gets the mode the umask gives (0644 under 022; was mkstemp's 0600, unreadable by a judge
    job's account on a shared disk), and transformers' cache-name deprecation line is gone (generate read the
    cache under its old name)."""
    import logging
    import os

    import transformers.utils.logging  # noqa: F401 - defines Logger.warning_once

    logging.Logger.warning_once.cache_clear()  # a deprecation already shown by an earlier test would show no more
    prompts = write_questions(tmp_path / "question.jsonl", QUESTIONS[:2])
    out = tmp_path / "a.jsonl"
    old = os.umask(0o022)
    try:
        assert run("--hf", hf_model, "--prompts", prompts, "--output", out, "--max-new-tokens", 3) == 0
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o644
    err = capfd.readouterr().err
    assert "deprecated" not in err.lower(), err


def test_resume_answers_only_missing_questions(hf_model, tmp_path, capsys):
    prompts = write_questions(tmp_path / "question.jsonl")
    out = tmp_path / "a.jsonl"
    assert run("--hf", hf_model, "--prompts", prompts, "--output", out, "--max-new-tokens", 4,
               "--model-id", "m") == 0
    full = answers(out)
    out.write_text("".join(json.dumps(a) + "\n" for a in full[1:4:2]))  # an interrupted run kept two
    capsys.readouterr()
    assert run("--hf", hf_model, "--prompts", prompts, "--output", out, "--max-new-tokens", 4,
               "--model-id", "m") == 0
    assert "3 new answers (2 already there)" in capsys.readouterr().out
    again = answers(out)
    assert [a["question_id"] for a in again] == [a["question_id"] for a in full]
    kept = {a["question_id"]: a for a in full[1:4:2]}
    for a in again:
        if a["question_id"] in kept:
            assert a == kept[a["question_id"]]  # untouched, same answer_id
    assert turns_of(out) == {a["question_id"]: a["choices"][0]["turns"] for a in full}  # greedy: same answers
    assert not list(tmp_path.glob(".a.jsonl*"))  # no temporary file left
    assert run("--hf", hf_model, "--prompts", prompts, "--output", out, "--model-id", "m") == 0  # nothing to do
    assert "0 new answers (5 already there)" in capsys.readouterr().out


def test_seeded_sampling_is_reproducible(hf_model, tmp_path):
    prompts = write_questions(tmp_path / "question.jsonl")
    flags = ["--hf", hf_model, "--prompts", prompts, "--max-new-tokens", 8, "--temperature", 1.5, "--top-p", 0.95]
    assert run(*flags, "--output", tmp_path / "a.jsonl", "--seed", 7, "--batch-size", 5) == 0
    assert run(*flags, "--output", tmp_path / "b.jsonl", "--seed", 7, "--batch-size", 2) == 0
    assert run(*flags, "--output", tmp_path / "c.jsonl", "--seed", 8, "--batch-size", 5) == 0
    a, b, c = (turns_of(tmp_path / f"{n}.jsonl") for n in "abc")
    assert a == b  # any batching: each question draws from its own (seed, question id) generator
    assert a != c
    assert a != turns_of_greedy(hf_model, prompts, tmp_path)


def turns_of_greedy(hf_model: Path, prompts: Path, tmp_path: Path) -> dict:
    assert run("--hf", hf_model, "--prompts", prompts, "--output", tmp_path / "g.jsonl", "--max-new-tokens", 8) == 0
    return turns_of(tmp_path / "g.jsonl")


def test_top_p_keeps_the_smallest_nucleus():
    import torch

    from megatron_jreg.evaluate.decoding import Sampling, next_tokens

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {next_tokens(logits, Sampling(1.0, 0.7), [torch.Generator().manual_seed(s)])[0] for s in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    draws = {next_tokens(logits, Sampling(1.0, 0.4), [torch.Generator().manual_seed(s)])[0] for s in range(50)}
    assert draws == {0}
    assert next_tokens(logits, Sampling(), [None]) == [0]


def test_bad_input_is_one_line_exit_2_before_any_model_loads(hf_model, tmp_path, capsys, monkeypatch):
    from megatron_jreg.generate import runner

    def no_model(cfg):  # noqa: ANN001, ANN202
        raise AssertionError("a model was loaded for bad input")

    monkeypatch.setattr(runner, "load_chat_model", no_model)
    good = write_questions(tmp_path / "q.jsonl")
    out = tmp_path / "out.jsonl"

    def prompts(name: str, text: str | bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path

    line = json.dumps
    broken_template = tmp_path / "t.jinja"
    broken_template.write_text("{% for m in messages %}")
    other_model = prompts("other.jsonl", line({"question_id": 1, "model_id": "other", "choices": []}) + "\n")
    not_answers = prompts("notes.txt", "my notes\n")
    hf = ["--hf", hf_model]
    cases = [
        (hf + ["--prompts", tmp_path / "missing.jsonl", "--output", out], "--prompts"),
        (hf + ["--prompts", tmp_path, "--output", out], "is a folder"),
        (hf + ["--prompts", prompts("a.jsonl", "{not json\n"), "--output", out], "a.jsonl: line 1 is not a JSON line"),
        (hf + ["--prompts", prompts("b.jsonl", "[1]\n"), "--output", out], "not an object"),
        (hf + ["--prompts", prompts("c.jsonl", line({"turns": ["x"]}) + "\n"), "--output", out], "question_id"),
        (hf + ["--prompts", prompts("d.jsonl", line({"question_id": True, "turns": ["x"]})), "--output", out],
         "question_id"),
        (hf + ["--prompts", prompts("e.jsonl", line(QUESTIONS[0]) + "\n" + line(QUESTIONS[0])), "--output", out],
         "e.jsonl: line 2: question_id 1 again"),
        (hf + ["--prompts", prompts("f.jsonl", line({"question_id": 1, "turns": []})), "--output", out], "turns"),
        (hf + ["--prompts", prompts("g.jsonl", line({"question_id": 1, "turns": "hi"})), "--output", out], "turns"),
        (hf + ["--prompts", prompts("h.jsonl", line({"question_id": 1, "turns": ["hi", " "]})), "--output", out],
         "turn 1 of question 1 is empty"),
        (hf + ["--prompts", prompts("i.jsonl", line({"question_id": 1, "turns": ["hi", 3]})), "--output", out],
         "turn 1 of question 1"),
        (hf + ["--prompts", prompts("j.jsonl", "\n\n"), "--output", out], "no questions"),
        (hf + ["--prompts", prompts("k.jsonl", b"\xff\xfe{}\n"), "--output", out], "can't decode"),
        (hf + ["--prompts", good, "--output", out, "--max-new-tokens", 0], "--max-new-tokens must be >= 1"),
        (hf + ["--prompts", good, "--output", out, "--max-new-tokens", -5], "--max-new-tokens must be >= 1"),
        (hf + ["--prompts", good, "--output", out, "--temperature", "nan"], "--temperature"),
        (hf + ["--prompts", good, "--output", out, "--temperature", "inf"], "--temperature"),
        (hf + ["--prompts", good, "--output", out, "--temperature", -1], "--temperature"),
        (hf + ["--prompts", good, "--output", out, "--top-p", 0], "--top-p"),
        (hf + ["--prompts", good, "--output", out, "--top-p", 1.5], "--top-p"),
        (hf + ["--prompts", good, "--output", out, "--top-p", "nan"], "--top-p"),
        (hf + ["--prompts", good, "--output", out, "--batch-size", 0], "--batch-size"),
        (hf + ["--prompts", good, "--output", out, "--seed", -1], "--seed"),
        (hf + ["--prompts", good, "--output", tmp_path], "--output"),
        (hf + ["--prompts", good, "--output", f"{tmp_path}/new/"], "is a folder"),
        (hf + ["--prompts", good, "--output", good], "is the --prompts file"),
        (hf + ["--prompts", good, "--output", good / "x.jsonl"], "is a file, not a folder"),
        (hf + ["--prompts", good, "--output", other_model], "holds answers of model 'other'"),
        (hf + ["--prompts", good, "--output", not_answers], "not a FastChat answer file"),
        (hf + ["--prompts", good, "--output", out, "--model-id", " "], "--model-id"),
        (hf + ["--prompts", good, "--output", out, "--chat-template", "chatml"], "neither a named template"),
        (hf + ["--prompts", good, "--output", out, "--chat-template", broken_template], "not a valid jinja"),
        (hf + ["--prompts", good, "--output", out, "--tokenizer", tmp_path], "use it with --load"),
        (hf + ["--prompts", good, "--output", out, "--iteration", 3], "--iteration"),
        (["--prompts", good, "--output", out], "give exactly one model"),
        (["--hf", tmp_path, "--prompts", good, "--output", out], "no config.json"),
        (["--load", tmp_path / "nope", "--prompts", good, "--output", out], "--load"),
    ]
    for argv, needle in cases:
        assert run(*argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("megatron-jreg generate: error:") and "\n" not in err, err
        assert needle in err, (needle, err)
        assert not out.exists()
    with pytest.raises(SystemExit) as stop:  # argparse: both models, a flag that is not a number
        run("--hf", hf_model, "--load", tmp_path, "--prompts", good, "--output", out)
    assert stop.value.code == 2
    with pytest.raises(SystemExit) as stop:
        run("--hf", hf_model, "--prompts", good, "--output", out, "--max-new-tokens", "many")
    assert stop.value.code == 2
    assert len(cases) == 37


def megatron_suite(rank: int, world: int, hf: str, tmp: str) -> dict:
    """In a fresh process (megatron-core's global state): import the HF model as a Megatron-LM release
    checkpoint, then answer with it; also a checkpoint whose tokenizer folder has moved."""
    import shutil

    import torch

    from megatron_jreg.convert.from_hf import hf_to_mcore
    from megatron_jreg.generate.cli import main

    torch.set_num_threads(1)
    ckpt = Path(tmp) / "mcore"
    hf_to_mcore(hf, ckpt, verify=False)
    common = ["--prompts", f"{tmp}/question.jsonl", "--max-new-tokens", str(MAX_NEW), "--batch-size", "2"]
    rc = main(["--load", str(ckpt), "--output", f"{tmp}/mcore.jsonl", *common])
    moved = Path(tmp) / "moved-tokenizer"
    shutil.copytree(hf, moved)
    shutil.move(hf, f"{hf}-gone")
    gone = main(["--load", str(ckpt), "--output", f"{tmp}/gone.jsonl", *common])
    given = main(["--load", str(ckpt), "--tokenizer", str(moved), "--output", f"{tmp}/given.jsonl", *common])
    shutil.move(f"{hf}-gone", hf)
    return {"rc": rc, "gone": gone, "given": given}


@pytest.mark.multirank
def test_megatron_checkpoint_answers_as_its_hf_original(hf_model, tmp_path, capsys):
    from tests.distributed import run_ranks

    write_questions(tmp_path / "question.jsonl")
    result = run_ranks(megatron_suite, 1, str(hf_model), str(tmp_path), timeout=900)[0]
    assert result == {"rc": 0, "gone": 2, "given": 0}
    assert run("--hf", hf_model, "--prompts", tmp_path / "question.jsonl", "--output", tmp_path / "hf.jsonl",
               "--max-new-tokens", MAX_NEW) == 0
    hf = turns_of(tmp_path / "hf.jsonl")
    assert turns_of(tmp_path / "mcore.jsonl") == hf
    assert turns_of(tmp_path / "given.jsonl") == hf
    assert answers(tmp_path / "mcore.jsonl")[0]["model_id"] == "mcore"


def test_answers_end_at_a_stop_token_a_turn_marker_or_the_window(hf_model):
    """Scripted next tokens: the EOS ends an answer, so does a `simple` turn marker the model starts to write
    (the answer is the text before it), and a full context window."""
    import torch
    from transformers import AutoTokenizer

    from megatron_jreg.evaluate.decoding import complete
    from megatron_jreg.generate.runner import ChatModel

    tok = AutoTokenizer.from_pretrained(hf_model)
    script = tok.encode("Sure.\n<|user|>\nmore", add_special_tokens=False)

    class Scripted:  # a Decoder whose next token is the script's, by the row's length
        def __init__(self, eos_at: int | None) -> None:
            self.eos_at, self.length = eos_at, 0

        def __call__(self, batch: int, length: int) -> Scripted:
            return self

        def extend(self, tokens: torch.Tensor) -> torch.Tensor:
            self.length += tokens.shape[1]
            step = self.length - 3  # prompts are 3 tokens long
            nxt = tok.eos_token_id if step == self.eos_at else script[min(step, len(script) - 1)]
            out = torch.zeros(tokens.shape[0], len(tok))
            out[:, nxt] = 1.0
            return out

    def scripted(eos_at: int | None) -> Scripted:
        return Scripted(eos_at)

    model = ChatModel(None, tok, None, "simple", {tok.eos_token_id}, SIMPLE_STOP_TEXTS)
    prompts = [[5, 6, 7]]
    done = complete(scripted(None), prompts, max_new_tokens=50, window=100, vocab_size=len(tok),
                    stop_ids=model.stop_ids, stopped=model.stopped, pad_id=0)[0]
    assert done.finish == "stop" and model.answer_text(done.ids) == "Sure."
    done = complete(scripted(2), prompts, max_new_tokens=50, window=100, vocab_size=len(tok),
                    stop_ids=model.stop_ids, pad_id=0)[0]
    assert done.finish == "stop" and done.ids == script[:2]
    done = complete(scripted(None), prompts, max_new_tokens=50, window=6, vocab_size=len(tok),
                    stop_ids=model.stop_ids, pad_id=0)[0]
    assert done.finish == "window" and done.ids == script[:3]
    done = complete(scripted(None), prompts, max_new_tokens=2, window=100, vocab_size=len(tok),
                    stop_ids=model.stop_ids, pad_id=0)[0]
    assert done.finish == "length" and done.ids == script[:2]
