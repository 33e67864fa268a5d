"""lm-evaluation-harness on any `CausalLM`: the adapter and one call that runs tasks through lm-eval.

`HarnessLM` answers lm-eval's three request types with the computations in `scoring`, so lm-eval's
task configs, prompts, metrics and aggregation run unchanged ("default settings as in the paper") on a
Hugging Face folder or, once `load_megatron_lm` exists, on a megatron checkpoint without converting it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import LM

from megatron_jreg.evaluate.models import CausalLM
from megatron_jreg.evaluate.scoring import encode_pair, generate_greedy, rolling_windows, score

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generation tasks


def _generation_settings(gen_kwargs: dict[str, Any]) -> tuple[list[str], int]:
    """(stop strings, max new tokens) from a request's gen_kwargs; greedy decoding only. The end of
    document needs no stop string: generation stops at the `eod` token itself."""
    kwargs = dict(gen_kwargs)
    if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
        raise ValueError(
            f"generate_until: sampling was requested ({kwargs}); this adapter decodes greedily only"
        )
    until = kwargs.get("until")
    stop = [until] if isinstance(until, str) else list(until or [])
    for key in ("max_gen_toks", "max_new_tokens", "max_tokens"):
        if kwargs.get(key) is not None:
            return stop, int(kwargs[key])
    return stop, DEFAULT_MAX_GEN_TOKS


class HarnessLM(LM):
    """An lm-eval `LM` backed by a `CausalLM` (single process: every request is answered here)."""

    def __init__(self, model: CausalLM, batch_size: int = 8) -> None:
        super().__init__()
        self.model = model
        self.batch_size = batch_size

    @property
    def max_length(self) -> int:
        return self.model.max_length

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.model, *request.args) for request in requests]
        results = [(s.logprob, s.greedy) for s in score(self.model, pairs, self.batch_size)]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text: its bare tokens (no BOS of their own) conditioned on the
        prefix token, in disjoint windows of max_length predictions (lm-eval's definition)."""
        windows, owner = [], []
        for index, request in enumerate(requests):
            tokens = self.model.encode(request.args[0], special=False)
            for window in rolling_windows(tokens, self.model.prefix_token, self.model.max_length):
                windows.append(window)
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, scored in zip(owner, score(self.model, windows, self.batch_size)):
            totals[index] += scored.logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in requests:
            context, gen_kwargs = request.args
            stop, max_new = _generation_settings(gen_kwargs)
            text = generate_greedy(self.model, context, stop, max_new)
            self.cache_hook.add_partial("generate_until", request.args, text)
            outputs.append(text)
        return outputs


def run_harness(
    model: CausalLM,
    specs: Sequence[str | dict[str, Any]],
    manager,
    limit: int | None = None,
    batch_size: int = 8,
    bootstrap_iters: int = 100000,
    num_fewshot: int | None = None,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` on `model` (its seeds and metrics; each task's few-shot default
    unless `num_fewshot` is given); raw output."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=HarnessLM(model, batch_size),
        tasks=list(specs),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        bootstrap_iters=bootstrap_iters,
        log_samples=False,
    )
