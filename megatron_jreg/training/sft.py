"""--sft on Megatron-LM's SFTDataset, with the three things the paper's SFT needs beyond it: loss on assistant tokens
only, Ψ over real tokens only, and packed attention the local (CPU) spec takes."""

from __future__ import annotations

import json
from collections.abc import Iterable

import torch

from megatron_jreg.data.chat_targets import ChatTargets

CHAT_TARGETS = "megatron.training.global_vars._GLOBAL_TOKENIZER"  # a row of megatron_jreg.patches.PATCHES


def chat_targets(tokenizer):  # noqa: ANN001, ANN201 - Megatron-LM's tokenizer object
    return tokenizer if isinstance(tokenizer, ChatTargets) else ChatTargets(tokenizer)


def real_token_mask(tokens: torch.Tensor, pad: int) -> torch.Tensor:
    """tokens[b, s] → bool [b, s], False on the padding SFTDataset puts after a pack's last conversation."""
    is_pad = tokens == pad
    # trailing run of pads: positions from which every token to the end is padding
    trailing = torch.flip(torch.cumprod(torch.flip(is_pad, dims=[1]).to(torch.int64), dim=1), dims=[1]).bool()
    return ~trailing


def packed_attention_mask(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """cu_seqlens[n + 1] of one flattened pack → mask [1, 1, s, s], True where attention is *not* allowed."""
    bounds = cu_seqlens.to(torch.int64).tolist()
    segment = torch.zeros(seq_length, dtype=torch.int64, device=cu_seqlens.device)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        segment[lo:hi] = i
    if bounds[-1] < seq_length:
        segment[bounds[-1]:] = len(bounds)
    same = segment[:, None] == segment[None, :]
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=cu_seqlens.device).tril()
    return ~(same & causal)[None, None]


_ROLES = ("system", "user", "assistant")


def check_conversations(args, paths: Iterable[tuple[str, str]]) -> None:  # noqa: ANN001 - Megatron-LM's args
    """Every --sft JSONL file read as SFTDataset reads it, before any work: it would fail in a worker iterations later,
    or train nothing."""
    from megatron_jreg.errors import UsageError

    fix = "clean it with megatron-jreg prepare-chat (docs/sft.md)"
    for flag, path in paths:
        option = f"{flag} {path}"
        trainable, answered, lines = False, False, 0
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                lines += 1
                problem = _record_problem(raw)
                if problem is not None:
                    raise UsageError(f"{option}: line {number}: {problem}; {fix}")
                messages = json.loads(raw)["messages"]
                answered = answered or any(t["role"] == "assistant" and t["content"].strip() for t in messages)
                trainable = trainable or _trains(args, messages, f"{option}: line {number}")
        if not lines:
            raise UsageError(f"{option}: no conversation in the file; {fix}")
        if not answered:  # the loss would fall on the end-of-turn tokens alone: a model trained to answer nothing
            raise UsageError(f"{option}: every assistant answer in its {lines} conversation(s) is empty, so the run "
                             f"would train only the token that ends each turn; fill in the answers ({fix})")
        if not trainable:
            raise UsageError(f"{option}: no conversation gives a token to train on within --seq-length "
                             f"{args.seq_length} (no assistant turn, or every assistant turn is cut off by the "
                             "pack's length): raise --seq-length or shorten the conversations (prepare-chat "
                             "--seq-length reports them)")


def _record_problem(raw: bytes) -> str | None:
    try:
        record = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        return f"not JSON ({e})"
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        return "no non-empty `messages` list"
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
            return f"turn {i} is not an object with `role` and `content`"
        if turn["role"] not in _ROLES:
            return f"turn {i} has role {turn['role']!r} (SFTDataset knows {', '.join(_ROLES)})"
        if not isinstance(turn["content"], str):
            return f"turn {i} has a {type(turn['content']).__name__} content, not a string"
    return None


def _trains(args, messages: list[dict], where: str) -> bool:  # noqa: ANN001
    """Whether this line, packed by SFTDataset's own __getitem__, has a loss token."""
    import types

    import numpy as np
    from megatron.training import get_tokenizer
    from megatron.training.datasets.sft_dataset import SFTDataset

    from megatron_jreg.errors import UsageError

    tokenizer = get_tokenizer()
    if args.sft_tokenizer_prompt_format in ("default", "identity"):
        tokenizer = chat_targets(tokenizer)  # what the run trains with (training.run.training_patches)
    config = types.SimpleNamespace(tokenizer=tokenizer, sequence_length=args.seq_length,
                                   context_parallel_size=args.context_parallel_size, reset_position_ids=False,
                                   create_attention_mask=False, reset_attention_mask=False)
    pack = types.SimpleNamespace(dataset=[messages], indices=np.zeros(1, dtype=np.int64), config=config,
                                 _split_conversations=lambda m: SFTDataset._split_conversations(None, m))
    try:
        sample = SFTDataset.__getitem__(pack, 0)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise UsageError(f"{where}: the chat template cannot tokenize it ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:160]})") from None
    return bool(sample["loss_mask"].any())
