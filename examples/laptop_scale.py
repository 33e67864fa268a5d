"""The laptop-scale setting that `make demo`, examples/sft and experiments/ share: data split, model, recipe.

Data: the bundled WikiText-2 (examples/data/wikitext-2: the valid and test splits, 122 articles). Every third
article of the test split (21 articles, ~90K tokens) is **held out**: never trained on, and every evaluation
of the demo and the study (validation loss, Ψ, ζ) reads it. The other 101 articles (~576K tokens) are the
training set. The chat data of examples/sft is built from the valid split only, so fine-tuning never sees
the held-out articles either.

Model: a Llama (RoPE, RMSNorm, SwiGLU, no biases, no dropout, untied embeddings, context 128) through
Megatron-LM's flags. The recipe's hyperparameters (AdamW 1e-3 → 1e-4 cosine, 5 % warm-up, weight decay 0.1,
β = (0.9, 0.95), clip 1.0) are ours: the paper does not state its learning rate, schedule, weight decay or β2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
WIKITEXT = HERE / "data" / "wikitext-2"
CHAT_TOKENS = ("<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
HELDOUT_EVERY = 3  # test-split articles 0, 3, 6, ... are held out
VOCAB_SIZE = 4096
SEQ_LENGTH = 128


@dataclass(frozen=True)
class Data:
    """The prepared data: tokenizer folder, Megatron-LM indexed-dataset prefixes, and the raw JSONL files."""

    root: Path
    tokenizer: str
    train_prefix: Path
    heldout_prefix: Path


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    ffn: int

    def flags(self) -> list[str]:
        return [
            "--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
            "--num-attention-heads", str(self.heads), "--ffn-hidden-size", str(self.ffn),
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--attention-dropout", "0", "--hidden-dropout", "0", "--untie-embeddings-and-output-weights",
            "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(SEQ_LENGTH),
            "--transformer-impl", "local",
        ]

    def describe(self) -> str:
        return f"{self.layers} layers × {self.hidden}, {self.heads} heads, FFN {self.ffn}"


@dataclass(frozen=True)
class Regime:
    model: Model
    batch: int
    train_iters: int  # the schedule's length
    stop_at: int  # Megatron-LM's --exit-interval
    save: int  # checkpoint (and measurement) interval
    lr: float = 1e-3
    weight_decay: float = 0.1
    tied: bool = False  # one embedding matrix for input and output (Megatron-LM's default)
    why: str = ""

    def model_flags(self) -> list[str]:
        untie = "--untie-embeddings-and-output-weights"
        return [f for f in self.model.flags() if not (self.tied and f == untie)]

    def recipe_flags(self, batch: int | None = None, train_iters: int | None = None) -> list[str]:
        """The recipe's optimizer/schedule flags with this regime's learning rate and weight decay."""
        flags = recipe_flags(batch or self.batch, train_iters or self.train_iters, self.lr, self.lr / 10)
        flags[flags.index("--weight-decay") + 1] = f"{self.weight_decay:g}"
        return flags


DEMO_REGIME = Regime(Model(12, 64, 2, 176), 4, 3000, 3000, 500, why="3× the steps in the same wall time, full schedule")
"""`make demo`'s model and recipe, chosen by experiments/demo_regimes (its regimes.txt): a top-of-stack jump
forms in 7 of its 8 baseline seeds."""


def split_articles() -> tuple[list[str], list[str]]:
    """(training articles, held-out articles) of the bundled WikiText-2, deterministic."""
    from megatron_jreg.data.text import wikitext_articles

    valid = wikitext_articles(WIKITEXT / "valid.txt")
    test = wikitext_articles(WIKITEXT / "test.txt")
    heldout = [a for i, a in enumerate(test) if i % HELDOUT_EVERY == 0]
    train = valid + [a for i, a in enumerate(test) if i % HELDOUT_EVERY != 0]
    return train, heldout


def prepare_data(out: Path, vocab_size: int = VOCAB_SIZE) -> Data:
    """Tokenizer (BPE trained on the training articles, chat markers and a pad token reserved so the
    checkpoints fine-tune in examples/sft unchanged) and indexed datasets; reused when already there."""
    from megatron_jreg.data.preprocess import PreprocessConfig, preprocess
    from megatron_jreg.data.train_tokenizer import train_tokenizer

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for split, articles in zip(("train", "heldout"), split_articles()):
        jsonl = data / f"{split}.jsonl"
        if not jsonl.exists():
            tmp = jsonl.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps({"text": a}) + "\n" for a in articles), encoding="utf-8")
            tmp.replace(jsonl)
    tokenizer = data / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        print(f"[data] training a BPE tokenizer (vocabulary {vocab_size}) on the training articles", flush=True)
        train_tokenizer([str(data / "train.jsonl")], str(tokenizer), vocab_size, kind="hf-bpe",
                        special_tokens=CHAT_TOKENS)
    for split in ("train", "heldout"):
        if not (data / f"{split}_text_document.idx").exists():
            preprocess(PreprocessConfig(
                input=[str(data / f"{split}.jsonl")], output_prefix=str(data / split),
                tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer), append_eod=True,
                workers=2, log_interval=10_000,
            ))
    return Data(data, str(tokenizer), data / "train_text_document", data / "heldout_text_document")


def recipe_flags(batch: int, steps: int, lr: float = 1e-3, min_lr: float = 1e-4) -> list[str]:
    """Megatron-LM's optimizer/schedule flags of our recipe (one rank: micro batch = global batch)."""
    return [
        "--micro-batch-size", str(batch), "--global-batch-size", str(batch), "--train-iters", str(steps),
        "--lr", f"{lr:g}", "--min-lr", f"{min_lr:g}", "--lr-warmup-iters", str(max(1, steps // 20)),
        "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--clip-grad", "1.0",
    ]


def data_flags(data: Data) -> list[str]:
    """Training on the training articles; Megatron-LM's validation on the held-out ones."""
    return [
        "--train-data-path", str(data.train_prefix), "--valid-data-path", str(data.heldout_prefix),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", data.tokenizer, "--num-workers", "0",
    ]


def child_env(threads: int = 1) -> dict[str, str]:
    """One process per core: BLAS threads pinned, unbuffered output, PYTHONPATH to this checkout."""
    import os

    root = str(HERE.parent)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
