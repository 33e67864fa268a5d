"""Small randomly initialised Hugging Face models with a locally trained tokenizer, for the tests and benchmarks.

One tiny model per architecture family, built from its config class, and the benchmarks' random Llamas; nothing
here touches the network. The benchmarks put the repository root on sys.path to import it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from megatron_jreg.data.tokenizers import ENDOFTEXT as SPECIAL


def train_tokenizer(texts: list[str], vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on `texts` (`megatron-jreg train-tokenizer --kind hf-bpe`),
    as a `PreTrainedTokenizerFast` whose `<|endoftext|>` (id 0) is BOS, EOS and padding.

    Byte-level so that any text encodes without unknown tokens, and so that it can be written into a
    GGUF file as a "gpt2" tokenizer. vocab_size >= 300 (the 256 bytes and some merges).
    """
    from transformers import PreTrainedTokenizerFast

    from megatron_jreg.data.train_tokenizer import train_tokenizer as train_hf_bpe

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(t.replace("\n", " ") for t in texts) + "\n", encoding="utf-8")
        folder = train_hf_bpe([str(corpus)], str(Path(tmp) / "tokenizer"), vocab_size, "hf-bpe")
        return PreTrainedTokenizerFast(
            tokenizer_file=str(Path(folder) / "tokenizer.json"), bos_token=SPECIAL, eos_token=SPECIAL, pad_token=SPECIAL
        )


def perturb_vectors(model: torch.nn.Module, scale: float = 0.3, seed: int = 0) -> None:
    """Add noise to every 1-D parameter (norm gains, biases).

    At initialisation RMSNorm gains are all one, so the final norm only rescales h_L and cannot change
    its direction; trained models have uneven gains, and so should the test models, or the
    `--include-final-norm` convention would be indistinguishable from the default.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))


def save_random_model(config: Any, folder: str | Path, tokenizer: Any, seed: int = 0) -> Path:
    """Build `AutoModelForCausalLM.from_config(config)` with `seed`, perturb its vectors, save it and
    the tokenizer to `folder` (safetensors); returns the folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    perturb_vectors(model, seed=seed)
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_random_llama(
    folder: str | Path,
    texts: list[str],
    *,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    tied: bool = True,
) -> Path:
    """A random Llama (`save_random_model`) with a `vocab`-token tokenizer trained on `texts`: the
    benchmarks' models, built here so that nothing is downloaded."""
    from transformers import LlamaConfig

    tokenizer = train_tokenizer(texts, vocab_size=vocab)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return save_random_model(config, folder, tokenizer)
