"""The work of one unit, in a worker process: parse, filter, split sentences, tokenize.

`init_worker` builds the tokenizer and sentence splitter once per process (`--workers` processes, one
thread each); `process_unit` turns a unit (a JSONL block, a parquet row group, an arrow slice) into token
arrays per `--json-keys` key and the records it skipped, by reason. The main process writes results in unit
order, so the output does not depend on the number of workers.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_jreg.data.sources import Records, Unit, read_records
from megatron_jreg.data.tokenizers import Tokenizer, build_tokenizer

BATCH_BYTES = 4 << 20  # text tokenized per batch inside a unit


@dataclass
class UnitResult:
    """Tokens of one unit, per key: tokens[T], sequence_lengths[S], doc_sequences[N] (kept docs only)."""

    input_bytes: int
    outputs: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    kept_positions: np.ndarray  # [N] record ordinal of each kept document within the unit
    doc_text_bytes: np.ndarray  # [N] UTF-8 bytes of each kept document (all keys)
    skipped: list[tuple[int, str, str]]  # (record ordinal, reason, where)
    records: int  # records of the unit, kept or not: ordinals of the next unit start here


_WORKER: dict[str, Any] = {}


def init_worker(spec: dict, tokenizer: Tokenizer | None = None) -> None:
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
    reject = getattr(_WORKER["tokenizer"], "reject", None)  # NullTokenizer: text must be ids
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
        elif reject is not None and (why := next(filter(None, map(reject, texts)), None)):
            skipped.append((pos, "not_token_ids", f"{records.where[i]} ({why})"))
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
        input_bytes=unit.input_bytes,
        outputs={
            k: (tokens, lengths, counts[has_tokens]) for k, (tokens, lengths, counts) in outputs.items()
        },
        kept_positions=np.asarray([records.positions[keep[j]] for j in kept], dtype=np.int64),
        doc_text_bytes=np.asarray([text_bytes[j] for j in kept], dtype=np.int64),
        skipped=skipped,
        records=records.count,
    )


def first_documents(result: UnitResult, n_docs: int) -> UnitResult:
    """The first `n_docs` (>= 1) kept documents of a unit (--max-documents); later records count as unread."""
    if n_docs > len(result.kept_positions):
        return result
    last = int(result.kept_positions[n_docs - 1])
    outputs = {}
    for k, (tokens, lengths, counts) in result.outputs.items():
        n_seq = int(counts[:n_docs].sum())
        outputs[k] = (tokens[: int(lengths[:n_seq].sum())], lengths[:n_seq], counts[:n_docs])
    return UnitResult(
        input_bytes=result.input_bytes,
        outputs=outputs,
        kept_positions=result.kept_positions[:n_docs],
        doc_text_bytes=result.doc_text_bytes[:n_docs],
        skipped=[s for s in result.skipped if s[0] < last],
        records=last + 1,
    )
