"""The datasets provider: pretrain_gpt.py's datasets built the same way (Megatron-LM's samples, sample for sample),
plus the check that the data fits the run's tokenizer and one-line reports of data failing mid-run."""

from __future__ import annotations

import argparse
import json
import math
from functools import partial
from pathlib import Path

import numpy as np
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_jreg.data.indexed import verify_dataset
from megatron_jreg.data.manifest import read_manifest
from megatron_jreg.errors import Failed, UsageError
from megatron_jreg.training.run_folder import resume_hint
from megatron_jreg.training.run_record import tokenizer_sha256
from megatron_jreg.training.sft import check_conversations


def data_paths(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, path) of every dataset the run names; UsageError for a blend Megatron-LM would assert on."""
    out = []
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if not (values := getattr(args, name, None)):
            continue
        option = "--" + name.replace("_", "-")
        try:
            blend = get_blend_from_list(values)
        except (AssertionError, ValueError) as e:
            raise UsageError(f"{option} {' '.join(values)}: {e}; give PREFIX or W1 PREFIX1 W2 PREFIX2 ...") from None
        bad = [w for w in blend[1] or [] if not (math.isfinite(w) and w > 0)]
        if bad:
            raise UsageError(f"{option} {' '.join(values)}: blend weight {bad[0]} is not a positive number; give W1 "
                             "PREFIX1 W2 PREFIX2 ... with every weight > 0 (drop a dataset instead of weighting it 0)")
        out += [(option, path) for path in blend[0]]
    return out


def data_prefixes(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, prefix) of every indexed dataset the run reads (none for --mock-data / --sft; the blend is checked)."""
    paths = data_paths(args)
    return [] if args.mock_data or args.sft else paths


def max_token_id(prefix: str, scan_limit_bytes: int = 2 << 30, exact_bytes: int = 256 << 20) -> tuple[int, bool]:
    """(largest token id, exact): scanned, or read from a manifest for a large .bin (only its ends past the limit)."""
    size = Path(prefix + ".bin").stat().st_size if Path(prefix + ".bin").is_file() else 0
    if size > exact_bytes:  # a manifest's, when it describes this very .bin (not data rewritten since)
        record = read_manifest(prefix) or {}
        files = record["files"] if isinstance(record.get("files"), dict) else {}
        if isinstance(record.get("max_token_id"), int) and files.get("bin_bytes") == size:
            return record["max_token_id"], True
    try:
        dtype = verify_dataset(prefix).dtype  # megatron's reader would fail deep in the builder
        tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    except (ValueError, OSError) as e:
        raise UsageError(f"{prefix}.idx/.bin is not a readable indexed dataset: {' '.join(str(e).split())}") from None
    if tokens.nbytes <= scan_limit_bytes:
        chunks, exact = [tokens], True
    else:
        half = scan_limit_bytes // 2 // tokens.itemsize
        chunks, exact = [tokens[:half], tokens[-half:]], False
    step = 1 << 26  # tokens a part: its max() reads it once
    parts = (chunk[i : i + step] for chunk in chunks for i in range(0, len(chunk), step))
    return max((int(part.max()) for part in parts), default=-1), exact


def token_beyond_vocabulary(error: BaseException, args: argparse.Namespace) -> UsageError | None:
    """One line for the embedding's IndexError: a token id beyond the vocabulary `check_vocabulary` missed."""
    while error is not None:
        if isinstance(error, IndexError) and "index out of range" in str(error):
            from megatron.training import get_tokenizer

            data = ", ".join(prefix for _, prefix in data_prefixes(args)) or "the data"
            return UsageError(f"--data-path {data}: a token id beyond the vocabulary of --tokenizer-model "
                              f"({get_tokenizer().vocab_size} tokens) reached the model's embedding; the data was "
                              "tokenized with another tokenizer, or its .bin changed during the run: preprocess it "
                              "again with this run's tokenizer")
        error = error.__cause__ or error.__context__
    return None


def data_changed(error: BaseException, args: argparse.Namespace) -> Failed | None:
    """One line when a data worker died of a dataset changed under the run (SIGBUS, torch blames shared memory)."""
    while error is not None and "DataLoader worker" not in str(error):  # "killed by signal", "exited unexpectedly"
        error = error.__cause__ or error.__context__
    if error is None:
        return None
    for option, prefix in data_prefixes(args):
        try:
            verify_dataset(prefix)
        except (ValueError, OSError) as e:
            return Failed(f"{option} {prefix}: the dataset changed during the run and a data loader worker died "
                          f"reading it ({' '.join(str(e).split())}): restore the files (or rerun preprocess) and "
                          f"resume; {resume_hint(args)}")
    return None


def check_vocabulary(args: argparse.Namespace) -> None:
    from megatron.training import get_tokenizer

    if args.sft:
        check_conversations(args, data_paths(args))
        return
    vocab_size = get_tokenizer().vocab_size
    for option, prefix in data_prefixes(args):
        largest, exact = max_token_id(prefix)
        if largest >= vocab_size:
            raise UsageError(
                f"{option} {prefix}: largest token id {largest} ({'exact' if exact else 'sampled'}) does not fit the "
                f"vocabulary of --tokenizer-model ({vocab_size} tokens): the data was tokenized with another "
                "tokenizer; pass the one preprocess_data.py used"
            )
        recorded = ((read_manifest(prefix) or {}).get("tokenizer") or {})
        if isinstance(recorded, dict) and recorded.get("sha256"):
            ours = tokenizer_sha256(args)
            if ours is not None and ours != recorded["sha256"]:
                raise UsageError(
                    f"{option} {prefix}: the data was tokenized with {recorded.get('type')} {recorded.get('model')} "
                    f"(sha256 {recorded['sha256'][:12]}…, its manifest), not with this run's --tokenizer-model "
                    f"{args.tokenizer_model or args.vocab_file} (sha256 {ours[:12]}…): give that tokenizer"
                )


def gpt_dataset_config(args: argparse.Namespace) -> GPTDatasetConfig:
    """pretrain_gpt.py's core_gpt_dataset_config_from_args (:377-441 at core_v0.19.0), with the run's tokenizer
    instead of a second one it builds."""
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as f:
            sequences_per_dataset = json.load(f)
    fields = dict(
        {name: getattr(args, name) for name in _SAME_NAMES},
        random_seed=args.seed, sequence_length=args.seq_length, tokenizer=get_tokenizer(),
        blend=blend, blend_per_split=blend_per_split, sequences_per_dataset=sequences_per_dataset,
        path_to_cache=args.data_cache_path, create_attention_mask=args.create_attention_mask_in_dataloader,
        fast_cache_load=args.dataloader_fast_cache_load, defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        inter_document_masking=args.dataloader_inter_document_masking,
    )
    if args.fim_data:
        from megatron.training.datasets.fim_dataset import GPTFIMDatasetConfig

        extra_tokens = {"prefix": args.fim_prefix_token, "middle": args.fim_middle_token,
                        "suffix": args.fim_suffix_token, "pad": args.fim_pad_token, "eod": args.fim_eod_token}
        return GPTFIMDatasetConfig(**fields, **{name: getattr(args, name) for name in _FIM_NAMES},
                                   fim_extra_tokens=extra_tokens)
    return GPTDatasetConfig(**fields)


# pretrain_gpt.py's dataset config fields named as their flags
_SAME_NAMES = ("split", "multiple_validation_sets", "full_validation", "object_storage_cache_path", "mmap_bin_files",
               "num_dataset_builder_threads", "reset_position_ids", "reset_attention_mask", "eod_mask_loss",
               "mid_level_dataset_surplus", "allow_ambiguous_pad_tokens", "context_parallel_size",
               "data_parallel_size", "hybrid_context_parallel")
_FIM_NAMES = ("fim_rate", "fim_spm_rate", "fim_split_sample", "fim_fragment_rate", "fim_no_prefix")


def _built_on_rank(vp_stage: int | None = None, packed: bool = False) -> bool:
    """pretrain_gpt.py's is_dataset_built_on_rank (core_v0.19.0, lines 361-374)."""
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    if packed or is_first_or_last_pipeline_stage(vp_stage):
        return True
    config = core_transformer_config_from_args(get_args())
    return mtp_on_this_rank(layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
                            ignore_virtual=False, vp_stage=vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int], vp_stage: int | None = None):
    """pretrain_gpt.py:444-477 at core_v0.19.0."""
    from megatron.training import get_args, print_rank_0

    args = get_args()
    config = gpt_dataset_config(args)
    packed = bool(args.sft)
    if args.sft:
        from megatron.training.datasets.sft_dataset import SFTDataset as dataset_type
    elif args.mock_data:
        dataset_type = MockGPTDataset
    elif args.fim_data:
        from megatron.training.datasets.fim_dataset import GPTFIMDataset as dataset_type
    else:
        dataset_type = GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples, partial(_built_on_rank, vp_stage=vp_stage, packed=packed), config
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # every rank calls it: pretrain_gpt.py:507 (core_v0.19.0)
