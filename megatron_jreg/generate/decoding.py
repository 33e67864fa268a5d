"""Batched greedy or sampled decoding over any `CausalLM` (megatron_jreg.evaluate.models).

`CausalLM.logits` takes right-padded rows and is causal, so a batch of prompts of different lengths runs as
one tensor: each row's next token is read at its own last position, and the padding after it is never
seen by it. Each step recomputes the whole prefix (the interface has no key/value cache): simple and exact,
and cheap at the sizes generate serves on a CPU; cost grows with the square of the answer length.

Sampling draws each row from its own `torch.Generator` (seeded per question by the caller), so a question's
answer depends on the seed and the question only, not on which batch it ran in or whether the run resumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax); > 0: softmax(logits / temperature), cut to the top-p nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    ids: list[int]  # generated tokens, the stop token left out
    finish: str  # "stop" (a stop token or text), "length" (max_new_tokens), "window" (context window full)


def next_tokens(logits: torch.Tensor, sampling: Sampling, generators: list[torch.Generator | None]) -> list[int]:
    """logits[n, V] float32 → the next token of each row (argmax, or one draw from each row's generator)."""
    if sampling.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs[before >= sampling.top_p] = 0.0  # keep the smallest prefix reaching top_p (never empty)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return [int(torch.multinomial(row, 1, generator=g)) for row, g in zip(probs, generators)]


def complete(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    window: int,
    vocab_size: int,
    stop_ids: set[int],
    sampling: Sampling = Sampling(),
    generators: list[torch.Generator | None] | None = None,
    stopped: Callable[[int, list[int]], bool] | None = None,
    pad_id: int = 0,
) -> list[Completion]:
    """Continue every prompt (token ids, each shorter than `window`) until a stop id, `max_new_tokens`, a
    full context `window`, or `stopped(row, generated_ids)` says so (e.g. a stop text appeared).

    logits_fn: tokens[n, t] int64 (right-padded with `pad_id`) → logits[n, t, V' >= vocab_size]; columns from
    `vocab_size` on (megatron's padded vocabulary) never win."""
    rows = [list(p) for p in prompts]
    out = [Completion([], "length") for _ in prompts]
    generators = generators or [None] * len(prompts)
    active = [i for i, p in enumerate(rows) if len(p) < window]
    for i in set(range(len(rows))) - set(active):
        out[i].finish = "window"
    for _ in range(max_new_tokens):
        if not active:
            break
        lengths = torch.tensor([len(rows[i]) for i in active])
        batch = torch.full((len(active), int(lengths.max())), pad_id, dtype=torch.int64)
        for k, i in enumerate(active):
            batch[k, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.int64)
        logits = logits_fn(batch)
        last = logits[torch.arange(len(active)), lengths.to(logits.device) - 1, :vocab_size].float().cpu()
        chosen = next_tokens(last, sampling, [generators[i] for i in active])
        still = []
        for i, token in zip(active, chosen):
            if token in stop_ids:
                out[i].finish = "stop"
                continue
            rows[i].append(token)
            out[i].ids.append(token)
            if stopped is not None and stopped(i, out[i].ids):
                out[i].finish = "stop"
            elif len(rows[i]) >= window:
                out[i].finish = "window"
            else:
                still.append(i)
        active = still
    return out
