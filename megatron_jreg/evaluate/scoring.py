"""Scoring continuations on a `CausalLM`, one computation for LAMBADA and the lm-eval adapter, cut and scored as
lm-eval 0.4's causal models do so the built-in LAMBADA and the harness agree on one model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_jreg.evaluate.decoding import check_finite_logits
from megatron_jreg.evaluate.models import CausalLM

Pair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class Scored:
    """One continuation: summed log-probability, whether greedy decoding reproduces every token, tokens scored."""

    logprob: float
    greedy: bool
    n_tokens: int


def encode_pair(lm: CausalLM, context: str, continuation: str) -> Pair:
    """(context ids, continuation ids) as lm-eval's `TemplateLM._encode_pair` splits them, so LAMBADA matches lm-eval:
    a token merged across the boundary still scores as the model sees it."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    ctx = lm.encode(context)
    return ctx, lm.encode(context + continuation)[len(ctx) :]


def _fit(lm: CausalLM, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
    """(input ids, scored targets): the window's inputs and the continuation tokens predicted in it."""
    window = (ctx + cont)[-(lm.max_length + 1) :]
    n_scored = min(len(cont), len(window) - 1)
    return window[:-1], cont[len(cont) - n_scored :]


def score(
    lm: CausalLM, pairs: Sequence[Pair], batch_size: int = 8, progress: Callable[[int], object] | None = None
) -> list[Scored]:
    """Each continuation's score given its context, in the order of `pairs`, in length-sorted right-padded batches
    (causal: a row's score ignores its batch); non-finite logits raise NonFiniteOutput (they would score as wrong)."""
    fitted = [_fit(lm, ctx, cont) for ctx, cont in pairs]
    results = [Scored(0.0, True, 0)] * len(fitted)  # kept for requests with nothing to score
    todo = sorted((i for i, (_, target) in enumerate(fitted) if target), key=lambda i: -len(fitted[i][0]))
    if progress is not None and len(todo) < len(fitted):
        progress(len(fitted) - len(todo))
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        tokens = torch.full((len(batch), len(fitted[batch[0]][0])), lm.eod, dtype=torch.long)
        for row, i in enumerate(batch):
            tokens[row, : len(fitted[i][0])] = torch.tensor(fitted[i][0], dtype=torch.long)
        logits = lm.logits(tokens)
        for row, i in enumerate(batch):
            inp, target = fitted[i]
            scored = logits[row, len(inp) - len(target) : len(inp), : lm.vocab_size]
            check_finite_logits(scored, getattr(lm, "dtype", torch.float32), f"request {i + 1} of {len(pairs)}")
            logp = scored.log_softmax(-1)
            target_t = torch.tensor(target, dtype=torch.long, device=logp.device)
            token_logp = logp.gather(-1, target_t[:, None])[:, 0]
            greedy = bool((logp.argmax(-1) == target_t).all())
            results[i] = Scored(float(token_logp.double().sum()), greedy, len(target))
        if progress is not None:
            progress(len(batch))
    return results
