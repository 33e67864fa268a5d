"""Tokenizers of a Megatron-LM run written as Hugging Face tokenizers (`convert mcore-to-hf`): every
--tokenizer-type `train` accepts, loaded back with `AutoTokenizer`, gives the run's ids on the corpus sample;
what transformers cannot reproduce is refused with --no-tokenizer named; a tokenizer that does not belong to
the checkpoint is refused with the numbers. No megatron-core model here (tests/test_convert.py runs the CLI
on trained checkpoints)."""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from megatron_jreg.data.train_tokenizer import train_tokenizer

if TYPE_CHECKING:
    from megatron_jreg.convert.tokenizer import TokenizerSource

WIKI = Path(__file__).resolve().parent.parent / "examples" / "data" / "wikitext-2" / "valid.txt"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """One tokenizer file set per type, all from the same 400-token byte-level BPE (and a SentencePiece)."""
    root = tmp_path_factory.mktemp("tok")
    (root / "text.txt").write_text(WIKI.read_text(encoding="utf-8")[:30000], encoding="utf-8")
    hf = Path(train_tokenizer([str(root / "text.txt")], str(root / "hf"), 400, kind="hf-bpe"))
    sp = Path(train_tokenizer([str(root / "text.txt")], str(root / "sp" / "sp"), 400, kind="sentencepiece"))
    model = json.loads((hf / "tokenizer.json").read_text())["model"]
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (gpt2 / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    pieces = [bytes([b]) for b in range(256)] + [bytes(to_byte[c] for c in "".join(m)) for m in model["merges"]]
    entries = [{"rank": i, "token_bytes": base64.b64encode(p).decode(), "token_str": ""} for i, p in enumerate(pieces)]
    (root / "megatron_tiktoken.json").write_text(json.dumps(entries))
    (root / "cl100k_base.tiktoken").write_text("\n".join(f"{e['token_bytes']} {e['rank']}" for e in entries) + "\n")
    return {"hf": hf, "sp": sp, "gpt2": gpt2, "tiktoken_json": root / "megatron_tiktoken.json",
            "tiktoken_file": root / "cl100k_base.tiktoken", "root": root, "entries": len(entries)}


def _sources(f: dict) -> dict[str, TokenizerSource]:
    from megatron_jreg.convert.tokenizer import TokenizerSource

    return {
        "hf": TokenizerSource("HuggingFaceTokenizer", str(f["hf"])),
        "hf_extra_specials": TokenizerSource("HuggingFaceTokenizer", str(f["hf"]),
                                             options={"special_tokens": ["<|pad|>", "<|user|>"]}),
        "sentencepiece": TokenizerSource("SentencePieceTokenizer", str(f["sp"])),
        "llama2_sentencepiece": TokenizerSource("Llama2Tokenizer", str(f["sp"])),
        "gpt2_bpe": TokenizerSource("GPT2BPETokenizer", None, str(f["gpt2"] / "vocab.json"),
                                    str(f["gpt2"] / "merges.txt")),
        "tiktoken_megatron_json": TokenizerSource("TikTokenizer", str(f["tiktoken_json"]),
                                                  options={"vocab_size": 1000 + f["entries"]}),
        "tiktoken_file": TokenizerSource("TikTokenizer", str(f["tiktoken_file"])),
    }


@pytest.mark.parametrize("name", ["hf", "hf_extra_specials", "sentencepiece", "llama2_sentencepiece", "gpt2_bpe",
                                  "tiktoken_megatron_json", "tiktoken_file"])
def test_every_tokenizer_type_exports_with_the_runs_ids(files, name, tmp_path):
    from megatron_jreg.convert.tokenizer import check_texts, check_written, write_tokenizer

    source = _sources(files)[name]
    source.where = name
    tok = source.build()
    written = write_tokenizer(tok, source, tmp_path, context_length=96)
    theirs = check_written(tok, source, tmp_path, vocab_size=10**6)  # the id check itself
    texts = check_texts(tok)
    assert len(texts) > 200 and [theirs(t)["input_ids"] for t in texts] == [tok.tokenize(t) for t in texts]
    assert "tokenizer.json" in written and "tokenizer_config.json" in written
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 96 and theirs.model_max_length == 96  # not 1073741824
    assert theirs.eos_token_id == tok.eod and theirs.pad_token_id is not None  # pad: its own, else the eod
    if name == "sentencepiece":
        assert "tokenizer.model" in written and theirs("<s>")["input_ids"] == tok.tokenize("<s>")  # text, not BOS
        assert tok.tokenize("Hello") == theirs("Hello")["input_ids"]  # no BOS added: trained without one
    if name == "hf_extra_specials":
        assert theirs.convert_tokens_to_ids("<|user|>") == tok.tokenize("<|user|>")[0] == 401


@pytest.mark.parametrize("options,needle", [
    ({"sentencepiece_ignore_extra_whitespaces": False}, "sample 0"),  # Megatron-LM's space markers
    ({"special_tokens": ["<extra_0>"], "sentencepiece_legacy": True}, "other ids"),
])
def test_options_transformers_cannot_reproduce_are_refused(files, tmp_path, options, needle):
    from megatron_jreg.convert.hf_io import ConversionError
    from megatron_jreg.convert.tokenizer import TokenizerSource, check_written, write_tokenizer

    source = TokenizerSource("SentencePieceTokenizer", str(files["sp"]), options=options, where="--tokenizer-model X")
    tok = source.build()
    write_tokenizer(tok, source, tmp_path, 64)
    with pytest.raises(ConversionError, match=needle) as e:
        check_written(tok, source, tmp_path, 10**6)
    assert "--no-tokenizer" in str(e.value)


def _args(**kw) -> argparse.Namespace:
    base = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=None, vocab_file=None, merge_file=None,
                make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, padded_vocab_size=512,
                vocab_size=None, mock_data=True, sft=False)
    return argparse.Namespace(**{**base, **kw})


def test_a_tokenizer_of_another_run_is_refused_with_the_numbers(files):
    """The run trained with the SentencePiece model (400 pieces, eod 2); an HF tokenizer (400 tokens, eod 0)
    given instead is refused, naming both ids; a vocabulary that pads to other rows names both sizes."""
    from megatron_jreg.convert.hf_io import ConversionError
    from megatron_jreg.convert.tokenizer import check_fits_checkpoint, resolve_source

    args = _args(tokenizer_model=str(files["sp"]))
    source, _ = resolve_source(args, str(files["hf"]), None, False)
    assert source.type == "HuggingFaceTokenizer"
    with pytest.raises(ConversionError, match=r"end-of-document id 0, the run's SentencePieceTokenizer .* has 2"):
        check_fits_checkpoint(source.build(), source, args)
    small = _args(tokenizer_model=str(files["sp"]), padded_vocab_size=384)
    with pytest.raises(ConversionError, match=r"its 400 tokens pad to 512 embedding rows .*, the checkpoint has 384"):
        check_fits_checkpoint(source.build(), source, small)
    null = _args(tokenizer_type="NullTokenizer", vocab_size=320)
    with pytest.raises(ConversionError, match=r"400 tokens, the run's NullTokenizer \(--vocab-size\) has 320"):
        check_fits_checkpoint(source.build(), source, null)
    own, _ = resolve_source(args, str(files["sp"]), None, False)
    check_fits_checkpoint(own.build(), own, args)  # the run's own model, given explicitly: accepted


def test_resolve_source_names_the_fix(files, tmp_path):
    from megatron_jreg.convert.hf_io import ConversionError
    from megatron_jreg.convert.tokenizer import infer_type, resolve_source

    assert [infer_type(files[k]) for k in ("hf", "sp", "gpt2", "tiktoken_json", "tiktoken_file")] == [
        "HuggingFaceTokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer", "TikTokenizer", "TikTokenizer"]
    assert resolve_source(_args(), None, None, True) == (None, "no tokenizer written (--no-tokenizer)")
    assert resolve_source(_args(tokenizer_type="NullTokenizer"), None, None, False)[0] is None
    moved = _args(tokenizer_model=str(tmp_path / "gone.model"))
    for call, needle in (
        (lambda: resolve_source(moved, None, None, False), "does not exist: pass --tokenizer-model"),
        (lambda: resolve_source(moved, str(files["sp"]), None, True), "contradict"),
        (lambda: resolve_source(moved, str(tmp_path), None, False), "not a tokenizer megatron-jreg can export"),
    ):
        with pytest.raises(ConversionError, match=needle) as e:
            call()
        assert "--no-tokenizer" in str(e.value) or "contradict" in str(e.value)


def test_a_transformers_5_save_exports_under_a_class_both_majors_load(files, tmp_path):
    """transformers 5's save_pretrained names its fast tokenizer `TokenizersBackend`, a class 4.x does not know;
    the copy of such a tokenizer says `PreTrainedTokenizerFast` (the same class in 5.x), as docs/convert.md says
    (issue 33: the docs said so while SmolLM2's export kept `TokenizersBackend`)."""
    from transformers import AutoTokenizer

    from megatron_jreg.convert.tokenizer import TokenizerSource, check_written, write_tokenizer

    AutoTokenizer.from_pretrained(files["hf"]).save_pretrained(tmp_path / "v5")
    if json.loads((tmp_path / "v5" / "tokenizer_config.json").read_text())["tokenizer_class"] != "TokenizersBackend":
        pytest.skip("this transformers does not save as TokenizersBackend")
    source = TokenizerSource("HuggingFaceTokenizer", str(tmp_path / "v5"), where="v5")
    tok = source.build()
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer(tok, source, out, context_length=96)
    check_written(tok, source, out, vocab_size=10**6)  # loads, and gives the run's ids
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    docs = " ".join((WIKI.parents[3] / "docs" / "convert.md").read_text(encoding="utf-8").split())
    assert "a copied one that said `TokenizersBackend`" in docs and "`PreTrainedTokenizerFast`" in docs
