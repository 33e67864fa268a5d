"""The forward step and loss handed to `pretrain`, as pretrain_gpt.py (core_v0.19.0) defines them, each block naming
its source lines; JREG only tells the plugin which tokens are real (list of flags: DEVELOPERS.md)."""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.parallel_state import get_context_parallel_group, get_hybrid_data_context_parallel_groups
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
from megatron.core.utils import (
    StragglerDetector,
    flatten_batch_for_packed_sequences,
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_timers, get_tokenizer
from megatron.training.training import update_seqlen_stats_from_cu_seqlens
from megatron.training.utils import is_first_or_last_pipeline_stage

from megatron_jreg.training.sft import packed_attention_mask, real_token_mask

stimer = StragglerDetector()  # Megatron-LM's process-wide straggler timers (--log-straggler), pretrain_gpt.py:79
# SPIKY_LOSS_FACTOR and BATCH_KEYS: pretrain_gpt.py:185 and 83-94 (core_v0.19.0)
SPIKY_LOSS_FACTOR = 10  # a loss 10× the largest seen so far is "spiky" (Megatron-LM's --check-for-spiky-loss)
BATCH_KEYS = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens")
_PACK_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "real_mask", "loss_tokens")
_JREG_KEYS = ("real_mask", "loss_tokens")


def get_batch(data_iterator, config, vp_stage: int | None = None, count_loss_tokens: bool = False) -> dict:
    """This rank's microbatch {BATCH_KEYS: tensor or None} plus JREG's `real_mask` [b, s] and `loss_tokens`
    (pretrain_gpt.py:97-181, core_v0.19.0)."""
    args = get_args()
    packed = bool(args.sft or args.dataloader_inter_document_masking)
    mtp_here = mtp_on_this_rank(layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
                                ignore_virtual=False, vp_stage=vp_stage)
    edge = is_first_or_last_pipeline_stage(vp_stage)
    if not edge and not mtp_here and not packed:
        return dict.fromkeys((*BATCH_KEYS, *_JREG_KEYS))
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {k: batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None for k in BATCH_KEYS}
    real_mask, loss_tokens = _jreg_tokens(batch, tp_rank, args.sft, count_loss_tokens)
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
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = flatten_batch_for_packed_sequences(batch)
    if real_mask is not None:
        batch["real_mask"] = real_mask.reshape(1, -1) if batch.get("cu_seqlens") is not None else real_mask
    batch["loss_tokens"] = loss_tokens
    if not edge and not mtp_here:  # packed middle stage: only the sequence boundaries (and JREG's counts)
        return {k: (batch.get(k) if k in _PACK_KEYS else None) for k in (*BATCH_KEYS, *_JREG_KEYS)}
    batch = get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=args.hybrid_context_parallel,
        cp_group=get_context_parallel_group(),
        hybrid_cp_group_func=get_hybrid_data_context_parallel_groups,
        use_per_sequence_balancing=args.dataloader_inter_document_masking and not args.sft,
    )
    return {k: batch.get(k) for k in (*BATCH_KEYS, *_JREG_KEYS)}


def _jreg_tokens(batch: dict, tp_rank: int, sft: bool, count_loss_tokens: bool):
    """(real-token mask [b, s], loss-token count), each or None, in one broadcast from TP rank 0."""
    if not sft and not count_loss_tokens:
        return None, None
    args = get_args()
    shape = (int(sft) + int(count_loss_tokens), args.micro_batch_size, args.seq_length)
    if tp_rank == 0:
        rows = [real_token_mask(batch["tokens"], get_tokenizer().pad)] if sft else []
        if count_loss_tokens:
            rows.append(batch["loss_mask"] != 0)
        codes = torch.stack(rows).to(torch.uint8)
    else:
        codes = torch.empty(shape, dtype=torch.uint8, device=torch.cuda.current_device())
    if mpu.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(codes, mpu.get_tensor_model_parallel_src_rank(),
                                    group=mpu.get_tensor_model_parallel_group())
    real = codes[0].bool() if sft else None
    loss_tokens = codes[-1].sum().float() if count_loss_tokens else None
    return real, loss_tokens


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(Σ loss over loss_mask[b, s], token count, report) from output_tensor[b, s]: pretrain_gpt.py:209-279
    (core_v0.19.0), its plain branch (--logits-load-dir refused, no ModelOpt)."""
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
    """THD parameters of a packed microbatch, or None: pretrain_gpt.py:310-334 (core_v0.19.0)."""
    cu_seqlens = batch["cu_seqlens"]
    if cu_seqlens is None:
        return None
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


def forward_step(data_iterator, model, jreg=None):  # noqa: ANN001
    """(output, loss function) of one microbatch: pretrain_gpt.py:282-358 (core_v0.19.0) without the refused
    `return_schedule_plan` branch; `jreg`: the run's JregLoop."""
    args = get_args()
    timers = get_timers()
    plugin = jreg.plugin if jreg is not None else None
    count_loss_tokens = bool(plugin is not None and plugin.penalize and args.calculate_per_token_loss)
    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        config = get_attr_wrapped_model(model, "config")
        batch = get_batch(data_iterator, config, get_attr_wrapped_model(model, "vp_stage"), count_loss_tokens)
    packed_seq_params = _packed_seq_params(batch, args.seq_length)
    if packed_seq_params is not None and args.transformer_impl == "local":
        # the local spec's attention takes no packed sequences: the same attention as a block-diagonal mask
        # over the flattened microbatch (flatten_batch_for_packed_sequences: micro-batch × seq-length tokens)
        batch["attention_mask"] = packed_attention_mask(packed_seq_params.cu_seqlens_q,
                                                        args.micro_batch_size * args.seq_length)
        packed_seq_params = None
    if plugin is not None and (batch["real_mask"] is not None or batch["loss_tokens"] is not None):
        plugin.set_token_mask(batch["real_mask"], loss_tokens=batch["loss_tokens"])  # SFT: no CP (refused)
    timers("batch-generator").stop()
    with stimer:
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                       loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params)
    return output, partial(loss_func, batch["loss_mask"])
