"""`megatron-jreg train-tokenizer`: a SentencePiece BPE or Hugging Face byte-level BPE from local text.

preprocess's inputs plus `.txt`, so a tokenizer is made from the data it will tokenize; the result is a
`--tokenizer-model` as it is (OUTPUT.model: unk 0, bos 1, eos 2 = eod; OUTPUT/: <|endoftext|> = id 0 = eod).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from megatron_jreg.data.checks import DataError, check_output_prefix, check_positive, skip_counts
from megatron_jreg.data.sources import iter_texts, resolve_inputs
from megatron_jreg.data.tokenizers import ENDOFTEXT
from megatron_jreg.errors import run_command
from megatron_jreg.fileio import check_output_folder
from megatron_jreg.usage import OneLineParser, example

PROG = "megatron-jreg train-tokenizer"

KINDS = ("sentencepiece", "hf-bpe")
# SentencePiece skips training "sentences" longer than this; documents are fed paragraph by paragraph.
_SP_MAX_SENTENCE = 1 << 16


class _Samples:
    """Non-empty paragraphs of the inputs, up to `max_chars` characters in total; counts what it yields
    and the records it skipped by reason, so that an input without usable text is named, not trained on."""

    def __init__(self, inputs: list[str], json_key: str, max_chars: int | None, hf_split: str | None) -> None:
        self.files = resolve_inputs(inputs, hf_split, allow_text=True)
        self.json_key, self.max_chars = json_key, max_chars
        self.count, self.skipped = 0, collections.Counter()

    def __iter__(self) -> Iterator[str]:
        used = 0
        for text in iter_texts(self.files, self.json_key, self.skipped):
            for line in text.split("\n"):
                if not line.strip():
                    continue
                self.count += 1
                yield line[:_SP_MAX_SENTENCE]
                used += len(line)
                if self.max_chars is not None and used >= self.max_chars:
                    return

    def check(self, report: bool = True) -> None:
        """After training: no text is an error naming the input and key; skipped records are reported (`report`)."""
        if self.count == 0:
            raise DataError(f"--input {' '.join(f.path for f in self.files)}: no text to train on under --json-key "
                            f"{self.json_key!r} ({skip_counts(self.skipped)}); check the files and --json-key")
        if report and self.skipped:
            print(f"train-tokenizer: skipped records of the input: {skip_counts(self.skipped)}", file=sys.stderr)


def train_tokenizer(input: list[str], output: str, vocab_size: int, kind: str = "sentencepiece", *,
                    json_key: str = "text", max_chars: int | None = None, hf_split: str | None = None,
                    special_tokens: list[str] | tuple[str, ...] = ()) -> str:
    """Train a tokenizer; returns the path to give `--tokenizer-model`. `special_tokens` are reserved in the
    vocabulary (as Llama-3 does), so a later chat format or padding needs no new embedding rows."""
    if kind not in KINDS:
        raise DataError(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
    check_positive("--vocab-size", vocab_size, 300, allow_none=False)  # a byte-level vocabulary needs >= 259
    check_positive("--max-chars", max_chars, 1)
    if kind == "sentencepiece":
        check_output_prefix(output, "--output", "a file prefix", "tokenizer.model")
    elif Path(output).exists() and not Path(output).is_dir():
        raise DataError(f"--output {output}: is a file; hf-bpe writes a folder, so give a new folder path")
    else:
        check_output_folder(Path(output).parent, f"--output {output}", create=True)
    samples = _Samples(input, json_key, max_chars, hf_split)
    if kind == "sentencepiece":
        import sentencepiece

        prefix = output[: -len(".model")] if output.endswith(".model") else output
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(samples), model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
                byte_fallback=True, max_sentence_length=_SP_MAX_SENTENCE, num_threads=os.cpu_count() or 1,
                minloglevel=2, user_defined_symbols=list(special_tokens))
        except RuntimeError as e:  # sentencepiece's C++ errors, e.g. "Vocabulary size too high (..)"
            samples.check(report=False)
            flag = "--vocab-size" if "vocab" in str(e).lower() else "--input"
            raise DataError(f"{flag}: SentencePiece cannot train on this input: {str(e).strip()[:300]}") from None
        samples.check()
        return f"{prefix}.model"

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [ENDOFTEXT, *[t for t in special_tokens if t != ENDOFTEXT]]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(iter(samples), trainer)
    samples.check()
    if tokenizer.get_vocab_size() < vocab_size:
        raise DataError(f"--vocab-size {vocab_size}: this input yields only {tokenizer.get_vocab_size()} tokens (no "
                        "more merges); give more text or --vocab-size <= that")
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": ENDOFTEXT, "model_max_length": 1 << 30}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(folder / "tokenizer.json"))  # last: a folder without it is not a tokenizer yet
    return str(folder)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0],
                      **example("megatron-jreg train-tokenizer --input examples/data/wikitext-2/valid.txt "
                                "--kind hf-bpe --vocab-size 4096 --output data/bpe4k"))
    p.add_argument("--input", nargs="+", required=True, help="files, directories or globs (.txt too)")
    p.add_argument("--output", required=True, help="sentencepiece: PATH(.model); hf-bpe: a folder")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="entries in the vocabulary, the special tokens included (at least 300)")
    p.add_argument("--kind", choices=KINDS, default="sentencepiece",
                   help="sentencepiece: OUTPUT.model for --tokenizer-type SentencePieceTokenizer; hf-bpe: a folder "
                   "(tokenizer.json) for --tokenizer-type HuggingFaceTokenizer (default: %(default)s)")
    p.add_argument("--json-key", default="text",
                   help="JSONL key / parquet column with the text (default: %(default)s)")
    p.add_argument("--max-chars", type=int, default=None, metavar="N",
                   help="train on at most the first N characters of input (default: all)")
    p.add_argument("--hf-split", default=None,
                   help="split of a saved HF DatasetDict folder (default: train, when the folder has one)")
    p.add_argument("--special-tokens", nargs="+", default=[], metavar="TOKEN",
                   help="tokens to reserve in the vocabulary, e.g. <|pad|> <|user|> <|assistant|> for a later SFT "
                   "(default: none)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        path = train_tokenizer(**vars(args))
        tokenizer_type = "SentencePieceTokenizer" if args.kind == "sentencepiece" else "HuggingFaceTokenizer"
        print(f"trained {args.kind} tokenizer: --tokenizer-type {tokenizer_type} --tokenizer-model {path}")
        return 0

    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
