"""The forward step and loss handed to Megatron-LM's `pretrain`, as `pretrain_gpt.py` defines them.

The batch comes from TP rank 0's data iterator and is broadcast over TP, packed sequences (SFT) are
flattened, and the context-parallel slice is cut — megatron-core's own helpers, in Megatron-LM's order.
The loss is Megatron-LM's three-tuple (sum over loss tokens, token count, report), with its NaN/Inf and
spiky-loss checks through the rerun state machine. JREG needs nothing here: its penalty enters backward
through hooks on the layers (plugin.py); only packed SFT batches tell the plugin which tokens are real,
and become a block-diagonal attention mask where the local spec cannot take packed sequences (sft.py).
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.parallel_state import get_context_parallel_group, get_hybrid_data_context_parallel_groups
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import (
    flatten_batch_for_packed_sequences,
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)

SPIKY_LOSS_FACTOR = 10  # a loss 10× the largest seen so far is "spiky" (Megatron-LM's --check-for-spiky-loss)
BATCH_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens")
_PACK_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "real_mask")


def get_batch(data_iterator, vp_stage: int | None = None) -> dict:
    """This rank's microbatch: {key: tensor or None} for BATCH_KEYS (all None on middle pipeline stages
    of unpacked data, which receive activations instead)."""
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    packed = bool(args.sft or args.dataloader_inter_document_masking)
    edge = is_first_or_last_pipeline_stage(vp_stage)
    if not edge and not packed:
        return dict.fromkeys(BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {k: batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None for k in BATCH_KEYS}
    real_mask = _real_mask(batch, tp_rank) if args.sft else None
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=packed,
        is_hybrid_cp=args.hybrid_context_parallel,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = flatten_batch_for_packed_sequences(batch)
    if real_mask is not None:
        batch["real_mask"] = real_mask.reshape(1, -1) if batch.get("cu_seqlens") is not None else real_mask
    if not edge:  # packed middle stage: only the sequence boundaries (and which tokens are real)
        return {k: (batch.get(k) if k in _PACK_KEYS else None) for k in (*BATCH_KEYS, "real_mask")}
    batch = get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=args.hybrid_context_parallel,
        cp_group=get_context_parallel_group(),
        hybrid_cp_group_func=get_hybrid_data_context_parallel_groups,
        use_per_sequence_balancing=args.dataloader_inter_document_masking and not args.sft,
    )
    return {k: batch.get(k) for k in (*BATCH_KEYS, "real_mask")}


def _real_mask(batch: dict, tp_rank: int) -> torch.Tensor:
    """[b, s] bool: which tokens of an SFT pack are real (not end padding), on every TP rank."""
    from megatron.training import get_args, get_tokenizer

    from megatron_jreg.training.sft import real_token_mask

    args = get_args()
    shape = (args.micro_batch_size, args.seq_length)
    if tp_rank == 0:
        mask = real_token_mask(batch["tokens"], get_tokenizer().pad).to(torch.uint8)
    else:
        mask = torch.empty(shape, dtype=torch.uint8, device=torch.cuda.current_device())
    if mpu.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(mask, mpu.get_tensor_model_parallel_src_rank(),
                                    group=mpu.get_tensor_model_parallel_group())
    return mask.bool()


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's loss: (Σ loss over loss tokens, token count, {"lm loss": [Σ, count]}).

    output_tensor[b, s]: per-token cross-entropy from GPTModel; loss_mask[b, s]: 1 where it counts.
    """
    from megatron.training import get_args

    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    rerun = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        rerun.validate_result(result=loss, rejection_func=torch.isnan,
                              message="found NaN in local forward loss calculation", tolerance=0.0, fatal=True)
        rerun.validate_result(result=loss, rejection_func=torch.isinf,
                              message="found Inf in local forward loss calculation", tolerance=0.0, fatal=True)
    if args.check_for_spiky_loss:
        rerun.validate_result(
            result=loss,
            rejection_func=partial(rerun.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False,
        )
    return loss, num_tokens, report


def _packed_seq_params(batch: dict, seq_length: int) -> PackedSeqParams | None:
    cu_seqlens = batch["cu_seqlens"]
    if cu_seqlens is None:
        return None
    from megatron.training.training import update_seqlen_stats_from_cu_seqlens

    cu_seqlens = cu_seqlens.squeeze(0)
    padded = batch["cu_seqlens_padded"]
    padded = padded.squeeze(0) if padded is not None else None
    update_seqlen_stats_from_cu_seqlens(cu_seqlens)  # FLOPs of real tokens only, as Megatron-LM counts them
    bounds = padded if padded is not None else cu_seqlens
    max_seqlen = int(batch["max_seqlen"].item())
    local_cp = batch["local_cp_size"]
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
        local_cp_size=int(local_cp.item()) if local_cp is not None else None, cp_group=batch["hybrid_cp_group"],
        tokens_per_sample=seq_length,
    )


def forward_step(data_iterator, model, return_schedule_plan: bool = False, jreg=None):  # noqa: ANN001
    """One microbatch through `model`; returns (output, loss function) as megatron's schedules expect.

    jreg: the run's JregLoop, told which tokens of a packed SFT batch are real."""
    from megatron.training import get_args, get_timers

    args = get_args()
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    packed_seq_params = _packed_seq_params(batch, args.seq_length)
    if packed_seq_params is not None and args.transformer_impl == "local":
        from megatron_jreg.training.sft import packed_attention_mask

        # the local spec's attention takes no packed sequences: the same attention as a block-diagonal mask
        length = batch["real_mask"].shape[-1] if batch.get("real_mask") is not None else args.seq_length
        batch["attention_mask"] = packed_attention_mask(packed_seq_params.cu_seqlens_q, length)
        packed_seq_params = None
    if jreg is not None and jreg.plugin is not None and batch.get("real_mask") is not None:
        jreg.plugin.set_token_mask(batch["real_mask"] if args.context_parallel_size == 1 else None)
    timers("batch-generator").stop()
    if return_schedule_plan:
        plan = model.build_schedule_plan(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                         labels=batch["labels"], loss_mask=batch["loss_mask"])
        return plan, partial(loss_func, batch["loss_mask"])
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params)
    return output, partial(loss_func, batch["loss_mask"])
