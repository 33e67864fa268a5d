"""The one seam with Megatron-LM and torch: every attribute of `megatron.*` / `torch.*` that megatron-jreg replaces,
why, the version it was written for and when it can go (`PATCHES`), and the appliers (DEVELOPERS.md, "The seam")."""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_jreg.errors import FAILED, JregError

WRITTEN_FOR = "megatron-core 0.19.2 (Megatron-LM core_v0.19.0)"

PROCESS = "process"  # applied once, stays for the life of the process
TRAINING = "training"  # applied around megatron.training.pretrain, undone after it (also on errors)
CALL = "call"  # applied around one call of a Megatron-LM function, undone when it returns

Maker = Callable[[Any], Any]  # the original → its replacement


class PatchError(JregError, RuntimeError):
    """A patch that cannot be applied: the installed Megatron-LM is not the one megatron-jreg was written for."""

    exit_code = FAILED


class SignatureDrift(PatchError):
    """The installed Megatron-LM function's parameters differ from those its replacement was written for."""


@dataclass(frozen=True)
class Patch:
    target: str  # dotted name: module, then attribute (or class.attribute)
    scope: str  # PROCESS, TRAINING or CALL
    owner: str  # the module that supplies the replacement
    why: str
    until: str  # when the patch can go
    params: tuple[str, ...] | None = None  # the original's parameter names, in order, as written for
    on_instance: bool = False  # replaced on one object of the class `target` names, not on the class
    written_for: str = WRITTEN_FOR


_COMPAT, _TRAIN_COMPAT = "megatron_jreg.compat", "megatron_jreg.compat (apply_cpu_training_compat)"
_CPU = "without CUDA only"
_NO_CPU_PATH = "when megatron-core runs without CUDA by itself (no upstream plan): keep"


def _cuda(name: str, why: str, owner: str = _COMPAT) -> Patch:
    return Patch(f"torch.cuda.{name}", PROCESS, owner, f"{_CPU}: {why}", _NO_CPU_PATH)


PATCHES: tuple[Patch, ...] = (
    # -- CPU compat (megatron_jreg.compat.apply_cpu_compat): every entry point, once per process --------------
    _cuda("current_device", "answers the CPU device (rotary embedding, attention and p2p buffers)"),
    _cuda("synchronize", "a no-op (p2p communication, DDP's gradient sync)"),
    _cuda("current_stream", "a null stream (p2p, DDP's gradient sync on a side stream)"),
    _cuda("default_stream", "a null stream"),
    _cuda("Stream", "a null stream class"),
    _cuda("Event", "a null event class"),
    _cuda("stream", "a null context"),
    _cuda("manual_seed", "seeds the generator standing in for the CUDA default generator"),
    _cuda("manual_seed_all", "the same as manual_seed (one stand-in generator)"),
    _cuda("get_rng_state", "the stand-in generator's state"),
    _cuda("set_rng_state", "sets the stand-in generator's state"),
    Patch("megatron.core.tensor_parallel.random._get_cuda_rng_state", PROCESS, _COMPAT,
          f"{_CPU}: the RNG tracker keeps real CPU generator states in a generator of its own (sharing the "
          "global CPU RNG trips megatron's 'CPU RNG state changed' warning on every fork)", _NO_CPU_PATH,
          ("device", "clone", "graph_safe")),
    Patch("megatron.core.tensor_parallel.random._set_cuda_rng_state", PROCESS, _COMPAT,
          f"{_CPU}: as _get_cuda_rng_state", _NO_CPU_PATH, ("new_state", "device", "graph_safe")),
    Patch("megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add", PROCESS, _COMPAT,
          f"{_CPU}: states from a CPU generator (megatron's forks a CUDA one)", _NO_CPU_PATH, ("self", "name", "seed")),
    Patch("megatron.core.transformer.utils.get_default_causal_mask", PROCESS, _COMPAT,
          f"{_CPU}: built on the CPU; activation recomputation rebuilds it inside backward, where the "
          "TorchFunctionMode is not active", _NO_CPU_PATH, ("sq",)),
    Patch("megatron.core.fusions.fused_softmax.get_default_causal_mask", PROCESS, _COMPAT,
          f"{_CPU}: the same function, imported by name into fused_softmax", _NO_CPU_PATH, ("sq",)),
    # -- CPU compat for megatron.training (apply_cpu_training_compat): train/import entries, once per process --
    _cuda("device_count", "answers 1: megatron builds its model-parallel groups and seeds its RNG tracker only "
          "when it sees a device", _TRAIN_COMPAT),
    _cuda("set_device", "a no-op", _TRAIN_COMPAT),
    Patch("megatron.training.arguments.get_device_arch_version", PROCESS, _TRAIN_COMPAT,
          f"{_CPU}: answers 9 (Hopper's rules) where validate_args asks the GPU", _NO_CPU_PATH, ()),
    Patch("megatron.training.training.initialize_megatron", PROCESS, _TRAIN_COMPAT,
          f"{_CPU}: called with allow_no_cuda=True (pretrain() does not pass it)",
          "when pretrain() takes allow_no_cuda", ("allow_no_cuda", "skip_mpu_initialization", "get_embedding_ranks",
                                                  "get_position_embedding_ranks", "store", "skip_model_parallel_init",
                                                  "seed_pp_group", "seed_dp_group", "seed_tp_group", "seed_ep_group",
                                                  "seed_etp_group", "skip_random_seed")),
    # -- safe checkpoint reading (megatron_jreg.checkpoints.files.install_safe_checkpoint_reader), GPUs too ----
    Patch("torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata", PROCESS,
          "megatron_jreg.checkpoints.files",
          "torch unpickles .metadata with plain pickle (a crafted file runs code): read it with MetadataUnpickler "
          "and check its storage paths", "when torch reads DCP metadata without pickle (or with weights_only)",
          ("self", "args", "kwargs")),
    Patch("torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.load_bytes", PROCESS,
          "megatron_jreg.checkpoints.files",
          "torch loads stored objects with torch.load(weights_only=False): weights_only=True with megatron-core's "
          "allow-list", "when torch's planner loads with weights_only=True", ("self", "read_item", "value")),
    # -- around pretrain (megatron_jreg.training.run.training_patches): undone after the run --------------------
    Patch("megatron.training.training.train_step", TRAINING, "megatron_jreg.training.loop",
          "JREG's step start (loss scale, microbatches) and Ψ's reduction over all ranks: Megatron-LM has no "
          "step callback", "when Megatron-LM's train() takes step-begin/step-end callbacks",
          ("forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler", "config",
           "forward_backward_func", "iteration", "pg_collection", "p2p_communicator")),
    Patch("megatron.training.training.training_log", TRAINING, "megatron_jreg.training.loop",
          "Ψ/ζ/L_cos on Megatron-LM's console line, TensorBoard/W&B and --metrics-file with the line's own loss "
          "window and time; the progress bar", "when Megatron-LM's training_log takes extra fields/callbacks",
          ("loss_dict", "total_loss_dict", "learning_rate", "iteration", "loss_scale", "report_memory_flag",
           "skipped_iter", "grad_norm", "params_norm", "num_zeros_in_grad", "max_attention_logit", "pg_collection",
           "is_first_iteration", "seqlen_squared_sum_in_batch", "total_real_tokens_in_batch")),
    Patch("megatron.training.training.evaluate", TRAINING, "megatron_jreg.training.loop",
          "Ψ on the validation batches (one JREG step over the evaluation)", "with evaluation callbacks",
          ("forward_step_func", "data_iterator", "model", "process_non_loss_data_func", "config", "verbose",
           "non_loss_data_func", "eval_iters", "pg_collection", "p2p_communicator")),
    Patch("megatron.training.training.evaluate_and_print_results", TRAINING, "megatron_jreg.training.loop",
          "one validation JREG line and record per evaluation, after Megatron-LM's", "with evaluation callbacks",
          ("prefix", "forward_step_func", "data_iterator", "model", "iteration", "process_non_loss_data_func",
           "config", "verbose", "write_to_tensorboard", "non_loss_data_func", "pg_collection", "p2p_communicator")),
    Patch("megatron.training.training.load_checkpoint", TRAINING, "megatron_jreg.training.checkpointing",
          "verify the SHA-256 manifest first, one-line load errors, torch Adam's step count after a resume "
          "(without apex/TE)", "when Megatron-LM's torch-Adam path stores the step and accepts manifest-less "
          "checkpoints under --verify-integrity",
          ("ddp_model", "optimizer", "opt_param_scheduler", "load_arg", "strict", "checkpointing_context",
           "skip_load_to_model_and_opt", "tp_group", "pp_group", "dp_cp_group", "dp_group", "expt_dp_group",
           "rng_state_key_prefix")),
    Patch("megatron.training.training.save_checkpoint", TRAINING, "megatron_jreg.training.checkpointing",
          "megatron_jreg.json beside each save (Adam's step, the run's settings and history); no save of "
          "non-finite weights or without --save; a failed save becomes one line", "as load_checkpoint",
          ("iteration", "model", "optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far",
           "checkpointing_context", "pipeline_rank", "expert_rank", "tensor_rank", "pipeline_parallel",
           "expert_parallel", "non_persistent_ckpt", "train_data_iterator", "preprocess_common_state_dict_fn",
           "release", "tp_group", "pp_group", "dp_cp_group", "dp_group", "expt_dp_group", "rng_state_key_prefix")),
    Patch("megatron.core.dist_checkpointing.save", TRAINING, "megatron_jreg.training.checkpointing",
          "the SHA-256 manifest digested by every rank (its own shards, in threads) before the tracker names the "
          "save, instead of verify_integrity's rank-0-only pass that stalls every rank",
          "when megatron-core digests each rank's files on that rank",
          ("sharded_state_dict", "checkpoint_dir", "sharded_strategy", "validate_access_integrity",
           "async_sharded_save", "preprocess_common_before_consistancy_check", "content_metadata", "async_strategy",
           "verify_integrity")),
    Patch("megatron.training.training.setup_model_and_optimizer", TRAINING, "megatron_jreg.training.run",
          "Megatron-LM's bare asserts on flag combinations become one UsageError line naming the flags",
          "when Megatron-LM validates these combinations in validate_args",
          ("model_type", "model_provider_func", "checkpointing_context", "cfg_container", "pg_collection")),
    Patch("megatron.core.datasets.utils.compile_helpers", TRAINING, "megatron_jreg.training.run",
          "the wheel ships the dataset helpers compiled but not the Makefile initialize_megatron runs (GPUs too)",
          "when the wheel ships the Makefile or initialize skips compiling an installed helper", ()),
    Patch("megatron.training.global_vars._GLOBAL_TOKENIZER", TRAINING, "megatron_jreg.training.sft",
          "--sft with the default/identity prompt format: loss on assistant tokens only (Megatron-LM's "
          "SFTTokenizer: on all); applied for that run only", "when Megatron-LM's SFTTokenizer masks "
          "non-assistant turns for the default template"),
    # -- around one Megatron-LM call (the loop adapter, inside training_log) ------------------------------------
    Patch("megatron.training.training.print_rank_last", CALL, "megatron_jreg.training.loop",
          "appends Ψ/ζ/L_cos to the iteration line training_log prints", "as training_log", ("message",)),
    Patch("megatron.core.timers.Timer.elapsed", CALL, "megatron_jreg.training.loop",
          "reads the 'interval-time' seconds training_log divides by (for --metrics-file's time and throughput), "
          "on that one timer", "as training_log", ("self", "reset", "barrier"), on_instance=True),
)

_BY_TARGET = {p.target: p for p in PATCHES}
assert len(_BY_TARGET) == len(PATCHES), "a target appears twice in PATCHES"


@dataclass(frozen=True)
class Reliance:
    """Something of Megatron-LM's that megatron-jreg uses as is but depends on the shape of."""

    name: str
    owner: str
    why: str
    params: tuple[str, ...] | None = None
    written_for: str = WRITTEN_FOR


RELIED_ON: tuple[Reliance, ...] = (
    Reliance("megatron.training.training.pretrain", "megatron_jreg.training.run",
             "called with pretrain_gpt.py's arguments, by keyword after the fourth",
             ("cfg_container", "train_valid_test_dataset_provider", "model_type", "forward_step_func",
              "model_provider", "process_non_loss_data_func", "get_embedding_ranks", "get_position_embedding_ranks",
              "non_loss_data_func", "store", "inprocess_call_wrapper", "p2p_communicator", "pg_collection",
              "skip_model_parallel_init")),
    Reliance("megatron.training.global_vars._build_tokenizer", "megatron_jreg.training.run",
             "private: the tokenizer is built apart from set_global_variables, so that its errors become a "
             "UsageError naming --tokenizer-type/--tokenizer-model", ("args",)),
    Reliance("megatron.training.arguments._add_tokenizer_args", "megatron_jreg.data.tokenizers",
             "private: Megatron-LM's tokenizer flags, added to preprocess's parser and read for their defaults as "
             "its tools/preprocess_data.py does", ("parser",)),
    Reliance("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._init_optimizer_states_with_dummy_values",
             "megatron_jreg.training.checkpointing", "private: gives an unstepped torch Adam its state before a load",
             ("self",)),
)


# -- applying ------------------------------------------------------------------------------------------------
def entry(target: str) -> Patch:
    try:
        return _BY_TARGET[target]
    except KeyError:
        raise PatchError(f"{target}: not in megatron_jreg.patches.PATCHES; add it there (why, until) first") from None


def resolve(dotted: str) -> tuple[Any, str]:
    """(holder, attribute) for a dotted name: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            holder = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            holder = getattr(holder, name)
        return holder, parts[-1]
    raise PatchError(f"{dotted}: no importable module in the name")


def signature_drift(name: str, expected: tuple[str, ...], fn: Callable) -> str | None:
    """One line naming how `fn`'s parameter names differ from `expected`, None when they do not."""
    try:
        found = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return f"{name}: its signature cannot be read"
    if inspect.ismethod(fn) and expected[:1] == ("self",):
        expected = expected[1:]
    if found == expected:
        return None
    missing = [p for p in expected if p not in found]
    extra = [p for p in found if p not in expected]
    moved = [p for p, q in zip(expected, [p for p in found if p in expected]) if p != q]
    parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"new {', '.join(extra)}"] if extra else []) \
        + ([f"reordered {', '.join(moved)}"] if moved else [])
    return (f"{name}: the installed megatron-core's parameters differ from those megatron-jreg was written for "
            f"({WRITTEN_FOR}): {'; '.join(parts)}; update megatron_jreg.patches and its wrapper")


def arguments(function: Callable, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call of `function` (a patched original, its parameters checked) by parameter name, defaults filled in."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def check(target: str, original: Any) -> None:
    """SignatureDrift when `original` is not the function the table's entry for `target` was written for."""
    patch = entry(target)
    if patch.params is not None:
        drift = signature_drift(target, patch.params, original)
        if drift is not None:
            raise SignatureDrift(drift)


def apply(makers: Mapping[str, Maker], objects: Mapping[str, Any] | None = None) -> Callable[[], None]:
    """Replace each target by `maker(original)`, all or nothing; returns the undo. `objects`: the object of each
    `on_instance` target."""
    undo: list[Callable[[], None]] = []

    def restore() -> None:
        while undo:
            undo.pop()()

    try:
        for target, maker in makers.items():
            patch = entry(target)
            if patch.on_instance:
                if not objects or target not in objects:
                    raise PatchError(f"{target}: replaced on one object; pass it in `objects`")
                holder, name = objects[target], target.rsplit(".", 1)[1]
            else:
                holder, name = resolve(target)
            if not hasattr(holder, name):
                raise PatchError(f"{target}: no such attribute in the installed version (written for {WRITTEN_FOR})")
            original = getattr(holder, name)
            check(target, original)
            own = patch.on_instance and name in vars(holder)
            setattr(holder, name, maker(original))
            if patch.on_instance and not own:
                undo.append(lambda h=holder, n=name: delattr(h, n))
            else:
                undo.append(lambda h=holder, n=name, o=original: setattr(h, n, o))
    except BaseException:
        restore()
        raise
    return restore


@contextlib.contextmanager
def patched(makers: Mapping[str, Maker], objects: Mapping[str, Any] | None = None) -> Iterator[None]:
    restore = apply(makers, objects)
    try:
        yield
    finally:
        restore()


_process: dict[str, Any] = {}  # target → original, for the PROCESS patches applied in this process


def apply_process(makers: Mapping[str, Maker]) -> None:
    """Apply PROCESS-scope patches for the life of the process; targets already applied are skipped."""
    todo = {}
    for target, maker in makers.items():
        if entry(target).scope != PROCESS:
            raise PatchError(f"{target}: a {entry(target).scope}-scope patch; use patched()")
        if target not in _process:
            todo[target] = maker
    originals: dict[str, Any] = {}

    def keep(target: str, maker: Maker) -> Maker:
        return lambda original: (originals.__setitem__(target, original), maker(original))[1]

    apply({t: keep(t, m) for t, m in todo.items()})
    _process.update(originals)


def is_applied(target: str) -> bool:
    return target in _process


def original(target: str) -> Any:
    """Megatron-LM's (or torch's) own object at `target`: the one a PROCESS patch replaced, else the current."""
    if target in _process:
        return _process[target]
    holder, name = resolve(target)
    return getattr(holder, name)
