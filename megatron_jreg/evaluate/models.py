"""`CausalLM`, the one model interface of evaluate and generate, with its tokenizer inside: the LAMBADA target split
and lm-eval's context/continuation split both depend on the model's own tokenizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from megatron_jreg import hub
from megatron_jreg.dtypes import WEIGHT_DTYPES, torch_dtype
from megatron_jreg.errors import ModelFileError, UsageError, one_line
from megatron_jreg.model_files import check_finite_weights, declared_context, inspect_model_folder

DTYPES = ("auto", *WEIGHT_DTYPES)  # auto: the checkpoint's own (float32 on CPU)
DEFAULT_MAX_LENGTH = 2048  # lm-eval's, for a model that declares no context window
BIG_TOKENIZER_BYTES = 32 << 20  # a tokenizer.json this large takes transformers minutes to load: said first


def check_model_flags(hf: Path | None, load: Path | None, iteration: int | None) -> None:
    if (hf is None) == (load is None):
        raise UsageError("give exactly one model: --hf DIR (a Hugging Face folder) or --load CKPT (a Megatron-LM or "
                          "megatron-jreg checkpoint)")
    if load is not None and not Path(load).is_dir():
        raise UsageError(f"--load {load}: no such checkpoint folder")
    if iteration is not None and load is None:
        raise UsageError("--iteration selects a checkpoint of --load; use it with --load")
    if hf is not None and not (Path(hf) / "config.json").is_file():
        raise UsageError(f"--hf {hf}: no config.json there; pass the folder save_pretrained wrote")


@runtime_checkable
class CausalLM(Protocol):

    eod: int  # end of document: generation stops when the model predicts it
    prefix_token: int  # what text-less input is conditioned on (lm-eval's prefix_token_id): BOS if any, else eod
    vocab_size: int  # real tokens: logit columns past it (megatron's padded output layer) never win an argmax
    max_length: int  # longest input `logits` accepts; callers left-truncate to it

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; `special=False`: without what the tokenizer adds around a document (Llama's BOS)."""
        ...

    def decode(self, ids: list[int]) -> str:
        ...

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens[b, t] int64 -> logits[b, t, V'] float32 (V' >= vocab_size); causal: right padding is harmless."""
        ...

    def decoder(self, batch: int, length: int):  # noqa: ANN201 - a decoding.Decoder
        """A key/value-cache decoder for `batch` rows of at most `length` positions (decoding.complete)."""
        ...


class HFCausalLM:

    def __init__(self, model: torch.nn.Module, tokenizer, max_length: int) -> None:
        if tokenizer.eos_token_id is None:
            raise ModelFileError("--hf: the tokenizer has no eos_token; set one in tokenizer_config.json")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eod = int(tokenizer.eos_token_id)
        bos = tokenizer.bos_token_id
        self.prefix_token = int(bos) if bos is not None else self.eod
        out_features = model.get_output_embeddings().weight.shape[0]
        self.vocab_size = min(len(tokenizer), int(out_features))
        self.max_length = max_length
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        # No attention mask on purpose: the causal mask alone is right for right-padded rows, and
        # position ids then count from 0 for every row, as they do without padding.
        return self.model(input_ids=tokens.to(self.device)).logits.float()

    def decoder(self, batch: int, length: int):  # noqa: ANN201 - transformers sizes its own cache
        from megatron_jreg.evaluate.decoding import HFDecoder

        return HFDecoder(self.model)


def load_hf_lm(
    path: str | Path, device: str | None = None, dtype: str = "auto", max_length: int | None = None
) -> HFCausalLM:
    """A Hugging Face folder (or a cached hub id), offline, checked before anything loads. dtype "auto": the
    checkpoint's on GPU, float32 on CPU (CPU half precision is slow and lossy)."""
    from transformers import AutoTokenizer

    path = hub.resolve(path, "--hf")
    if not (path / "config.json").is_file():
        raise ModelFileError(f"--hf {path}: no config.json there; pass a folder written by save_pretrained or by "
                             "`hf download REPO --local-dir DIR` on a machine with internet")
    config = inspect_model_folder(path, "--hf").config  # before any allocation: config, headers, no code, no pickle
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    auto: str | torch.dtype = "auto" if device.startswith("cuda") else torch.float32
    weights_dtype = auto if dtype == "auto" else torch_dtype(dtype)
    _note_big_tokenizer(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"--hf {path}: cannot load its tokenizer ({one_line(e, 300)}); the folder needs "
                             "tokenizer.json or the tokenizer files save_pretrained writes") from None
    try:
        model = hub.load_causal_lm(path, where=f"--hf {path}", dtype=weights_dtype, checked=True)
    except ModelFileError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelFileError(f"--hf {path}: transformers cannot load it as a causal LM ({one_line(e, 300)}); the "
                             f"folder needs the model's config.json and weight files") from None
    check_finite_weights(model.named_parameters(), f"--hf {path}")
    # the context window: the config's, else the tokenizer's limit when real (HF says ~1e30 for unset), else lm-eval's
    limit = tokenizer.model_max_length or 0
    window = max_length or declared_context(config) or (int(limit) if 0 < limit < 1_000_000 else DEFAULT_MAX_LENGTH)
    return HFCausalLM(model.to(device), tokenizer, window)


def _note_big_tokenizer(path: Path) -> None:
    """One line before a tokenizer that takes transformers minutes to load (e.g. 1.5M added tokens: 308 s)."""
    file = path / "tokenizer.json"
    size = file.stat().st_size if file.is_file() else 0
    if size < BIG_TOKENIZER_BYTES:
        return
    try:
        added = len(json.loads(file.read_text(encoding="utf-8")).get("added_tokens") or [])
    except (OSError, ValueError, AttributeError):
        added = 0
    what = f"{added:,} added tokens, " if added else ""
    print(f"note: --hf {path}: loading its tokenizer ({what}{size / 2**20:,.0f} MB of tokenizer.json) takes "
          "transformers minutes", file=sys.stderr, flush=True)


class MegatronCausalLM:
    """A megatron-jreg checkpoint as a `CausalLM`; the run's tokenizer encodes as preprocess_data.py did (no BOS)."""

    def __init__(self, loaded) -> None:
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.path}: the run had no tokenizer (mock data): nothing to evaluate text with")
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.prefix_token = self.eod = int(self.tokenizer.eod)
        self.vocab_size = loaded.vocab_size
        self.max_length = loaded.seq_length
        self.iteration = int(loaded.iteration)  # the checkpoint's, also when the latest was asked for
        self.dtype = next(loaded.model.parameters()).dtype

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer.tokenize(text))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.detokenize([i for i in ids if i != self.eod])

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.loaded.logits(tokens).cpu()

    def decoder(self, batch: int, length: int):  # noqa: ANN201
        from megatron_jreg.evaluate.decoding import MegatronDecoder

        return MegatronDecoder(self.loaded.model, batch, length)


def load_megatron_lm(path: str | Path, iteration: int | None = None) -> CausalLM:
    from megatron_jreg.checkpoints import load_megatron_model

    return MegatronCausalLM(load_megatron_model(path, iteration))
