"""Jump analysis of existing models (the paper's Section 3): Ψ_ℓ per decoder layer and jump rates ζ_ℓ.

Layout: `source.py` (the hidden-state source protocol and the layer hooks), `hf_source.py` (Hugging
Face folders and GGUF files, the latter audited by `gguf_model.py`), `stream_source.py` (safetensors
folders one decoder layer at a time) over `weights.py` (tensors read from safetensors shards),
`megatron_source.py` (megatron-jreg checkpoints), `config.py` (settings, data and model lists),
`measure.py` (batching and exact accumulation), `memory.py` (peak memory), `report.py` and `plot.py`
(outputs), `run.py` (one run), `cli.py` (`megatron-jreg analyze`). The math is `megatron_jreg.jreg`; hub
ids and complete loads are `megatron_jreg.hub`.
"""
