"""lm-evaluation-harness on any `CausalLM`: lm-eval's task configs, prompts, metrics and aggregation unchanged
("default settings as in the paper") on a Hugging Face folder or a megatron checkpoint without converting it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from lm_eval.api.model import TemplateLM

from megatron_jreg.evaluate.decoding import complete
from megatron_jreg.evaluate.models import CausalLM
from megatron_jreg.evaluate.scoring import score
from megatron_jreg.progress import progress_bar

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generation tasks


def _generation_settings(gen_kwargs: dict[str, Any]) -> tuple[list[str], int]:
    """(non-empty stop strings, max new tokens) from a request's gen_kwargs; greedy decoding only."""
    kwargs = dict(gen_kwargs)
    if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
        raise ValueError(f"generate_until: sampling was requested ({kwargs}); this adapter decodes greedily only")
    until = kwargs.get("until")
    stop = [s for s in ([until] if isinstance(until, str) else until or []) if s]
    keys = ("max_gen_toks", "max_new_tokens", "max_tokens")
    return stop, next((int(kwargs[k]) for k in keys if kwargs.get(k) is not None), DEFAULT_MAX_GEN_TOKS)


class HarnessLM(TemplateLM):
    """An lm-eval `TemplateLM` backed by a `CausalLM`: lm-eval tokenizes and cuts, `scoring.score` scores."""

    def __init__(self, model: CausalLM, batch_size: int = 8, progress: bool = True) -> None:
        super().__init__()
        self.model = model
        self.batch_size = batch_size
        self.progress = progress  # a bar per request type on stderr, as lm-eval's own models show (unless disabled)

    @property
    def max_length(self) -> int:
        return self.model.max_length

    @property
    def eot_token_id(self) -> int:
        return self.model.eod

    @property
    def prefix_token_id(self) -> int:
        return self.model.prefix_token

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.model.encode(string, special=add_special_tokens is not False)

    def _bar(self, total: int, kind: str, disable_tqdm: bool):  # noqa: ANN202 - a tqdm bar
        return progress_bar(total, f"lm-eval {kind}", "request", self.progress and not disable_tqdm)

    def _score(self, pairs: list, kind: str, disable_tqdm: bool) -> list:
        with self._bar(len(pairs), kind, disable_tqdm) as bar:
            return score(self.model, pairs, self.batch_size, bar.update)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        scored = self._score([(ctx, cont) for _, ctx, cont in requests], "loglikelihood", disable_tqdm)
        results = [(s.logprob, s.greedy) for s in scored]
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text in lm-eval's disjoint windows (as its HFLM cuts them)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for index, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0], add_special_tokens=False)
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, scored in zip(owner, self._score(windows, "loglikelihood_rolling", disable_tqdm)):
            totals[index] += scored.logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations through generate's KV-cache loop (decoding.complete), batched per max_gen_toks;
        a context keeps its last max_length - max_gen_toks tokens, so the generation always fits."""
        lm, settings = self.model, [_generation_settings(request.args[1]) for request in requests]
        groups: dict[int, list[int]] = {}
        for index, (_, max_new) in enumerate(settings):
            if max_new >= lm.max_length:
                raise ValueError(f"max_gen_toks {max_new} must be below the model's max_length {lm.max_length}")
            groups.setdefault(max_new, []).append(index)
        outputs = [""] * len(requests)
        with self._bar(len(requests), "generate_until", disable_tqdm) as bar:
            for max_new, indices in groups.items():
                for start in range(0, len(indices), self.batch_size):
                    batch = indices[start : start + self.batch_size]
                    stops = [settings[i][0] for i in batch]
                    prompts = [lm.encode(requests[i].args[0])[-(lm.max_length - max_new) :] or [lm.prefix_token]
                               for i in batch]
                    done = complete(lm.decoder, prompts, max_new_tokens=max_new,
                                    window=lm.max_length, vocab_size=lm.vocab_size, stop_ids={lm.eod},
                                    stopped=lambda row, ids: any(s in lm.decode(ids) for s in stops[row]),  # noqa: B023
                                    pad_id=lm.eod)
                    for i, row_stops, result in zip(batch, stops, done):
                        text = lm.decode(result.ids)
                        for s in row_stops:
                            text = text.split(s)[0]
                        outputs[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(batch))
        return outputs


@contextlib.contextmanager
def quiet_git_hash() -> Iterator[None]:
    """lm-eval's `git describe` prints "fatal: not a git repository" outside one; its .git/ fallback is silent."""
    from unittest import mock

    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    with mock.patch.object(evaluator, "get_git_commit_hash", lambda: get_commit_from_path(os.getcwd())):
        yield


def run_harness(model: CausalLM, specs: Sequence[str | dict[str, Any]], manager, limit: int | None = None,
                batch_size: int = 8, bootstrap_iters: int = 100000, num_fewshot: int | None = None,
                progress: bool = False) -> dict[str, Any]:
    import lm_eval

    with quiet_git_hash():
        return lm_eval.simple_evaluate(model=HarnessLM(model, batch_size, progress), tasks=list(specs),
                                       task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                       bootstrap_iters=bootstrap_iters, log_samples=False)
