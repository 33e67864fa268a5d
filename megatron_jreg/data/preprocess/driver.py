"""`preprocess(cfg)`: the whole run, from the input files to finished datasets and manifests, in an order such that
an interruption (Ctrl-C included) never leaves an output that looks finished, and the same command resumes.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import gc
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_jreg.data.checks import DataError, check_output_prefix, describe_skips
from megatron_jreg.data.indexed import Builder, optimal_dtype, remove_dataset
from megatron_jreg.data.manifest import fingerprint, is_complete, write_manifest
from megatron_jreg.data.preprocess import worker
from megatron_jreg.data.preprocess.config import PreprocessConfig
from megatron_jreg.data.preprocess.progress import Progress
from megatron_jreg.data.sources import ERROR_REASONS, InputFile, Unit, iter_units, resolve_inputs
from megatron_jreg.data.tokenizers import file_sha256, from_args
from megatron_jreg.errors import Interrupted

EXAMPLES_PER_REASON = 5


class PreprocessError(DataError):
    """A bad record under --on-error fail, or input that yields no documents at all."""


@dataclass
class Written:
    """One dataset being written: the builder and the counts its manifest records."""

    builder: Builder
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    max_token_id: int = -1

    def add(self, tokens: list[np.ndarray], lengths: list[list[int]]) -> None:
        for doc, lens in zip(tokens, lengths):
            self.builder.add_document(doc, lens)
            if len(doc):
                self.max_token_id = max(self.max_token_id, int(doc.max()))
            self.sequences += len(lens)
            self.tokens += len(doc)
        self.documents += len(tokens)


def _plan_shards(files: list[InputFile], n: int) -> list[list[InputFile]]:
    """Cut the ordered file list into `n` contiguous groups of roughly equal bytes (each non-empty): shards are
    whole files, in order, so one node's share is a run of them."""
    if n > len(files):
        raise DataError(f"--output-shards {n} but the input has only {len(files)} file(s); shards are made of whole "
                        f"files, so use --output-shards <= {len(files)} or split the input into more files")
    total = sum(f.size for f in files)
    groups: list[list[InputFile]] = [[]]
    done = 0
    for i, f in enumerate(files):
        remaining_files, remaining_groups = len(files) - i, n - len(groups) + 1
        if groups[-1] and (done >= total * len(groups) / n or remaining_files < remaining_groups):
            groups.append([])
        groups[-1].append(f)
        done += f.size
    return groups


def _shard_fingerprint(cfg: PreprocessConfig, files: list[InputFile], tokenizer: dict, shard: int, n: int) -> str:
    """Hash of what a shard's bytes depend on (inputs' path, size and mtime, tokenizer, keys, filters, order): a
    finished shard with the same one in its manifest is skipped on a rerun."""
    return fingerprint({
        "format": 1, "shard": [shard, n], "inputs": [[f.path, f.size, os.stat(f.path).st_mtime_ns] for f in files],
        "tokenizer": tokenizer, "json_keys": cfg.json_keys, "append_eod": cfg.append_eod, "level": cfg.level,
        "sentences": [cfg.keep_newlines, cfg.lang] if cfg.split_sentences else None,
        "filters": [cfg.min_int_score, cfg.min_chars, cfg.max_documents, cfg.on_error, cfg.hf_split]})


def _results(units: Iterable[Unit], pool: Any, max_in_flight: int) -> Iterator[worker.UnitResult]:
    """`process_unit` over `units`, in order, with at most `max_in_flight` units pending."""
    if pool is None:
        yield from map(worker.process_unit, units)
        return
    pending: collections.deque = collections.deque()
    for unit in units:
        pending.append(pool.apply_async(worker.process_unit, (unit,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _write_shard(cfg: PreprocessConfig, files: list[InputFile], prefixes: dict[str, str], dtype: type[np.number],
                 pool: Any, progress: Progress, kept_before: int) -> tuple[dict[str, Written], collections.Counter,
                                                                           dict[str, list[str]]]:
    """Tokenize one shard's files into finished datasets (one per key); returns their counts and the skips. Old
    outputs go first; any exception (Ctrl-C included) closes the partial files (the caller removes them)."""
    remove_dataset(*prefixes.values())
    written: dict[str, Written] = {}
    skips: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    columns = [*cfg.json_keys, *(["int_score"] if cfg.min_int_score is not None else [])]
    kept = kept_before
    try:
        for k, p in prefixes.items():
            written[k] = Written(Builder(p, dtype))
        units = iter_units(files, columns, int(cfg.block_mb * (1 << 20)))
        for result in _results(units, pool, 2 * cfg.workers + 2):
            if cfg.max_documents is not None:
                result = worker.first_documents(result, cfg.max_documents - kept)
            for _, reason, where in result.skipped:
                if cfg.on_error == "fail" and reason in ERROR_REASONS:
                    raise PreprocessError(f"{where}: {reason}. Fix the input, or rerun with --on-error skip "
                                          "(the default) to skip and count such records")
                skips[reason] += 1
                if len(examples[reason]) < EXAMPLES_PER_REASON:
                    examples[reason].append(where)
            for k, w in written.items():
                w.add(result.tokens[k], result.lengths[k])
            kept += len(result.kept_positions)
            tokens = sum(map(len, result.tokens[cfg.json_keys[0]]))
            progress.update(len(result.kept_positions), sum(result.text_bytes), tokens, result.input_bytes)
            if cfg.max_documents is not None and kept >= cfg.max_documents:
                break
        for w in written.values():
            w.builder.finalize()
    except BaseException:
        for w in written.values():
            w.builder.abort()
        raise
    return written, skips, dict(examples)


def _start_pool(cfg: PreprocessConfig) -> Any:
    """`--workers` forked processes that inherit `worker.STATE` (no tokenizer is rebuilt, nothing re-imported)."""
    # One thread per process (processes give the speed); and rayon's pool, if the tokenizer's checks used it
    # here, does not survive the fork: a worker must not wait on its threads.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # The parent's objects (torch, megatron-core, the tokenizer) out of the collector's reach: a collection in a
    # worker would otherwise touch them and copy their pages (measured: docs/results/preprocess_throughput.txt).
    gc.freeze()  # the workers inherit the frozen state; this process collects as before
    # The workers get SIGTERM's default action, not a handler this process may have (one that only records it):
    # pool.terminate() then ends even a worker stuck before its first line (seen in a pytest process whose gloo
    # threads held a lock at the fork), where a Python handler never runs and terminate() waited forever.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main else None
    try:
        # The workers leave Ctrl-C to this process, which stops them and says what is kept (one line, no traceback
        # from every worker).
        ignore_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_IGN)
        return multiprocessing.get_context("fork").Pool(cfg.workers, initializer=ignore_sigint)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        gc.unfreeze()


def preprocess(cfg: PreprocessConfig) -> dict:
    """Run the whole pipeline; returns the summary (outputs, counts, skips by reason, throughput). Shards an
    identical run finished are skipped; an interrupted shard is redone from its start."""
    cfg.validate()
    check_output_prefix(cfg.output_prefix)
    files = resolve_inputs(cfg.input, cfg.hf_split)
    tokenizer = from_args(cfg.tokenizer_args())
    if cfg.append_eod and tokenizer.eod is None:
        raise DataError(f"--append-eod: tokenizer {cfg.tokenizer_model} defines no end-of-document token "
                        "(eos_token); add one to its tokenizer_config.json or drop --append-eod")
    dtype = optimal_dtype(tokenizer.vocab_size)
    shards = _plan_shards(files, cfg.output_shards)
    summary: dict[str, Any] = {
        "outputs": [], "documents": 0, "sequences": 0, "tokens": 0, "skipped": {}, "skipped_examples": {},
        "shards": {"written": [], "already_complete": [], "not_written": []},
        "tokenizer": tokenizer.identity, "tokenizer_backend": tokenizer.backend, "dtype": np.dtype(dtype).name,
        "level": cfg.level, "notes": cfg.notes(),
        "sentence_splitter": f"nltk Punkt, --lang {cfg.lang}{' --keep-newlines' * cfg.keep_newlines}"
        if cfg.split_sentences else None,
    }
    filters = {k: getattr(cfg, k) for k in ("min_int_score", "min_chars", "max_documents", "on_error")}
    skipped_total: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    todo = []
    for i, shard_files in enumerate(shards):
        if cfg.shard_ids and i not in cfg.shard_ids:
            continue
        base = cfg.output_prefix if len(shards) == 1 else f"{cfg.output_prefix}_{i:05d}"
        prefixes = {k: f"{base}_{k}_{cfg.level}" for k in cfg.json_keys}  # Megatron-LM's PREFIX_{key}_{level}
        fp = _shard_fingerprint(cfg, shard_files, tokenizer.identity, i, len(shards))
        done = [is_complete(p, fp) for p in prefixes.values()]
        if all(done):
            summary["shards"]["already_complete"].append(i)
            summary["outputs"] += list(prefixes.values())
            summary["documents"] += done[0]["documents"]
            summary["tokens"] += sum(m["tokens"] for m in done)
            print(f"shard {i}: already complete ({done[0]['documents']:,} docs), skipped", file=sys.stderr)
        else:
            todo.append((i, shard_files, prefixes, fp))
    splitter = worker.sentence_splitter(cfg.lang, cfg.keep_newlines) if cfg.split_sentences and todo else None
    worker.setup(tokenizer=tokenizer, eod=tokenizer.eod if cfg.append_eod else None, dtype=dtype,
                 json_keys=cfg.json_keys, min_int_score=cfg.min_int_score, min_chars=cfg.min_chars, splitter=splitter)
    pool = _start_pool(cfg) if cfg.workers > 1 and todo else None
    hasher = cf.ThreadPoolExecutor(1)  # input sha256 for the manifests, alongside tokenization (after the fork)
    note = f"tokenizer {tokenizer.backend}" if "(no " in tokenizer.backend else None  # no fast path, or not tiktoken
    progress = Progress(sum(f.size for _, fs, _, _ in todo for f in fs), cfg.log_interval, note)
    kept = summary["documents"]
    unreported: list[str] = []  # "shard i: wrote ..." lines, held back until the run has kept a document
    current, current_prefixes = None, {}
    try:
        for i, shard_files, prefixes, fp in todo:
            if cfg.max_documents is not None and kept >= cfg.max_documents:
                summary["shards"]["not_written"].append(i)
                continue
            current, current_prefixes = i, prefixes
            hashes = {f.path: hasher.submit(file_sha256, f.path) for f in shard_files}
            written, shard_skips, shard_examples = _write_shard(cfg, shard_files, prefixes, dtype, pool, progress, kept)
            first = written[cfg.json_keys[0]]
            kept += first.documents
            inputs = [{"path": f.path, "bytes": f.size, "sha256": hashes[f.path].result()} for f in shard_files]
            for k, p in prefixes.items():
                w = written[k]
                write_manifest(p, fingerprint=fp, shard=[i, len(shards)], json_key=k, level=cfg.level,
                               dtype=summary["dtype"], documents=w.documents, sequences=w.sequences, tokens=w.tokens,
                               max_token_id=w.max_token_id, tokenizer=tokenizer.identity, append_eod=cfg.append_eod,
                               filters=filters, sentence_splitter=summary["sentence_splitter"],
                               skipped=dict(sorted(shard_skips.items())), skipped_examples=dict(shard_examples),
                               inputs=inputs)
            current = None
            summary["shards"]["written"].append(i)
            summary["outputs"] += list(prefixes.values())
            summary["documents"] += first.documents
            summary["sequences"] += first.sequences
            summary["tokens"] += sum(w.tokens for w in written.values())
            skipped_total.update(shard_skips)
            for reason, wheres in shard_examples.items():
                examples[reason] = (examples[reason] + wheres)[:EXAMPLES_PER_REASON]
            unreported.append(f"shard {i}: wrote {', '.join(prefixes.values())} ({first.documents:,} docs, "
                              f"{first.tokens:,} tokens)")
            if kept:  # else the run may still end with nothing written (removed, an error)
                print("\n".join(unreported), file=sys.stderr)
                unreported.clear()
    except BaseException as e:  # Ctrl-C, a full disk, ...: wherever it lands, the unfinished shard leaves nothing
        if current is not None:
            remove_dataset(*current_prefixes.values())
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(_interrupted(summary["shards"], current, len(shards))) from None
        raise
    finally:
        hasher.shutdown(wait=False, cancel_futures=True)
        if pool is not None:
            pool.terminate()
    progress.print()
    summary["skipped"] = dict(sorted(skipped_total.items()))
    summary["skipped_examples"] = dict(examples)
    summary.update(progress.rates())
    if summary["shards"]["written"] and summary["documents"] == 0:
        remove_dataset(*summary["outputs"])
        why = describe_skips(summary["skipped"], summary["skipped_examples"]) if summary["skipped"] else "no records"
        raise PreprocessError(f"--input {' '.join(cfg.input)}: no documents kept, so nothing was written ({why}); "
                              "check the files, --json-keys and the filters against the data")
    return summary


def _interrupted(shards: dict[str, list[int]], current: int | None, n_shards: int) -> str:
    """The one line of Ctrl-C: what is kept, what was removed, how to resume."""
    finished = sorted(shards["written"] + shards["already_complete"])
    kept = (f"shard{'s' * (len(finished) > 1)} {', '.join(map(str, finished))} of {n_shards} finished and kept"
            if finished else f"no shard of {n_shards} finished")
    removed = f"; shard {current}'s partial files were removed" if current is not None else ""
    return (f"interrupted: {kept}{removed}; run the same command again to resume (finished shards are skipped, an "
            "unfinished one is redone)")
