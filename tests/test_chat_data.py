"""`megatron-jreg prepare-chat`: every bad chat record counted and skipped, good ones kept as they were, a
damaged .gz keeping its complete lines, the `simple` chat template written into a tokenizer copy that
transformers loads offline, and targets only on assistant text through Megatron-LM's own SFTTokenizer."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megatron_jreg.data.chat import MARKER, SIMPLE_TEMPLATE
from megatron_jreg.data.checks import DataError
from megatron_jreg.data.prepare_chat import ChatConfig, main, prepare_chat

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2" / "valid.txt"
VENDORED = REPO / "examples" / "sft" / "data"

GOOD = [
    {"messages": [{"role": "user", "content": "Continue: The lobster is blue ."},
                  {"role": "assistant", "content": "It turns red on cooking ."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a sea."},
                  {"role": "assistant", "content": "The Black Sea."}, {"role": "user", "content": "Another?"},
                  {"role": "assistant", "content": "(a) the Mediterranean, 3.5 'deep'"}]},
    {"id": "x", "dataset": "tulu", "messages": [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "Hello!", "name": "bot"}]},
]


def chat(*turns: tuple) -> str:
    """A JSONL line of a conversation given as (role, content) pairs."""
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


U, A, S = "user", "assistant", "system"
# (reason, the line as written)
BAD = [
    ("malformed_json", '{"messages": [ '),
    ("malformed_json", "[1, 2, 3]"),
    ("missing_messages", json.dumps({"conversations": [{"from": "human", "value": "hi"}]})),
    ("missing_messages", json.dumps({"messages": []})),
    ("missing_messages", json.dumps({"messages": "hi"})),
    ("not_a_message", json.dumps({"messages": ["hi", {"role": "assistant", "content": "x"}]})),
    ("not_a_message", json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]})),
    ("unknown_role", chat(("human", "q"), (A, "a"))),
    ("unknown_role", chat((U, "q"), ("tool", "a"))),
    ("not_a_string", chat((U, ["q"]), (A, "a"))),
    ("not_a_string", chat((U, "q"), (A, None))),
    ("not_a_string", chat((U, "q"), (A, 42))),
    ("empty_content", chat((U, "q"), (A, ""))),
    ("empty_content", chat((U, " \n"), (A, "a"))),
    ("bad_first_role", chat((A, "a"), (U, "q"))),
    ("misplaced_system", chat((U, "q"), (S, "s"), (A, "a"))),
    ("consecutive_roles", chat((U, "q"), (U, "q2"), (A, "a"))),
    ("consecutive_roles", chat((U, "q"), (A, "a"), (A, "b"))),
    ("no_assistant_turn", chat((S, "s"), (U, "q"))),
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8"))
    return path


def kept(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A 300-token byte-level BPE with no chat template, no BOS and no pad (like `make demo`'s)."""
    from megatron_jreg.data.train_tokenizer import train_tokenizer

    tmp = tmp_path_factory.mktemp("chat_tok")
    (tmp / "text.txt").write_text(WIKITEXT.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return Path(train_tokenizer([str(tmp / "text.txt")], str(tmp / "tok"), 300, kind="hf-bpe"))


@pytest.fixture(scope="module")
def reserved_tokenizer_dir(tmp_path_factory) -> Path:
    """The same with the chat markers and <|pad|> reserved as special tokens, as `make demo` trains it."""
    from megatron_jreg.data.train_tokenizer import train_tokenizer

    tmp = tmp_path_factory.mktemp("chat_tok_reserved")
    (tmp / "text.txt").write_text(WIKITEXT.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return Path(train_tokenizer([str(tmp / "text.txt")], str(tmp / "tok"), 300, kind="hf-bpe",
                                special_tokens=("<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")))


def test_every_bad_record_kind_is_counted_and_skipped(tmp_path, capsys):
    lines: list[bytes] = []
    for i, record in enumerate(GOOD):  # good and bad records interleaved, plus blank lines
        lines += [json.dumps(record).encode(), BAD[i][1].encode(), b""]
    lines += [line.encode() for _, line in BAD[len(GOOD):]]
    lines.append(b'{"messages": "\xff\xfe"}')  # not UTF-8
    src = tmp_path / "chat.jsonl"
    src.write_bytes(b"".join(line + b"\n" for line in lines))
    out = tmp_path / "clean.jsonl"
    assert main(["--input", str(src), "--output", str(out)]) == 0
    report = capsys.readouterr().out
    expected = {}
    for reason, _ in BAD:
        expected[reason] = expected.get(reason, 0) + 1
    expected.update(not_utf8=1, blank_line=len(GOOD))
    summary = prepare_chat(ChatConfig((str(src),), str(tmp_path / "again.jsonl")))
    assert dict(summary.skipped) == expected
    for reason in expected:
        assert f"{reason} {expected[reason]}" in report
    assert "chat.jsonl:2" in summary.examples[BAD[0][0]][0]  # file:line of the first bad record
    # good records kept in order, as {"messages": [{"role", "content"}]} only
    want = [{"messages": [{"role": m["role"], "content": m["content"]} for m in r["messages"]]} for r in GOOD]
    assert kept(out) == want
    assert f"kept: {len(GOOD)} conversations" in report


def test_truncated_gzip_keeps_every_complete_line(tmp_path):
    records = [{"messages": [{"role": "user", "content": f"question {i} " + "x" * (i % 50)},
                             {"role": "assistant", "content": f"answer {i}"}]} for i in range(400)]
    data = gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
    src = tmp_path / "chat.jsonl.gz"
    src.write_bytes(data[: len(data) * 2 // 3])
    summary = prepare_chat(ChatConfig((str(src),), str(tmp_path / "out.jsonl")))
    good = kept(tmp_path / "out.jsonl")
    assert summary.skipped["corrupt_stream"] == 1
    assert 100 < len(good) < 400 and summary.conversations == len(good)
    assert good == records[: len(good)]  # a prefix, nothing altered, the cut line dropped


def test_bad_flags_and_inputs_stop_before_work(tmp_path, tokenizer_dir, capsys):
    src = write_lines(tmp_path / "chat.jsonl", [json.dumps(GOOD[0])])
    bad = write_lines(tmp_path / "bad.jsonl", [BAD[0][1]])
    cases = [
        (["--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o.jsonl")], "none.jsonl"),
        (["--input", str(bad), "--output", str(tmp_path / "o.jsonl")], "no usable conversation"),
        (["--input", str(src), "--output", str(tmp_path)], "is a folder"),
        (["--input", str(src), "--output", str(src)], "also an --input"),
        (["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--chat-template", "simple"],
         "needs --tokenizer"),
        (["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--tokenizer", str(tmp_path / "nope")],
         "no such folder"),
        (["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--tokenizer", str(tokenizer_dir),
          "--chat-template", "chatml"], "neither a named template"),
        (["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--tokenizer", str(tokenizer_dir),
          "--seq-length", "0"], "--seq-length"),
    ]
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    cases.append((["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--tokenizer", str(tokenizer_dir),
                   "--chat-template", str(broken)], "not a valid jinja"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    cases.append((["--input", str(src), "--output", str(tmp_path / "o.jsonl"), "--tokenizer", str(tokenizer_dir),
                   "--tokenizer-output", str(foreign)], "not written by prepare-chat"))
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("megatron-jreg prepare-chat: error:") and "\n" not in err and needle in err, (argv, err)
        assert not (tmp_path / "o.jsonl").exists()


def test_simple_template_written_into_a_tokenizer_copy(tmp_path, tokenizer_dir, capsys):
    from transformers import AutoTokenizer

    src = write_lines(tmp_path / "chat.jsonl", [json.dumps(r) for r in GOOD])
    out = tmp_path / "clean.jsonl"
    assert main(["--input", str(src), "--output", str(out), "--tokenizer", str(tokenizer_dir)]) == 0
    report = capsys.readouterr().out
    copy = tmp_path / "clean_tokenizer"
    assert f"--tokenizer-model {copy}" in report and "pads with its EOS" in report
    assert (copy / MARKER).is_file() and (copy / "chat_template.jinja").read_text() == SIMPLE_TEMPLATE
    tok = AutoTokenizer.from_pretrained(str(copy), local_files_only=True)
    text = tok.apply_chat_template(GOOD[1]["messages"], tokenize=False)
    assert text == ("<|system|>\nBe brief.\n<|user|>\nName a sea.\n<|assistant|>\nThe Black Sea.<|endoftext|>"
                    "<|user|>\nAnother?\n<|assistant|>\n(a) the Mediterranean, 3.5 'deep'<|endoftext|>")
    prompt = tok.apply_chat_template(GOOD[1]["messages"][:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>\nName a sea.\n<|assistant|>\n")
    # the source folder is untouched; a rerun replaces the copy it wrote; --pad-token goes into the copy
    assert not (tokenizer_dir / "chat_template.jinja").exists()
    assert main(["--input", str(src), "--output", str(out), "--tokenizer", str(tokenizer_dir),
                 "--pad-token", "<|pad|>"]) == 0
    assert "vocabulary grows from 300 to 301" in capsys.readouterr().out
    assert AutoTokenizer.from_pretrained(str(copy), local_files_only=True).pad_token == "<|pad|>"
    # a tokenizer with a chat template of its own is used as it is (no copy)
    assert main(["--input", str(src), "--output", str(tmp_path / "c2.jsonl"), "--tokenizer", str(copy)]) == 0
    assert "has chat template: the tokenizer's own" in capsys.readouterr().out
    assert not (tmp_path / "c2_tokenizer").exists()


def test_tokenizer_copy_holds_the_tokenizer_files_only_readable_by_others(tmp_path, tokenizer_dir, capsys):
    """A model folder given as --tokenizer (where Hugging Face users keep their tokenizer): the copy holds what a
    tokenizer-only `save_pretrained` would, not the weights (was: every file, a 514 MB model.safetensors of a
    135M model), and the copy and the chat file get the modes the umask gives, as every other output (were
    owner-only: a teammate's or a judge job's account could not read them on a shared disk)."""
    import os
    import shutil

    from transformers import AutoTokenizer

    model = shutil.copytree(tokenizer_dir, tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"\0" * 4096)  # stands in for the weights
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "generation_config.json").write_text("{}")
    src = write_lines(tmp_path / "chat.jsonl", [json.dumps(r) for r in GOOD])
    out = tmp_path / "clean.jsonl"
    old = os.umask(0o022)
    try:
        assert main(["--input", str(src), "--output", str(out), "--tokenizer", str(model)]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    copy = tmp_path / "clean_tokenizer"
    assert sorted(p.name for p in copy.iterdir()) == ["chat_template.jinja", MARKER, "tokenizer.json",
                                                      "tokenizer_config.json"]
    assert AutoTokenizer.from_pretrained(str(copy), local_files_only=True).apply_chat_template(
        GOOD[0]["messages"], tokenize=False).startswith("<|user|>\n")
    assert (copy.stat().st_mode & 0o777) == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in copy.iterdir()} == dict.fromkeys(
        [p.name for p in copy.iterdir()], 0o644)
    assert (out.stat().st_mode & 0o777) == 0o644


def test_tokenizer_checks_skip_what_would_train_wrong(tmp_path, reserved_tokenizer_dir):
    template = tmp_path / "strict.jinja"
    template.write_text(SIMPLE_TEMPLATE.replace(
        "{%- for message in messages -%}",
        "{%- for message in messages -%}{%- if 'FORBIDDEN' in message['content'] -%}"
        "{{- raise_exception('no FORBIDDEN') -}}{%- endif -%}"))
    long_answer = " ".join(["word"] * 200)
    records = [GOOD[0],
               {"messages": [{"role": "user", "content": "say FORBIDDEN"}, {"role": "assistant", "content": "no"}]},
               {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a<|endoftext|>b"}]},
               {"messages": [{"role": "user", "content": "q <|user|> x"}, {"role": "assistant", "content": "a"}]},
               {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long_answer}]}]
    src = write_lines(tmp_path / "chat.jsonl", [json.dumps(r) for r in records])
    summary = prepare_chat(ChatConfig((str(src),), str(tmp_path / "out.jsonl"), str(reserved_tokenizer_dir),
                                      str(template), seq_length=64))
    assert dict(summary.skipped) == {"template_error": 1, "special_token_text": 2, "too_long": 1}
    assert "no FORBIDDEN" in summary.examples["template_error"][0]
    assert kept(tmp_path / "out.jsonl") == [GOOD[0]] and summary.template == "strict.jinja"
    assert summary.tokens and max(summary.tokens) <= 64


@pytest.mark.parametrize("reserved", [False, True], ids=["plain-text-markers", "reserved-markers"])
def test_targets_only_on_assistant_text_through_megatron_sft_tokenizer(tmp_path, tokenizer_dir,
                                                                      reserved_tokenizer_dir, reserved):
    """Megatron-LM's SFTTokenizer (`--sft-tokenizer-prompt-format default`) on the prepared tokenizer: its own
    targets cover every token (what --sft's ChatTargets corrects); through ChatTargets every target lies in
    an assistant turn's text (its answer and the EOS closing it) and every such token is a target."""
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import SFTTokenizer

    from megatron_jreg.data.chat_targets import IGNORE_INDEX, ChatTargets

    src = write_lines(tmp_path / "chat.jsonl", [json.dumps(r) for r in GOOD])
    source = reserved_tokenizer_dir if reserved else tokenizer_dir
    summary = prepare_chat(ChatConfig((str(src),), str(tmp_path / "out.jsonl"), str(source)))
    sft = SFTTokenizer(str(tmp_path / "out_tokenizer"), "default")
    if reserved:  # the reserved <|pad|> pads (not the EOS, whose targets SFTDataset would then mask)
        assert sft.pad_id == sft._tokenizer.convert_tokens_to_ids("<|pad|>") != sft.eod
        assert sft.vocab_size == 300 and any("reserved in the vocabulary" in n for n in summary.notes)
    else:
        assert sft.pad_id == sft.eod and any("pads with its EOS" in n for n in summary.notes)
    hf = sft._tokenizer
    for record in kept(tmp_path / "out.jsonl"):
        conversation = record["messages"]
        tokens, stock = sft.tokenize_conversation(conversation, return_target=True, add_generation_prompt=False)
        assert (stock != IGNORE_INDEX).all()
        tokens2, targets = ChatTargets(sft).tokenize_conversation(conversation, True, False)
        assert tokens.tolist() == tokens2.tolist()
        text = hf.apply_chat_template(conversation, tokenize=False)
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        assert enc["input_ids"] == tokens.tolist()
        spans, cursor = [], 0  # each assistant answer + its EOS, found in order in the rendered text
        for m in conversation:
            start = text.index(m["content"].strip(), cursor)
            cursor = start + len(m["content"].strip())
            if m["role"] == "assistant":
                assert text.startswith(hf.eos_token, cursor)
                cursor += len(hf.eos_token)
                spans.append((start, cursor))
        for (lo, hi), target in zip(enc["offset_mapping"], targets.tolist()):
            inside = any(a <= lo and hi <= b for a, b in spans)
            assert inside == (target != IGNORE_INDEX), (text[lo:hi], target)
        # transformers' own assistant mask ({% generation %} tags in the template) agrees
        mask = hf.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
        assert mask["assistant_masks"] == [int(t != IGNORE_INDEX) for t in targets.tolist()]


def test_vendored_chat_data_is_clean():
    """examples/sft/data/: every conversation passes, the questions are in FastChat's question format."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        summary = prepare_chat(ChatConfig((str(VENDORED / "wikitext_chat.jsonl"),), f"{tmp}/out.jsonl"))
        assert not summary.skipped and summary.conversations >= 500
        assert Path(f"{tmp}/out.jsonl").read_bytes() == (VENDORED / "wikitext_chat.jsonl").read_bytes()
    questions = [json.loads(line) for line in (VENDORED / "wikitext_questions.jsonl").read_text().splitlines()]
    assert 20 <= len(questions) <= 80
    assert all(set(q) == {"question_id", "category", "turns"} and q["turns"] for q in questions)
    assert len({q["question_id"] for q in questions}) == len(questions)
    assert (VENDORED / "wikitext_chat.jsonl").stat().st_size < 2_000_000


def test_config_errors_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="--tokenizer-output needs --tokenizer"):
        ChatConfig((str(tmp_path / "x.jsonl"),), str(tmp_path / "o.jsonl"), tokenizer_output="t").check()
