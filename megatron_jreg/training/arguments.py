"""`megatron-jreg train` flags: Megatron-LM's own parser and validation, plus what is ours.

Every `pretrain_gpt.py` flag comes from `megatron.training.arguments` with its meaning and default; this
module only adds (through Megatron-LM's `extra_args_provider`) the flags JREG and this project need, and
turns Megatron-LM's bare assertions into one line naming the problem (`megatron-jreg train: error: …`,
exit 2) before any work.

`--model-preset NAME` is shorthand for the architecture flags below, placed before the user's flags so
that explicit flags override it (argparse keeps the last value).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import math
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_jreg.errors import UsageError
from megatron_jreg.plugin import JregConfig

if TYPE_CHECKING:
    from megatron_jreg.training.run_folder import Start

PROG = "megatron-jreg train"

# Llama architecture flags common to the presets (RoPE, RMSNorm, SwiGLU, no biases, no dropout).
_LLAMA = ("--position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-5 --swiglu "
          "--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02 "
          "--group-query-attention")
# The paper gives layers × hidden (12×768, 16×2048, 30×3072) and the names 170M/1B/3.4B. Heads, query
# groups, FFN width, RoPE base and tied embeddings are our choice, following Llama-3.2 (1B: 16×2048, 32
# heads, 8 KV heads, FFN 8192; 3B: 24 heads, 8 KV heads, FFN 8192). The vocabulary comes from the tokenizer,
# so the parameter count does too (tied embeddings): with the Llama-3 tokenizer (128,256 tokens) 174.0M,
# 1.24B and 3.41B, matching the paper's names; with the 32,000-token SentencePiece model the docs' recipe
# trains, 100.1M, 1.04B and 3.12B (docs/results/preset_params.txt, from benchmarks/preset_params.py).
PRESETS: dict[str, str] = {
    "tiny": "--num-layers 4 --hidden-size 128 --ffn-hidden-size 352 --num-attention-heads 4 --num-query-groups 2 "
            "--seq-length 128 --max-position-embeddings 128 --rotary-base 10000",
    "llama-170m": "--num-layers 12 --hidden-size 768 --ffn-hidden-size 2048 --num-attention-heads 12 "
                  "--num-query-groups 4 --seq-length 2048 --max-position-embeddings 2048 --rotary-base 500000",
    "llama-1b": "--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 "
                "--num-query-groups 8 --seq-length 2048 --max-position-embeddings 2048 --rotary-base 500000",
    "llama-3.4b": "--num-layers 30 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 "
                  "--num-query-groups 8 --seq-length 2048 --max-position-embeddings 2048 --rotary-base 500000",
}


def preset_flags(name: str) -> list[str]:
    return (PRESETS[name] + " " + _LLAMA).split()


def expand_preset(argv: list[str]) -> list[str]:
    """Put the preset's architecture flags before the user's (explicit flags then override them)."""
    for i, arg in enumerate(argv):
        name = None
        if arg == "--model-preset" and i + 1 < len(argv):
            name = argv[i + 1]
        elif arg.startswith("--model-preset="):
            name = arg.split("=", 1)[1]
        if name is not None:
            if name not in PRESETS:
                raise UsageError(f"--model-preset {name!r} is unknown: choose one of {', '.join(PRESETS)}")
            return preset_flags(name) + argv
    return argv


EXAMPLE = ("megatron-jreg train --model-preset tiny --transformer-impl local --mock-data --tokenizer-type "
           "NullTokenizer --vocab-size 512 \\\n    --micro-batch-size 2 --global-batch-size 8 --train-iters 20 "
           "--lr 1e-3 --eval-interval 10 --eval-iters 2 --jreg-lambda 1")


def _escape_bare_percent(parser: argparse.ArgumentParser) -> None:
    """Help texts argparse cannot format: megatron-core 0.19.2's --moe-paged-stash-buffer-size-factor-cuda help
    holds a bare `%` (from its config docstring), which makes `--help` raise ValueError, in Megatron-LM's own
    pretrain_gpt.py too. Such a `%` is doubled; `%(default)s`-style fields stay."""
    for action in parser._actions:
        if isinstance(action.help, str):
            try:
                action.help % collections.defaultdict(str)
            except (ValueError, TypeError, KeyError):
                action.help = re.sub(r"%%|%\(\w+\)[a-z]|%", lambda m: m[0] if len(m[0]) > 1 else "%%", action.help)


def add_jreg_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider`: our flags, one-line argparse errors, a help that prints."""
    from megatron_jreg.usage import example

    parser.prog = PROG
    _escape_bare_percent(parser)
    for key, value in example(EXAMPLE).items():
        setattr(parser, key, value)

    def error(message: str) -> None:  # argparse would print Megatron-LM's 800-flag usage first
        raise UsageError(message)

    parser.error = error  # type: ignore[method-assign]
    g = parser.add_argument_group("megatron-jreg", "JREG and what megatron-jreg adds to Megatron-LM")
    JregConfig.add_flags(g)
    g.add_argument("--layernorm-scaling", action="store_true",
                   help="LayerNorm Scaling (Sun et al. 2025, 'The Curse of Depth in Large Language Models'): each "
                        "decoder layer ℓ's pre-attention and pre-MLP norm outputs × 1/√ℓ (--transformer-impl local)")
    g.add_argument("--model-preset", choices=sorted(PRESETS), default=None,
                   help="the paper's architectures (Llama-3.2 proportions) as flags; explicit flags override")
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON object per logged iteration and validation (Ψ, ζ, losses) here")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr, its rate Megatron-LM's elapsed time per iteration (default: when "
                        "stderr is a terminal and --log-interval > 1)")
    g.add_argument("--init-mode", choices=["megatron", "layout-independent"], default="megatron",
                   help="layout-independent: draw every weight from its global tensor, so one seed gives one "
                        "model at every TP/PP/VPP layout (default: Megatron-LM's own init)")
    g.add_argument("--no-exit-signal-handler", dest="jreg_no_exit_signal_handler", action="store_true",
                   help="SIGTERM kills the run (default here: save a checkpoint and exit 0, Megatron-LM's "
                        "--exit-signal-handler, for Slurm preemption)")
    g.add_argument("--allow-cpu", action="store_true",
                   help="train on the CPU (gloo) when CUDA is not usable, also where a GPU is expected (NVIDIA "
                        "devices, CUDA_VISIBLE_DEVICES, a Slurm GPU allocation, several nodes), which is refused "
                        "otherwise; a machine with no sign of a GPU trains on the CPU without it")
    g.add_argument("--no-verify-integrity", dest="jreg_no_verify_integrity", action="store_true",
                   help="do not record SHA-256 digests at save nor verify them at load (default here: every rank "
                        "digests the files it wrote before the tracker names the save, and verifies its share at "
                        "load)")
    g.add_argument("--overwrite-save", dest="jreg_overwrite_save", action="store_true",
                   help="write into a --save folder that holds another run's checkpoints without --load of it "
                        "(refused otherwise): its iter_* folders and tracker are first moved into "
                        "SAVE/overwritten-DATE/")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Megatron-LM's parse_args on `argv`, with our flags; raises UsageError."""
    from megatron.training import arguments

    argv = expand_preset(list(argv))
    if any(a == "--yaml-cfg" or a.startswith("--yaml-cfg=") for a in argv):  # Megatron-LM loads it while parsing
        raise UsageError("--yaml-cfg is not supported by megatron-jreg train: give the flags on the command line")
    saved = sys.argv
    sys.argv = [PROG, *argv]
    try:
        return arguments.parse_args(extra_args_provider=add_jreg_args)
    finally:
        sys.argv = saved


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_numbers(args: argparse.Namespace) -> None:
    """NaN or ±inf in any numeric flag (Megatron-LM accepts them and e.g. --clip-grad nan disables clipping)."""
    for name, value in sorted(vars(args).items()):
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if isinstance(v, float) and not math.isfinite(v):
                raise UsageError(f"{flag(name)} {v}: give a finite number")


def _check_paths(args: argparse.Namespace) -> None:
    """Paths Megatron-LM would only trip over after the model is built (or silently ignore)."""
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


def _check_sft(args: argparse.Namespace) -> None:
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


def _check_data(args: argparse.Namespace) -> None:
    """Every dataset the run reads exists, --sft's chat JSONL files or PREFIX.bin + PREFIX.idx (Megatron-LM fails
    deep in the builder)."""
    from megatron_jreg.training.data import data_paths

    for option, path in data_paths(args):
        if args.sft and not Path(path).is_file():
            raise UsageError(f"{option} {path}: no such chat JSONL file (--sft reads JSONL lines with a `messages` "
                             "list; see megatron-jreg prepare-chat)")
        for ext in () if args.sft or args.mock_data else (".idx", ".bin"):
            if not Path(path + ext).is_file():
                raise UsageError(f"{option} {path}: {path}{ext} not found (the prefix is the path without "
                                 ".bin/.idx, e.g. my-data_text_document)")


def _assertion_text(e: BaseException, args: argparse.Namespace | None = None) -> str:
    """One line for an exception from Megatron-LM's validation; a bare `assert` is shown as the check it
    made, with `args.foo_bar` (and, given `args`, any bare argument name) spelled as the flag `--foo-bar`."""
    import traceback

    text = " ".join(str(e).split())
    if text:
        if args is not None:
            text = re.sub(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b",
                          lambda m: flag(m.group(0)) if hasattr(args, m.group(0)) else m.group(0), text)
        return text
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return type(e).__name__
    frame = frames[-1]
    check = re.sub(r"^assert\s+", "", (frame.line or "").strip())
    check = re.sub(r"args\.([a-z0-9_]+)", lambda m: flag(m.group(1)), check)
    return f"Megatron-LM's argument check `{check}` failed ({Path(frame.filename).name}:{frame.lineno})"


def _check_cpu(args: argparse.Namespace) -> None:
    """Megatron-LM features that need CUDA, refused on a CPU with the reason: Megatron-LM would fail in its
    validation, the build or a step, or hang (FP8 and Transformer Engine: training/model.py; CUDA graphs:
    check_pretrain_gpt_flags)."""
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


def check_pretrain_gpt_flags(args: argparse.Namespace, jreg: JregConfig) -> None:
    """Flags of Megatron-LM's pretrain_gpt.py (and its loop) that megatron-jreg train does not run as
    Megatron-LM would, refused in one line before any work (the full list: training/step.py). Runs before
    Megatron-LM's validation, which already calls CUDA for some of them."""
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
    packed = args.sft or args.dataloader_inter_document_masking
    virtual = args.num_layers_per_virtual_pipeline_stage or args.num_virtual_stages_per_pipeline_rank
    readers_only = not packed and (args.pipeline_model_parallel_size > 2 or (
        args.pipeline_model_parallel_size > 1 and virtual is not None))
    if args.eod_mask_loss and args.calculate_per_token_loss and jreg.lam > 0 and readers_only:
        raise UsageError("--eod-mask-loss with --calculate-per-token-loss and --jreg-lambda > 0: JREG weights each "
                         "microbatch by its loss tokens, which the pipeline stages between the first and last do "
                         "not read here (more than 2 stages, or virtual stages); drop one of the three")
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


def _args_from_checkpoint(args: argparse.Namespace, start: Start | None) -> None:
    """--use-checkpoint-args: Megatron-LM's load_args_from_checkpoint on the checkpoint the run starts from (already
    checked by run_folder.find_start)."""
    from megatron.training.checkpointing import load_args_from_checkpoint

    if start is None:
        raise UsageError("--use-checkpoint-args needs a checkpoint in --load (or --pretrained-checkpoint) to read the "
                         "model from")
    try:
        load_args_from_checkpoint(args, load_arg=start.option[2:].replace("-", "_"))
    except (AssertionError, ValueError, KeyError, OSError) as e:
        raise UsageError(f"--use-checkpoint-args: cannot read the args of {start.root} "
                         f"({_assertion_text(e)})") from None


def _check_model_config(args: argparse.Namespace) -> None:
    """megatron-core's TransformerConfig checks (heads and groups divisible by TP, layers by stages, ...)
    that Megatron-LM's validate_args leaves to the model build, after the process groups exist."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    try:
        core_transformer_config_from_args(args)
    except (AssertionError, ValueError, TypeError) as e:
        raise UsageError(_assertion_text(e, args)) from None


_HF_TOKENIZERS = ("HuggingFaceTokenizer", "SFTTokenizer", "MultimodalTokenizer")


def _check_tokenizer_path(args: argparse.Namespace) -> None:
    """A local --tokenizer-model that does not exist: transformers would take `data/bpe4` for a hub id and retry
    the network for a minute before failing. A path counts as local when it starts with / . or ~, has more
    parts than a hub id's `org/name`, or its first folder exists here; a tokenizer file of the other types
    always is. A hub id in the local cache is left to transformers (offline when the hub cannot be reached, so
    that it reads the cache without retrying); one that is not must be reachable on the hub (one try,
    `hub.hub_unreachable`), else the value is most likely a mistyped folder: one line naming both readings.
    Offline (HF_HUB_OFFLINE, huggingface_hub's own switch) it must be in the cache."""
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
    """What Megatron-LM's optimizer, scheduler and layers need but its validate_args does not check: it finds
    out only after the model is built (a bare `assert`, torch's TypeError from AdamW without --lr) or in the
    first step (gloo's all_to_all), once per rank. Refused here, before any work, naming the flag."""
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
    _check_tokenizer_path(args)
    tokenizer = Path(args.tokenizer_model) if args.tokenizer_model else None
    if args.tokenizer_type in ("HuggingFaceTokenizer", "SFTTokenizer") and tokenizer is not None and tokenizer.is_dir():
        found = custom_code(tokenizer)
        if found is None and args.trust_remote_code and custom_code(tokenizer, any_map=True):
            found = "tokenizer_config.json names its own code (auto_map), which --trust-remote-code would run"
        if found is not None:
            raise UsageError(f"--tokenizer-model {tokenizer}: {found}; megatron-jreg never runs a tokenizer's own "
                             "code: save it as a fast tokenizer (tokenizer.json) and drop --trust-remote-code")


def parse_and_validate(argv: list[str]) -> tuple[argparse.Namespace, JregConfig, Start | None]:
    """Flags → (Megatron-LM's validated args (global state set), the run's JREG config, the checkpoint it starts
    from), each built once and handed down; or UsageError before any work.

    Megatron-LM's own order (parse_and_validate_args): parse, validate_args, set_global_variables
    (tokenizer, timers, TensorBoard/W&B writers, signal handler); our checks run before its validation.
    """
    import torch
    from megatron.training import arguments, global_vars

    from megatron_jreg.compat import apply_cpu_training_compat, cpu_training_refusal
    from megatron_jreg.training.model import check_transformer_impl
    from megatron_jreg.training.run_folder import find_start

    args = parse_args(argv)
    cpu = not torch.cuda.is_available()
    refusal = cpu_training_refusal() if cpu and not args.allow_cpu else None
    if refusal is not None:  # never train on the CPU by accident (compat.py)
        raise UsageError(refusal)
    start = find_start(args)
    if args.use_checkpoint_args:  # as Megatron-LM's parse_and_validate_args: the model flags from the checkpoint
        _args_from_checkpoint(args, start)
    _check_numbers(args)
    jreg = JregConfig.from_args(args)  # --jreg-* before Megatron-LM's own checks
    _check_paths(args)
    _check_sft(args)
    _check_data(args)
    check_pretrain_gpt_flags(args, jreg)
    if not args.jreg_no_exit_signal_handler:
        args.exit_signal_handler = True
    if args.tokenizer_type is None:  # pretrain_gpt.py's default (its args_defaults, :512-515 at core_v0.19.0)
        args.tokenizer_type = "GPT2BPETokenizer"
    if cpu:
        _check_cpu(args)
        apply_cpu_training_compat(args)
    check_transformer_impl(args)
    check_megatron_prerequisites(args)
    try:
        arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    except (AssertionError, ValueError, TypeError, RuntimeError) as e:
        raise UsageError(_assertion_text(e, args)) from None
    _check_model_config(args)
    jreg.check_layers(args.num_layers)  # --jreg-layers against num_layers, which may only now be known
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise UsageError("--wandb-project needs the wandb package: pip install wandb")
    try:
        global_vars.set_global_variables(args, build_tokenizer=False)
    except (AssertionError, ValueError) as e:
        raise UsageError(_assertion_text(e)) from None
    try:
        global_vars._build_tokenizer(args)
    except (OSError, ValueError, AssertionError, ImportError, KeyError) as e:
        raise UsageError(f"--tokenizer-type {args.tokenizer_type} --tokenizer-model {args.tokenizer_model}: "
                         f"{_assertion_text(e)}") from None
    from megatron_jreg.training.data import check_vocabulary

    _note_unused_vocab_size(args)
    check_vocabulary(args)
    return args, jreg, start


# Megatron-LM's tokenizers that read --vocab-size (core/tokenizers/utils/build_tokenizer.py, core_v0.19.0)
_VOCAB_SIZE_READERS = ("NullTokenizer", "NullMultimodalTokenizer", "TikTokenizer")


def _note_unused_vocab_size(args: argparse.Namespace) -> None:
    """--vocab-size with a tokenizer that has its own vocabulary (Hugging Face, SentencePiece, GPT-2 files):
    Megatron-LM ignores it. A note on rank 0 rather than a refusal: pretrain_gpt.py accepts it the same way, launch
    scripts carry it from NullTokenizer runs, and the run is well defined (the tokenizer's vocabulary); the note
    says which vocabulary the model gets, when it is not the number given."""
    from megatron.training import get_tokenizer, print_rank_0

    if args.vocab_size is None or args.tokenizer_type in _VOCAB_SIZE_READERS:
        return
    vocabulary = get_tokenizer().vocab_size
    if vocabulary != args.vocab_size:
        print_rank_0(f"megatron-jreg train: note: --vocab-size {args.vocab_size} has no effect with --tokenizer-type "
                     f"{args.tokenizer_type} (as in Megatron-LM): the model's vocabulary is the tokenizer's "
                     f"{vocabulary:,} tokens ({args.padded_vocab_size:,} embedding rows); drop --vocab-size")


def model_args(argv: list[str], vocab_size: int, world_size: int = 1) -> argparse.Namespace:
    """Megatron-LM args for a model described by flags alone (an import, not a training run): parsed and
    validated by Megatron-LM's own code, quietly, with the padded vocabulary set — what a checkpoint
    stores as `args`, so Megatron-LM and every megatron-jreg command rebuild the same model from it.
    world_size: the TP×PP the flags ask for (validation checks the layout against it)."""
    import contextlib
    import io
    from unittest import mock

    import torch
    from megatron.training import arguments
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    from megatron_jreg.compat import apply_cpu_training_compat

    # validation checks the layout against a world of TP×PP ranks, as a training launch sets it up
    launch = {"RANK": "0", "WORLD_SIZE": str(world_size), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    try:
        with mock.patch.dict(os.environ, launch):
            # Megatron-LM's validation asks for a micro-batch size even when nothing trains.
            args = parse_args(["--micro-batch-size", "1", *argv, "--vocab-size", str(vocab_size),
                               "--transformer-impl", "local"])
            if not torch.cuda.is_available():
                apply_cpu_training_compat(args)
            with contextlib.redirect_stdout(io.StringIO()):
                arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            _check_model_config(args)
    except (AssertionError, ValueError, TypeError) as e:
        raise UsageError(_assertion_text(e)) from None
    args.padded_vocab_size = calculate_padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size, logging_enabled=False)
    return args
