"""Megatron-LM's tokenizer flags (its `_add_tokenizer_args` group, megatron-core 0.19.2) added here, the types
megatron-jreg runs or refuses, and the args `build_tokenizer` reads: importing megatron.training for them takes
seconds before `--help` answers. tests/test_data_megatron_compat.py checks them against the installed group.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

TITLE = "tokenizer"
DESCRIPTION = "Configuration settings for the tokenizers."
MEGATRON_TYPES = (
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer",
    "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer",
)
SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (*SP_TYPES, "HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer", "NullTokenizer")
# Megatron-LM's other --tokenizer-type names, and why megatron-jreg refuses them.
_BERT = ("a BERT WordPiece tokenizer for BERT/T5 models, which megatron-jreg does not train (Megatron-LM fetches "
         "its config from the Hub); for a BERT tokenizer saved with save_pretrained use --tokenizer-type "
         "HuggingFaceTokenizer")
_NO_FLAGS = ("needs prompt-format flags that Megatron-LM's tools/preprocess_data.py does not have either (it fails "
             "there); text data needs a text tokenizer")
REFUSED_TYPES = {
    "BertWordPieceLowerCase": _BERT,
    "BertWordPieceCase": _BERT,
    "MultimodalTokenizer": _NO_FLAGS,
    "SFTTokenizer": _NO_FLAGS,
    "NullMultimodalTokenizer": "serves multimodal (LLaVA) training, which megatron-jreg does not run; for "
    "pre-tokenized text use --tokenizer-type NullTokenizer",
}
def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's tokenizer flags as their own parser group (as its tools/preprocess_data.py adds them)."""
    add = parser.add_argument_group(TITLE, DESCRIPTION).add_argument
    add("--vocab-size", type=int, help="Size of vocab before EOD or padding.")
    add("--padded-vocab-size", type=int, help="Vocabulary size of the model (padded to be divisible by tensor model "
        "parallel size). If not provided, it will be automatically calculated from vocab-size.")
    add("--no-pad-vocab-size", "--disable-pad-vocab-size", action="store_false", dest="pad_vocab_size",
        help="Whether to pad vocab size of the model automatically if padded_vocab_size is not provided.")
    add("--vocab-file", type=str, help="Path to the vocab file.")
    add("--merge-file", type=str, help="Path to the BPE merge file.")
    add("--vocab-extra-ids", type=int, default=0,
        help="Number of additional vocabulary tokens. They are used for span masking in the T5 model.")
    add("--tokenizer-type", type=str, choices=MEGATRON_TYPES, help="What type of tokenizer to use.")
    add("--tokenizer-model", type=str, help="Path to the tokenizer model.")
    add("--tokenizer-metadata", type=str, dest="metadata_path",
        help="Path to the tokenizer metadata file in json format.")
    add("--tokenizer-special-tokens", type=str, nargs="+", dest="special_tokens", help="List of special tokens. For "
        'TikTokenizer needs to have ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]')
    add("--tiktoken-pattern", type=str, choices=("v1", "v2"), help="Which tiktoken pattern to use. Options: [v1, v2]")
    add("--tiktoken-num-special-tokens", type=int, default=1000, help="Number of special tokens in tiktoken tokenizer.")
    add("--tokenizer-sentencepiece-legacy", action="store_true",
        help="SentencePiece tokenizer wrapper legacy behavior. Allows special tokens usage.")
    add("--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces", action="store_false",
        dest="tokenizer_sentencepiece_ignore_extra_whitespaces",
        help="Whether to ignore extra whitespaces in the input text while encoding.")
    add("--tokenizer-hf-no-use-fast", action="store_true", help="Whether to use fast HuggingFace tokenizer.")
    add("--tokenizer-hf-no-include-special-tokens", action="store_true",
        help="Converting text to ids will not include special for HuggingFace tokenizer.")
    add("--trust-remote-code", action="store_true",
        help="Whether or not to allow PreTrainedTokenizer to execute remote code.")
    add("--null-tokenizer-eod-id", type=int, help="EOD token id for NullTokenizer. Defaults to `vocab_size - 1`.")
    add("--null-tokenizer-pad-id", type=int, default=-1, help="Pad token id for NullTokenizer. Defaults to -1 (no "
        "pad token). Set to a value outside the dataset to avoid masking real tokens.")
    add("--chat-template", type=str, help="Custom chat template in jinja format for conversation formatting.")
    return parser


@functools.cache
def tokenizer_defaults() -> dict[str, Any]:
    """Megatron-LM's tokenizer flags (dest names) and their defaults (read-only)."""
    return vars(add_tokenizer_args(argparse.ArgumentParser()).parse_args([]))


def megatron_args(tokenizer_type: str, tokenizer_model: str | None = None, **flags: Any) -> argparse.Namespace:
    """Megatron-LM's tokenizer args: its parser's defaults, `flags` by their dest names, and the values its
    preprocess_data.py fills in for the tokenizer (rank, vocabulary padding)."""
    args = argparse.Namespace(**tokenizer_defaults())
    vars(args).update(flags, tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model)
    vars(args).update(rank=1, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_extra_ids=0)
    return args
