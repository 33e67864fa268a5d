"""The one decoding loop (generate's answers, evaluate's generate_until), through the model's own KV cache; ours so
each question samples from its own seeded generator, whatever its batch (DEVELOPERS.md, evaluate)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_jreg.errors import JregError


class NonFiniteOutput(JregError, ValueError):
    """Logits holding NaN or ±inf: scored they give accuracy 0 and perplexity NaN, decoded an empty answer."""


def check_finite_logits(logits: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    if bool(torch.isfinite(logits).all()):
        return
    if dtype in (torch.float16, torch.bfloat16):
        fix = (f"its activations overflow {str(dtype).removeprefix('torch.')}: load it with --dtype float32"
               + (" or bfloat16 (float16 ends at ±65504)" if dtype == torch.float16 else ""))
    else:
        fix = "its activations overflow even in float32: the model is broken (analyze shows at which layer)"
    raise NonFiniteOutput(f"the model's logits are NaN/inf on {what}: {fix}; nothing computed from them would be "
                          "a number")


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


class Decoder:
    """A batch of sequences advanced together through a model's key/value cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        weight = next(model.parameters())
        self._device, self.dtype = weight.device, weight.dtype

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens[n, t]: the next t positions of every row → float32 logits[n, V'] at the last of them."""
        raise NotImplementedError


class HFDecoder(Decoder):
    """A Hugging Face causal LM with the cache it builds for itself on the first call (transformers' own)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers 5 / 4
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._cache = None

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=tokens.to(self._device), use_cache=True, **{self._cache_arg: self._cache},
                         **self._last_only)
        self._cache = out[self._cache_arg]  # by the name this transformers uses (the other one logs a deprecation)
        return out.logits[:, -1].float().cpu()


class MegatronDecoder(Decoder):
    """A megatron-core GPTModel with its static-batching KV cache; only the last position's logits are computed."""

    def __init__(self, model: torch.nn.Module, batch: int, length: int) -> None:
        from megatron.core.inference.contexts import StaticInferenceContext

        super().__init__(model)
        self.context = StaticInferenceContext(batch, length)

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        from megatron.core.inference.utils import InferenceMode

        start, t = self.context.sequence_len_offset, tokens.shape[1]
        positions = torch.arange(start, start + t, device=self._device).unsqueeze(0).expand(tokens.shape[0], t)
        with InferenceMode.active():  # megatron-core's inference path: the last position's logits only
            out = self.model(tokens.to(self._device), positions, None, inference_context=self.context,
                             runtime_gather_output=True)
        self.context.sequence_len_offset += t
        return out[:, -1].float().cpu()


def complete(open_decoder: Callable[[int, int], Decoder], prompts: list[list[int]], *, max_new_tokens: int, window: int,
             vocab_size: int, stop_ids: set[int], sampling: Sampling = Sampling(),
             generators: list[torch.Generator | None] | None = None,
             stopped: Callable[[int, list[int]], bool] | None = None, pad_id: int = 0) -> list[Completion]:
    """Continue every prompt until a stop id, `max_new_tokens`, a full `window` or `stopped(row, generated_ids)`;
    non-finite logits raise NonFiniteOutput (decoded, they would end answers silently)."""
    out = [Completion([], "length") for _ in prompts]
    generators = generators or [None] * len(prompts)
    batch = [i for i, p in enumerate(prompts) if len(p) < window]
    for i in set(range(len(prompts))) - set(batch):
        out[i].finish = "window"
    if not batch or max_new_tokens < 1:
        return out
    length = max(min(len(prompts[i]) + max_new_tokens, window) for i in batch)
    decoder = open_decoder(len(batch), length)
    pos = min(len(prompts[i]) for i in batch)  # the position the logits predict, in every row
    logits = decoder.extend(torch.tensor([prompts[i][:pos] for i in batch], dtype=torch.int64))
    running = set(batch)
    while running:
        generating = [k for k, i in enumerate(batch) if i in running and pos >= len(prompts[i])]
        scores = logits[generating, :vocab_size]
        check_finite_logits(scores, getattr(decoder, "dtype", torch.float32), f"position {pos} of an answer")
        chosen = dict(zip(generating, next_tokens(scores, sampling, [generators[batch[k]] for k in generating])))
        feed = []
        for k, i in enumerate(batch):
            token = prompts[i][pos] if i in running and pos < len(prompts[i]) else chosen.get(k, pad_id)
            if k in chosen:
                if token in stop_ids:
                    out[i].finish, token = "stop", pad_id
                else:
                    out[i].ids.append(token)
                    if stopped is not None and stopped(i, out[i].ids):
                        out[i].finish = "stop"
                    elif len(prompts[i]) + len(out[i].ids) >= window:
                        out[i].finish = "window"
                    elif len(out[i].ids) < max_new_tokens:
                        feed.append(token)
                        continue
                running.discard(i)
            feed.append(token)
        if running:
            logits = decoder.extend(torch.tensor(feed, dtype=torch.int64).unsqueeze(1))
            pos += 1
    return out
