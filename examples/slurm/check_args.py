"""Check a training command's flags before submitting it: `megatron-jreg train`'s own checks, here, on a CPU.

    python examples/slurm/check_args.py --world-size 16 -- --model-preset llama-1b --bf16 ...   # the train flags
    DRY_RUN=1 bash examples/slurm/llama-1b.sbatch          # the Slurm recipes run it (launch.sh), no allocation

The flags go through what every rank of the job runs first (`megatron_jreg.training.run.parse_and_validate`:
Megatron-LM's parser and validate_args, megatron-jreg's checks of the data, tokenizer, --save folder and flag
combinations) as rank 0 of `--world-size` ranks, then Megatron-LM's sizing of the train/validation samples, and
a summary is printed: the parallel layout and the batch arithmetic (global batch = micro-batch × data-parallel
size × micro-batches per step), tokens, parameters, and what the checkpoints will take on disk. A refusal is
the training CLI's own one line (exit 2), so a batch size that does not divide, a missing data prefix or
tokenizer, or a flag the job would stop on is found on a login node, not after the allocation is granted.

On a machine without CUDA (a login node) it stands in for the GPU nodes in what only they can answer, and
says so: CPU training's refusals and rewrites (megatron_jreg.compat) stay off, Megatron-LM's question for the
GPU architecture gets Hopper's answer (9), and Transformer Engine, FP8 and GPU memory are not checked: the
job's ranks check them at start. With CUDA nothing is stood in for.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's megatron_jreg, as `python -m` has

PROG = "check_args.py"
HOPPER = 9  # the compute capability major Megatron-LM's validation is told on a CPU


@dataclass
class Report:
    """What the checked flags describe (the summary's figures)."""

    args: argparse.Namespace
    world: int
    samples: tuple[int, int | None, int]  # train, validation, test samples (Megatron-LM's sizing)
    params: int | None  # None: not a dense Llama/GPT this estimate covers (MoE)
    not_checked: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # Megatron-LM's warnings about these flags


@contextlib.contextmanager
def as_rank_zero(world: int) -> Iterator[list[str]]:
    """This process as rank 0 of `world` ranks for the checks (the environment a launcher gives each rank);
    on a CPU, the stand-ins for the GPU nodes described above. Yields the list of what was not checked."""
    import torch
    from megatron.training import arguments as megatron_arguments

    from megatron_jreg import compat
    from megatron_jreg.training import checks, model

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_DEVICE_MAX_CONNECTIONS")
    saved_env = {key: os.environ.get(key) for key in keys}
    before = set(os.environ)  # validate_args exports NVTE_*_ATTN for --attention-backend: removed after, as run() does
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), CUDA_DEVICE_MAX_CONNECTIONS="1")
    not_checked: list[str] = []

    te_here = model.have_transformer_engine()

    def transformer_engine(args: argparse.Namespace) -> None:
        needs = [what for what, on in (("--transformer-impl transformer_engine",
                                         args.transformer_impl == "transformer_engine"),
                                        ("RoPE fusion (on unless --no-rope-fusion)", args.apply_rope_fusion)) if on]
        if not te_here and needs:
            not_checked.append(f"Transformer Engine, not importable here, which {' and '.join(needs)} need(s) on "
                               "the GPU nodes (each rank checks it at start)")
        if args.fp8 is not None:
            not_checked.append(f"FP8 (--fp8-format {args.fp8} --fp8-recipe {args.fp8_recipe}: the GPU's and "
                               "Transformer Engine's support; each rank checks it at start)")

    check_model_config = checks.check_model_config

    def model_config(args: argparse.Namespace) -> None:
        """megatron-core's TransformerConfig checks; without TE here, on a copy of the flags with the kernel only
        TE brings (RoPE fusion) off, so that the rest is still checked (the GPU nodes may have TE)."""
        if not te_here:
            args = argparse.Namespace(**{**vars(args), "apply_rope_fusion": False})
        check_model_config(args)

    stand_ins = [] if torch.cuda.is_available() else [
        (compat, "cpu_training_refusal", lambda *a, **k: None),
        (compat, "apply_cpu_training_compat", lambda *a, **k: False),
        (checks, "check_cpu", lambda args: None),
        (model, "check_transformer_impl", transformer_engine),
        (checks, "check_model_config", model_config),
        (megatron_arguments, "get_device_arch_version", lambda: HOPPER),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in stand_ins]
    for owner, name, stand_in in stand_ins:
        setattr(owner, name, stand_in)
    try:
        yield not_checked
        if stand_ins:
            not_checked.append("GPU memory (the first steps on the GPUs show it)")
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        for key in [k for k in os.environ if k.startswith("NVTE_") and k not in before]:
            del os.environ[key]
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Megatron-LM's and megatron-jreg's INFO lines (micro-batches, vocabulary padding) kept out of the summary."""
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(previous)


def check(argv: list[str], world: int) -> Report:
    """`argv` (the flags after `-m megatron_jreg.train`) as rank 0 of `world` ranks; UsageError when a rank would
    refuse them. Megatron-LM's global state is torn down afterwards, so one process can check many commands."""
    from megatron.training.training import get_train_valid_test_num_samples

    from megatron_jreg.training.run import parse_and_validate, teardown

    try:
        # Megatron-LM prints its argument table (and notes) on stdout and warns through `warnings`: kept out of the
        # summary, a warning that is not about the defaults being overridden becomes a note of its own
        with as_rank_zero(world) as not_checked, contextlib.redirect_stdout(io.StringIO()), \
                warnings.catch_warnings(record=True) as caught, quiet_logs():
            warnings.simplefilter("always")
            args, _, _ = parse_and_validate(argv)
            samples = get_train_valid_test_num_samples()
        notes = list(dict.fromkeys(" ".join(str(w.message).split()) for w in caught
                                   if issubclass(w.category, UserWarning) and "Megatron" not in str(w.message)
                                   and not str(w.message).startswith("Overriding default arguments")))
        return Report(args, world, samples, llama_parameters(args), not_checked, notes)
    finally:
        teardown()


def llama_parameters(args: argparse.Namespace) -> int | None:
    """Distinct parameters of the dense GPT the flags describe (embedding, tied or not; per layer QKV with
    grouped queries, output projection, MLP (SwiGLU: two input matrices), biases, norms; the final norm), the
    closed form benchmarks/preset_params.py checks against built models; None for MoE."""
    if args.num_experts:
        return None
    h, f, layers = args.hidden_size, args.ffn_hidden_size, args.num_layers
    head = args.kv_channels or h // args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    qkv = h * head * (args.num_attention_heads + 2 * groups)
    proj = head * args.num_attention_heads * h
    mlp = h * f * (2 if args.swiglu else 1) + f * h
    norm = h * (1 if args.normalization == "RMSNorm" else 2)
    bias = (head * (args.num_attention_heads + 2 * groups) + h + f * (2 if args.swiglu else 1) + h) \
        if args.add_bias_linear else 0
    embed = args.padded_vocab_size * h * (2 if args.untie_embeddings_and_output_weights else 1)
    return embed + layers * (qkv + proj + mlp + 2 * norm + bias) + norm


def bytes_per_parameter(args: argparse.Namespace) -> tuple[int, str]:
    """A checkpoint's bytes per parameter and what they are: the weights in their training precision, and with
    the optimizer state (saved unless --no-save-optim) fp32 main weights under bf16/fp16 and Adam's two fp32
    moments (SGD: one momentum)."""
    half = args.bf16 or args.fp16
    parts = [(2, "bf16 weights" if args.bf16 else "fp16 weights") if half else (4, "fp32 weights")]
    if not args.no_save_optim:
        if half:
            parts.append((4, "fp32 main weights"))
        parts.append((8, "Adam's two fp32 moments") if args.optimizer == "adam" else (4, "SGD's fp32 momentum"))
    return sum(n for n, _ in parts), ", ".join(what for _, what in parts)


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def summary(report: Report) -> list[str]:
    """The summary's lines (see the module docstring)."""
    a, world = report.args, report.world
    dp = world // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.context_parallel_size)
    per_step = a.global_batch_size // (a.micro_batch_size * dp)
    tokens = a.global_batch_size * a.seq_length
    lines = [f"{PROG}: megatron-jreg train accepts these flags for {world} rank(s)",
             f"  layout       TP {a.tensor_model_parallel_size} × PP {a.pipeline_model_parallel_size} × CP "
             f"{a.context_parallel_size} × DP {dp} = {world} ranks"
             f"{' (sequence parallel)' if a.sequence_parallel else ''}",
             f"  batch        global {a.global_batch_size} = micro-batch {a.micro_batch_size} × DP {dp} × {per_step} "
             f"micro-batch(es) per rank and step; {a.global_batch_size} × {a.seq_length} = {tokens:,} tokens a step"]
    if a.train_iters:
        valid = (f"validation every {a.eval_interval:,} iterations ({a.eval_iters} batches)" if a.eval_iters
                 else "no validation (--eval-iters 0)")
        lines.append(f"  length       {a.train_iters:,} iterations = {a.train_iters * tokens / 1e9:,.1f}B tokens; "
                     f"{valid}")
    vocab = f"vocabulary {a.padded_vocab_size:,} after padding"
    lines.append(f"  model        {report.params:,} parameters ({vocab})" if report.params is not None else
                 f"  model        parameters not estimated (MoE); {vocab}")
    if a.save and report.params is not None:
        per_param, what = bytes_per_parameter(a)
        each = report.params * per_param
        saves = math.ceil(a.train_iters / a.save_interval) if a.train_iters else None
        lines.append(f"  checkpoints  {Path(a.save).resolve()}: a save every {a.save_interval:,} iterations of "
                     f"≈ {size(each)} ({per_param} bytes a parameter: {what})")
        if saves is not None:
            if a.save_retain_interval:
                kept = a.train_iters // a.save_retain_interval + (a.train_iters % a.save_retain_interval != 0)
                kept = min(kept, saves)
                lines.append(f"               --save-retain-interval {a.save_retain_interval:,} keeps {kept} of the "
                             f"{saves} saves (every {a.save_retain_interval:,}th iteration's and the latest): "
                             f"≈ {size(kept * each)} at the end (all {saves}: {size(saves * each)})")
            else:
                lines.append(f"               all {saves} saves are kept: ≈ {size(saves * each)} at the end "
                             "(--save-retain-interval N keeps only every Nth iteration's and the latest)")
        existing = next((p for p in [Path(a.save).resolve(), *Path(a.save).resolve().parents] if p.exists()), None)
        if existing is not None:
            lines.append(f"               {size(shutil.disk_usage(existing).free)} free now in {existing}")
    lines += [f"  note         {note}" for note in report.notes]
    if report.not_checked:
        lines.append(f"  not checked  here (no CUDA): {'; '.join(report.not_checked)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        argv = argv if argv[:1] in (["-h"], ["--help"]) else [*argv, "--help"]
        ours, train = argv, []
    else:
        ours, train = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                usage=f"{PROG} --world-size N -- TRAIN_FLAGS...")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the job: nodes × GPUs per node")
    opts = p.parse_args(ours)
    if opts.world_size < 1:
        p.error(f"--world-size {opts.world_size}: give the job's number of ranks (nodes × GPUs per node)")
    try:
        from megatron_jreg.errors import JregError, report
        from megatron_jreg.train import _import_megatron_quietly

        _import_megatron_quietly()
    except ImportError as e:
        print(f"{PROG}: error: {sys.executable} cannot import {e.name or e} (megatron-jreg and its dependencies): "
              "install them in it (docs/cluster.md), or run this with the Python that has them", file=sys.stderr)
        return 2
    try:
        result = check(train, opts.world_size)
    except JregError as e:
        return report("megatron-jreg train", e, False)
    print("\n".join(summary(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
