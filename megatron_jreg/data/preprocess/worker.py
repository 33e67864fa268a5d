"""The work of one unit in a worker process: parse, filter, split sentences and tokenize, as Megatron-LM's
`Encoder.encode` does; `setup` puts the state here before the fork, so the tokenizer is built once, not per worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_jreg.data.checks import DataError
from megatron_jreg.data.sources import Records, Unit, read_records

MAX_SPLIT_CHARS = 1_000_000  # Megatron-LM hands Punkt very long documents in pieces of this many characters


@dataclass
class UnitResult:
    """Kept documents of one unit per key: tokens[k][j] (the document's ids) and lengths[k][j] (its sequences)."""

    input_bytes: int
    tokens: dict[str, list[np.ndarray]]
    lengths: dict[str, list[list[int]]]
    kept_positions: list[int]  # record ordinal of each kept document within the unit
    text_bytes: list[int]  # UTF-8 bytes of each kept document (all keys)
    skipped: list[tuple[int, str, str]]  # (record ordinal, reason, where)


STATE: dict[str, Any] = {}


def setup(**state: Any) -> None:
    """tokenizer, eod (None without --append-eod), dtype, json_keys, min_int_score, min_chars, splitter."""
    STATE.clear()
    STATE.update(state)


def sentence_splitter(lang: str, keep_newlines: bool) -> Any:
    """nltk's Punkt for `--lang` from nltk's data path (Megatron-LM's splitter; punkt_tab, which nltk >= 3.9 reads
    instead of the pickles Megatron-LM loads), keeping newlines with Megatron-LM's own pattern when asked."""
    from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer, PunktTokenizer

    try:
        punkt = PunktTokenizer(lang)
    except (LookupError, OSError, ValueError) as e:
        raise DataError(f"--split-sentences: no nltk Punkt model for --lang {lang} ({str(e).split(chr(10))[0][:120]}); "
                        "install nltk's punkt_tab data where NLTK_DATA points (`python -m nltk.downloader -d DIR "
                        "punkt_tab` on a machine with internet)") from None
    if not keep_newlines:
        return punkt

    class KeepNewlines(PunktLanguageVars):  # Megatron-LM's CustomLanguageVars: the whitespace stays
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                          #  <-- THIS is what Megatron-LM changed
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        #  <-- Normally you would have \s+ here
            ))"""

    return PunktSentenceTokenizer(train_text=punkt._params, lang_vars=KeepNewlines())


def _encode(texts: list[str]) -> list[tuple[np.ndarray, list[int]]]:
    """(tokens, sequence lengths) of each document text: one sequence, or one per non-empty sentence; with
    --append-eod the eod ends the last sequence (none for a document without tokens). The texts of a unit are
    tokenized in one batch (the `tokenizers` engine encodes a batch in one call)."""
    tokenizer, splitter, eod = STATE["tokenizer"], STATE["splitter"], STATE["eod"]
    if splitter is None:
        per_doc = [[ids] for ids in tokenizer.tokenize_arrays(texts)]
    else:
        pieces = ((t[i : i + MAX_SPLIT_CHARS] for i in range(0, len(t), MAX_SPLIT_CHARS)) for t in texts)
        sentences = [[s for piece in doc for s in splitter.tokenize(piece)] for doc in pieces]
        flat = iter(tokenizer.tokenize_arrays([s for doc in sentences for s in doc]))
        per_doc = [[next(flat) for _ in doc] for doc in sentences]
    encoded = []
    for sequences in per_doc:
        sequences = [ids for ids in sequences if len(ids)]
        lengths = [len(ids) for ids in sequences]
        if sequences and eod is not None:
            lengths[-1] += 1
        tokens = np.empty(sum(lengths), dtype=STATE["dtype"])
        at = 0
        for ids in sequences:
            tokens[at : at + len(ids)] = ids
            at += len(ids)
        if sequences and eod is not None:
            tokens[-1] = eod
        encoded.append((tokens, lengths))
    return encoded


def _filter(records: Records) -> tuple[list[int], list[int], list[tuple[int, str, str]]]:
    """Records to keep (indices), their UTF-8 sizes, and the skipped ones as (position, reason, where)."""
    keys: list[str] = STATE["json_keys"]
    min_score, min_chars, reject = STATE["min_int_score"], STATE["min_chars"], STATE["tokenizer"].reject
    keep, text_bytes, skipped = [], [], list(records.bad)
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
        elif why := next(filter(None, map(reject, texts)), None):
            skipped.append((pos, "not_token_ids", f"{records.where[i]} ({why})"))
        else:
            keep.append(i)
            text_bytes.append(nbytes)
    return keep, text_bytes, skipped


def process_unit(unit: Unit) -> UnitResult:
    """Parse, filter and tokenize one unit (in a worker process)."""
    keys: list[str] = STATE["json_keys"]
    records = read_records(unit, keys, want_score=STATE["min_int_score"] is not None)
    keep, text_bytes, skipped = _filter(records)
    encoded = {k: _encode([records.texts[k][i] for i in keep]) for k in keys}
    # A document whose every key tokenizes to nothing is empty too (e.g. only characters the model drops).
    has_tokens = [any(len(encoded[k][j][0]) for k in keys) for j in range(len(keep))]
    skipped += [(records.positions[i], "empty", records.where[i]) for i, ok in zip(keep, has_tokens) if not ok]
    skipped.sort()
    kept = [j for j, ok in enumerate(has_tokens) if ok]
    return UnitResult(
        input_bytes=unit.input_bytes,
        tokens={k: [encoded[k][j][0] for j in kept] for k in keys},
        lengths={k: [encoded[k][j][1] for j in kept] for k in keys},
        kept_positions=[records.positions[keep[j]] for j in kept],
        text_bytes=[text_bytes[j] for j in kept],
        skipped=skipped,
    )


def first_documents(result: UnitResult, n_docs: int) -> UnitResult:
    """The first `n_docs` (>= 1) kept documents of a unit (--max-documents); later records count as unread."""
    if n_docs > len(result.kept_positions):
        return result
    last = result.kept_positions[n_docs - 1]
    return dataclasses.replace(
        result, tokens={k: v[:n_docs] for k, v in result.tokens.items()},
        lengths={k: v[:n_docs] for k, v in result.lengths.items()}, kept_positions=result.kept_positions[:n_docs],
        text_bytes=result.text_bytes[:n_docs], skipped=[s for s in result.skipped if s[0] < last])
