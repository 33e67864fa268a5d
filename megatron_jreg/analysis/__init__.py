"""Jump analysis of existing models (the paper's Section 3): Ψ_ℓ per decoder layer and jump rates ζ_ℓ, with the
layer-redundancy views beside them: layer removal, the distance between any two layers, residual norms.

Layout: `source.py` (the hidden-state source protocol and the layer hooks), `hf_source.py` (Hugging
Face folders and GGUF files, the latter audited by `gguf_model.py`), `stream_source.py` (safetensors
folders one decoder layer at a time) over `weights.py` (tensors read from safetensors shards),
`megatron_source.py` (megatron-jreg checkpoints), `config.py` (settings, data and model lists),
`measure.py` (batching and exact accumulation), `removal.py` (layer removal; `layer_removal` is its library
entry on token windows), `memory.py` (peak memory), `report.py` (table, reading, JSON, CSV) and `plot.py`
(PNGs), `run.py` (one run), `cli.py` (`megatron-jreg analyze`). The math is `megatron_jreg.jreg`; hub
ids and complete loads are `megatron_jreg.hub`.
"""
