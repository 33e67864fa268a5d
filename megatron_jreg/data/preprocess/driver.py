"""`preprocess(cfg)`: the whole run, from the input files to finished datasets and manifests.

The main process checks the flags and the output folder, builds the tokenizer, plans the shards, skips those
an identical run finished, and for each remaining shard streams its work units (`sources.iter_units`, in
file order) through `--workers` processes with a bounded number in flight, writing results in unit order.
Each shard's datasets are written under `.partial` names and renamed when complete; its manifest is written
last, so an interrupted run never leaves an output that looks finished.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import multiprocessing
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from megatron_jreg.data.checks import DataError, check_output_prefix
from megatron_jreg.data.indexed import IndexedWriter, optimal_dtype, remove_dataset
from megatron_jreg.data.manifest import is_complete, manifest_path, new_manifest, write_json_atomic
from megatron_jreg.data.preprocess.config import PreprocessConfig
from megatron_jreg.data.preprocess.partitions import RoundRobinWriter
from megatron_jreg.data.preprocess.progress import Progress
from megatron_jreg.data.preprocess.shards import output_prefixes, plan_shards, shard_fingerprint
from megatron_jreg.data.preprocess.worker import UnitResult, first_documents, init_worker, process_unit
from megatron_jreg.data.sources import ERROR_REASONS, InputFile, Unit, iter_texts, iter_units, resolve_inputs
from megatron_jreg.data.tokenizers import build_tokenizer, file_sha256

EXAMPLES_PER_REASON = 5


class PreprocessError(DataError):
    """A bad record under --on-error fail, or input that yields no documents at all."""


def describe_skips(skipped: dict[str, int], examples: dict[str, list[str]]) -> str:
    """`skipped: reason n (e.g. file:line); ...` on one line."""
    if not skipped:
        return "skipped: none"
    parts = [f"{reason} {n:,} (e.g. {examples[reason][0]})" for reason, n in sorted(skipped.items())]
    return "skipped: " + "; ".join(parts)


def _punkt(cfg: PreprocessConfig, files: list[InputFile]) -> tuple[Any, dict]:
    """Punkt parameters and where they came from (given, found locally, or trained on the input)."""
    from megatron_jreg.data import sentences as sent

    found = sent.find_punkt(cfg.punkt_model, cfg.lang)
    if found is not None:
        params, source = found
        return params, {"source": source}
    texts = iter_texts(files, cfg.json_keys[0])
    params, used = sent.train_punkt(texts, cfg.punkt_train_chars)
    saved = sent.save_punkt_tab(params, f"{cfg.output_prefix}_punkt_tab")
    source = (
        f"trained on the first {used:,} characters of the input (no punkt_tab model found); saved to {saved}"
    )
    print(f"sentence splitting: Punkt {source}", file=sys.stderr)
    return params, {"source": source, "trained_chars": used, "saved": str(saved)}


def _stream_results(units: Iterable[Unit], pool: cf.Executor | None, max_in_flight: int) -> Iterator[UnitResult]:
    """Results of `process_unit` over `units`, in order, with at most `max_in_flight` units pending."""
    if pool is None:
        yield from map(process_unit, units)
        return
    pending: collections.deque[cf.Future] = collections.deque()
    for unit in units:
        pending.append(pool.submit(process_unit, unit))
        if len(pending) >= max_in_flight:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _write_shard(
    cfg: PreprocessConfig,
    files: list[InputFile],
    prefixes: dict[str, str],
    dtype: type[np.number],
    pool: cf.Executor | None,
    progress: Progress,
    kept_before: int,
) -> tuple[dict[str, IndexedWriter | RoundRobinWriter], collections.Counter, dict[str, list[str]]]:
    """Tokenize one shard's files into finished datasets (one per key); returns writers and skips.

    Old outputs of the shard go first, so that an interruption leaves nothing that looks finished; any
    exception deletes the partial files.
    """
    for p in prefixes.values():
        manifest_path(p).unlink(missing_ok=True)
        remove_dataset(p)
    partitions = cfg.reorders()
    writers: dict[str, IndexedWriter | RoundRobinWriter] = {
        k: RoundRobinWriter(p, dtype, partitions) if partitions else IndexedWriter(p, dtype)
        for k, p in prefixes.items()
    }
    skips: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    columns = [*cfg.json_keys, *(["int_score"] if cfg.min_int_score is not None else [])]
    kept, first_record = kept_before, 0
    try:
        units = iter_units(files, columns, int(cfg.block_mb * (1 << 20)))
        for result in _stream_results(units, pool, 2 * cfg.workers + 2):
            if cfg.max_documents is not None:
                result = first_documents(result, cfg.max_documents - kept)
            for _, reason, where in result.skipped:
                if cfg.on_error == "fail" and reason in ERROR_REASONS:
                    raise PreprocessError(
                        f"{where}: {reason}. Fix the input, or rerun with --on-error skip "
                        "(the default) to skip and count such records"
                    )
                skips[reason] += 1
                if len(examples[reason]) < EXAMPLES_PER_REASON:
                    examples[reason].append(where)
            for k, (tokens, lengths, counts) in result.outputs.items():
                if partitions:
                    writers[k].add_documents(tokens, lengths, counts, first_record + result.kept_positions)
                else:
                    writers[k].add_documents(tokens, lengths, counts)
            first_record += result.records
            kept += len(result.kept_positions)
            first = result.outputs[cfg.json_keys[0]][0]
            progress.update(
                len(result.kept_positions), int(result.doc_text_bytes.sum()), len(first), result.input_bytes
            )
            if cfg.max_documents is not None and kept >= cfg.max_documents:
                break
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return writers, skips, dict(examples)


def _manifest(
    cfg: PreprocessConfig,
    prefix: str,
    key: str,
    writer: IndexedWriter | RoundRobinWriter,
    fp: str,
    shard: list[int],
    dtype: str,
    tokenizer: dict,
) -> dict:
    """The manifest of one finished dataset: how it was made and what it holds."""
    return new_manifest(
        prefix,
        fingerprint=fp,
        shard=shard,
        json_key=key,
        level=cfg.level,
        dtype=dtype,
        documents=writer.documents,
        sequences=writer.sequences,
        tokens=writer.tokens,
        max_token_id=writer.max_token_id,
        tokenizer=tokenizer,
        append_eod=cfg.append_eod,
        filters={
            "min_int_score": cfg.min_int_score,
            "min_chars": cfg.min_chars,
            "max_documents": cfg.max_documents,
            "on_error": cfg.on_error,
        },
        **({"partitions": cfg.reorders()} if cfg.reorders() else {}),
    )


def preprocess(cfg: PreprocessConfig) -> dict:
    """Run the whole pipeline; returns the summary (outputs, counts, skips by reason, throughput).

    Shards already finished by an identical run are skipped; an interrupted shard is redone from its start.
    With --find-optimal-num-workers it only measures worker counts (see `optimal_workers`).
    """
    cfg.validate()
    if cfg.find_optimal_num_workers:
        from megatron_jreg.data.preprocess.optimal_workers import find_optimal_num_workers

        return find_optimal_num_workers(cfg)
    check_output_prefix(cfg.output_prefix)
    files = resolve_inputs(cfg.input, cfg.hf_split)
    tokenizer = build_tokenizer(**cfg.tokenizer_kwargs(), threads=1)
    if cfg.append_eod and tokenizer.eod is None:
        raise DataError(
            f"--append-eod: tokenizer {cfg.tokenizer_model} defines no end-of-document token (eos_token); "
            "add one to its tokenizer_config.json or drop --append-eod"
        )
    dtype = optimal_dtype(tokenizer.vocab_size)
    shards = plan_shards(files, cfg.output_shards)
    n_shards = len(shards)
    summary: dict[str, Any] = {
        "outputs": [],
        "documents": 0,
        "sequences": 0,
        "tokens": 0,
        "skipped": {},
        "skipped_examples": {},
        "shards": {"written": [], "already_complete": [], "not_written": []},
        "tokenizer": tokenizer.identity,
        "tokenizer_backend": getattr(tokenizer, "backend", "?"),
        "dtype": np.dtype(dtype).name,
        "level": cfg.level,
        "sentence_splitter": None,
        "notes": cfg.notes(),
    }
    skipped_total: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)

    todo = []
    for i, shard_files in enumerate(shards):
        if cfg.shard_ids and i not in cfg.shard_ids:
            continue
        prefixes = output_prefixes(cfg, i, n_shards)
        fp = shard_fingerprint(cfg, shard_files, tokenizer.identity, i, n_shards)
        done = [is_complete(p, fp) for p in prefixes.values()]
        if all(done):
            summary["shards"]["already_complete"].append(i)
            summary["outputs"] += list(prefixes.values())
            summary["documents"] += done[0]["documents"]
            summary["tokens"] += sum(m["tokens"] for m in done)
            print(f"shard {i}: already complete ({done[0]['documents']:,} docs), skipped", file=sys.stderr)
        else:
            todo.append((i, shard_files, prefixes, fp))

    punkt_params, splitter_info = None, None
    if cfg.split_sentences and todo:
        punkt_params, splitter_info = _punkt(cfg, files)
    summary["sentence_splitter"] = splitter_info

    spec = {
        "tokenizer": cfg.tokenizer_kwargs(),
        "json_keys": cfg.json_keys,
        "dtype": dtype,
        "eod": tokenizer.eod if cfg.append_eod else None,
        "min_int_score": cfg.min_int_score,
        "min_chars": cfg.min_chars,
        "punkt_params": punkt_params,
        "keep_newlines": cfg.keep_newlines,
    }
    pool = None
    if cfg.workers > 1 and todo:
        pool = cf.ProcessPoolExecutor(
            cfg.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=init_worker,
            initargs=(spec,),
        )
    elif todo:
        init_worker(spec, tokenizer)
    progress = Progress(sum(f.size for _, fs, _, _ in todo for f in fs), cfg.log_interval)
    kept = summary["documents"]
    unreported: list[str] = []  # "shard i: wrote ..." lines, held back until the run has kept a document
    hasher = cf.ThreadPoolExecutor(1)  # input sha256 for the manifests, alongside tokenization
    try:
        for i, shard_files, prefixes, fp in todo:
            if cfg.max_documents is not None and kept >= cfg.max_documents:
                summary["shards"]["not_written"].append(i)
                continue
            hashes = {f.path: hasher.submit(file_sha256, f.path) for f in shard_files}
            writers, shard_skips, shard_examples = _write_shard(
                cfg, shard_files, prefixes, dtype, pool, progress, kept
            )
            kept += writers[cfg.json_keys[0]].documents
            try:
                inputs = [
                    {"path": f.path, "bytes": f.size, "sha256": hashes[f.path].result()} for f in shard_files
                ]
                for k, p in prefixes.items():
                    write_json_atomic(
                        manifest_path(p),
                        _manifest(cfg, p, k, writers[k], fp, [i, n_shards], np.dtype(dtype).name, tokenizer.identity)
                        | {
                            "sentence_splitter": splitter_info,
                            "skipped": dict(sorted(shard_skips.items())),
                            "skipped_examples": dict(shard_examples),
                            "inputs": inputs,
                        },
                    )
            except BaseException:  # e.g. a full disk: no dataset may stay without its manifest
                for p in prefixes.values():
                    manifest_path(p).unlink(missing_ok=True)
                    remove_dataset(p)
                raise
            first_writer = writers[cfg.json_keys[0]]
            summary["shards"]["written"].append(i)
            summary["outputs"] += list(prefixes.values())
            summary["documents"] += first_writer.documents
            summary["sequences"] += first_writer.sequences
            summary["tokens"] += sum(w.tokens for w in writers.values())
            skipped_total.update(shard_skips)
            for reason, wheres in shard_examples.items():
                examples[reason] = (examples[reason] + wheres)[:EXAMPLES_PER_REASON]
            unreported.append(f"shard {i}: wrote {', '.join(prefixes.values())} ({first_writer.documents:,} docs, "
                              f"{first_writer.tokens:,} tokens)")
            if kept:  # else the run may still end with nothing written (removed, an error)
                print("\n".join(unreported), file=sys.stderr)
                unreported.clear()
    finally:
        hasher.shutdown(wait=False, cancel_futures=True)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    progress.print()
    summary["skipped"] = dict(sorted(skipped_total.items()))
    summary["skipped_examples"] = dict(examples)
    summary.update(progress.rates())
    if summary["shards"]["written"] and summary["documents"] == 0:
        for prefix in summary["outputs"]:
            manifest_path(prefix).unlink(missing_ok=True)
            remove_dataset(prefix)
        why = describe_skips(summary["skipped"], summary["skipped_examples"]) if summary["skipped"] else "no records"
        raise PreprocessError(
            f"--input {' '.join(cfg.input)}: no documents kept, so nothing was written ({why}); "
            "check the files, --json-keys and the filters against the data"
        )
    return summary
