"""Built-in LAMBADA (the paper's next-token metric): lm-eval's "lambada_openai" top-1 accuracy and perplexity without
lm-eval, so a checkpoint is scored without converting it (split and aggregation: docs/evaluate.md)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from statistics import stdev

from megatron_jreg.errors import UsageError
from megatron_jreg.evaluate.models import CausalLM
from megatron_jreg.evaluate.scoring import Scored, encode_pair, score
from megatron_jreg.fileio import JsonlError, read_jsonl
from megatron_jreg.progress import progress_bar


def split_passage(text: str) -> tuple[str, str]:
    """(context, target) split on single spaces as lambada_openai's `text.split(' ')`: our numbers equal lm-eval's."""
    words = text.split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def skip_reason(value: object) -> str | None:
    """Why a passage's "text" cannot be scored (nothing to predict from, or nothing to predict), or None."""
    if not isinstance(value, str):
        return "not_a_string"
    if not value.strip():
        return "empty"
    context, target = split_passage(value)
    if not context.strip():
        return "one_word"
    if not target.strip():
        return "no_last_word"  # ends in a space: split(" ") gives an empty last word
    return None


def read_lambada(path: str | Path) -> tuple[list[str], Counter[str]]:
    """(scoreable passages, skipped ones counted by reason); a malformed line is refused: skipping it would change
    silently what is scored."""
    path = Path(path)
    passages: list[str] = []
    skipped: Counter[str] = Counter()
    fix = 'fix the line, or pass a LAMBADA JSONL file (one UTF-8 {"text": passage} a line)'
    try:
        for lineno, record in read_jsonl(path):
            if "text" not in record:
                raise UsageError(f'--lambada-file {path}: line {lineno} has no "text" field; {fix}')
            reason = skip_reason(record["text"])
            if reason is None:
                passages.append(record["text"])
            else:
                skipped[reason] += 1
    except JsonlError as e:
        raise UsageError(f"--lambada-file {e}; {fix}") from None
    except OSError as e:
        raise UsageError(f"--lambada-file {path}: cannot read it ({e.strerror}); pass a readable file") from None
    if not passages:
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())) or "no passages"
        raise UsageError(f'--lambada-file {path}: no passage can be scored ({counts}); pass a LAMBADA JSONL file '
                         '(one {"text": passage} a line)')
    return passages, skipped


def score_lambada(lm: CausalLM, passages: Sequence[str], batch_size: int = 8, progress: bool = False) -> list[Scored]:
    pairs = [encode_pair(lm, *split_passage(p)) for p in passages]
    with progress_bar(len(pairs), "lambada", "passage", progress) as bar:
        return score(lm, pairs, batch_size, bar.update)


def evaluate_lambada(
    lm: CausalLM, passages: Sequence[str], batch_size: int = 8, progress: bool = False
) -> dict[str, float | None]:
    """{acc, acc_stderr, perplexity, perplexity_stderr} of `lm` on `passages` (the last word is the target; stderr:
    the sample standard deviation over √n, None for one passage)."""
    if not passages:
        raise ValueError("LAMBADA: no passages to score; check --lambada-file and --limit")
    scored = score_lambada(lm, passages, batch_size, progress)
    n, hits, nll = len(scored), [float(s.greedy) for s in scored], [-s.logprob for s in scored]
    acc_stderr, nll_stderr = (stdev(hits) / math.sqrt(n), stdev(nll) / math.sqrt(n)) if n > 1 else (None, None)
    perplexity = math.exp(sum(nll) / n)
    return {"acc": sum(hits) / n, "acc_stderr": acc_stderr, "perplexity": perplexity,
            "perplexity_stderr": None if nll_stderr is None else perplexity * nll_stderr}
