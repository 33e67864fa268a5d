"""One training run: flags checked once (`parse_and_validate`) → providers → `megatron.training.pretrain`, then
Megatron-LM's globals torn down so one process trains again; far-off library errors become one line naming the cause."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

    from megatron_jreg.plugin import JregConfig
    from megatron_jreg.training.run_record import Start


def parse_and_validate(argv: list[str]) -> tuple[argparse.Namespace, JregConfig, Start | None]:
    """Flags → (Megatron-LM's validated args, the JREG config, the checkpoint to start from), our checks first."""
    import importlib.util

    import torch
    from megatron.training import arguments, global_vars

    from megatron_jreg.compat import apply_cpu_training_compat, cpu_training_refusal
    from megatron_jreg.errors import UsageError
    from megatron_jreg.plugin import JregConfig
    from megatron_jreg.training import checks
    from megatron_jreg.training.data import check_vocabulary
    from megatron_jreg.training.flags import parse_args
    from megatron_jreg.training.model import check_transformer_impl
    from megatron_jreg.training.run_record import find_start

    args = parse_args(argv)
    cpu = not torch.cuda.is_available()
    refusal = cpu_training_refusal() if cpu and not args.allow_cpu else None
    if refusal is not None:  # never train on the CPU by accident (compat.py)
        raise UsageError(refusal)
    start = find_start(args)
    if args.use_checkpoint_args:  # as Megatron-LM's parse_and_validate_args: the model flags from the checkpoint
        checks.args_from_checkpoint(args, start)
    checks.check_numbers(args)
    jreg = JregConfig.from_args(args)  # --jreg-* before Megatron-LM's own checks
    checks.check_paths(args)
    checks.check_sft(args)
    checks.check_data(args)
    checks.check_pretrain_gpt_flags(args)
    jreg.check_args(args)
    if not args.jreg_no_exit_signal_handler:
        args.exit_signal_handler = True
    if args.tokenizer_type is None:  # pretrain_gpt.py's default (its args_defaults, :512-515 at core_v0.19.0)
        args.tokenizer_type = "GPT2BPETokenizer"
    if cpu:
        checks.check_cpu(args)
        apply_cpu_training_compat(args)
    check_transformer_impl(args)
    checks.check_megatron_prerequisites(args)
    try:
        arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    except (AssertionError, ValueError, TypeError, RuntimeError) as e:
        raise UsageError(checks.assertion_text(e, args)) from None
    checks.check_model_config(args)
    jreg.check_layers(args.num_layers)  # --jreg-layers against num_layers, which may only now be known
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise UsageError("--wandb-project needs the wandb package: pip install wandb")
    try:
        global_vars.set_global_variables(args, build_tokenizer=False)
    except (AssertionError, ValueError) as e:
        raise UsageError(checks.assertion_text(e)) from None
    try:
        global_vars._build_tokenizer(args)
    except (OSError, ValueError, AssertionError, ImportError, KeyError) as e:
        raise UsageError(f"--tokenizer-type {args.tokenizer_type} --tokenizer-model {args.tokenizer_model}: "
                         f"{checks.assertion_text(e)}") from None
    checks.note_unused_vocab_size(args)
    check_vocabulary(args)
    return args, jreg, start


def _get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding word embeddings (pretrain_gpt.py:480-492, core_v0.19.0)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1:
        args = get_args()
        if not args.untie_embeddings_and_output_weights:
            ranks.append(pp_ranks[-1])
        ranks += get_mtp_ranks(pp_ranks, core_transformer_config_from_args(args))
    return sorted(set(ranks))


# The flags torch's optimizers check (their errors name the argument, not the flag).
_OPTIMIZER_FLAGS = {"adam": "--lr, --adam-beta1, --adam-beta2, --adam-eps, --weight-decay",
                    "sgd": "--lr, --sgd-momentum, --weight-decay"}


def _build_errors_as_usage(setup):  # noqa: ANN001, ANN202 - Megatron-LM's setup_model_and_optimizer
    import functools
    import traceback

    from megatron_jreg.checkpoints.args import assertion_text
    from megatron_jreg.errors import UsageError

    @functools.wraps(setup)
    def setup_model_and_optimizer(*a, **k):  # noqa: ANN002, ANN003, ANN202
        from megatron.training import get_args

        try:
            return setup(*a, **k)
        except UsageError:
            raise
        except (AssertionError, TypeError, ValueError, NotImplementedError) as e:
            args = get_args()
            files = [frame.filename for frame in traceback.extract_tb(e.__traceback__)]
            if any("/torch/optim/" in f or "/megatron/core/optimizer/" in f for f in files):
                what = f"the optimizer (check {_OPTIMIZER_FLAGS.get(args.optimizer, '--optimizer and its flags')})"
            else:
                what = "the model"
            raise UsageError(f"Megatron-LM cannot build {what} for these flags: {assertion_text(e, args)} "
                             "(rerun with --debug for the traceback)") from e

    return setup_model_and_optimizer


@contextlib.contextmanager
def training_patches(args, loop) -> Iterator[None]:  # noqa: ANN001 - Megatron-LM's args, training.loop.JregLoop
    from megatron_jreg import patches
    from megatron_jreg.training import checkpointing
    from megatron_jreg.training.sft import CHAT_TARGETS, chat_targets

    makers = {**loop.patch_makers(), **checkpointing.patch_makers(loop.folder.record),
              "megatron.training.training.setup_model_and_optimizer": _build_errors_as_usage,
              # the wheel ships the dataset helpers compiled but not their Makefile: a no-op
              "megatron.core.datasets.utils.compile_helpers": lambda _original: lambda: None}
    if args.sft and args.sft_tokenizer_prompt_format in ("default", "identity"):
        makers[CHAT_TARGETS] = chat_targets  # loss on assistant tokens only (Megatron-LM's SFTTokenizer: on all)
    with patches.patched(makers):
        yield


def _not_a_traceback_copy(record: logging.LogRecord) -> bool:
    """Drops StragglerDetector's copy of the traceback of an exception leaving a timed region."""
    return not (record.funcName == "__exit__" and "Traceback (most recent call last)" in record.getMessage())


def run(argv: list[str]) -> int:
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.training import training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_jreg.checkpoints.model import one_process_store
    from megatron_jreg.errors import JregError, LimitReached, limit_reached
    from megatron_jreg.training import checkpointing
    from megatron_jreg.training.data import data_changed, token_beyond_vocabulary, train_valid_test_datasets_provider
    from megatron_jreg.training.loop import JregLoop
    from megatron_jreg.training.model import gpt_model_config
    from megatron_jreg.training.run_folder import RunFolder, resume_hint
    from megatron_jreg.training.step import forward_step

    if parallel_state.model_parallel_is_initialized():  # Megatron-LM would silently keep another layout
        parallel_state.destroy_model_parallel()
    import atexit

    atexit.unregister(_stop_data_workers)
    atexit.register(_stop_data_workers)
    loop = args = folder = None
    environ = dict(os.environ)  # validate_args exports NVTE_*_ATTN for --attention-backend: restored after
    timers = logging.getLogger("megatron.core.utils")
    timers.addFilter(_not_a_traceback_copy)
    try:
        args, jreg, start = parse_and_validate(argv)
        folder = RunFolder.open(args, jreg, start)  # first: a refusal leaves nothing else behind
        loop = JregLoop(args, jreg, folder)
        model = gpt_model_config(args)
        model.post_wrap_hooks.append(loop.attach)  # JREG on this rank's wrapped chunks (plugin.JregPlugin)
        # pretrain_gpt.py:520-530 (core_v0.19.0): its config container and pretrain call, with our providers
        config = pretrain_cfg_container_from_args(args, model)
        try:
            with training_patches(args, loop):
                training.pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
                                  partial(forward_step, jreg=loop), get_embedding_ranks=_get_embedding_ranks,
                                  store=one_process_store())
        except SystemExit as e:  # Megatron-LM's exit paths
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except RuntimeError as e:  # a collective whose peer died: one line naming the checkpoint to resume
            lost = checkpointing.rank_lost(args, e)
            if lost is None:
                raise
            raise lost from e
        return 0
    except JregError:
        raise
    except Exception as e:  # what a library reports far from its cause: the data, a process limit
        known = (token_beyond_vocabulary(e, args) or data_changed(e, args)) if args is not None else None
        if known is None and (limit := limit_reached(e)) is not None:
            known = LimitReached(f"{limit}; {resume_hint(args)}" if args is not None else str(limit))
        if known is None:
            raise
        raise known from e
    finally:
        timers.removeFilter(_not_a_traceback_copy)
        if loop is not None:
            loop.close()
        if folder is not None:
            folder.close()
        teardown()
        for key in [k for k in os.environ if k.startswith("NVTE_") and k not in environ]:
            del os.environ[key]


def _stop_data_workers() -> None:
    """At exit, kill data workers a crash left: they inherited Megatron-LM's SIGTERM handler and would never end
    (registered after multiprocessing's hook, so it runs first)."""
    import multiprocessing
    import signal

    # torch's DataLoader SIGCHLD handler would raise "worker killed by signal" in whatever exit code runs next
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()


def teardown() -> None:
    """Undo Megatron-LM's global state so the process can train again (the process group stays)."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from megatron.training import global_vars
    from megatron.training.training import destroy_global_state

    destroy_global_state()
    global_vars.unset_global_variables()
    CachedMetadataFileSystemReader.clear_metadata_cache()
