"""Megatron-LM compatibility: byte-identical .bin/.idx, read back through megatron-core.

The expected bytes are built here from the documented format (header magic, version, dtype code, sequence
and document counts, lengths, pointers, document indices) and the token ids from megatron-core's own
tokenizer classes (`megatron.core.tokenizers`, which Megatron-LM's tools/preprocess_data.py calls) plus its
eod, appended to every non-empty document.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_jreg.data.preprocess import PreprocessConfig, preprocess
from megatron_jreg.data.text import wikitext_articles
from megatron_jreg.data.train_tokenizer import train_tokenizer

WIKI = Path(__file__).resolve().parent.parent / "examples" / "data" / "wikitext-2"
EXTRA = [
    "Special text inside a document: A<|endoftext|>B </s> <s> stays special where the tokenizer says so.",
    "Unicode and spacing: naïve café — 東京 😀\n\n\tindented   runs of   spaces  ",
    "Numbers 1234567 and 3.14159, contractions don't I'LL they've.",
    "Chat markers: <|im_start|>user<tag> hi <tag> ▁x<unk>  the end <SPECIAL_9>",
    " ",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    texts = wikitext_articles(WIKI / "test.txt")[:20] + EXTRA
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    return path, texts


def _expected_files(docs: list[list[int]], vocab_size: int) -> tuple[bytes, bytes]:
    """The .bin and .idx Megatron-LM writes for one sequence per document."""
    dtype, code = (np.dtype("<u2"), 8) if vocab_size < 65500 else (np.dtype("<i4"), 4)
    lengths = [len(d) for d in docs]
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * dtype.itemsize
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1)
    idx += np.array(lengths, "<i4").tobytes() + np.array(pointers, "<i8").tobytes()
    idx += np.arange(len(docs) + 1, dtype="<i8").tobytes()
    return b"".join(np.array(d, dtype).tobytes() for d in docs), idx


def _megatron_tokenizer(library: str, path: str, **kwargs):
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        tokenizer_path=path, metadata_path={"library": library}, **kwargs
    )


def _tiktoken_json(bpe_folder: str, out: Path) -> int:
    """Megatron-LM's tiktoken vocabulary from a byte-level BPE (bytes, then merges); returns its size."""
    from tests._tokenizers import tiktoken_entries

    entries = tiktoken_entries(bpe_folder)
    out.write_text(json.dumps(entries))
    return len(entries)


KINDS = ["HuggingFaceTokenizer", "SmolLM2-style", "Llama-3-style", "SentencePieceTokenizer", "TikTokenizer"]


@pytest.mark.parametrize("kind", KINDS)
def test_output_is_byte_identical_to_megatron_lm(kind, corpus, tmp_path):
    """Every kind of tokenizer, on its fast engine (tiktoken where it converts exactly): the bytes Megatron-LM
    writes with megatron-core's tokenizer. SmolLM2-style: bytes lacking from the vocabulary, a duplicate piece, its
    special tokens; Llama-3-style: its regex, ignore_merges, a BOS and 256 special tokens (tests/_tokenizers.py)."""
    from tests._tokenizers import llama3_style, smollm2_style

    texts = [*corpus[1], "lacking bytes\x01\x02 here \x7f", "paragraphs\n\nand\n\n\nnewlines"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    extra: dict = {}
    if kind == "SentencePieceTokenizer":
        model = train_tokenizer([str(WIKI / "valid.txt")], str(tmp_path / "sp"), 800, max_chars=300_000)
        ref = _megatron_tokenizer("sentencepiece", model)
    elif kind.endswith("-style"):
        articles = [a.replace(" \n \n ", "\n\n") for a in wikitext_articles(WIKI / "valid.txt")]
        model = (smollm2_style(tmp_path / "smollm2", articles, 1500) if kind == "SmolLM2-style"
                 else llama3_style(tmp_path / "llama3", articles, 1756))
        ref, kind = _megatron_tokenizer("huggingface", model), "HuggingFaceTokenizer"
    else:
        model = train_tokenizer(
            [str(WIKI / "valid.txt")], str(tmp_path / "bpe"), 1200, "hf-bpe", max_chars=300_000
        )
        ref = _megatron_tokenizer("huggingface", model)
        if kind == "TikTokenizer":
            size = _tiktoken_json(model, tmp_path / "tiktoken.json")
            model, extra = str(tmp_path / "tiktoken.json"), {"tokenizer": {"vocab_size": 1000 + size}}
            ref = _megatron_tokenizer("tiktoken", model, vocab_size=1000 + size, num_special_tokens=1000)
    cfg = PreprocessConfig(
        input=[str(path)],
        output_prefix=str(tmp_path / "out"),
        tokenizer_type=kind,
        tokenizer_model=model,
        append_eod=True,
        workers=2,
        **extra,
    )
    summary = preprocess(cfg)
    assert summary["tokenizer_backend"] == ("megatron-core (tiktoken)" if kind == "TikTokenizer" else "tiktoken")

    # The one intended difference: a text with no tokens (" " under SentencePiece) is skipped and counted,
    # where Megatron-LM writes a document without sequences, which GPTDataset cannot index consistently.
    expected_docs = [ids + [ref.eod] for ids in map(ref.tokenize, texts) if ids]
    expected_bin, expected_idx = _expected_files(expected_docs, ref.vocab_size)
    empty = len(texts) - len(expected_docs)
    assert empty == (1 if kind == "SentencePieceTokenizer" else 0)
    assert summary["documents"] == len(expected_docs) and summary["skipped"] == (
        {"empty": empty} if empty else {}
    )
    assert Path(f"{tmp_path}/out_text_document.bin").read_bytes() == expected_bin
    assert Path(f"{tmp_path}/out_text_document.idx").read_bytes() == expected_idx


def test_tokenizer_flags_table_is_megatron_lms_group():
    """preprocess parses Megatron-LM's tokenizer flags as tokenizer_flags.py writes them out (no torch for --help
    and the flag checks): the same flags as megatron-core's own `_add_tokenizer_args` group, spelling, action,
    type, default, choices and help, so that an upgrade that changes them fails here."""
    import argparse

    from megatron.training.arguments import _add_tokenizer_args

    from megatron_jreg.data.tokenizer_flags import add_tokenizer_args

    def described(parser: argparse.ArgumentParser) -> list:
        return [(g.title, g.description, [(type(a).__name__, a.option_strings, a.dest, a.default, a.type, a.nargs,
                                           a.const, a.choices and list(a.choices), a.help) for a in g._group_actions])
                for g in parser._action_groups]

    assert described(add_tokenizer_args(argparse.ArgumentParser())) == described(
        _add_tokenizer_args(argparse.ArgumentParser()))


def test_megatron_core_reads_the_output(corpus, tmp_path):
    """Round trip through megatron-core's IndexedDataset (what the training CLI reads)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_jreg.data.tokenizers import build_tokenizer

    path, texts = corpus
    model = train_tokenizer(
        [str(WIKI / "valid.txt")], str(tmp_path / "bpe"), 700, "hf-bpe", max_chars=200_000
    )
    cfg = PreprocessConfig(
        input=[str(path)],
        output_prefix=str(tmp_path / "rt"),
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=model,
        append_eod=True,
    )
    preprocess(cfg)
    tok = build_tokenizer("HuggingFaceTokenizer", model)
    ds = IndexedDataset(str(tmp_path / "rt_text_document"))
    assert len(ds) == len(texts) and ds.index.dtype == np.uint16
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tok.tokenize(text) + [tok.eod]
    assert ds.document_indices.tolist() == list(range(len(texts) + 1))


# ------------------------------------------------------------------------------------------------------------
# Every option of Megatron-LM's tools/preprocess_data.py (core_v0.19.0), with its meaning.

# Its own options, as (option strings, dest, default); its tokenizer group comes from megatron.training below.
MEGATRON_TOOL_OPTIONS = [
    (["--input"], "input", None),
    (["--json-keys"], "json_keys", ["text"]),
    (["--split-sentences"], "split_sentences", False),
    (["--keep-newlines"], "keep_newlines", False),
    (["--append-eod"], "append_eod", False),
    (["--lang"], "lang", "english"),
    (["--output-prefix"], "output_prefix", None),
    (["--workers"], "workers", None),
    (["--find-optimal-num-workers"], "find_optimal_num_workers", False),
    (["--workers-to-check"], "workers_to_check", [16, 32, 64]),
    (["--max-documents"], "max_documents", 100_000),
    (["--partitions"], "partitions", 1),
    (["--log-interval"], "log_interval", 1000),
    (["--keep-sequential-samples"], "keep_sequential_samples", False),
]
# workers: required there, one here when not given; max_documents: None converts everything and gives
# Megatron-LM's 100,000 per --find-optimal-num-workers trial (the only place Megatron-LM reads it).
RELAXED_DEFAULTS = {"workers": 1, "max_documents": None}


def _megatron_lm_options() -> list[tuple[list[str], str, object, object]]:
    import argparse

    from megatron.training.arguments import _add_tokenizer_args

    group = _add_tokenizer_args(argparse.ArgumentParser())
    tokenizer = [(a.option_strings, a.dest, a.default, a.choices) for a in group._actions if a.dest != "help"]
    return tokenizer + [(strings, dest, default, None) for strings, dest, default in MEGATRON_TOOL_OPTIONS]


def test_every_megatron_lm_option_is_accepted_with_its_default():
    from megatron_jreg.data.preprocess import build_parser
    from megatron_jreg.data.preprocess.cli import config_from_args

    options = _megatron_lm_options()
    assert sum(len(strings) for strings, *_ in options) == 36  # 34 options, two with a second spelling
    ours = {s: a for a in build_parser()._actions for s in a.option_strings}
    for strings, dest, default, choices in options:
        actions = {id(ours[s]) for s in strings}  # every spelling, one option
        action = ours[strings[0]]
        assert len(actions) == 1 and action.dest == dest, strings
        assert action.default == RELAXED_DEFAULTS.get(dest, default), strings
        assert choices is None or set(choices) <= set(action.choices), strings
    # A command line using every option parses into the configuration it names.
    argv = (
        "--input a.jsonl --json-keys text --split-sentences --keep-newlines --append-eod --lang english "
        "--output-prefix out --workers 4 --find-optimal-num-workers --workers-to-check 2 4 --max-documents 50 "
        "--partitions 2 --log-interval 10 --keep-sequential-samples --vocab-size 100 --padded-vocab-size 128 "
        "--disable-pad-vocab-size --vocab-file v.json --merge-file m.txt --vocab-extra-ids 0 --tokenizer-type "
        "NullTokenizer --tokenizer-model tok --tokenizer-metadata meta.json --tokenizer-special-tokens <a> <b> "
        "--tiktoken-pattern v1 --tiktoken-num-special-tokens 10 --tokenizer-sentencepiece-legacy "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast "
        "--tokenizer-hf-no-include-special-tokens --trust-remote-code --null-tokenizer-eod-id 3 "
        "--null-tokenizer-pad-id 4 --chat-template {{x}}"
    ).split()
    cfg = config_from_args(build_parser().parse_args(argv))
    assert (cfg.workers_to_check, cfg.max_documents, cfg.partitions) == ([2, 4], 50, 2)
    # megatron-jreg 0.1's --max-docs is the same count under Megatron-LM's name, with a note, hidden from --help
    base = "--input a.jsonl --output-prefix out --tokenizer-type NullTokenizer".split()
    assert config_from_args(build_parser().parse_args(base + ["--max-docs", "7"])).max_documents == 7
    assert "--max-docs" not in build_parser().format_help()
    tok = cfg.tokenizer  # Megatron-LM's tokenizer flags, by its names, for megatron-core's build_tokenizer
    assert tok["special_tokens"] == ["<a>", "<b>"] and tok["metadata_path"] == "meta.json"
    assert (tok["null_tokenizer_eod_id"], tok["null_tokenizer_pad_id"]) == (3, 4)
    assert cfg.keep_sequential_samples and cfg.find_optimal_num_workers
    assert not tok["pad_vocab_size"] and not tok["tokenizer_sentencepiece_ignore_extra_whitespaces"]
    assert tok["tokenizer_hf_no_include_special_tokens"] and tok["tiktoken_pattern"] == "v1"
    # Flags that change nothing in the data, in Megatron-LM either, are named in one note each.
    notes = "\n".join(cfg.notes())
    for flag in ("--padded-vocab-size", "--no-pad-vocab-size", "--chat-template", "--vocab-file", "--tokenizer-model"):
        assert flag in notes


REFUSED = ["BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer", "NullMultimodalTokenizer"]
REFUSED += ["SFTTokenizer"]


@pytest.mark.parametrize("kind", REFUSED)
def test_megatron_lm_tokenizer_types_we_cannot_run_are_refused_with_the_reason(kind, corpus, tmp_path, capsys):
    from megatron_jreg.data.preprocess import main

    path, _ = corpus
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", kind]
    assert main(argv + ["--vocab-file", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--tokenizer-type {kind}: " in err
    assert "megatron-jreg does not" in err or "Megatron-LM's tools/preprocess_data.py does not" in err
    assert not list(tmp_path.iterdir())


def _preprocess(path: Path, prefix: Path, **kw) -> tuple[dict, bytes, bytes]:
    summary = preprocess(PreprocessConfig(input=[str(path)], output_prefix=str(prefix), **kw))
    return (
        summary,
        Path(f"{prefix}_text_document.bin").read_bytes(),
        Path(f"{prefix}_text_document.idx").read_bytes(),
    )


def _bos_tokenizer(bpe: str, folder: Path) -> str:
    """The BPE with a Llama-3-style post-processor that puts a BOS before every text."""
    from tokenizers import Tokenizer, processors

    hf = Tokenizer.from_file(f"{bpe}/tokenizer.json")
    hf.add_special_tokens(["<|begin_of_text|>"])
    bos = hf.token_to_id("<|begin_of_text|>")
    hf.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return str(folder)


SPECIALS = ["<|im_start|>", "<tag>", "</s>", "<unk>", "the"]  # new ones, ones the model has, a plain word
OPTION_CASES = {
    # name: (tokenizer kind, Megatron-LM's tokenizer flags by dest, megatron-core tokenizer options, append eod)
    "hf-special-tokens": ("hf", {"special_tokens": SPECIALS}, {"additional_special_tokens": SPECIALS}, True),
    "hf-no-include-special-tokens": (
        "hf-bos",
        {"tokenizer_hf_no_include_special_tokens": True},
        {"include_special_tokens": False},
        True,
    ),
    "hf-bos-included": ("hf-bos", {}, {}, True),
    "sp-keep-extra-whitespaces": (
        "sp",
        {"tokenizer_sentencepiece_ignore_extra_whitespaces": False},
        {"ignore_extra_whitespaces": False},
        True,
    ),
    "sp-legacy-special-tokens": (  # Megatron-LM's legacy wrapper has no eod: no --append-eod
        "sp",
        {"tokenizer_sentencepiece_legacy": True, "special_tokens": SPECIALS},
        {"legacy": True, "special_tokens": SPECIALS},
        False,
    ),
    "tiktoken-special-tokens-v1": (
        "tiktoken",
        {"special_tokens": ["<sep>", "<cls>", "<pad>", "<mask>", "</s>", "<s>", "<unk>", "<|im_start|>"]},
        {"special_tokens": ["<sep>", "<cls>", "<pad>", "<mask>", "</s>", "<s>", "<unk>", "<|im_start|>"]},
        True,
    ),
}


@pytest.mark.parametrize("case", OPTION_CASES)
def test_tokenizer_options_are_byte_identical_to_megatron_lm(case, corpus, tmp_path):
    kind, ours, theirs, eod = OPTION_CASES[case]
    path, texts = corpus
    extra = {"tokenizer_type": "HuggingFaceTokenizer"}
    if kind == "sp":
        model = train_tokenizer([str(WIKI / "valid.txt")], str(tmp_path / "sp"), 800, max_chars=300_000)
        ref = _megatron_tokenizer("sentencepiece", model, **theirs)
        extra = {"tokenizer_type": "SentencePieceTokenizer"}
    else:
        model = train_tokenizer([str(WIKI / "valid.txt")], str(tmp_path / "bpe"), 1200, "hf-bpe", max_chars=300_000)
        if kind == "hf-bos":
            model = _bos_tokenizer(model, tmp_path / "bos")
        if kind != "tiktoken":
            ref = _megatron_tokenizer("huggingface", model, **theirs)
        else:
            size = _tiktoken_json(model, tmp_path / "tiktoken.json")
            model = str(tmp_path / "tiktoken.json")
            ref = _megatron_tokenizer(
                "tiktoken", model, vocab_size=20 + size, num_special_tokens=20, pattern="v1", **theirs
            )
            extra = {"tokenizer_type": "TikTokenizer"}
            ours = {**ours, "vocab_size": 20 + size, "tiktoken_num_special_tokens": 20, "tiktoken_pattern": "v1"}
    summary, got_bin, got_idx = _preprocess(
        path, tmp_path / "out", tokenizer_model=model, append_eod=eod, **extra, tokenizer=ours
    )
    expected_docs = [ids + [ref.eod] if eod else ids for ids in map(ref.tokenize, texts) if ids]
    expected_bin, expected_idx = _expected_files(expected_docs, ref.vocab_size)
    assert summary["documents"] == len(expected_docs) and summary["tokenizer"]["vocab_size"] == ref.vocab_size
    assert (got_bin, got_idx) == (expected_bin, expected_idx)
    if kind.startswith("hf"):  # and on the fast engine: the options are converted, not a fallback
        assert summary["tokenizer_backend"] == "tiktoken"
    if case == "hf-no-include-special-tokens":  # the option really changed the ids: no BOS
        assert all(d[0] != ref.bos for d in expected_docs)
    if "special_tokens" in str(ours):
        assert summary["tokenizer"]["options"]  # the manifest says how the ids were made


def test_null_tokenizer_is_byte_identical_and_skips_text_that_is_not_ids(tmp_path):
    from megatron.core.tokenizers import MegatronTokenizer

    good = ["1 2 3", "69999 0", "7", "12 12 12 12"]
    bad = ["1  2", "70000", "one two", "3.5"]  # Megatron-LM would crash on three, and write 70000
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in good[:2] + bad + good[2:]))
    summary, got_bin, got_idx = _preprocess(
        path,
        tmp_path / "out",
        tokenizer_type="NullTokenizer",
        tokenizer={"vocab_size": 70_000, "null_tokenizer_eod_id": 5},
        append_eod=True,
    )
    ref = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=70_000, eod_id=5)
    expected = _expected_files([ref.tokenize(t) + [ref.eod] for t in good], ref.vocab_size)
    assert (got_bin, got_idx) == expected and got_idx[9 + 8] == 4  # int32 ids: the vocabulary is > 65500
    assert summary["skipped"] == {"not_token_ids": len(bad)}
    assert "70000 outside 0..69999" in " ".join(summary["skipped_examples"]["not_token_ids"])


def test_partitions_keep_the_input_order_or_are_refused(corpus, tmp_path, capsys):
    """Megatron-LM's --partitions N deals records round-robin over partition files to spread its work; here
    --workers spreads it: with --keep-sequential-samples (contiguous partitions) the output is the input order,
    byte for byte, with a note; without it, one line names the fix. --find-optimal-num-workers is refused too."""
    from megatron_jreg.data.preprocess import main

    path, texts = corpus
    model = train_tokenizer([str(WIKI / "valid.txt")], str(tmp_path / "bpe"), 700, "hf-bpe", max_chars=200_000)
    ref = _megatron_tokenizer("huggingface", model)
    argv = ["--input", str(path), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model,
            "--append-eod", "--workers", "2", "--block-mb", "0.01"]
    assert main(argv + ["--output-prefix", str(tmp_path / "out" / "x"), "--partitions", "3",
                        "--keep-sequential-samples"]) == 0
    assert "note: --partitions 3 with --keep-sequential-samples keeps the input order" in capsys.readouterr().err
    expected = _expected_files([ref.tokenize(t) + [ref.eod] for t in texts], ref.vocab_size)
    assert (Path(tmp_path / "out" / "x_text_document.bin").read_bytes(),
            Path(tmp_path / "out" / "x_text_document.idx").read_bytes()) == expected
    for flags, needle in ((["--partitions", "3"], "--partitions 3: "),
                          (["--find-optimal-num-workers", "--workers-to-check", "1", "2"],
                           "--find-optimal-num-workers: not run here")):
        assert main(argv + ["--output-prefix", str(tmp_path / "refused" / "x"), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err and "--workers" in err
        assert not (tmp_path / "refused").exists()
