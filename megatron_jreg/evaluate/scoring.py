"""Token-level computations on a `CausalLM`, written once for both evaluators.

The definitions follow lm-evaluation-harness 0.4 for causal models, so the built-in LAMBADA numbers
and the harness numbers of the same model are the same numbers:
- a (context, continuation) pair is tokenized by encoding context+continuation and the context alone,
  and taking the tokens past the context's length as the continuation (`encode_pair`);
- an input longer than the model's window keeps its last max_length+1 tokens (the last one is only a
  target), and only the continuation tokens that still fit are scored (`score`);
- a rolling log-likelihood cuts the document into disjoint windows of max_length predicted tokens,
  each with as much preceding text as fits (`rolling_windows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_jreg.evaluate.models import CausalLM, check_finite_logits

Pair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class Scored:
    """Score of one continuation: the summed log-probability of its tokens, whether greedy decoding
    reproduces every one of them, and how many tokens were scored."""

    logprob: float
    greedy: bool
    n_tokens: int


def encode_pair(lm: CausalLM, context: str, continuation: str) -> Pair:
    """(context ids, continuation ids) as lm-eval's causal models split them.

    Trailing whitespace of the context moves into the continuation (" word" is one token in most
    BPEs, "word" after a space another). The continuation is whole[len(ctx):], not encode(continuation):
    when a tokenizer merges across the boundary, the scored tokens are still exactly the ones the model
    sees after the context tokens. An empty context conditions on `lm.prefix_token`.
    """
    if not context:
        cont = lm.encode(continuation, special=False)
        if cont and cont[0] == lm.prefix_token:
            return cont[:1], cont[1:]
        return [lm.prefix_token], cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = lm.encode(context + continuation)
    ctx = lm.encode(context)
    return ctx, whole[len(ctx) :]


def _fit(lm: CausalLM, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
    """(input ids, scored targets): the window's inputs and the continuation tokens predicted in it."""
    window = (ctx + cont)[-(lm.max_length + 1) :]
    n_scored = min(len(cont), len(window) - 1)
    return window[:-1], cont[len(cont) - n_scored :]


def score(
    lm: CausalLM, pairs: Sequence[Pair], batch_size: int = 8, progress: Callable[[int], object] | None = None
) -> list[Scored]:
    """Score each continuation given its context; results in the order of `pairs`.

    Batches are formed from length-sorted requests (least padding) and right-padded with `lm.eod`; the
    model is causal, so a row's scores do not depend on what it is batched with. `progress(n)` is told
    after each batch how many requests it finished (a tqdm bar's `update`). Logits that are not finite
    where a continuation is scored stop the run (NonFiniteOutput): they would score as wrong, silently.
    """
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


def rolling_windows(tokens: list[int], prefix_token: int, max_length: int) -> list[Pair]:
    """Disjoint (context, continuation) windows that predict every token of a document exactly once.

    Window k predicts tokens[k*L : (k+1)*L] (L = max_length) and is conditioned on the tokens just
    before them, as many as fit in L inputs; the first window is conditioned on `prefix_token`.
    """
    full = [prefix_token, *tokens]
    windows = []
    for start in range(0, len(tokens), max_length):
        end = min(start + max_length, len(tokens))
        windows.append((full[max(0, end - max_length) : start + 1], tokens[start:end]))
    return windows
