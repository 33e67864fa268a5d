"""megatron-jreg checkpoints as hidden-state sources (read directly, no conversion step for the user).

TODO(lead): implement `load_megatron_source` with the training CLI. `source.model_kind` already routes
here any `--model` / `--checkpoints` path that `source.is_megatron_checkpoint` accepts: a run directory
(`latest_checkpointed_iteration.txt` or `iter_*/` folders; use the latest iteration) or one
`iter_NNNNNNN/` folder. The returned object must satisfy `source.HiddenStateSource`:

- `label`, `num_layers` (L), `context_length` (seq length of the run), `pad_id`, `model_class`,
  `convention` (`source.LAYER_IO`, or `source.FINAL_NORM` when `include_final_norm`);
- `encode(texts) -> list[list[int]]` with the run's tokenizer (or `tokenizer` when given);
- `layer_sums(input_ids[b, t], attention_mask[b, t], kind) -> (sums[L], counts[L])` float64 on the CPU.
  Reuse `source.LayerDisplacementHooks(model.decoder.layers, mask.t(), kind)`: megatron's
  TransformerLayer takes `hidden_states` [s, b, h] first and returns `(hidden_states, context)`, which
  the hooks already handle; pass the mask transposed to [s, b]. Run under `torch.no_grad()` (not
  `inference_mode`: the hooks use version counters). With pipeline parallelism, gather the per-rank
  layer sums so that all L layers come back;
- `close()`.

Then Ψ and ζ here equal what the training CLI logs for the same weights and data (issue 5, "Also in
the training run"), because both go through `jreg.displacement_sum`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_jreg.analysis.source import HiddenStateSource


def load_megatron_source(
    path: Path,
    *,
    label: str,
    dtype: torch.dtype,
    device: torch.device | str,
    include_final_norm: bool = False,
    tokenizer: str | None = None,
) -> HiddenStateSource:
    """Load a megatron-jreg dist_checkpointing checkpoint at `path` as a source. TODO(lead)."""
    raise NotImplementedError("megatron checkpoint analysis lands with the training CLI")
