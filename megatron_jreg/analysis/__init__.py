"""Jump analysis of existing models (the paper's Section 3): Ψ_ℓ per decoder layer and jump rates ζ_ℓ, with the
layer-redundancy views beside them: layer removal, the distance between any two layers, residual norms.

Layout, each module importing only the ones listed after it: `cli.py` (`megatron-jreg analyze`), `run.py` (one
run), `config.py` (settings, data and model lists), `plot.py` (PNGs) over `report.py` (table, reading, JSON,
CSV), `measure.py` (batching and exact accumulation), `removal.py` (layer removal; `layer_removal` is its library
entry on token windows), `loading.py` (what a path is, and its source), the sources: `stream_source.py`
(safetensors folders one decoder layer at a time, over `weights.py`), `hf_source.py` (Hugging Face folders and
GGUF files, the latter audited by `gguf_model.py`), `megatron_source.py` (megatron-jreg checkpoints), then
`memory.py` (peak memory) and `source.py` (the source protocol and the layer hooks they share). The math is
`megatron_jreg.jreg`; hub ids and complete loads are `megatron_jreg.hub`.
"""
