"""One training run: flags → Megatron-LM's args → providers → `megatron.training.pretrain`.

Megatron-LM keeps its state in module globals (args, timers, microbatch calculator, parallel groups,
rerun state machine); `run` tears them down afterwards so that one process can run several trainings
(tests do), and turns `sys.exit` from Megatron-LM's exit paths (--exit-interval, SIGTERM, NaN) into the
return code.
"""

from __future__ import annotations


def _get_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Ranks holding word embeddings: the first stage, and the last when they are tied (pretrain_gpt.py)."""
    from megatron.training import get_args

    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not get_args().untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))


def run(argv: list[str]) -> int:
    """Train with Megatron-LM's loop; returns the process exit code. Raises UsageError before any work."""
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.enums import ModelType
    from megatron.training import training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_jreg.training import checkpointing
    from megatron_jreg.training.arguments import parse_and_validate
    from megatron_jreg.training.data import train_valid_test_datasets_provider
    from megatron_jreg.training.loop import JregLoop
    from megatron_jreg.training.model import gpt_model_config
    from megatron_jreg.training.step import forward_step

    # The megatron-core wheel ships its dataset index helpers compiled but not the Makefile that
    # compile_helpers() runs at startup (on GPUs too): the compiled module is used as is.
    dataset_utils.compile_helpers = lambda: None
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():  # Megatron-LM would silently keep another layout
        parallel_state.destroy_model_parallel()
    loop = None
    try:
        args = parse_and_validate(argv)
        checkpointing.check_load(args)
        loop = JregLoop(args)
        config = pretrain_cfg_container_from_args(args, gpt_model_config(args, post_wrap=loop.attach))
        loop.install()
        checkpointing.install(args)
        try:
            training.pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
                              get_embedding_ranks=_get_embedding_ranks)
        except SystemExit as e:  # Megatron-LM's exit paths
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            _stop_data_workers()
            raise
        return 0
    finally:
        if loop is not None:
            loop.uninstall()
        checkpointing.uninstall()
        teardown()


def _stop_data_workers() -> None:
    """After a crash, end the data loader workers: forked after the SIGTERM handler was installed, they
    ignore the SIGTERM Python's exit sends them, and the process would wait for them forever."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()


def teardown() -> None:
    """Undo Megatron-LM's global state so the process can run again (the process group stays)."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from megatron.training import global_vars
    from megatron.training.training import destroy_global_state

    destroy_global_state()
    global_vars.unset_global_variables()
    CachedMetadataFileSystemReader.clear_metadata_cache()
