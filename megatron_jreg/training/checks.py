"""train's pre-flight checks: what Megatron-LM would trip over after the model is built, in its first step, or
never (silently), refused in one line naming the flag and the fix before any work (order: run.parse_and_validate)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_jreg.checkpoints.args import assertion_text, check_model_config, flag  # noqa: F401 - the run calls it here
from megatron_jreg.errors import UsageError

if TYPE_CHECKING:
    from megatron_jreg.training.run_record import Start


def check_numbers(args: argparse.Namespace) -> None:
    """NaN or ±inf in any numeric flag (Megatron-LM accepts them and e.g. --clip-grad nan disables clipping)."""
    for name, value in sorted(vars(args).items()):
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise UsageError(f"{flag(name)} {v}: give a finite number")


def check_paths(args: argparse.Namespace) -> None:
    """Paths and sizes Megatron-LM would only trip over after the model is built (or silently ignore)."""
    if args.load is not None and Path(args.load).is_file():
        raise UsageError(f"--load {args.load} is a file: give the checkpoint directory (the one holding "
                         "latest_checkpointed_iteration.txt) or an iter_* directory's parent")
    if args.save is not None:
        save = Path(args.save)
        if save.exists() and not save.is_dir():
            raise UsageError(f"--save {args.save} is a file: give a directory for the checkpoints")
        existing = next((p for p in [save, *save.parents] if p.exists()), None)
        if existing is not None and not os.access(existing, os.W_OK):
            raise UsageError(f"--save {args.save}: {existing} is not writable; choose a writable directory")
    if args.global_batch_size is not None and args.micro_batch_size:
        dp = args.world_size // max(args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                                    * args.context_parallel_size, 1)
        if dp and args.global_batch_size % (args.micro_batch_size * dp):
            raise UsageError(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                             f"× data-parallel size = {args.micro_batch_size} × {dp}: choose a multiple of "
                             f"{args.micro_batch_size * dp}")
    if args.eval_interval is None and not args.skip_train and not args.full_validation:
        raise UsageError("give --eval-interval N: Megatron-LM's loop sizes the validation samples from it and fails "
                         "without it, --eval-iters 0 too (which then runs no validation)")
    if args.save is not None and args.save_interval is None:
        raise UsageError(f"--save {args.save} needs --save-interval N (Megatron-LM saves every N iterations; at exit "
                         "too with --exit-interval or on SIGTERM)")
    if args.metrics_file is not None and Path(args.metrics_file).is_dir():
        raise UsageError(f"--metrics-file {args.metrics_file} is a directory: give a file path")
    if (split := args.split) is not None:
        try:
            parts = [float(x) for x in split.replace("/", ",").split(",")]
        except ValueError:
            raise UsageError(f"--split {split!r}: give comma-separated weights, e.g. 969,30,1") from None
        if any(p < 0 or not math.isfinite(p) for p in parts) or sum(parts) <= 0:
            raise UsageError(f"--split {split!r}: weights must be >= 0 and not all 0, e.g. 969,30,1")


def check_sft(args: argparse.Namespace) -> None:
    """--sft: Megatron-LM's SFTDataset reads chat JSONL files and asserts what it needs deep inside."""
    if not args.sft:
        return
    if args.tokenizer_type != "SFTTokenizer":
        raise UsageError("--sft tokenizes conversations with a chat template: give --tokenizer-type SFTTokenizer "
                         "--tokenizer-model HF_TOKENIZER_DIR (see docs/sft.md)")
    if args.create_attention_mask_in_dataloader:
        raise UsageError("--sft packs conversations (Megatron-LM's SFTDataset builds no attention mask): add "
                         "--no-create-attention-mask-in-dataloader")
    if args.reset_position_ids or args.reset_attention_mask:
        raise UsageError("--sft restarts positions per conversation itself: drop --reset-position-ids / "
                         "--reset-attention-mask")


def check_data(args: argparse.Namespace) -> None:
    from megatron_jreg.training.data import data_paths

    for option, path in data_paths(args):
        if args.sft and not Path(path).is_file():
            raise UsageError(f"{option} {path}: no such chat JSONL file (--sft reads JSONL lines with a `messages` "
                             "list; see megatron-jreg prepare-chat)")
        for ext in () if args.sft or args.mock_data else (".idx", ".bin"):
            if not Path(path + ext).is_file():
                raise UsageError(f"{option} {path}: {path}{ext} not found (the prefix is the path without "
                                 ".bin/.idx, e.g. my-data_text_document)")


def check_cpu(args: argparse.Namespace) -> None:
    """Features that need CUDA: on a CPU Megatron-LM would fail late or hang."""
    dp = "on a CPU use data parallelism, optionally with --use-distributed-optimizer"
    grouped = ("runs grouped-GEMM CUDA kernels, which need a GPU: drop it on a CPU (the experts then run as separate "
               "MLPs)")
    for on, line in (
        (args.use_megatron_fsdp,
         f"--use-megatron-fsdp runs on GPUs only (Megatron-FSDP shards over NCCL and CUDA streams): {dp}"),
        (args.use_torch_fsdp2,
         f"--use-torch-fsdp2 runs on GPUs only (torch FSDP2 with Megatron-LM's CUDA mixed precision): {dp}"),
        (args.profile and not args.use_pytorch_profiler,
         "--profile drives Nsight Systems through the CUDA profiler, which needs a GPU: add --use-pytorch-profiler "
         "to profile on a CPU"),
        *((getattr(args, name), f"{flag(name)} {grouped}")
          for name in ("moe_grouped_gemm", "use_grouped_gemm_for_dense_mlp", "use_grouped_gemm_for_shared_expert")),
        (args.record_memory_history,
         "--record-memory-history records the CUDA caching allocator, which needs a GPU: drop it on a CPU"),
        (args.async_save and args.use_persistent_ckpt_worker,
         "--async-save --use-persistent-ckpt-worker needs a GPU (its writer process selects a CUDA device and would "
         "hang here): drop --async-save on a CPU"),
    ):
        if on:
            raise UsageError(line)


def check_pretrain_gpt_flags(args: argparse.Namespace) -> None:
    """pretrain_gpt.py flags train does not run as Megatron-LM would (DEVELOPERS.md), refused before its validation."""
    import torch

    cpu = not torch.cuda.is_available()
    if args.logits_load_dir is not None:
        raise UsageError(f"--logits-load-dir {args.logits_load_dir}: offline distillation from cached teacher "
                         "log-probs (pretrain_gpt.py's KD loss, with --logits-load-kd-loss-alpha and the other "
                         "--logits-load-* flags) is not implemented by megatron-jreg train; drop it")
    if args.inprocess_restart:
        raise UsageError("--inprocess-restart: megatron-jreg train does not wrap pretrain in nvidia-resiliency-ext's "
                         "in-process restart (pretrain_gpt.py does); drop it and requeue the job with --load instead")
    if args.overlap_moe_expert_parallel_comm:
        raise UsageError("--overlap-moe-expert-parallel-comm: its schedule runs each layer's attention and MLP "
                         "parts directly, so JREG's layer hooks would never see a layer (Ψ silently 0); drop it")
    graphs = [f for f, on in (("--cuda-graph-impl " + str(args.cuda_graph_impl), args.cuda_graph_impl != "none"),
                              ("--enable-cuda-graph", getattr(args, "enable_cuda_graph", False)),
                              ("--external-cuda-graph", getattr(args, "external_cuda_graph", False))) if on]
    if graphs:
        why = ("CUDA graphs need a GPU" if cpu else "a replayed graph runs no forward hooks, so JREG's layer hooks "
               "would never see a layer (Ψ silently 0)")
        raise UsageError(f"{graphs[0]}: {why}; drop it")
    tied_mtp_stage = args.mtp_num_layers and args.pipeline_model_parallel_size > 1 and \
        not args.untie_embeddings_and_output_weights
    if tied_mtp_stage and (args.save or args.load or args.pretrained_checkpoint or args.init_mode != "megatron"):
        raise UsageError("--mtp-num-layers with --pipeline-model-parallel-size > 1 and tied embeddings: megatron-core "
                         "0.19.2 cannot build the MTP stage's sharded state dict, which checkpoints and --init-mode "
                         "layout-independent need (Megatron-LM fails at its first save); add "
                         "--untie-embeddings-and-output-weights")
    if args.layernorm_scaling:
        clash = next((why for why, on in (
            (f"--transformer-impl {args.transformer_impl}: its norms are fused into Transformer Engine's linear "
             "layers; add --transformer-impl local", args.transformer_impl != "local"),
            (f"--spec {' '.join(args.spec or [])}: a layer spec of its own; drop --spec", args.spec is not None),
            ("--mtp-num-layers: the MTP layers have no place ℓ in the stack; drop one of the two",
             bool(args.mtp_num_layers))) if on), None)
        if clash:
            raise UsageError(f"--layernorm-scaling with {clash}")
    if args.sft and (args.context_parallel_size > 1 or args.hybrid_context_parallel):
        raise UsageError(f"--sft with --context-parallel-size {args.context_parallel_size}"
                         f"{' --hybrid-context-parallel' if args.hybrid_context_parallel else ''}: JREG's mask of "
                         "the packs' real tokens is not split over context-parallel ranks here, so Ψ would count "
                         "the padding; use --context-parallel-size 1 (tensor/sequence or pipeline parallelism)")


def args_from_checkpoint(args: argparse.Namespace, start: Start | None) -> None:
    from megatron.training.checkpointing import load_args_from_checkpoint

    if start is None:
        raise UsageError("--use-checkpoint-args needs a checkpoint in --load (or --pretrained-checkpoint) to read the "
                         "model from")
    try:
        load_args_from_checkpoint(args, load_arg=start.option[2:].replace("-", "_"))
    except (AssertionError, ValueError, KeyError, OSError) as e:
        raise UsageError(f"--use-checkpoint-args: cannot read the args of {start.root} "
                         f"({assertion_text(e)})") from None


_HF_TOKENIZERS = ("HuggingFaceTokenizer", "SFTTokenizer", "MultimodalTokenizer")


def check_tokenizer_path(args: argparse.Namespace) -> None:
    """A --tokenizer-model that is neither here nor a reachable/cached hub id: one line naming both readings
    (transformers would retry the network for a minute on a mistyped folder); rules: DEVELOPERS.md."""
    import difflib

    text = args.tokenizer_model
    if not text or Path(text).expanduser().exists():
        return
    path, hf = Path(text).expanduser(), args.tokenizer_type in _HF_TOKENIZERS
    parts = Path(text).parts
    local = (not hf or text.startswith(("/", ".", "~")) or len(parts) > 2
             or (len(parts) == 2 and Path(parts[0]).expanduser().is_dir()))
    if not path.parent.is_dir():
        hint = f" (nor is there a folder {path.parent})"
    elif near := difflib.get_close_matches(path.name, [p.name for p in path.parent.iterdir()], n=1, cutoff=0.6):
        hint = f"; did you mean {path.parent / near[0]}?"
    else:
        hint = f" ({path.parent} holds nothing of a close name)"
    given = f"--tokenizer-type {args.tokenizer_type} --tokenizer-model {text}"
    if local:
        raise UsageError(f"{given}: no such {'folder' if hf else 'file'}{hint}")
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    from megatron_jreg.hub import HubError, force_offline, hub_unreachable, resolve

    online = not constants.HF_HUB_OFFLINE
    cache = Path(constants.HF_HUB_CACHE)
    try:
        resolve(text, "--tokenizer-model")
        if online and hub_unreachable() is not None:
            force_offline()  # transformers would retry the hub five times before reading its cache
        return  # in the local cache, where transformers finds it
    except HubError as e:
        if not online and (cache / repo_folder_name(repo_id=text, repo_type="model")).is_dir():
            raise UsageError(f"--tokenizer-type {args.tokenizer_type} {e}") from None  # cached, but incomplete
    why = hub_unreachable() if online else None
    if online and why is None:
        return  # a Hugging Face hub id (`org/name`) the hub may hold: transformers downloads it
    fix = hint[2:] if hint.startswith(";") else (f"give the tokenizer's folder, or run `hf download {text}` on a "
                                                 "machine with internet and copy the cache here")
    if online:
        nor = hint if hint.startswith(" (") else ""
        raise UsageError(f"{given}: no such local folder{nor}, and not a reachable hub id (not in the local Hugging "
                         f"Face cache {cache}; the hub: {why}); {fix}")
    raise UsageError(f"{given}: neither a folder here nor a model in the local Hugging Face cache {cache} (offline: "
                     f"HF_HUB_OFFLINE); {fix}")


def check_megatron_prerequisites(args: argparse.Namespace) -> None:
    """What Megatron-LM's optimizer, scheduler and layers need but validate_args leaves to the build or first step."""
    from megatron_jreg.model_files import custom_code

    if not args.skip_train:
        if args.lr is None:
            raise UsageError("--lr is required: Megatron-LM's optimizer has no default learning rate (e.g. --lr 3e-4; "
                             "the --min-lr/--lr-* schedule flags have defaults)")
        if args.train_iters is None and args.train_samples is None:
            raise UsageError("give --train-iters N or --train-samples N (Megatron-LM's scheduler needs the length)")
        unit = "iters" if args.train_iters is not None else "samples"
        decay_flag = f"--lr-decay-{unit}" if getattr(args, f"lr_decay_{unit}") is not None else f"--train-{unit}"
        decay = getattr(args, decay_flag[2:].replace("-", "_"))
        if decay <= 0:
            raise UsageError(f"{decay_flag} {decay}: the learning-rate schedule needs a positive length")
        if args.lr_warmup_fraction is not None and not 0 <= args.lr_warmup_fraction < 1:
            raise UsageError(f"--lr-warmup-fraction {args.lr_warmup_fraction}: give a fraction in [0, 1) of "
                             f"{decay_flag}")
        warmup = getattr(args, f"lr_warmup_{unit}")
        if args.lr_warmup_fraction is None and warmup >= decay:
            raise UsageError(f"--lr-warmup-{unit} {warmup} must be smaller than {decay_flag} {decay} (Megatron-LM's "
                             "scheduler decays after the warmup)")
        if args.lr_decay_style == "WSD" and getattr(args, f"lr_wsd_decay_{unit}") is None:
            raise UsageError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} N (the length of its decay phase)")
        if not 0 <= args.min_lr <= args.lr or args.lr_warmup_init > args.lr:
            raise UsageError(f"--lr {args.lr}, --min-lr {args.min_lr}, --lr-warmup-init {args.lr_warmup_init}: "
                             "Megatron-LM's scheduler needs 0 <= --min-lr <= --lr and --lr-warmup-init <= --lr")
        for name in ("weight_decay", "start_weight_decay", "end_weight_decay"):
            if getattr(args, name) is not None and getattr(args, name) < 0:
                raise UsageError(f"{flag(name)} {getattr(args, name)}: weight decay must be >= 0")
    if args.context_parallel_size > 1 and args.transformer_impl == "local":
        raise UsageError(f"--context-parallel-size {args.context_parallel_size} needs Transformer Engine's attention "
                         "(Megatron-LM's local DotProductAttention has no context parallelism): use --transformer-impl "
                         "transformer_engine on GPUs with Transformer Engine, or --context-parallel-size 1")
    if (args.expert_model_parallel_size > 1 and args.moe_token_dispatcher_type in ("alltoall", "flex")
            and args.distributed_backend == "gloo"):
        raise UsageError(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} with --expert-model-parallel-"
                         f"size {args.expert_model_parallel_size} exchanges tokens with all_to_all_single, which "
                         "Megatron-LM calls in a form gloo (CPU) does not accept: use --moe-token-dispatcher-type "
                         "allgather (Megatron-LM's default)")
    check_tokenizer_path(args)
    tokenizer = Path(args.tokenizer_model) if args.tokenizer_model else None
    if args.tokenizer_type in ("HuggingFaceTokenizer", "SFTTokenizer") and tokenizer is not None and tokenizer.is_dir():
        found = custom_code(tokenizer)
        if found is None and args.trust_remote_code and custom_code(tokenizer, any_map=True):
            found = "tokenizer_config.json names its own code (auto_map), which --trust-remote-code would run"
        if found is not None:
            raise UsageError(f"--tokenizer-model {tokenizer}: {found}; megatron-jreg never runs a tokenizer's own "
                             "code: save it as a fast tokenizer (tokenizer.json) and drop --trust-remote-code")


# Megatron-LM's tokenizers that read --vocab-size (core/tokenizers/utils/build_tokenizer.py, core_v0.19.0)
_VOCAB_SIZE_READERS = ("NullTokenizer", "NullMultimodalTokenizer", "TikTokenizer")


def note_unused_vocab_size(args: argparse.Namespace) -> None:
    """A note, not a refusal (pretrain_gpt.py accepts it), when a tokenizer's own vocabulary overrides --vocab-size."""
    from megatron.training import get_tokenizer, print_rank_0

    if args.vocab_size is None or args.tokenizer_type in _VOCAB_SIZE_READERS:
        return
    vocabulary = get_tokenizer().vocab_size
    if vocabulary != args.vocab_size:
        print_rank_0(f"megatron-jreg train: note: --vocab-size {args.vocab_size} has no effect with --tokenizer-type "
                     f"{args.tokenizer_type} (as in Megatron-LM): the model's vocabulary is the tokenizer's "
                     f"{vocabulary:,} tokens ({args.padded_vocab_size:,} embedding rows); drop --vocab-size")
