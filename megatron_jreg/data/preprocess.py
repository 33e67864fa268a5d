"""`megatron-jreg preprocess`: FineWeb-Edu / HF dataset folders / JSONL -> megatron indexed datasets.

Writes `PREFIX_{key}_{document|sentence}.bin/.idx` (Megatron-LM's naming and bytes) plus a manifest per
output. With `--output-shards N` the input files are cut into N contiguous groups, each written as
`PREFIX_{i:05d}_{key}_{level}`; finished shards are skipped when the same command is run again.

Pipeline: the main process plans work units in file order (`sources.iter_units`) and keeps a bounded
number in flight on `--workers` processes; each worker parses, filters, splits sentences, tokenizes in
batches and returns token arrays; the main process writes them in unit order. The output therefore does
not depend on the number of workers.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import itertools
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_jreg.data.indexed import IndexedWriter, optimal_dtype, remove_dataset
from megatron_jreg.data.manifest import (
    fingerprint,
    is_complete,
    manifest_path,
    new_manifest,
    write_json_atomic,
)
from megatron_jreg.data.sources import (
    ERROR_REASONS,
    InputFile,
    Records,
    Unit,
    iter_texts,
    iter_units,
    read_records,
    resolve_inputs,
)
from megatron_jreg.data.tokenizers import TOKENIZER_TYPES, Tokenizer, build_tokenizer, file_sha256

EXAMPLES_PER_REASON = 5
BATCH_BYTES = 4 << 20  # text tokenized per batch inside a unit


class PreprocessError(RuntimeError):
    """A bad record under --on-error fail, or an unusable configuration found while running."""


@dataclass
class PreprocessConfig:
    """Everything `preprocess` needs; fields mirror the command-line flags (`--json-keys` -> json_keys)."""

    input: list[str]
    output_prefix: str
    tokenizer_type: str
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None  # TikTokenizer with Megatron's JSON vocabulary
    tiktoken_pattern: str = "v2"
    tiktoken_num_special_tokens: int = 1000
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    punkt_model: str | None = None
    punkt_train_chars: int = 1_000_000
    workers: int = 1
    log_interval: int = 1000
    min_int_score: int | None = None
    min_chars: int = 0
    max_docs: int | None = None
    output_shards: int = 1
    shard_ids: list[int] | None = None  # process only these shards (one node's share); None: all
    on_error: str = "skip"
    hf_split: str | None = None
    block_mb: float = 1.0

    def validate(self) -> None:
        """Check the configuration once, with messages that name the flag and the fix."""
        if isinstance(self.input, str):
            self.input = [self.input]
        if isinstance(self.json_keys, str):
            self.json_keys = [self.json_keys]
        checks = [
            (bool(self.input), "--input is required (a file, directory or glob)"),
            (bool(self.output_prefix), "--output-prefix is required"),
            (
                self.tokenizer_type in TOKENIZER_TYPES,
                f"--tokenizer-type {self.tokenizer_type!r}: choose one of {', '.join(TOKENIZER_TYPES)}",
            ),
            (
                bool(self.json_keys) and len(set(self.json_keys)) == len(self.json_keys),
                "--json-keys needs distinct key names",
            ),
            (self.workers >= 1, f"--workers must be >= 1, got {self.workers}"),
            (self.log_interval >= 1, f"--log-interval must be >= 1, got {self.log_interval}"),
            (self.min_chars >= 0, f"--min-chars must be >= 0, got {self.min_chars}"),
            (self.max_docs is None or self.max_docs >= 1, f"--max-docs must be >= 1, got {self.max_docs}"),
            (self.output_shards >= 1, f"--output-shards must be >= 1, got {self.output_shards}"),
            (
                not self.shard_ids or all(0 <= i < self.output_shards for i in self.shard_ids),
                f"--shard-ids must lie in 0..{self.output_shards - 1} (--output-shards {self.output_shards})",
            ),
            (
                not self.shard_ids or self.max_docs is None,
                "--max-docs counts documents across all shards in order; drop it or --shard-ids",
            ),
            (self.on_error in ("skip", "fail"), f"--on-error must be skip or fail, got {self.on_error!r}"),
            (self.punkt_train_chars >= 1000, "--punkt-train-chars must be >= 1000"),
            (self.block_mb > 0, "--block-mb must be > 0"),
            (
                not self.keep_newlines or self.split_sentences,
                "--keep-newlines only applies with --split-sentences",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def tokenizer_kwargs(self) -> dict:
        return {
            "tokenizer_type": self.tokenizer_type,
            "tokenizer_model": self.tokenizer_model,
            "vocab_file": self.vocab_file,
            "merge_file": self.merge_file,
            "tiktoken_pattern": self.tiktoken_pattern,
            "tiktoken_num_special_tokens": self.tiktoken_num_special_tokens,
            "vocab_size": self.vocab_size,
        }


# ----------------------------------------------------------------------------------------------- workers


@dataclass
class UnitResult:
    """Tokens of one unit, per key: tokens[T], sequence_lengths[S], doc_sequences[N] (kept docs only)."""

    path: str
    input_bytes: int
    outputs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    kept_positions: np.ndarray  # [N] record ordinal of each kept document within the unit
    doc_text_bytes: np.ndarray  # [N] UTF-8 bytes of each kept document (all keys)
    skipped: list[tuple[int, str, str]]  # (record ordinal, reason, where)
    records: int


_WORKER: dict[str, Any] = {}


def _init_worker(spec: dict, tokenizer: Tokenizer | None = None) -> None:
    """Build the tokenizer (one thread: parallelism comes from processes) and the sentence splitter.

    In a worker process `tokenizer` is None; with --workers 1 the main process passes its own.
    """
    if tokenizer is None:  # a worker process of our own: keep the `tokenizers` library to one thread too
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
        tokenizer = build_tokenizer(**spec["tokenizer"], threads=1)
    _WORKER.clear()
    _WORKER.update(spec)
    _WORKER["tokenizer"] = tokenizer
    params = spec.get("punkt_params")
    _WORKER["splitter"] = None
    if params is not None:  # nltk takes seconds to import: only when splitting sentences
        from megatron_jreg.data.sentences import SentenceSplitter

        _WORKER["splitter"] = SentenceSplitter(params, spec["keep_newlines"])


def _sequences(texts: list[str]) -> tuple[list[list[int]], list[int]]:
    """Token sequences of documents and the number of sequences of each (Megatron-LM's encode step).

    Document level: one sequence per document. Sentence level: one per non-empty sentence. With
    --append-eod the eod goes at the end of the document's last sequence (none for an empty document).
    """
    tokenizer, eod = _WORKER["tokenizer"], _WORKER["eod"]
    splitter = _WORKER["splitter"]
    if splitter is None:
        seqs = tokenizer.tokenize_batch(texts)
        counts = [1 if ids else 0 for ids in seqs]
        if eod is not None:
            for ids in seqs:
                if ids:
                    ids.append(eod)
        return [ids for ids in seqs if ids], counts
    per_doc = [splitter.split(t) for t in texts]
    flat = tokenizer.tokenize_batch([s for doc in per_doc for s in doc])
    seqs, counts, it = [], [], iter(flat)
    for doc in per_doc:
        kept = [ids for ids in itertools.islice(it, len(doc)) if ids]
        if kept and eod is not None:
            kept[-1].append(eod)
        seqs.extend(kept)
        counts.append(len(kept))
    return seqs, counts


def _filter(records: Records) -> tuple[list[int], list[int], list[tuple[int, str, str]]]:
    """Records to keep (indices), their UTF-8 sizes, and the skipped ones as (position, reason, where)."""
    keys: list[str] = _WORKER["json_keys"]
    min_score, min_chars = _WORKER["min_int_score"], _WORKER["min_chars"]
    keep: list[int] = []
    text_bytes: list[int] = []
    skipped = list(records.bad)
    for i, pos in enumerate(records.positions):
        texts = [records.texts[k][i] for k in keys]
        try:
            nbytes = sum(len(t.encode("utf-8")) for t in texts)
        except UnicodeEncodeError as e:  # lone surrogates from a "\ud800" JSON escape
            skipped.append((pos, "not_utf8", f"{records.where[i]} ({e.reason})"))
            continue
        if not any(texts):  # whitespace-only text still has tokens, and Megatron-LM keeps it
            skipped.append((pos, "empty", records.where[i]))
        elif min_score is not None and records.int_scores[i] < min_score:
            skipped.append((pos, "below_min_int_score", records.where[i]))
        elif sum(len(t) for t in texts) < min_chars:
            skipped.append((pos, "too_short", records.where[i]))
        else:
            keep.append(i)
            text_bytes.append(nbytes)
    return keep, text_bytes, skipped


def _tokenize(texts: list[str], text_bytes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens[T], sequence_lengths[S], sequences per document[N] of N texts of one key.

    Batches of ~BATCH_BYTES become numpy at once, so a large parquet row group never holds all its ids
    as Python ints.
    """
    dtype = _WORKER["dtype"]
    parts = []
    start = 0
    while start < len(texts):
        stop, size = start, 0
        while stop < len(texts) and (stop == start or size < BATCH_BYTES):
            size, stop = size + text_bytes[stop], stop + 1
        seqs, counts = _sequences(texts[start:stop])
        lengths = np.fromiter(map(len, seqs), dtype=np.int32, count=len(seqs))
        tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=dtype, count=int(lengths.sum()))
        parts.append((tokens, lengths, np.asarray(counts, dtype=np.int64)))
        start = stop
    if not parts:
        return np.zeros(0, dtype), np.zeros(0, np.int32), np.zeros(0, np.int64)
    return tuple(np.concatenate(column) for column in zip(*parts))


def process_unit(unit: Unit) -> UnitResult:
    """Parse, filter and tokenize one unit (runs in a worker process)."""
    keys: list[str] = _WORKER["json_keys"]
    records = read_records(unit, keys, want_score=_WORKER["min_int_score"] is not None)
    keep, text_bytes, skipped = _filter(records)
    outputs = {k: _tokenize([records.texts[k][i] for i in keep], text_bytes) for k in keys}
    # A document whose every key tokenizes to nothing is empty too (e.g. only characters the model drops).
    has_tokens = np.zeros(len(keep), dtype=bool)
    for _, _, counts in outputs.values():
        has_tokens |= counts > 0
    skipped += [
        (records.positions[keep[j]], "empty", records.where[keep[j]]) for j in np.flatnonzero(~has_tokens)
    ]
    skipped.sort()
    kept = np.flatnonzero(has_tokens)
    return UnitResult(
        path=unit.path,
        input_bytes=unit.input_bytes,
        outputs={
            k: (tokens, lengths, counts[has_tokens]) for k, (tokens, lengths, counts) in outputs.items()
        },
        kept_positions=np.asarray([records.positions[keep[j]] for j in kept], dtype=np.int64),
        doc_text_bytes=np.asarray([text_bytes[j] for j in kept], dtype=np.int64),
        skipped=skipped,
        records=records.count,
    )


def _truncate(result: UnitResult, n_docs: int) -> UnitResult:
    """The first `n_docs` (>= 1) kept documents of a unit; records after the last of them count as unread."""
    if n_docs > len(result.kept_positions):
        return result
    last = int(result.kept_positions[n_docs - 1])
    outputs = {}
    for k, (tokens, lengths, counts) in result.outputs.items():
        n_seq = int(counts[:n_docs].sum())
        outputs[k] = (tokens[: int(lengths[:n_seq].sum())], lengths[:n_seq], counts[:n_docs])
    return UnitResult(
        result.path,
        result.input_bytes,
        outputs,
        result.kept_positions[:n_docs],
        result.doc_text_bytes[:n_docs],
        [s for s in result.skipped if s[0] < last],
        last + 1,
    )


# ------------------------------------------------------------------------------------------ main process


class Progress:
    """A line every `interval` documents: docs, MB of text and tokens per second, ETA from input bytes."""

    def __init__(self, total_input_bytes: int, interval: int) -> None:
        self.start = time.monotonic()
        self.total = max(total_input_bytes, 1)
        self.interval = interval
        self.docs = self.text_bytes = self.tokens = self.input_bytes = 0
        self._next = interval
        self._printed_at = 0

    def update(self, docs: int, text_bytes: int, tokens: int, input_bytes: int) -> None:
        self.docs += docs
        self.text_bytes += text_bytes
        self.tokens += tokens
        self.input_bytes += input_bytes
        if self.docs >= self._next:
            self._next = (self.docs // self.interval + 1) * self.interval
            self.print()

    def print(self) -> None:
        """The progress line on stderr (the final one too, unless it would repeat the last)."""
        if self.docs and self.docs != self._printed_at:
            self._printed_at = self.docs
            print(self.line(), file=sys.stderr, flush=True)

    def rates(self) -> dict:
        dt = max(time.monotonic() - self.start, 1e-9)
        return {
            "elapsed_s": round(dt, 3),
            "docs_per_s": round(self.docs / dt, 1),
            "text_mb_per_s": round(self.text_bytes / 1e6 / dt, 3),
            "input_mb_per_s": round(self.input_bytes / 1e6 / dt, 3),
            "tokens_per_s": round(self.tokens / dt, 1),
        }

    def line(self) -> str:
        r = self.rates()
        frac = min(self.input_bytes / self.total, 1.0)
        eta = r["elapsed_s"] * (1 - frac) / frac if frac > 0 else float("nan")
        eta_text = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        return (
            f"processed {self.docs:,} docs ({r['docs_per_s']:,.0f} docs/s) | "
            f"{self.text_bytes / 1e6:,.1f} MB text ({r['text_mb_per_s']:.2f} MB/s) | "
            f"{self.tokens:,} tokens ({r['tokens_per_s'] / 1e6:.2f}M tok/s) | "
            f"input {100 * frac:.1f}% ETA {eta_text}"
        )


def plan_shards(files: list[InputFile], n: int) -> list[list[InputFile]]:
    """Cut the ordered file list into `n` contiguous groups of roughly equal bytes (each non-empty)."""
    if n > len(files):
        raise ValueError(
            f"--output-shards {n} but the input has only {len(files)} file(s); shards are made of whole "
            f"files, so use --output-shards <= {len(files)} or split the input into more files"
        )
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


def _output_prefixes(cfg: PreprocessConfig, shard: int, n_shards: int) -> dict[str, str]:
    base = cfg.output_prefix if n_shards == 1 else f"{cfg.output_prefix}_{shard:05d}"
    return {k: f"{base}_{k}_{cfg.level}" for k in cfg.json_keys}


def _shard_fingerprint(
    cfg: PreprocessConfig, files: list[InputFile], tokenizer_identity: dict, shard: int, n_shards: int
) -> str:
    described = {
        "format": 1,
        "shard": [shard, n_shards],
        "inputs": [[f.path, f.size, os.stat(f.path).st_mtime_ns] for f in files],
        "tokenizer": tokenizer_identity,
        "json_keys": cfg.json_keys,
        "append_eod": cfg.append_eod,
        "level": cfg.level,
        "sentences": [cfg.keep_newlines, cfg.lang, cfg.punkt_model, cfg.punkt_train_chars]
        if cfg.split_sentences
        else None,
        "filters": [cfg.min_int_score, cfg.min_chars, cfg.max_docs, cfg.on_error, cfg.hf_split],
    }
    return fingerprint(described)


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


def _stream_results(units, pool: cf.Executor | None, max_in_flight: int):
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


def _describe_skips(skipped: dict[str, int], examples: dict[str, list[str]]) -> str:
    if not skipped:
        return "skipped: none"
    parts = [f"{reason} {n:,} (e.g. {examples[reason][0]})" for reason, n in sorted(skipped.items())]
    return "skipped: " + "; ".join(parts)


def _write_shard(
    cfg: PreprocessConfig,
    files: list[InputFile],
    prefixes: dict[str, str],
    dtype: type[np.number],
    pool: cf.Executor | None,
    progress: Progress,
    kept_before: int,
) -> tuple[dict[str, IndexedWriter], collections.Counter, dict[str, list[str]]]:
    """Tokenize one shard's files into finished datasets (one per key); returns writers and skips.

    Old outputs of the shard go first, so that an interruption leaves nothing that looks finished; any
    exception deletes the partial files.
    """
    for p in prefixes.values():
        manifest_path(p).unlink(missing_ok=True)
        remove_dataset(p)
    writers = {k: IndexedWriter(p, dtype) for k, p in prefixes.items()}
    skips: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    columns = [*cfg.json_keys, *(["int_score"] if cfg.min_int_score is not None else [])]
    kept = kept_before
    try:
        units = iter_units(files, columns, int(cfg.block_mb * (1 << 20)))
        for result in _stream_results(units, pool, 2 * cfg.workers + 2):
            if cfg.max_docs is not None:
                result = _truncate(result, cfg.max_docs - kept)
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
                writers[k].add_documents(tokens, lengths, counts)
            kept += len(result.kept_positions)
            first = result.outputs[cfg.json_keys[0]][0]
            progress.update(
                len(result.kept_positions), int(result.doc_text_bytes.sum()), len(first), result.input_bytes
            )
            if cfg.max_docs is not None and kept >= cfg.max_docs:
                break
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return writers, skips, dict(examples)


def preprocess(cfg: PreprocessConfig) -> dict:
    """Run the whole pipeline; returns the summary (outputs, counts, skips by reason, throughput).

    Shards already finished by an identical run are skipped; an interrupted shard is redone from its start.
    """
    cfg.validate()
    files = resolve_inputs(cfg.input, cfg.hf_split)
    tokenizer = build_tokenizer(**cfg.tokenizer_kwargs(), threads=1)
    if cfg.append_eod and tokenizer.eod is None:
        raise ValueError(
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
    }
    skipped_total: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)

    todo = []
    for i, shard_files in enumerate(shards):
        if cfg.shard_ids and i not in cfg.shard_ids:
            continue
        prefixes = _output_prefixes(cfg, i, n_shards)
        fp = _shard_fingerprint(cfg, shard_files, tokenizer.identity, i, n_shards)
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
            initializer=_init_worker,
            initargs=(spec,),
        )
    elif todo:
        _init_worker(spec, tokenizer)
    progress = Progress(sum(f.size for _, fs, _, _ in todo for f in fs), cfg.log_interval)
    kept = summary["documents"]
    hasher = cf.ThreadPoolExecutor(1)  # input sha256 for the manifests, alongside tokenization
    try:
        for i, shard_files, prefixes, fp in todo:
            if cfg.max_docs is not None and kept >= cfg.max_docs:
                summary["shards"]["not_written"].append(i)
                continue
            hashes = {f.path: hasher.submit(file_sha256, f.path) for f in shard_files}
            writers, shard_skips, shard_examples = _write_shard(
                cfg, shard_files, prefixes, dtype, pool, progress, kept
            )
            kept += writers[cfg.json_keys[0]].documents
            inputs = [
                {"path": f.path, "bytes": f.size, "sha256": hashes[f.path].result()} for f in shard_files
            ]
            for k, p in prefixes.items():
                w = writers[k]
                write_json_atomic(
                    manifest_path(p),
                    new_manifest(
                        p,
                        fingerprint=fp,
                        shard=[i, n_shards],
                        json_key=k,
                        level=cfg.level,
                        dtype=np.dtype(dtype).name,
                        documents=w.documents,
                        sequences=w.sequences,
                        tokens=w.tokens,
                        max_token_id=w.max_token_id,
                        tokenizer=tokenizer.identity,
                        append_eod=cfg.append_eod,
                        filters={
                            "min_int_score": cfg.min_int_score,
                            "min_chars": cfg.min_chars,
                            "max_docs": cfg.max_docs,
                            "on_error": cfg.on_error,
                        },
                        sentence_splitter=splitter_info,
                        skipped=dict(sorted(shard_skips.items())),
                        skipped_examples=dict(shard_examples),
                        inputs=inputs,
                    ),
                )
            first_writer = writers[cfg.json_keys[0]]
            summary["shards"]["written"].append(i)
            summary["outputs"] += list(prefixes.values())
            summary["documents"] += first_writer.documents
            summary["sequences"] += first_writer.sequences
            summary["tokens"] += sum(w.tokens for w in writers.values())
            skipped_total.update(shard_skips)
            for reason, wheres in shard_examples.items():
                examples[reason] = (examples[reason] + wheres)[:EXAMPLES_PER_REASON]
            print(
                f"shard {i}: wrote {', '.join(prefixes.values())} ({first_writer.documents:,} docs, "
                f"{first_writer.tokens:,} tokens)",
                file=sys.stderr,
            )
    finally:
        hasher.shutdown(wait=False, cancel_futures=True)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    progress.print()
    summary["skipped"] = dict(sorted(skipped_total.items()))
    summary["skipped_examples"] = dict(examples)
    summary.update(progress.rates())
    return summary


# ------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-jreg preprocess",
        description="Tokenize FineWeb-Edu parquet, HF dataset folders or JSONL(.gz/.zst) into megatron-core "
        "indexed datasets (PREFIX_text_document.bin/.idx), like Megatron-LM's tools/preprocess_data.py.",
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="file(s), directories or globs")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys (parquet columns) to tokenize")
    g.add_argument("--hf-split", default=None, help="split of a saved HF DatasetDict folder (default train)")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (nltk Punkt)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between split sentences")
    g.add_argument("--lang", default="english", help="Punkt model language to look up in nltk's data path")
    g.add_argument("--punkt-model", default=None, help="punkt_tab/<lang> folder (or an nltk_data root)")
    g.add_argument(
        "--punkt-train-chars",
        type=int,
        default=1_000_000,
        help="without a Punkt model: train Punkt on this many input characters",
    )
    g = p.add_argument_group("filters")
    g.add_argument(
        "--min-int-score", type=int, default=None, help="keep FineWeb-Edu docs with int_score >= N"
    )
    g.add_argument("--min-chars", type=int, default=0, help="skip documents shorter than N characters")
    g.add_argument("--max-docs", type=int, default=None, help="stop after N kept documents (in input order)")
    g.add_argument(
        "--on-error",
        choices=("skip", "fail"),
        default="skip",
        help="bad records: skip and count (default) or stop naming file and line",
    )
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None, help=".model file, HF folder, or tiktoken file")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    g.add_argument(
        "--vocab-size", type=int, default=None, help="TikTokenizer (Megatron JSON) vocabulary size"
    )
    g.add_argument("--tiktoken-pattern", default="v2", help="TikTokenizer (Megatron JSON) pattern v1|v2")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each doc")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix, no suffix")
    g.add_argument(
        "--output-shards", type=int, default=1, help="write N shards (groups of whole input files)"
    )
    g.add_argument(
        "--shard-ids", type=int, nargs="+", default=None, help="only these shards (split a run across nodes)"
    )
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (use the number of cores)")
    g.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    g.add_argument("--block-mb", type=float, default=1.0, help="JSONL work unit size in MB")
    return p


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    names = PreprocessConfig.__dataclass_fields__
    return PreprocessConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    try:
        summary = preprocess(cfg)
    except (PreprocessError, ValueError, FileNotFoundError) as e:
        print(f"megatron-jreg preprocess: error: {e}", file=sys.stderr)
        return 1
    print(
        f"done: {summary['documents']:,} documents, {summary['tokens']:,} tokens ({summary['dtype']}, "
        f"{summary['level']} level, tokenizer backend {summary['tokenizer_backend']}) "
        f"in {summary['elapsed_s']:.1f}s "
        f"({summary['text_mb_per_s']:.2f} MB/s text, {summary['tokens_per_s'] / 1e6:.2f}M tokens/s)"
    )
    print(_describe_skips(summary["skipped"], summary["skipped_examples"]))
    if summary["sentence_splitter"]:
        print(f"sentence splitter: {summary['sentence_splitter']['source']}")
    for prefix in summary["outputs"]:
        print(f"output: {prefix}.bin/.idx (manifest {manifest_path(prefix)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
