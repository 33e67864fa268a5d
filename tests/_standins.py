"""Stand-ins for a cluster's files, so that the commands the docs and scripts quote can be checked here for real.

The docs read `/data/fwe100b/fwe_text_document` (FineWeb-Edu), `/data/tok/fwe32k.model` (its 32K SentencePiece
model), the chat data and tokenizer of docs/sft.md, and write run folders on `/scratch` or `/runs`. `build(root)`
makes a small real file of each kind under `root` (a SentencePiece model and a Hugging Face chat tokenizer trained
on the vendored WikiText-2, indexed datasets whose ids fit them, chat JSONL, a pretrained run's tracker), and
`mapped` moves a command's absolute paths under `root`, so megatron-jreg train's checks open real files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2" / "valid.txt"
VOCAB = 1000  # the stand-in SentencePiece model's vocabulary; the datasets' ids lie below it
PREFIXES = ("data/fwe100b/fwe_text_document", "data/other_text_document")
PRETRAINED = ("work/runs/jreg-3.4b/checkpoints",)  # relative to `root`: docs/sft.md's --pretrained-checkpoint


def indexed_dataset(prefix: Path, vocab: int, documents: int = 64, length: int = 3000) -> None:
    """A megatron-core indexed dataset (PREFIX.bin/.idx) of random ids below `vocab`, written by megatron-core."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    generator = torch.Generator().manual_seed(0)
    for _ in range(documents):
        builder.add_document(torch.randint(0, vocab, (length,), generator=generator), [length])
    builder.finalize(str(prefix) + ".idx")


def build(root: Path) -> Path:
    """The stand-in files under `root` (see the module docstring); returns `root / "work"`, the working directory
    the commands' relative paths are resolved in."""
    from megatron_jreg.data.train_tokenizer import train_tokenizer
    from tests.test_sft import chat_tokenizer, conversations

    (root / "data" / "tok").mkdir(parents=True, exist_ok=True)
    train_tokenizer([str(WIKITEXT)], str(root / "data" / "tok" / "fwe32k"), VOCAB, max_chars=300_000)
    for prefix in PREFIXES:
        indexed_dataset(root / prefix, VOCAB)
    chat = Path(chat_tokenizer(root / "data" / "tok"))
    chat.rename(root / "data" / "tok" / "fwe32k-chat")
    (root / "data" / "tulu").mkdir()
    (root / "data" / "tulu" / "tulu_v1.jsonl").write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in conversations(60)))
    for folder in PRETRAINED:  # a pretrained run's --save folder: its tracker and a complete iteration folder
        ckpt = root / folder / "iter_0001000"
        ckpt.mkdir(parents=True)
        (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        (root / folder / "latest_checkpointed_iteration.txt").write_text("1000\n")
    for folder in ("scratch", "runs", "shared"):
        (root / folder).mkdir(exist_ok=True)
    return root / "work"


def mapped(text: str, root: Path) -> str:
    """`text` (an argument, or an environment value) with an absolute path at its start moved under `root`;
    `$USER` spelled as a user name."""
    text = text.replace("$USER", "user").replace("${USER}", "user")
    return f"{root}{text}" if re.match(r"/[A-Za-z]", text) else text


def check_args():  # -> the module examples/slurm/check_args.py
    """examples/slurm/check_args.py as a module (it is a script beside the Slurm recipes, not part of the package)."""
    import importlib.util
    import sys

    name = "jreg_check_args"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "slurm" / "check_args.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules[name]
