"""The progress line of a preprocess run and its throughput for the summary: a log line every --log-interval
documents, as Megatron-LM's tool prints, not a tqdm bar, whose carriage-return redraws make one line that grows
all run long in a batch job's log. The ETA is from input bytes read (compressed ones for .gz/.zst).
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    """Counts documents, text bytes, tokens and input bytes; prints a line every `interval` documents."""

    def __init__(self, total_input_bytes: int, interval: int, note: str | None = None) -> None:
        self.start = time.monotonic()
        self.note = note  # said once, at the end of the first line (e.g. that the tokenizer has no fast path)
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
            line = self.line() if self._printed_at or not self.note else f"{self.line()} | {self.note}"
            self._printed_at = self.docs
            print(line, file=sys.stderr, flush=True)

    def rates(self) -> dict:
        """Throughput so far, for the summary."""
        dt = max(time.monotonic() - self.start, 1e-9)
        return {
            "elapsed_s": round(dt, 3),
            "docs_per_s": round(self.docs / dt, 1),
            "text_mb_per_s": round(self.text_bytes / 1e6 / dt, 3),
            "input_mb_per_s": round(self.input_bytes / 1e6 / dt, 3),
            "tokens_per_s": round(self.tokens / dt, 1),
        }

    def line(self) -> str:
        """`processed N docs (...) | X MB text (...) | T tokens (...) | input P% ETA hh:mm:ss`."""
        r = self.rates()
        frac = min(self.input_bytes / self.total, 1.0)
        eta_text = tqdm.format_interval(r["elapsed_s"] * (1 - frac) / frac) if frac > 0 else "?"
        return (
            f"processed {self.docs:,} docs ({r['docs_per_s']:,.0f} docs/s) | "
            f"{self.text_bytes / 1e6:,.1f} MB text ({r['text_mb_per_s']:.2f} MB/s) | "
            f"{self.tokens:,} tokens ({r['tokens_per_s'] / 1e6:.2f}M tok/s) | "
            f"input {100 * frac:.1f}% ETA {eta_text}"
        )
