"""Readers for the plain corpora the project uses directly (demo, analysis, evaluation), one place per format:
LAMBADA and other JSONL, WikiText (articles at ` = Title = ` lines), plain text (blank-line separated paragraphs).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from megatron_jreg.fileio import JsonlError, read_jsonl

_WIKITEXT_TITLE = re.compile(r"^(?= = [^=].* = $)", re.MULTILINE)  # split before each title line
DEFAULT_LAMBADA = Path(__file__).resolve().parent.parent / "resources" / "lambada_test.jsonl"


def iter_jsonl(path: str | Path, key: str = "text") -> Iterator[str]:
    """Yield the `key` field of each JSON line; a line without it raises "<file>:<line>: cannot read key ...",
    the wording analysis/config.py passes on."""
    try:
        for line, record in read_jsonl(path):
            if key not in record:
                raise JsonlError(Path(path), line, f"has no {key!r} (keys: {sorted(record)[:8]})")
            yield str(record[key])
    except JsonlError as e:
        raise ValueError(f"{e.path}:{e.line}: cannot read key {key!r}: {e.reason}") from None


def lambada_passages(path: str | Path = DEFAULT_LAMBADA) -> list[str]:
    """Full LAMBADA passages (the target word is the last whitespace-separated word)."""
    return list(iter_jsonl(path, "text"))


def wikitext_articles(path: str | Path) -> list[str]:
    """Split a WikiText file into articles at its top-level ` = Title = ` lines."""
    articles = _WIKITEXT_TITLE.split(Path(path).read_text(encoding="utf-8"))
    return [t.strip() for t in articles if t.strip()]


def text_paragraphs(path: str | Path) -> list[str]:
    """Blank-line separated paragraphs of a plain text file."""
    content = Path(path).read_text(encoding="utf-8")
    return [p.strip() for p in re.split(r"\n\s*\n", content) if p.strip()]
