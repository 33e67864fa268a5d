"""Jump analysis of existing models (the paper's Section 3): Ψ_ℓ and ζ_ℓ per decoder layer, with layer removal,
layer-to-layer distances and residual norms beside them. Layout and design: DEVELOPERS.md."""
