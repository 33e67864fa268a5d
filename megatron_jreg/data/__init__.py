"""Data: inputs -> megatron-core indexed datasets byte-identical to Megatron-LM's, tokenizers, chat data
(which module owns what: docs/data.md, "Code layout").
"""
