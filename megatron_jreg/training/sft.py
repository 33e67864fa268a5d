"""Supervised fine-tuning (`--sft`) on Megatron-LM's SFTDataset, with what megatron-jreg adds to it.

Megatron-LM's `--sft` packs whole conversations into each sequence (cu_seqlens boundaries, positions
restarting per conversation, padding at the end) and tokenizes them with its `SFTTokenizer`. Three gaps
for the paper's SFT (loss on assistant tokens, JREG on the real tokens, a CPU run):

- With `--sft-tokenizer-prompt-format default` (the tokenizer's own chat template) Megatron-LM's
  SFTTokenizer puts the loss on *every* token; `install_chat_targets` wraps the run's tokenizer in
  `ChatTargets` (data/chat_targets.py), so that only the assistant turns are targets.
- Ψ must average over real tokens only: `real_token_mask` marks everything but the end-of-pack padding.
- Megatron-LM's packed sequences need Transformer Engine's THD attention; the local spec's attention
  refuses them. `packed_attention_mask` gives the same attention as a block-diagonal causal mask (each
  conversation sees only itself, as with THD), which the local spec takes.
"""

from __future__ import annotations

import torch

from megatron_jreg.data.chat_targets import ChatTargets

CHAT_TARGETS = "megatron.training.global_vars._GLOBAL_TOKENIZER"  # a row of megatron_jreg.patches.PATCHES


def chat_targets(tokenizer):  # noqa: ANN001, ANN201 - Megatron-LM's tokenizer object
    """The maker for CHAT_TARGETS: Megatron-LM's global tokenizer (built) → `ChatTargets` around it."""
    return tokenizer if isinstance(tokenizer, ChatTargets) else ChatTargets(tokenizer)


def install_chat_targets() -> None:
    """Replace Megatron-LM's global tokenizer by `ChatTargets` around it (after it was built), until Megatron-LM's
    global state is torn down (training.run.teardown); a run applies it through training.run.training_patches."""
    from megatron_jreg import patches

    patches.apply({CHAT_TARGETS: chat_targets})


def real_token_mask(tokens: torch.Tensor, pad: int) -> torch.Tensor:
    """tokens[b, s] → bool [b, s], False on the padding that ends a pack (Megatron-LM's SFTDataset pads
    after the last conversation with the tokenizer's pad id)."""
    is_pad = tokens == pad
    # trailing run of pads: positions from which every token to the end is padding
    trailing = torch.flip(torch.cumprod(torch.flip(is_pad, dims=[1]).to(torch.int64), dim=1), dims=[1]).bool()
    return ~trailing


def packed_attention_mask(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """cu_seqlens[n + 1] (conversation boundaries of one flattened pack) → attention mask [1, 1, s, s],
    True where attention is *not* allowed: causal within each conversation, nothing across them."""
    bounds = cu_seqlens.to(torch.int64).tolist()
    segment = torch.zeros(seq_length, dtype=torch.int64, device=cu_seqlens.device)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        segment[lo:hi] = i
    if bounds[-1] < seq_length:
        segment[bounds[-1]:] = len(bounds)
    same = segment[:, None] == segment[None, :]
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=cu_seqlens.device).tril()
    return ~(same & causal)[None, None]
