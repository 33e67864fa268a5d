"""`megatron-jreg train-tokenizer`: a SentencePiece BPE or Hugging Face byte-level BPE from local text.

Inputs are the same as for preprocessing (parquet, HF dataset folders, JSONL(.gz/.zst)) plus plain `.txt`
files (one sample per line). The result plugs straight into `build_tokenizer` / `--tokenizer-type`:

    sentencepiece  OUTPUT.model   -> SentencePieceTokenizer   (unk 0, bos 1, eos 2 = eod, byte fallback)
    hf-bpe         OUTPUT/ folder -> HuggingFaceTokenizer     (tokenizer.json; <|endoftext|> = id 0 = eod)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from megatron_jreg.data.sources import iter_texts, resolve_inputs
from megatron_jreg.data.tokenizers import ENDOFTEXT

KINDS = ("sentencepiece", "hf-bpe")
# SentencePiece skips training "sentences" longer than this; documents are fed paragraph by paragraph.
_SP_MAX_SENTENCE = 1 << 16


def _samples(inputs: list[str], json_key: str, max_chars: int | None, hf_split: str | None) -> Iterator[str]:
    """Non-empty paragraphs of the inputs, up to `max_chars` characters in total."""
    used = 0
    for text in iter_texts(resolve_inputs(inputs, hf_split, allow_text=True), json_key):
        for line in text.split("\n"):
            if not line.strip():
                continue
            yield line[:_SP_MAX_SENTENCE]
            used += len(line)
            if max_chars is not None and used >= max_chars:
                return


def train_tokenizer(
    inputs: list[str],
    output: str,
    vocab_size: int,
    kind: str = "sentencepiece",
    *,
    json_key: str = "text",
    max_chars: int | None = None,
    hf_split: str | None = None,
    character_coverage: float = 0.9995,
) -> str:
    """Train a tokenizer of `vocab_size` entries; returns the path to give `--tokenizer-model`.

    `max_chars` caps the training text (the first characters of the inputs in order), which keeps the run
    short on a large corpus; None uses everything.
    """
    if kind not in KINDS:
        raise ValueError(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
    if vocab_size < 300:
        raise ValueError(f"--vocab-size {vocab_size}: too small for a byte-level vocabulary (use >= 300)")
    samples = _samples(inputs, json_key, max_chars, hf_split)
    if kind == "sentencepiece":
        import sentencepiece

        prefix = output[: -len(".model")] if output.endswith(".model") else output
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=samples,
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=character_coverage,
            max_sentence_length=_SP_MAX_SENTENCE,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        return f"{prefix}.model"

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(samples, trainer)
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": ENDOFTEXT,
        "model_max_length": 1 << 30,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(folder)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-jreg train-tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="files, directories or globs (.txt too)")
    p.add_argument("--output", required=True, help="sentencepiece: PATH(.model); hf-bpe: a folder")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--kind", choices=KINDS, default="sentencepiece")
    p.add_argument("--json-key", default="text", help="JSONL key / parquet column with the text")
    p.add_argument("--max-chars", type=int, default=None, help="train on at most N characters of input")
    p.add_argument("--hf-split", default=None, help="split of a saved HF DatasetDict folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = train_tokenizer(
            args.input,
            args.output,
            args.vocab_size,
            args.kind,
            json_key=args.json_key,
            max_chars=args.max_chars,
            hf_split=args.hf_split,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"megatron-jreg train-tokenizer: error: {e}", file=sys.stderr)
        return 1
    tokenizer_type = "SentencePieceTokenizer" if args.kind == "sentencepiece" else "HuggingFaceTokenizer"
    print(f"trained {args.kind} tokenizer: --tokenizer-type {tokenizer_type} --tokenizer-model {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
