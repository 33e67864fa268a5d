"""Jump analysis of existing models (the paper's Section 3): Ψ_ℓ per decoder layer and jump rates ζ_ℓ, with the
layer-redundancy views beside them: layer removal, the distance between any two layers, residual norms.

Layout, each module importing only the ones listed after it: `cli.py` (`megatron-jreg analyze`), `run.py` (one
run), `config.py` (settings and data), `report.py` (table, reading, JSON, CSV, PNGs), `measure.py`
(batching, exact accumulation, peak memory), `removal.py` (layer removal; `layer_removal` is its library entry on
token windows), `loading.py` (what a `--model` is, whether it streams, and its source), the sources:
`stream_source.py` (safetensors folders one decoder layer at a time), `hf_source.py` (Hugging Face folders and
GGUF files, the latter audited by `gguf_model.py`), `megatron_source.py` (megatron-jreg checkpoints), then
`source.py` (the source protocol and the layer hooks they share). The math is `megatron_jreg.jreg`; hub ids and
complete loads are `megatron_jreg.hub`, checked model files `megatron_jreg.model_files`.
"""
