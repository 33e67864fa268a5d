"""Tokenizers: megatron-core's, by Megatron-LM's --tokenizer-type; the fast engines' exactness on every kind of
tokenizer (GPT-2/SmolLM2/Llama-3-style byte-level BPE, SentencePiece BPE, the ones without a tiktoken conversion);
clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_jreg.data.tokenizers import build_tokenizer
from megatron_jreg.data.train_tokenizer import train_tokenizer

WIKI = Path(__file__).resolve().parent.parent / "examples" / "data" / "wikitext-2"
TRICKY = [
    "Plain English, with numbers 1234567 and 3.14159.",
    "Whitespace:   three spaces\n\n\ttab\r\nCRLF   \n  trailing   ",
    "Unicode: naïve café — 東京 😀 ｆｕｌｌ Ω≈ç √ ∫ \u200b zero-width",
    "Special text inside: before<|endoftext|>after and <|endoftext|><|endoftext|>",
    "Contractions: don't I'LL we've they'd it's O'Neil's",
    "",
    " ",
]


@pytest.fixture(scope="module")
def hf_bpe(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tok") / "bpe"
    return train_tokenizer([str(WIKI / "valid.txt")], str(out), 1000, "hf-bpe", max_chars=300_000)


def _reference_ids(folder: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json")).encode(text).ids


def test_hf_bpe_fast_path_matches_megatron_core(hf_bpe):
    tok = build_tokenizer("HuggingFaceTokenizer", hf_bpe)
    assert tok.backend == "tiktoken"
    assert tok.vocab_size == 1000 and tok.eod == 0 and tok.pad is None
    texts = TRICKY + (WIKI / "test.txt").read_text(encoding="utf-8")[:200_000].split("\n")
    expected = [_reference_ids(hf_bpe, t) for t in TRICKY]
    assert [tok.tokenize(t) for t in TRICKY] == expected
    assert tok.tokenize_batch(texts) == [list(tok.megatron.tokenize(t)) for t in texts]  # megatron-core's own ids
    assert tok.tokenize("a<|endoftext|>b")[1] == tok.eod
    assert tok.detokenize(tok.tokenize(TRICKY[2])) == TRICKY[2]


def _llama3_style(hf_bpe: str, folder: Path):  # noqa: ANN202 - (tokenizers.Tokenizer, BOS id)
    """hf_bpe with Llama-3's Split+ByteLevel pre-tokenizer and a BOS post-processor, saved in `folder`."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers, processors

    hf = Tokenizer.from_file(f"{hf_bpe}/tokenizer.json")
    hf.add_special_tokens(["<|begin_of_text|>"])
    bos = hf.token_to_id("<|begin_of_text|>")
    pattern = (  # Llama-3's
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )
    hf.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
            ),
        ]
    )
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return hf, bos


def test_llama3_style_tokenizer_json_with_bos_template(hf_bpe, tmp_path):
    """Split+ByteLevel pre-tokenizer and a BOS post-processor also run on tiktoken, with the BOS added."""
    hf, bos = _llama3_style(hf_bpe, tmp_path)
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert tok.backend == "tiktoken"
    assert [tok.tokenize(t) for t in TRICKY] == [hf.encode(t).ids for t in TRICKY]
    assert tok.tokenize("hello")[0] == bos and tok.vocab_size == 1001


@pytest.mark.parametrize("flags", ["", "--tokenizer-hf-no-include-special-tokens",
                                   "--tokenizer-special-tokens <|user|> <|assistant|>"])
def test_checkpoint_readers_tokenize_as_megatron_lms_builder_on_the_saved_args(hf_bpe, tmp_path, flags):
    """analyze/evaluate/convert rebuild the run's tokenizer from its saved args: every tokenizer option the run
    had applies, and the ids equal Megatron-LM's own builder (megatron.core) on the same args."""
    import argparse

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build
    from megatron.training.arguments import _add_tokenizer_args

    from megatron_jreg.checkpoints.model import tokenizer_from_args

    _llama3_style(hf_bpe, tmp_path)
    argv = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path), *flags.split()]
    args = _add_tokenizer_args(argparse.ArgumentParser()).parse_args(argv)  # as Megatron-LM saves them
    args.pad_vocab_size, args.metadata_path = False, None
    ours, theirs = tokenizer_from_args(args), megatron_build(args)
    texts = [*TRICKY, "<|user|>hi<|assistant|>hello"]
    assert [ours.tokenize(t) for t in texts] == [list(theirs.tokenize(t)) for t in texts]
    assert ours.eod == theirs.eod


def test_unconvertible_tokenizer_falls_back_to_tokenizers(hf_bpe, tmp_path):
    from tokenizers import Tokenizer, normalizers

    hf = Tokenizer.from_file(f"{hf_bpe}/tokenizer.json")
    hf.normalizer = normalizers.NFKC()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert tok.backend == "tokenizers (no exact tiktoken conversion: a normalizer)"
    assert tok.eod is None  # no tokenizer_config.json: no eos token, so --append-eod will refuse
    assert tok.tokenize_batch(TRICKY) == [hf.encode(t).ids for t in TRICKY]
    assert tok.tokenize(TRICKY[2]) != _reference_ids(hf_bpe, TRICKY[2])  # NFKC really changed the ids


# Text the engines must get right beyond TRICKY: bytes and characters the stand-ins lack (control bytes, rare
# scripts, private use, emoji), the stand-ins' special and added tokens in and between words, runs of newlines.
EDGES = [
    "control\x01bytes\x00 and \x7f delete\tand\x0btabs\r\n",
    "rare scripts: ܐܒܓ ދިވެހި ߒߞߏ \ue000\U000f0000 \U0001f600\U0001f680 ＡＢＣ",
    "chat: <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n\n\nhello<|im_end|><|endoftext|>",
    "llama: <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>x<|reserved_special_token_7|>",
    "\n\n\n\n\n and a\n\nb and \n\n",
    "<|endoftext|",
]


def _corpus() -> list[str]:
    return [*TRICKY, *EDGES, *(WIKI / "test.txt").read_text(encoding="utf-8")[:300_000].split("\n")]


def _same_ids_as_megatron_core(tok, texts: list[str]) -> None:  # noqa: ANN001 - our Tokenizer
    expected = [list(tok.megatron.tokenize(t)) for t in texts]
    got = tok.tokenize_batch(texts)
    wrong = [t for t, a, b in zip(texts, got, expected) if a != b]
    assert not wrong, f"{len(wrong)} texts differ, e.g. {wrong[0][:80]!r}"
    assert [list(map(int, ids)) for ids in tok.tokenize_arrays(texts)] == expected  # what preprocess writes


@pytest.fixture(scope="module")
def smollm2_like(tmp_path_factory) -> str:
    from megatron_jreg.data.text import wikitext_articles
    from tests._tokenizers import smollm2_style

    paragraphs = [a.replace(" \n \n ", "\n\n") for a in wikitext_articles(WIKI / "valid.txt")]  # makes "ĊĊ"
    return smollm2_style(tmp_path_factory.mktemp("smollm2"), paragraphs, 3000)


@pytest.mark.parametrize("flags", [{}, {"include_special_tokens": False}])
def test_smollm2_style_bpe_lacking_bytes_with_a_duplicate_piece_runs_on_tiktoken(smollm2_like, flags):
    """SmolLM2-style: its special tokens first, bytes missing from the vocabulary, "\n\n" both a piece and an added
    token: exact on tiktoken, a text holding a lacking byte tokenized by the library (which drops the byte)."""
    from tests._tokenizers import DUPLICATE, SMOLLM2_SPECIALS

    tok = build_tokenizer("HuggingFaceTokenizer", smollm2_like, **flags)
    assert tok.backend == "tiktoken"
    plan = tok._engine.plan
    assert plan.uncovered is not None and plan.uncovered.search(b"\x01")  # the stand-in lacks bytes
    _same_ids_as_megatron_core(tok, _corpus())
    backend = tok.megatron._tokenizer.tokenizer.backend_tokenizer
    duplicate, piece = backend.token_to_id(DUPLICATE), backend.model.token_to_id("ĊĊ")
    assert duplicate != piece is not None  # the same text twice: as the added token it is always the added id
    ids = tok.tokenize(f"a{DUPLICATE}\nb")
    assert duplicate in ids and piece not in ids
    assert tok.eod == 0 and tok.tokenize(SMOLLM2_SPECIALS[2]) == [2]


@pytest.mark.parametrize("flags", [{}, {"include_special_tokens": False}])
def test_llama3_style_bpe_with_reserved_specials_and_ignore_merges_runs_on_tiktoken(tmp_path, flags):
    from megatron_jreg.data.text import wikitext_articles
    from tests._tokenizers import llama3_specials, llama3_style

    folder = llama3_style(tmp_path / "llama3", wikitext_articles(WIKI / "valid.txt"), 3256)
    tok = build_tokenizer("HuggingFaceTokenizer", folder, **flags)
    assert tok.backend == "tiktoken"
    _same_ids_as_megatron_core(tok, _corpus())
    bos, eos, eot = 3000, 3001, 3009  # the 256 special tokens follow the 3000 trained pieces, in Llama-3's order
    with_bos = [] if flags else [bos]
    assert tok.eod == eos and tok.tokenize(llama3_specials()[9]) == [*with_bos, eot]


@pytest.mark.parametrize("pre", ["split-letters-only", "byte-level-without-regex"])
def test_other_byte_level_pre_tokenizers_run_on_tiktoken(hf_bpe, tmp_path, pre):
    """A Split regex that leaves text between its matches (`tokenizers` keeps it as pieces; tiktoken would drop
    it: the pattern takes the gaps too), and ByteLevel without its regex (one piece between added tokens)."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    hf = Tokenizer.from_file(f"{hf_bpe}/tokenizer.json")
    hf.pre_tokenizer = (pre_tokenizers.ByteLevel(False, use_regex=False) if pre.startswith("byte-level") else
                        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{L}+"), "isolated"),
                                                 pre_tokenizers.ByteLevel(False, use_regex=False)]))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert tok.backend == "tiktoken"
    _same_ids_as_megatron_core(tok, _corpus())


def test_ids_out_of_merge_order_are_mapped(hf_bpe, tmp_path):
    """A vocabulary whose ids do not rise with the merge index (two merged pieces' ids swapped): tiktoken ranks in
    merge order, its ids mapped back to the vocabulary's."""
    spec = json.loads(Path(hf_bpe, "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, last = ("".join(m) if isinstance(m, list) else m.replace(" ", "") for m in spec["model"]["merges"][::600])
    vocab[first], vocab[last] = vocab[last], vocab[first]
    Path(tmp_path, "tokenizer.json").write_text(json.dumps(spec))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert tok.backend == "tiktoken" and tok._engine.plan.table is not None
    _same_ids_as_megatron_core(tok, _corpus())


def test_merges_edited_by_hand_fall_back_to_tokenizers_batch_encoding(hf_bpe, tmp_path):
    """A merge repeated at the end of the list (`tokenizers` keeps the last index) no longer makes the pieces built
    on it from their characters: tiktoken would give other ids, so the `tokenizers` engine runs, exactly."""
    spec = json.loads(Path(hf_bpe, "tokenizer.json").read_text())
    spec["model"]["merges"].append(spec["model"]["merges"][2])
    Path(tmp_path, "tokenizer.json").write_text(json.dumps(spec))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert tok.backend.startswith("tokenizers (no exact tiktoken conversion: merges that do not make the piece")
    _same_ids_as_megatron_core(tok, _corpus())


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_sentencepiece_bpe_runs_on_tiktoken(tmp_path, byte_fallback):
    """A SentencePiece BPE (Llama-2's kind, with or without byte fallback, with user-defined symbols): exact on
    tiktoken; characters the model lacks become byte pieces, or one unknown piece per run."""
    import sentencepiece

    prefix = str(tmp_path / "sp")
    sentencepiece.SentencePieceTrainer.train(
        input=str(WIKI / "valid.txt"), model_prefix=prefix, vocab_size=1200, model_type="bpe", minloglevel=2,
        byte_fallback=byte_fallback, character_coverage=0.999, user_defined_symbols=["<tag>", "<|im_start|>"])
    tok = build_tokenizer("SentencePieceTokenizer", f"{prefix}.model")
    assert tok.backend == "tiktoken"
    _same_ids_as_megatron_core(tok, [*_corpus(), "a<tag>b <tag> <|im_start|>x東京😀y", "▁a▁ b▁"])  # ▁ not special
    processor = tok.megatron._tokenizer.tokenizer
    lacking = [i for i in tok.tokenize("x \U0001f600\U0001f680 y") if processor.is_byte(i) or processor.is_unknown(i)]
    assert len(lacking) == (8 if byte_fallback else 1)  # two emoji: their 8 bytes, or one unknown piece
    if byte_fallback:  # a lacking character sharing its first two bytes with one the model has: its 3 bytes
        ranks = tok._engine.plan.ranks
        shared = next(c for c in map(chr, range(0x800, 0xD800)) if c.encode()[:2] in ranks
                      and c.encode() not in ranks and processor.normalize(c) == f"\u2581{c}")
        _same_ids_as_megatron_core(tok, [f"a{shared}b {shared}{shared}", shared, f"{shared}😀東"])
        assert sum(map(processor.is_byte, tok.tokenize(f"x {shared}"))) == 3


def test_sentencepiece_unigram_and_legacy_mode_say_why_they_have_no_fast_path(tmp_path):
    import sentencepiece

    prefix = str(tmp_path / "uni")
    sentencepiece.SentencePieceTrainer.train(input=str(WIKI / "valid.txt"), model_prefix=prefix, vocab_size=800,
                                             model_type="unigram", minloglevel=2)
    tok = build_tokenizer("SentencePieceTokenizer", f"{prefix}.model")
    assert tok.backend == ("megatron-core (no fast path: no exact tiktoken conversion: a SentencePiece model that is "
                           "not BPE (unigram: no merges to convert))")
    assert tok.tokenize_batch(TRICKY) == [list(tok.megatron.tokenize(t)) for t in TRICKY]
    model = train_tokenizer([str(WIKI / "valid.txt")], str(tmp_path / "bpe"), 600, max_chars=200_000)
    tok = build_tokenizer("SentencePieceTokenizer", model, sentencepiece_legacy=True, special_tokens=["<x>"])
    assert tok.backend.startswith("megatron-core (no fast path: --tokenizer-sentencepiece-legacy")


def test_gpt2_bpe_from_vocab_and_merges_matches_transformers(hf_bpe, tmp_path):
    """GPT2BPETokenizer follows GPT2TokenizerFast(vocab, merges), which Megatron-LM loads for this type."""
    from transformers import GPT2TokenizerFast

    model = json.loads(Path(f"{hf_bpe}/tokenizer.json").read_text())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = build_tokenizer(
        "GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt")
    )
    ref = GPT2TokenizerFast.from_pretrained(tmp_path)  # reads vocab.json + merges.txt
    assert tok.backend == "tiktoken"
    assert tok.eod == ref.eos_token_id == 0 and tok.vocab_size == len(ref)
    assert [tok.tokenize(t) for t in TRICKY] == [ref(t).input_ids for t in TRICKY]


def test_tiktokenizer_megatron_json_and_tiktoken_file(hf_bpe, tmp_path):
    from tests._tokenizers import tiktoken_entries

    entries = tiktoken_entries(hf_bpe)
    (tmp_path / "vocab.json").write_text(json.dumps(entries))
    tok = build_tokenizer("TikTokenizer", str(tmp_path / "vocab.json"), vocab_size=1000 + len(entries))
    assert tok.eod == 2 and tok.pad == 4 and tok.vocab_size == 1000 + len(entries)
    ids = tok.tokenize("Hello world</s>")
    assert ids[-1] == 2 and min(ids[:-1]) >= 1000  # text ids are shifted past the 1000 special tokens
    assert tok.detokenize(ids) == "Hello world</s>"

    lines = [f"{e['token_bytes']} {e['rank']}" for e in entries]
    (tmp_path / "cl100k_base.tiktoken").write_text("\n".join(lines) + "\n")
    tok = build_tokenizer("TikTokenizer", str(tmp_path / "cl100k_base.tiktoken"))
    assert tok.eod == 100257 and tok.vocab_size == 100277
    assert tok.detokenize(tok.tokenize(TRICKY[2])) == TRICKY[2]
    (tmp_path / "mystery.tiktoken").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'mystery'"):
        build_tokenizer("TikTokenizer", str(tmp_path / "mystery.tiktoken"))


def test_sentencepiece_conventions(tmp_path):
    import sentencepiece

    model = train_tokenizer([str(WIKI / "valid.txt")], str(tmp_path / "sp"), 500, max_chars=200_000)
    tok = build_tokenizer("SentencePieceTokenizer", model)
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    assert (tok.vocab_size, tok.eod, tok.pad) == (500, sp.eos_id(), None) and tok.eod == 2
    assert tok.tokenize_batch(TRICKY) == [sp.encode(t) for t in TRICKY]
    assert tok.identity["type"] == "SentencePieceTokenizer" and len(tok.identity["sha256"]) == 64


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (("BertWordPieceCase",), ValueError, "--tokenizer-type BertWordPieceCase: .*use --tokenizer-type Hugging"),
        (("Unigram",), ValueError, "--tokenizer-type 'Unigram' is not supported"),
        (("SentencePieceTokenizer", "/nonexistent.model"), FileNotFoundError, "--tokenizer-model"),
        (("HuggingFaceTokenizer", "/nonexistent"), FileNotFoundError, "--tokenizer-model /nonexistent: no such"),
        (("GPT2BPETokenizer",), FileNotFoundError, "--vocab-file"),
        (("TikTokenizer", "/nonexistent.json"), FileNotFoundError, "nothing is downloaded"),
    ],
)
def test_build_tokenizer_errors_name_the_flag(args, error, match):
    with pytest.raises(error, match=match):
        build_tokenizer(*args)


@pytest.mark.parametrize("kind", ["hf-bpe", "sentencepiece"])
def test_reserved_special_tokens_stay_inside_the_vocabulary(tmp_path, kind):
    """Reserved chat/padding tokens are single ids below --vocab-size, so SFT needs no new embedding rows."""
    from megatron_jreg.data.tokenizers import build_tokenizer
    from megatron_jreg.data.train_tokenizer import train_tokenizer

    text = tmp_path / "t.txt"
    text.write_text((WIKI / "valid.txt").read_text()[:200000])
    out = str(tmp_path / ("tok" if kind == "hf-bpe" else "sp.model"))
    path = train_tokenizer([str(text)], out, 600, kind=kind, special_tokens=("<|pad|>", "<|user|>"))
    tok = build_tokenizer("HuggingFaceTokenizer" if kind == "hf-bpe" else "SentencePieceTokenizer", path)
    assert tok.vocab_size == 600
    for special in ("<|pad|>", "<|user|>"):
        ids = [i for i in tok.tokenize(f"a {special} b") if tok.detokenize([i]).strip() == special]
        assert len(ids) == 1 and ids[0] < 600


@pytest.mark.parametrize("split", [False, True])
def test_split_special_tokens_in_the_folders_config_is_honoured_as_transformers_does(hf_bpe, tmp_path, split):
    """A SentencePiece model exported to Hugging Face keeps a literal "</s>" as text (split_special_tokens:
    true); AutoTokenizer, hence Megatron-LM's HuggingFaceTokenizer, honours it, and so must we."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    shutil.copytree(hf_bpe, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": split}))
    reference = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    ours = build_tokenizer("HuggingFaceTokenizer", str(folder))
    for text in TRICKY:
        assert ours.tokenize(text) == reference.encode(text, add_special_tokens=False), (split, text)
    special = "before<|endoftext|>after"
    assert (ours.eod in ours.tokenize(special)) is not split
