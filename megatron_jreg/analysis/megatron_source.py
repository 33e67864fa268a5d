"""megatron-jreg checkpoints as hidden-state sources, read directly (no conversion); Ψ comes from `JregPlugin`, so
analysis and training logs share one implementation."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from megatron_jreg import jreg
from megatron_jreg.analysis.source import (
    FINAL_NORM,
    LAYER_IO,
    AnalysisError,
    HiddenStateSource,
    LayerDisplacementHooks,
    batch_stats,
)


class MegatronSource(HiddenStateSource):
    """A megatron-jreg GPTModel measured layer by layer (see `HiddenStateSource` for the contract)."""

    def __init__(self, loaded, label: str, include_final_norm: bool = False) -> None:
        self.loaded = loaded
        self.label = label
        self.num_layers = loaded.num_layers
        self.context_length = loaded.seq_length
        self.model_class = f"megatron-core GPTModel (iteration {loaded.iteration})"
        self.iteration = loaded.iteration  # the step of a checkpoint given by --model
        self.include_final_norm = include_final_norm
        self.convention = FINAL_NORM if include_final_norm else LAYER_IO
        self.pad_id = int(getattr(loaded.tokenizer, "eod", 0) or 0)
        self.vocab_size = loaded.vocab_size

    @property
    def layers(self) -> list[torch.nn.Module]:
        return list(self.loaded.model.decoder.layers)

    def logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """logits[b, t, V] fp32 over the true vocabulary; rows right-padded (megatron's causal mask then keeps
        real tokens blind to the padding)."""
        if bool((attention_mask[:, :-1] < attention_mask[:, 1:]).any()):
            raise ValueError("MegatronSource.logits needs right-padded batches")
        return self.loaded.logits(input_ids)

    def encode(self, texts: list[str]) -> list[list[int]]:
        tok = self.loaded.tokenizer
        if tok is None:
            raise AnalysisError(f"{self.loaded.path}: the run had no tokenizer (mock data); pass --tokenizer PATH")
        return [list(ids) for ids in tok.tokenize_batch(texts)]

    @torch.no_grad()
    def layer_stats(self, input_ids: Tensor, attention_mask: Tensor, kind: str, select: Tensor | None = None
                    ) -> dict[str, Tensor]:
        """See `HiddenStateSource.layer_stats`: Ψ from `JregPlugin`, h_0..h_L kept by hooks on the same pass."""
        from megatron_jreg.plugin import JregConfig, JregPlugin

        mask = attention_mask.bool()
        select = mask if select is None else select.bool() & mask
        ids, mask, select = _right_pad(input_ids, mask, self.pad_id, select)
        device = next(self.loaded.model.parameters()).device
        last = self.loaded.model.decoder.final_layernorm if self.include_final_norm else None
        with LayerDisplacementHooks(self.layers, select.t().to(device), None, last=last) as hooks:  # [s, b, h]
            plugin = JregPlugin([self.loaded.model], JregConfig(lam=0.0, distance=kind))  # recording Ψ only
            try:
                plugin.start_step(1, record=True)
                plugin.set_token_mask(select.to(device))
                self.loaded.logits(ids)
                psi = torch.tensor(plugin.finish_step().psi_distance, dtype=torch.float64)
            finally:
                plugin.remove_hooks()
        counts = torch.full_like(psi, float(select.sum()))
        sums = psi * counts
        if self.include_final_norm:  # Ψ_L between layer L's input and the final norm's output
            total, _ = jreg.displacement_sum(hooks.states[-2], hooks.states[-1], None, kind)
            sums[-1] = total.double().cpu()
        return batch_stats(sums, counts, hooks.states, kind)

    def close(self) -> None:
        self.loaded = None


@contextlib.contextmanager
def _no_reader_tracebacks() -> Iterator[None]:
    """Drop torch.distributed.checkpoint's logged tracebacks of failed metadata reads: the CheckpointError that follows
    names the file in one line."""
    reader = f"{os.sep}torch{os.sep}distributed{os.sep}checkpoint{os.sep}"

    def keep(record: logging.LogRecord) -> bool:
        return not (record.exc_info and reader in record.pathname)

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def _right_pad(ids: Tensor, mask: Tensor, pad_id: int, *others: Tensor) -> tuple[Tensor, ...]:
    """Move each row's real tokens to the front (and the same positions of the masks in `others`):
    megatron's causal attention then never sees padding."""
    order = (~mask).long().argsort(dim=1, stable=True)  # each row's real positions first, in their order
    moved = mask.gather(1, order)
    return (ids.gather(1, order).masked_fill(~moved, pad_id), moved,
            *(o.gather(1, order).masked_fill(~moved, 0) for o in others))


def load_megatron_source(path: Path, *, label: str, dtype: torch.dtype, device: torch.device | str,
                         include_final_norm: bool = False, tokenizer: str | None = None, with_tokenizer: bool = True
                         ) -> MegatronSource:
    """A megatron-jreg checkpoint (run dir or iter_* dir) as a source; with_tokenizer=False: ids from the caller."""
    from megatron_jreg.checkpoints import CheckpointError, load_megatron_model

    try:
        with _no_reader_tracebacks():
            loaded = load_megatron_model(path, dtype=dtype, tokenizer_model=tokenizer,
                                         load_tokenizer=with_tokenizer)
    except (CheckpointError, FileNotFoundError) as e:
        raise AnalysisError(str(e)) from None
    return MegatronSource(loaded, label, include_final_norm)

