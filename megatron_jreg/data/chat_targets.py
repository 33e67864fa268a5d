"""Targets on assistant tokens only, what `--sft` trains on and `prepare-chat` checks against: with the
tokenizer's own template (`--sft-tokenizer-prompt-format default`) Megatron-LM's SFTTokenizer targets every token.
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100  # Megatron-LM's SFTDataset masks targets equal to it


class ChatTargets:
    """Megatron-LM's tokenizer whose `tokenize_conversation` targets the tokens between each assistant turn's
    prompt (`add_generation_prompt=True`) and its end: any template that renders prefixes consistently."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001 - Megatron-LM's tokenizer object
        from transformers import PreTrainedTokenizerBase

        self._inner = self._hf = tokenizer
        for _ in range(4):  # the transformers tokenizer inside Megatron-LM's wrappers (text → SFT → transformers)
            if isinstance(self._hf, PreTrainedTokenizerBase):
                return
            self._hf = getattr(self._hf, "_tokenizer", None)
        raise ValueError("--sft: the tokenizer has no chat template support (use --tokenizer-type SFTTokenizer "
                         "with a Hugging Face tokenizer folder)")

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the wrapped tokenizer's
        return getattr(self._inner, name)

    def _render(self, conversation: list[dict], generation_prompt: bool) -> list[int]:
        ids = self._hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def tokenize_conversation(self, conversation: list[dict], return_target: bool, add_generation_prompt: bool):
        """(tokens, targets) as np arrays: targets are the tokens on assistant turns, IGNORE_INDEX elsewhere."""
        tokens = np.array(self._render(conversation, add_generation_prompt), dtype=np.int64)
        if not return_target:
            return tokens
        target = np.full_like(tokens, IGNORE_INDEX)
        for k, turn in enumerate(conversation):
            if turn["role"] != "assistant":
                continue
            start = len(self._render(conversation[:k], True))
            rendered = self._render(conversation[: k + 1], False)
            end = len(rendered)
            if start > end or rendered != list(tokens[:end]):
                raise ValueError("--sft: the chat template does not render conversation prefixes consistently; "
                                 "use a template whose turns are appended in order")
            target[start:end] = tokens[start:end]
        return tokens, target
