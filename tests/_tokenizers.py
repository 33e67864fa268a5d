"""Stand-ins for the tokenizers people bring to preprocess, trained here (nothing is downloaded): the tests build
small ones, benchmarks/preprocess_throughput.py full-size ones.

- `smollm2_style`: a GPT-2-style byte-level BPE like SmolLM2-135M's (49,152 pieces): its 17 special tokens
  first (ids 0-16), trained without an initial alphabet, so that only the bytes the text holds are pieces
  (SmolLM2's vocabulary lacks some of the 256 too), and one piece twice: `\\n\\n` as the vocabulary's `ĊĊ`
  and as an added token of its own id;
- `llama3_style`: a Llama-3-style byte-level BPE (128,256 pieces): Llama-3's regex as a `Split`
  pre-tokenizer, `ignore_merges`, a BOS post-processor and its 256 special tokens at the end;
- `sentencepiece_bpe`: a SentencePiece BPE with byte fallback (Llama-2's kind), by `train_tokenizer`;
- `tiktoken_entries`: Megatron-LM's tiktoken JSON of a byte-level BPE.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path

SMOLLM2_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
    "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
    "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>",
]
DUPLICATE = "\n\n"  # SmolLM2-style stand-in: a vocabulary piece that is also an added token of another id
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def llama3_specials(n: int = 256) -> list[str]:
    """Llama-3's special tokens in id order (128000 on): begin/end of text, reserved ones, the chat headers."""
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
             9: "<|eot_id|>"}
    reserved = iter(range(n))
    return [named[i] if i in named else f"<|reserved_special_token_{next(reserved)}|>" for i in range(n)]


def _save(tokenizer, folder: Path, config: dict) -> str:  # noqa: ANN001 - tokenizers.Tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1 << 30, **config}))
    return str(folder)


def smollm2_style(folder: Path, texts: Iterable[str], vocab_size: int = 49_152) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=SMOLLM2_SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    assert tokenizer.get_vocab_size() == vocab_size - 1, "too little text for this many merges"
    assert tokenizer.token_to_id("ĊĊ") is not None, "the duplicated piece must be in the vocabulary"
    tokenizer.add_tokens([AddedToken(DUPLICATE, normalized=False)])
    end = SMOLLM2_SPECIALS[0]
    return _save(tokenizer, folder, {"tokenizer_class": "GPT2Tokenizer", "bos_token": end, "eos_token": end,
                                     "unk_token": end, "additional_special_tokens": SMOLLM2_SPECIALS[1:]})


def llama3_style(folder: Path, texts: Iterable[str], vocab_size: int = 128_256, n_specials: int = 256) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    assert tokenizer.get_vocab_size() == vocab_size - n_specials, "too little text for this many merges"
    specials = llama3_specials(n_specials)
    tokenizer.add_special_tokens(specials)
    bos = specials[0]
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tokenizer.token_to_id(bos))]),
    ])
    spec = json.loads(tokenizer.to_str())
    spec["model"]["ignore_merges"] = True  # as Llama-3's tokenizer.json: a whole word in the vocabulary is one token
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    return _save(tokenizer, folder, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                                     "eos_token": specials[1]})


def sentencepiece_bpe(path: Path, inputs: list[str], vocab_size: int = 32_000, max_chars: int | None = None) -> str:
    from megatron_jreg.data.train_tokenizer import train_tokenizer

    return train_tokenizer(inputs, str(path), vocab_size, "sentencepiece", max_chars=max_chars)


def tiktoken_entries(hf_bpe: str | Path) -> list[dict]:
    """Megatron-LM's tiktoken JSON from a byte-level BPE folder: 256 bytes, then merged tokens in merge order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    model = json.loads(Path(hf_bpe, "tokenizer.json").read_text())["model"]
    pieces = [bytes([b]) for b in range(256)] + [bytes(to_byte[c] for c in "".join(m)) for m in model["merges"]]
    return [{"rank": i, "token_bytes": base64.b64encode(p).decode(), "token_str": p.decode("utf-8", "replace")}
            for i, p in enumerate(pieces)]
