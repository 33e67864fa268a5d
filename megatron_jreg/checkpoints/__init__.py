"""Megatron-LM checkpoints as analyze, evaluate, convert and train read them (see files.py, model.py)."""

from megatron_jreg.checkpoints.files import (
    CheckpointError,
    failure_text,
    install_safe_checkpoint_reader,
    is_checkpoint,
    load_metadata,
    read_tracker,
    resolve,
    saved_iterations,
    verify_integrity,
    write_integrity,
)
from megatron_jreg.checkpoints.model import Checkpoint, MegatronModel, build_model, load_megatron_model, read_args

__all__ = ["Checkpoint", "CheckpointError", "MegatronModel", "build_model", "failure_text",
           "install_safe_checkpoint_reader", "is_checkpoint", "load_megatron_model", "load_metadata", "read_args",
           "read_tracker", "resolve", "saved_iterations", "verify_integrity", "write_integrity"]
