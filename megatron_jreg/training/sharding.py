"""Parameters as slices of global tensors, through megatron's sharded state dict: one seed gives one model at every
TP/PP/VPP layout (`init_layout_independent`), and tests compare layouts by the full tensors (`gather_full`)."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import unwrap_model

# Global keys of megatron's "output" projections, initialised with the depth-scaled std.
_OUTPUT_LAYER_KEYS = ("linear_proj.weight", "linear_fc2.weight")


def param_shards(
    chunk: torch.nn.Module, value: Callable[[torch.nn.Parameter], torch.Tensor] | None = None
) -> Iterator[ShardedTensor]:
    model = unwrap_model(chunk)
    sharded = model.sharded_state_dict()
    for name, param in model.named_parameters():
        entry = sharded.get(name)
        if entry is None:
            continue
        data = param.data if value is None else value(param)
        if isinstance(entry, ShardedTensorFactory):
            built = dataclasses.replace(entry, data=data).build()
            yield from built if isinstance(built, list) else [built]
        elif isinstance(entry, ShardedTensor):
            yield dataclasses.replace(entry, data=data)


def global_index(sh: ShardedTensor) -> tuple:
    """Index of this shard in its global tensor (integers on prepended axes such as layers)."""
    lead, offsets = sh.global_offset[: sh.prepend_axis_num], sh.global_offset[sh.prepend_axis_num :]
    return (*lead, *(slice(off, off + size) for off, size in zip(offsets, sh.local_shape)))


def _seed(seed: int, key: str, prefix: tuple) -> int:
    return (seed * 1_000_003 + zlib.crc32(f"{key}|{prefix}".encode())) % (2**63)


@torch.no_grad()
def init_layout_independent(chunks: list[torch.nn.Module], config: TransformerConfig, seed: int) -> None:
    """Re-draw every matrix from its global tensor with megatron's init methods; norms/biases untouched."""
    for chunk in chunks:
        for sh in param_shards(chunk):
            if len(sh.local_shape) < 2:
                continue
            if sh.key.endswith(_OUTPUT_LAYER_KEYS):
                init = config.output_layer_init_method
            elif "word_embeddings" in sh.key:
                init = config.embedding_init_method
            else:
                init = config.init_method
            prefix = tuple(sh.global_offset[: sh.prepend_axis_num])
            full_shape = sh.global_shape[sh.prepend_axis_num :]
            # drawn on the CPU whatever the parameter's device: the same weights on a GPU as on a laptop
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_seed(seed, sh.key, prefix))
                full = torch.empty(full_shape, dtype=torch.float32)
                init(full)
            sh.data.copy_(full[global_index(sh)[sh.prepend_axis_num :]].to(sh.data.device))


def gather_full(
    chunks: list[torch.nn.Module],
    value: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """{global key: full fp32 CPU tensor} of parameters (or `value(param)`) on every rank (tests, small models)."""
    pieces = []
    for chunk in chunks:
        for sh in param_shards(chunk, value):
            if any(r != 0 for r in (sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,))):
                continue  # a copy: the first replica's shard stands for it
            pieces.append((sh.key, tuple(sh.global_shape), global_index(sh), sh.data.detach().float().cpu()))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, pieces, group=group)
        pieces = [p for rank_pieces in gathered for p in rank_pieces]
    full: dict[str, torch.Tensor] = {}
    for key, shape, index, data in pieces:
        if key not in full:
            full[key] = torch.zeros(shape)
        full[key][index] = data
    return full
