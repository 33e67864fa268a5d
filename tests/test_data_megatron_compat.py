"""Megatron-LM compatibility: byte-identical .bin/.idx, read back through megatron-core.

The expected bytes are built here from the documented format (header magic, version, dtype code, sequence
and document counts, lengths, pointers, document indices) and the token ids from megatron-core's own
tokenizer classes (`megatron.core.tokenizers`, which Megatron-LM's tools/preprocess_data.py calls) plus its
eod, appended to every non-empty document.
"""

from __future__ import annotations

import base64
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
    from megatron_jreg.data.tokenizers import _byte_to_unicode

    to_byte = {c: b for b, c in _byte_to_unicode().items()}
    merges = json.loads(Path(bpe_folder, "tokenizer.json").read_text())["model"]["merges"]
    pieces = [bytes([b]) for b in range(256)] + [bytes(to_byte[c] for c in "".join(m)) for m in merges]
    out.write_text(
        json.dumps(
            [
                {
                    "rank": i,
                    "token_bytes": base64.b64encode(p).decode(),
                    "token_str": p.decode("utf-8", "replace"),
                }
                for i, p in enumerate(pieces)
            ]
        )
    )
    return len(pieces)


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "SentencePieceTokenizer", "TikTokenizer"])
def test_output_is_byte_identical_to_megatron_lm(kind, corpus, tmp_path):
    path, texts = corpus
    extra: dict = {}
    if kind == "SentencePieceTokenizer":
        model = train_tokenizer([str(WIKI / "valid.txt")], str(tmp_path / "sp"), 800, max_chars=300_000)
        ref = _megatron_tokenizer("sentencepiece", model)
    else:
        model = train_tokenizer(
            [str(WIKI / "valid.txt")], str(tmp_path / "bpe"), 1200, "hf-bpe", max_chars=300_000
        )
        ref = _megatron_tokenizer("huggingface", model)
        if kind == "TikTokenizer":
            size = _tiktoken_json(model, tmp_path / "tiktoken.json")
            model, extra = str(tmp_path / "tiktoken.json"), {"vocab_size": 1000 + size}
            ref = _megatron_tokenizer("tiktoken", model, vocab_size=1000 + size, num_special_tokens=1000)
    cfg = PreprocessConfig(
        input=[str(path)],
        output_prefix=str(tmp_path / "out"),
        tokenizer_type=kind,
        tokenizer_model=model,
        append_eod=True,
        **extra,
    )
    summary = preprocess(cfg)

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
