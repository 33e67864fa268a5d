"""Layer streaming: Ψ of a Llama-family model read one decoder layer at a time from its safetensors files.

Ψ_ℓ needs only h_{ℓ−1} and h_ℓ, so the model never has to be whole. The embedding rows of the tokens in
use give h_0 of every sample; then for each layer ℓ its tensors are read (`weights.py`), every batch's
hidden states go through it (h_{ℓ−1} → h_ℓ, Σ d accumulated over the real tokens), and the layer is
dropped before the next one is read. Memory: one layer, plus the hidden states of all samples
(tokens × hidden × dtype size, twice for the batch in flight), plus the embedding rows in use — a
70B Llama in bf16 needs ~1.7 GB per layer and ~0.16 GB per 10k tokens, against ~140 GB in memory.

The arithmetic is transformers' own: the model's decoder layer, rotary embedding and final norm are
built on the meta device from its config and filled with one layer's tensors, so Ψ equals that of the
in-memory path (`hf_source.py`, tested to 1e-5). Inputs follow the in-memory path: right padding,
positions 0..t−1, a causal mask that hides padding (and applies the sliding window of the layers that
have one). Families: those whose base model is embeddings → rotary → layers → final norm, without
embedding scaling (STREAMABLE).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from megatron_jreg.analysis.hf_source import HEAD, context_length, encode_texts, find_decoder_layers, padding_id
from megatron_jreg.analysis.memory import return_large_blocks_to_the_os
from megatron_jreg.analysis.source import (
    FINAL_NORM,
    LAYER_IO,
    AnalysisError,
    first_tensor,
    masked_displacement_sum,
    real_rows,
)
from megatron_jreg.analysis.weights import SafetensorsFolder, WeightsError
from megatron_jreg.hub import IncompleteWeightsError, check_loading_info, read_config

STREAMABLE = ("llama", "mistral", "qwen2", "qwen3")
EMBEDDINGS, FINAL_NORM_MODULE = "embed_tokens", "norm"
HEADROOM = 1.25  # in-memory analysis needs the weights plus activations; below this factor we stream


@dataclass
class _Batch:
    """One padded batch and what every layer needs for it: rows[n] of real tokens, positions[b, t],
    the rotary (cos, sin)[b, t, head_dim], attention_mask[b, t]."""

    mask: Tensor
    rows: Tensor | None
    positions: Tensor
    rotary: tuple[Tensor, Tensor]
    tokens: int


def not_streamable(folder: Path) -> str | None:
    """Why layer streaming cannot read `folder` (a sentence), or None when it can."""
    config = read_config(folder, "--model")
    if config["model_type"] not in STREAMABLE:
        return f"model_type {config['model_type']!r} (streaming supports {', '.join(STREAMABLE)})"
    if not any(Path(folder).glob("*.safetensors")):
        return "no *.safetensors weights (streaming reads safetensors only)"
    return None


def available_bytes(device: torch.device) -> int:
    """Free memory where the model would live: the GPU's free memory, or the host's available memory
    (MemAvailable, capped by a cgroup limit when the process runs in a container)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def should_stream(folder: Path, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(stream?, why) for `--stream` left to auto: stream when the weights in `dtype`, with headroom for
    activations, exceed the free memory of `device` and the model can be streamed."""
    reason = not_streamable(folder)
    if reason is not None:
        return False, f"in memory ({reason})"
    need = SafetensorsFolder(folder).nbytes(dtype)
    free = available_bytes(device)
    gib = 2**30
    if need * HEADROOM > free:
        return True, f"streaming layer by layer: the weights need {need / gib:.1f} GiB, {free / gib:.1f} GiB free"
    return False, f"in memory: the weights need {need / gib:.1f} GiB, {free / gib:.1f} GiB free"


def _causal_mask(mask: Tensor, window: int | None, dtype: torch.dtype) -> Tensor | None:
    """Additive attention mask [b, 1, t, t] (0 = attend, dtype min = not): causal, real keys only, keys
    within `window` of the query when the layer has a sliding window. None when that is plain causal
    (no padding, no window): attention then takes its causal fast path, as in the in-memory run."""
    if window is None and bool(mask.all()):
        return None
    t = mask.shape[1]
    q = torch.arange(t, device=mask.device)[:, None]
    k = torch.arange(t, device=mask.device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    allowed = allowed[None, None] & mask.bool()[:, None, None, :]
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, torch.finfo(dtype).min)


class StreamingSource:
    """A Llama-family folder measured layer by layer from safetensors (see the module docstring).

    Implements `HiddenStateSource` for encoding and `stream_sums` for measuring: a streamed model cannot
    measure one batch through all layers (`layer_sums`), only all batches through one layer at a time.
    """

    def __init__(
        self,
        folder: Path,
        tokenizer: Any,
        label: str,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        include_final_norm: bool = False,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        return_large_blocks_to_the_os()  # a dropped layer leaves the resident set (see memory.py)
        self.folder = Path(folder)
        reason = not_streamable(self.folder)
        if reason is not None:
            raise AnalysisError(f"--model {folder}: --stream cannot read this model: {reason}; drop --stream")
        try:
            self.weights = SafetensorsFolder(self.folder)
        except WeightsError as e:
            raise AnalysisError(f"--model {folder}: {e}") from None
        config = AutoConfig.from_pretrained(str(self.folder), local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", trust_remote_code=False)
        self.config = skeleton.config
        self.base = skeleton.base_model
        self.model_class = f"{type(skeleton).__name__} (streamed)"
        self.label = label
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = torch.device(device)
        self.include_final_norm = include_final_norm
        self.convention = FINAL_NORM if include_final_norm else LAYER_IO
        self.context_length = context_length(config)
        self.pad_id = padding_id(tokenizer)
        self.layer_path, self.layers = find_decoder_layers(self.base, config.num_hidden_layers)
        self.num_layers = len(self.layers)
        self.prefix = self._checkpoint_prefix(skeleton.base_model_prefix)
        self._check_names()
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        self.windows = [
            window if (layer_types[i] == "sliding_attention" if layer_types else window is not None) else None
            for i in range(self.num_layers)
        ]

    def _checkpoint_prefix(self, base_prefix: str) -> str:
        """'model.' when the files hold a *ForCausalLM's names, '' when they hold the base model's."""
        for prefix in (f"{base_prefix}.", ""):
            if f"{prefix}{EMBEDDINGS}.weight" in self.weights.tensors:
                return prefix
        raise AnalysisError(
            f"--model {self.folder}: no {base_prefix}.{EMBEDDINGS}.weight in its safetensors files; the weights "
            "are not those of its config's architecture: download or convert the model again"
        )

    def _check_names(self) -> None:
        """Every tensor of the base model present with its shape, nothing unknown besides the LM head,
        before any work (the in-memory path's strict load, done on the file headers)."""
        expected = {self.prefix + name: tuple(p.shape) for name, p in self.base.state_dict().items()}
        present = self.weights.tensors
        info = {
            "missing_keys": sorted(set(expected) - set(present)),
            "unexpected_keys": sorted(n for n in present if n not in expected and not n.startswith(HEAD)),
            "mismatched_keys": sorted(n for n, s in expected.items() if n in present and present[n].shape != s),
        }
        try:
            check_loading_info(info, type(self.base).__name__, f"--model {self.folder}")
        except IncompleteWeightsError as e:
            raise AnalysisError(str(e)) from None

    def encode(self, texts: list[str]) -> list[list[int]]:
        return encode_texts(self.tokenizer, texts)

    def _filled(self, module: nn.Module, prefix: str) -> nn.Module:
        """`module` (on the meta device) with its tensors read from the files, in our dtype and device."""
        names = {self.prefix + prefix + key: key for key in module.state_dict()}
        try:
            tensors = self.weights.load(names)
        except WeightsError as e:
            raise AnalysisError(f"--model {self.folder}: {e}") from None
        state = {names[n]: t.to(device=self.device, dtype=self.dtype) for n, t in tensors.items()}
        module.load_state_dict(state, strict=True, assign=True)
        return module.eval()

    def _embeddings(self, batches: Sequence[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """h_0[b, t, h] of each batch from the embedding rows of the tokens in use (the rest is never read)."""
        used = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in batches]))
        name = f"{self.prefix}{EMBEDDINGS}.weight"
        vocab = self.weights.tensors[name].shape[0]
        if int(used[-1]) >= vocab or int(used[0]) < 0:
            raise AnalysisError(
                f"--model {self.folder}: token id {int(used[-1])} is outside its {vocab}-row embedding; the "
                "tokenizer does not belong to this model (pass the right one with --tokenizer)"
            )
        table = self.weights.rows(name, used.tolist()).to(device=self.device, dtype=self.dtype)
        return [table[torch.searchsorted(used, ids).to(self.device)] for ids, _ in batches]

    def _prepare(self, batches: Sequence[tuple[Tensor, Tensor]], hidden: list[Tensor]) -> list[_Batch]:
        rotary = type(self.base.rotary_emb)(config=self.config).to(self.device)
        out = []
        for (ids, mask), h in zip(batches, hidden):
            mask = mask.to(self.device)
            positions = torch.arange(ids.shape[1], device=self.device).expand(ids.shape[0], -1)
            out.append(_Batch(mask, real_rows(mask), positions, rotary(h, positions), int(mask.sum())))
        return out

    @torch.no_grad()
    def stream_sums(
        self,
        batches: Sequence[tuple[Tensor, Tensor]],
        kind: str,
        on_batch: Callable[[int], None] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """All batches through the layers, one layer in memory at a time.

        batches: (input_ids[b, t] int64, attention_mask[b, t]) right-padded, as `measure.padded_batches`
        yields them → (sums[L], counts[L]) float64 on the CPU, as `layer_sums` summed over the batches.
        on_batch(real tokens) is called after each batch of each layer (progress).
        """
        if any(bool((mask[:, :-1] < mask[:, 1:]).any()) for _, mask in batches):
            raise ValueError("stream_sums needs right-padded batches (padding_side='right')")
        hidden = self._embeddings(batches)
        state = self._prepare(batches, hidden)
        sums = torch.zeros(self.num_layers, dtype=torch.float64)
        counts = torch.zeros(self.num_layers, dtype=torch.float64)
        for i, meta_layer in enumerate(self.layers):
            layer = self._filled(meta_layer, f"{self.layer_path}.{i}.")
            last = i == self.num_layers - 1
            norm = self._filled(getattr(self.base, FINAL_NORM_MODULE), f"{FINAL_NORM_MODULE}.") if (
                last and self.include_final_norm
            ) else None
            partial = []
            for j, batch in enumerate(state):
                h_in = hidden[j]
                h_out = first_tensor(
                    layer(
                        h_in,
                        attention_mask=_causal_mask(batch.mask, self.windows[i], self.dtype),
                        position_ids=batch.positions,
                        position_embeddings=batch.rotary,
                        use_cache=False,
                    )
                )
                measured = norm(h_out) if norm is not None else h_out
                partial.append(torch.stack(masked_displacement_sum(h_in, measured, batch.rows, kind)))
                hidden[j] = h_out
                if on_batch is not None:
                    on_batch(batch.tokens)
            layer.to("meta")  # drop this layer's tensors before the next layer is read
            if norm is not None:
                norm.to("meta")
            totals = torch.stack(partial).double().cpu()  # [batches, 2]
            sums[i], counts[i] = totals[:, 0].sum(), totals[:, 1].sum()
        return sums, counts

    def layer_sums(self, input_ids: Tensor, attention_mask: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """One batch through all layers (reads every layer once per call: use `stream_sums` for many)."""
        return self.stream_sums([(input_ids, attention_mask)], kind)

    def close(self) -> None:
        del self.base, self.layers, self.weights


def load_stream_source(
    path: Path,
    *,
    label: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    include_final_norm: bool = False,
    tokenizer: str | None = None,
) -> StreamingSource:
    """A local Llama-family folder (never downloads) as a layer-streaming source."""
    from megatron_jreg.analysis.hf_source import load_tokenizer

    return StreamingSource(
        Path(path),
        load_tokenizer(Path(path), None, tokenizer),
        label,
        dtype=dtype,
        device=device,
        include_final_norm=include_final_norm,
    )
