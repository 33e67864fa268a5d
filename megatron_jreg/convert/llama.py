"""The Llama architecture on both sides: megatron-core's GPTModel (local spec, TP=1/PP=1 state dict) and
Hugging Face's `LlamaForCausalLM`. Torch only: no megatron-core or transformers import.

Parameter correspondence (L layers; h hidden; n heads and g query groups of d = h/n; f FFN width;
V true vocabulary, Vp = V padded for TP):

    megatron                                          Hugging Face
    embedding.word_embeddings.weight [Vp, h]          model.embed_tokens.weight [V, h]
    decoder.layers.i.input_layernorm.weight [h]       model.layers.i.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.weight model.layers.i.self_attn.{q,k,v}_proj.weight
        [g·(n/g + 2)·d, h]: per group, its n/g query heads, then one key and one value head
    decoder.layers.i.self_attention.linear_proj.weight model.layers.i.self_attn.o_proj.weight [h, n·d]
    decoder.layers.i.pre_mlp_layernorm.weight [h]     model.layers.i.post_attention_layernorm.weight
    decoder.layers.i.mlp.linear_fc1.weight [2f, h]    model.layers.i.mlp.{gate,up}_proj.weight ([gate; up])
    decoder.layers.i.mlp.linear_fc2.weight [h, f]     model.layers.i.mlp.down_proj.weight
    decoder.final_layernorm.weight [h]                model.norm.weight
    output_layer.weight [Vp, h] (absent when tied)    lm_head.weight [V, h] (absent when tied)

RoPE needs no permutation: megatron's non-interleaved rotary embedding rotates halves (`rotate_half`),
as Hugging Face's Llama does on its (already permuted) q/k weights. Both scale attention by 1/sqrt(d) and
compute the RMSNorm as x / sqrt(mean(x²) + eps) · weight.
"""

from __future__ import annotations

import torch

from megatron_jreg.config import ModelConfig


class UnsupportedModel(ValueError):
    """An architecture this converter does not map exactly; the message names the mismatch."""


# Hugging Face model types whose blocks differ from Llama's, with what differs.
_OTHER_ARCHITECTURES = {
    "mixtral": "mixture-of-experts MLP (MoE)",
    "qwen2_moe": "mixture-of-experts MLP (MoE)",
    "qwen3_moe": "mixture-of-experts MLP (MoE)",
    "deepseek_v2": "mixture-of-experts MLP (MoE) and multi-latent attention",
    "deepseek_v3": "mixture-of-experts MLP (MoE) and multi-latent attention",
    "gemma": "a different norm: RMSNorm scaled by (1 + weight), and GELU-gated MLP",
    "gemma2": "a different norm: RMSNorm scaled by (1 + weight), extra post-norms, sliding window",
    "gemma3": "a different norm: RMSNorm scaled by (1 + weight), QK-norm, sliding window",
    "olmo": "a different norm: LayerNorm without weights",
    "olmo2": "a different norm placement (post-norms) and QK-norm",
    "stablelm": "a different norm: LayerNorm with bias",
    "phi": "a different norm: LayerNorm with bias, parallel attention/MLP, biases",
    "gpt_neox": "a different norm: LayerNorm with bias, biases",
    "falcon": "a different norm: LayerNorm with bias",
    "cohere": "a different norm: LayerNorm",
    "qwen2": "biases on the q/k/v projections",
    "qwen3": "QK-norm (RMSNorm on queries and keys)",
}
_SUPPORTED_TYPES = ("llama", "mistral")


def rope_settings(hf: dict) -> tuple[float, str, dict | None]:
    """(rope θ, rope type, scaling dict) from either config.json format: transformers >= 5 writes
    `rope_parameters`, older versions `rope_theta` (+ `rope_scaling`)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    return float(theta), rope_type, scaling


def head_dim_of(hf: dict) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def check_hf_config(hf: dict) -> None:
    """Refuse, naming the mismatch, any Hugging Face config the Llama mapping would convert wrongly."""
    model_type = hf.get("model_type")
    where = f"config.json (model_type {model_type!r})"
    if model_type in _OTHER_ARCHITECTURES:
        raise UnsupportedModel(f"{where}: {_OTHER_ARCHITECTURES[model_type]}; only Llama-architecture models convert")
    if any(hf.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")):
        raise UnsupportedModel(f"{where}: mixture-of-experts (MoE) layers; megatron-jreg builds dense Llama models")
    if model_type not in _SUPPORTED_TYPES:
        raise UnsupportedModel(
            f"{where}: not a Llama-architecture model; supported: {', '.join(_SUPPORTED_TYPES)} "
            "(LlamaForCausalLM; Mistral without sliding window)"
        )
    biased = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)]
    if biased:
        raise UnsupportedModel(
            f"{where}: {' and '.join(biased)} = true (linear layers with biases); megatron-jreg models have "
            "no biases (--disable-bias-linear)"
        )
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise UnsupportedModel(
            f"{where}: sliding_window = {hf['sliding_window']} (sliding-window attention); megatron-jreg "
            "attends over the whole sequence"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{where}: hidden_act {hf['hidden_act']!r}; the SwiGLU MLP needs silu")
    _, rope_type, scaling = rope_settings(hf)
    if rope_type != "default" or scaling:
        raise UnsupportedModel(
            f"{where}: RoPE scaling {rope_type!r}; megatron-jreg's ModelConfig has plain RoPE (--rotary-base) only"
        )
    head_dim = head_dim_of(hf)
    if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise UnsupportedModel(
            f"{where}: head_dim {head_dim} != hidden_size / num_attention_heads = "
            f"{hf['hidden_size']} / {hf['num_attention_heads']}; megatron would need --kv-channels, which "
            "megatron-jreg's ModelConfig does not have"
        )
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % groups:
        raise UnsupportedModel(f"{where}: num_attention_heads {heads} not divisible by num_key_value_heads {groups}")


def check_megatron_config(model: ModelConfig) -> None:
    """Refuse, naming the mismatch, a megatron-jreg model that LlamaForCausalLM cannot represent."""
    problems = []
    if model.normalization != "RMSNorm":
        problems.append(f"--normalization {model.normalization} (LlamaForCausalLM has RMSNorm)")
    if not model.disable_bias_linear:
        problems.append("linear layers with biases (trained without --disable-bias-linear)")
    if not model.swiglu:
        problems.append("a GELU MLP (trained without --swiglu)")
    if model.position_embedding_type != "rope":
        problems.append(f"--position-embedding-type {model.position_embedding_type} (Llama uses RoPE)")
    if problems:
        raise UnsupportedModel(
            f"this checkpoint's model has {'; '.join(problems)}: it is not a Llama architecture, so no "
            "Hugging Face LlamaForCausalLM can reproduce it"
        )


def model_config_from_hf(hf: dict, seq_length: int | None = None) -> ModelConfig:
    """The megatron-jreg ModelConfig of a (checked) Llama config.json; seq_length defaults to
    max_position_embeddings."""
    check_hf_config(hf)
    theta, _, _ = rope_settings(hf)
    max_pos = int(hf.get("max_position_embeddings", 2048))
    heads = int(hf["num_attention_heads"])
    return ModelConfig(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        seq_length=int(seq_length or max_pos),
        max_position_embeddings=max_pos,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,  # type: ignore[arg-type]
        normalization="RMSNorm",
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        vocab_size=int(hf["vocab_size"]),
    )


def hf_config_kwargs(model: ModelConfig, bos: int | None, eos: int | None, pad: int | None) -> dict:
    """`LlamaConfig(**kwargs)` for a (checked) megatron-jreg model; the vocabulary is the true size."""
    check_megatron_config(model)
    return dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(model.vocab_size),
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups or model.num_attention_heads,
        head_dim=model.hidden_size // model.num_attention_heads,
        hidden_act="silu",
        max_position_embeddings=model.max_position_embeddings,
        initializer_range=model.init_method_std,
        rms_norm_eps=model.norm_epsilon,
        rope_theta=float(model.rotary_base),
        tie_word_embeddings=not model.untie_embeddings_and_output_weights,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def num_parameters(model: ModelConfig) -> int:
    """Parameter count of the model (true vocabulary), to size the verification's memory."""
    h, f, layers = model.hidden_size, model.ffn_hidden_size, model.num_layers
    d = h // model.num_attention_heads
    groups = model.num_query_groups or model.num_attention_heads
    attention = h * (model.num_attention_heads * d + 2 * groups * d) + model.num_attention_heads * d * h
    per_layer = attention + 3 * h * f + 2 * h
    embeddings = int(model.vocab_size) * h * (2 if model.untie_embeddings_and_output_weights else 1)
    return embeddings + layers * per_layer + h


def _attention_shape(model: ModelConfig) -> tuple[int, int, int, int]:
    """(query groups g, query heads per group r, head dim d, hidden h)."""
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    return groups, heads // groups, model.hidden_size // heads, model.hidden_size


def split_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused qkv[g·(r+2)·d, h] → q[g·r·d, h], k[g·d, h], v[g·d, h] (copies)."""
    g, r, d, h = _attention_shape(model)
    w = qkv.reshape(g, r + 2, d, h)
    q, k, v = w[:, :r].reshape(g * r * d, h), w[:, r].reshape(g * d, h), w[:, r + 1].reshape(g * d, h)
    return q.clone(), k.clone(), v.clone()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Inverse of `split_qkv`: q[g·r·d, h], k[g·d, h], v[g·d, h] → qkv[g·(r+2)·d, h]."""
    g, r, d, h = _attention_shape(model)
    parts = [q.reshape(g, r, d, h), k.reshape(g, 1, d, h), v.reshape(g, 1, d, h)]
    return torch.cat(parts, dim=1).reshape(g * (r + 2) * d, h)


def _layer_names(i: int) -> dict[str, str]:
    """One layer's megatron → Hugging Face names for the tensors that map one to one."""
    m, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    return {
        m + "input_layernorm.weight": hf + "input_layernorm.weight",
        m + "self_attention.linear_proj.weight": hf + "self_attn.o_proj.weight",
        m + "pre_mlp_layernorm.weight": hf + "post_attention_layernorm.weight",
        m + "mlp.linear_fc2.weight": hf + "mlp.down_proj.weight",
    }


def megatron_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """A TP=1/PP=1 GPTModel state dict → LlamaForCausalLM tensors (same dtype; vocabulary padding cut).

    Every megatron tensor must be used exactly once: a leftover (an architecture feature this mapping
    does not know) raises instead of being dropped.
    """
    check_megatron_config(model)
    left = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    vocab, ffn = int(model.vocab_size), model.ffn_hidden_size

    def take(name: str) -> torch.Tensor:
        if name not in left:
            raise UnsupportedModel(f"megatron state dict has no {name}: not a megatron-jreg Llama model")
        return left.pop(name)

    out = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")[:vocab].clone()}
    for i in range(model.num_layers):
        for m_name, hf_name in _layer_names(i).items():
            out[hf_name] = take(m_name)
        prefix = f"model.layers.{i}."
        q, k, v = split_qkv(take(f"decoder.layers.{i}.self_attention.linear_qkv.weight"), model)
        out[prefix + "self_attn.q_proj.weight"], out[prefix + "self_attn.k_proj.weight"] = q, k
        out[prefix + "self_attn.v_proj.weight"] = v
        fc1 = take(f"decoder.layers.{i}.mlp.linear_fc1.weight")
        out[prefix + "mlp.gate_proj.weight"] = fc1[:ffn].clone()
        out[prefix + "mlp.up_proj.weight"] = fc1[ffn:].clone()
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = take("output_layer.weight")[:vocab].clone()
    if left:
        raise UnsupportedModel(
            f"megatron parameters with no Llama counterpart: {', '.join(sorted(left)[:5])}; refusing to drop them"
        )
    return {k: v.contiguous() for k, v in out.items()}


def _leftover_reason(name: str) -> str:
    if name.endswith(".bias"):
        return "biases"
    if "q_norm" in name or "k_norm" in name:
        return "QK-norm"
    if "expert" in name or "router" in name or ".gate.weight" in name:
        return "mixture-of-experts (MoE) layers"
    return "tensors with no megatron counterpart"


def hf_to_megatron(
    state: dict[str, torch.Tensor], model: ModelConfig, padded_vocab_size: int
) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM tensors → a TP=1/PP=1 GPTModel state dict (same dtype; vocabulary zero-padded to
    `padded_vocab_size` rows). Every Hugging Face tensor must be used: leftovers (biases, QK-norm,
    experts, ...) raise, naming them."""
    left = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # old checkpoints' buffers
    vocab = int(model.vocab_size)

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in left:
            raise UnsupportedModel(f"the Hugging Face checkpoint has no {name}: not a complete Llama checkpoint")
        tensor = left.pop(name)
        if tuple(tensor.shape) != shape:
            raise UnsupportedModel(f"{name} has shape {tuple(tensor.shape)}; config.json implies {shape}")
        return tensor

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(padded_vocab_size - vocab, t.shape[1])]) if padded_vocab_size > vocab else t

    g, r, d, h = _attention_shape(model)
    f = model.ffn_hidden_size
    embed = take("model.embed_tokens.weight", (vocab, h))
    out = {"embedding.word_embeddings.weight": pad(embed)}
    for i in range(model.num_layers):
        hf = f"model.layers.{i}."
        shapes = {"input_layernorm.weight": (h,), "self_attn.o_proj.weight": (h, g * r * d),
                  "post_attention_layernorm.weight": (h,), "mlp.down_proj.weight": (h, f)}
        for m_name, hf_name in _layer_names(i).items():
            out[m_name] = take(hf_name, shapes[hf_name[len(hf):]])
        q = take(hf + "self_attn.q_proj.weight", (g * r * d, h))
        k = take(hf + "self_attn.k_proj.weight", (g * d, h))
        v = take(hf + "self_attn.v_proj.weight", (g * d, h))
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, model)
        gate, up = take(hf + "mlp.gate_proj.weight", (f, h)), take(hf + "mlp.up_proj.weight", (f, h))
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.cat([gate, up])
    out["decoder.final_layernorm.weight"] = take("model.norm.weight", (h,))
    if model.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = pad(take("lm_head.weight", (vocab, h)))
    elif "lm_head.weight" in left:  # some tied checkpoints store the shared matrix twice
        if not torch.equal(left.pop("lm_head.weight"), embed):
            raise UnsupportedModel("tie_word_embeddings is true but lm_head.weight differs from embed_tokens")
    if left:
        names = sorted(left)
        raise UnsupportedModel(
            f"Hugging Face tensors with no counterpart in a megatron-jreg Llama ({_leftover_reason(names[0])}): "
            f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        )
    return out

