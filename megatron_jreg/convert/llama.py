"""The Llama architecture on both sides (megatron-core's GPTModel, Hugging Face's LlamaForCausalLM) and the exact
tensor mapping between them, refusing what either side cannot represent; torch only (DEVELOPERS.md, convert)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from megatron_jreg.errors import JregError


class UnsupportedModel(JregError, ValueError):
    """An architecture this converter does not map exactly; the message names the mismatch."""


# Hugging Face model types whose blocks differ from Llama's, with what differs.
_OTHER_ARCHITECTURES = {
    **dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe"), "mixture-of-experts MLP (MoE)"),
    **dict.fromkeys(("deepseek_v2", "deepseek_v3"), "mixture-of-experts MLP (MoE) and multi-latent attention"),
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


_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass
class LlamaArch:
    """What a megatron-core GPTModel and a LlamaForCausalLM must share to compute the same logits."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # the true vocabulary (rows of the HF embedding)
    max_position_embeddings: int
    seq_length: int
    rotary_base: float
    norm_epsilon: float
    untie_embeddings_and_output_weights: bool
    init_method_std: float = 0.02
    rope_scaling_factor: float | None = None  # Llama-3.1-style scaling when set
    layernorm_scaling: bool = False  # trained with --layernorm-scaling: folded into the exported norm weights

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(query groups g, query heads per group r, head dim d, hidden h)."""
        g = self.num_query_groups
        return g, self.num_attention_heads // g, self.head_dim, self.hidden_size

    @classmethod
    def from_hf(cls, hf: dict, seq_length: int | None = None) -> LlamaArch:
        check_hf_config(hf)
        theta, _, scaling = rope_settings(hf)
        max_pos = int(hf.get("max_position_embeddings", 2048))
        heads = int(hf["num_attention_heads"])
        return cls(num_layers=int(hf["num_hidden_layers"]), hidden_size=int(hf["hidden_size"]),
                   ffn_hidden_size=int(hf["intermediate_size"]), num_attention_heads=heads,
                   num_query_groups=int(hf.get("num_key_value_heads") or heads),
                   head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads), vocab_size=int(hf["vocab_size"]),
                   max_position_embeddings=max_pos, seq_length=int(seq_length or max_pos), rotary_base=theta,
                   norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
                   untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                   init_method_std=float(hf.get("initializer_range", 0.02)),
                   rope_scaling_factor=float(scaling["factor"]) if scaling else None)

    @classmethod
    def from_args(cls, args: argparse.Namespace, vocab_size: int) -> LlamaArch:
        check_megatron_args(args)
        heads = int(args.num_attention_heads)
        groups = int(args.num_query_groups) if args.group_query_attention and args.num_query_groups else heads
        return cls(num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
                   ffn_hidden_size=int(args.ffn_hidden_size), num_attention_heads=heads, num_query_groups=groups,
                   head_dim=int(args.kv_channels or args.hidden_size // heads), vocab_size=int(vocab_size),
                   max_position_embeddings=int(args.max_position_embeddings), seq_length=int(args.seq_length),
                   rotary_base=float(args.rotary_base), norm_epsilon=float(args.layernorm_epsilon),
                   untie_embeddings_and_output_weights=bool(args.untie_embeddings_and_output_weights),
                   init_method_std=float(args.init_method_std),
                   rope_scaling_factor=float(args.rope_scaling_factor) if args.use_rope_scaling else None,
                   layernorm_scaling=bool(getattr(args, "layernorm_scaling", False)))

    def megatron_flags(self) -> list[str]:
        base = int(self.rotary_base) if float(self.rotary_base).is_integer() else self.rotary_base
        flags = ["--num-layers", self.num_layers, "--hidden-size", self.hidden_size, "--ffn-hidden-size",
                 self.ffn_hidden_size, "--num-attention-heads", self.num_attention_heads, "--group-query-attention",
                 "--num-query-groups", self.num_query_groups, "--kv-channels", self.head_dim, "--seq-length",
                 self.seq_length, "--max-position-embeddings", self.max_position_embeddings,
                 "--position-embedding-type", "rope", "--rotary-base", base, "--normalization", "RMSNorm",
                 "--norm-epsilon", self.norm_epsilon, "--swiglu", "--disable-bias-linear", "--init-method-std",
                 self.init_method_std, "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
        if self.untie_embeddings_and_output_weights:
            flags.append("--untie-embeddings-and-output-weights")
        if self.rope_scaling_factor is not None:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", self.rope_scaling_factor]
        return [str(f) for f in flags]

    def hf_config_kwargs(self, bos: int | None, eos: int | None, pad: int | None) -> dict:
        """`LlamaConfig(**kwargs)`, RoPE written both ways readers look for it (transformers 4.x and 5)."""
        rope: dict = {"rope_type": "default", "rope_theta": float(self.rotary_base)}
        scaling = None
        if self.rope_scaling_factor is not None:
            scaling = {"rope_type": "llama3", "factor": self.rope_scaling_factor, **_LLAMA3_ROPE}
            rope = {**scaling, "rope_theta": float(self.rotary_base)}
        return dict(architectures=["LlamaForCausalLM"], vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                    intermediate_size=self.ffn_hidden_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_query_groups,
                    head_dim=self.head_dim, hidden_act="silu", max_position_embeddings=self.max_position_embeddings,
                    initializer_range=self.init_method_std, rms_norm_eps=self.norm_epsilon,
                    rope_theta=float(self.rotary_base), rope_scaling=scaling, rope_parameters=rope,
                    tie_word_embeddings=not self.untie_embeddings_and_output_weights, attention_bias=False,
                    mlp_bias=False, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)

    def num_parameters(self) -> int:
        h, f, n, g, d = self.hidden_size, self.ffn_hidden_size, self.num_attention_heads, self.num_query_groups, \
            self.head_dim
        per_layer = h * (n * d + 2 * g * d) + n * d * h + 3 * h * f + 2 * h
        embeddings = self.vocab_size * h * (2 if self.untie_embeddings_and_output_weights else 1)
        return embeddings + self.num_layers * per_layer + h


def rope_settings(hf: dict) -> tuple[float, str, dict | None]:
    """(rope θ, rope type, llama3 scaling dict or None) from either transformers' config.json format."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or None
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "llama3":
        scaling = {**(scaling or {}), **{k: v for k, v in params.items() if k != "rope_theta"}}
    elif rope_type == "default":
        scaling = None
    return float(theta), rope_type, scaling


def check_hf_config(hf: dict) -> None:
    model_type = hf.get("model_type")
    where = f"config.json (model_type {model_type!r})"
    if model_type in _OTHER_ARCHITECTURES:
        raise UnsupportedModel(f"{where}: {_OTHER_ARCHITECTURES[model_type]}; only Llama-architecture models convert")
    if any(hf.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")):
        raise UnsupportedModel(f"{where}: mixture-of-experts (MoE) layers; megatron-jreg builds dense Llama models")
    if model_type not in _SUPPORTED_TYPES:
        raise UnsupportedModel(f"{where}: not a Llama-architecture model; supported: {', '.join(_SUPPORTED_TYPES)} "
                               "(LlamaForCausalLM; Mistral without sliding window)")
    biased = [k for k in ("attention_bias", "mlp_bias") if hf.get(k)]
    if biased:
        raise UnsupportedModel(f"{where}: {' and '.join(biased)} = true (linear layers with biases); the Llama mapping "
                               "has none (--disable-bias-linear)")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise UnsupportedModel(f"{where}: sliding_window = {hf['sliding_window']} (sliding-window attention); the "
                               "model would attend over the whole sequence")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"{where}: hidden_act {hf['hidden_act']!r}; the SwiGLU MLP needs silu")
    _, rope_type, scaling = rope_settings(hf)
    if rope_type not in ("default", "llama3"):
        raise UnsupportedModel(f"{where}: RoPE scaling {rope_type!r}; megatron-core implements plain RoPE and "
                               f"Llama-3.1's 'llama3' scaling (--use-rope-scaling) only")
    if rope_type == "llama3":
        odd = {k: scaling.get(k) for k, v in _LLAMA3_ROPE.items() if float(scaling.get(k, v)) != v}
        if odd or "factor" not in scaling:
            raise UnsupportedModel(f"{where}: llama3 RoPE scaling with {odd or 'no factor'}; megatron-core's "
                                   "--use-rope-scaling fixes low_freq_factor 1, high_freq_factor 4 and "
                                   "original_max_position_embeddings 8192 (Llama-3.1/3.2's)")
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % groups:
        raise UnsupportedModel(f"{where}: num_attention_heads {heads} not divisible by num_key_value_heads {groups}")


def check_megatron_args(args: argparse.Namespace) -> None:
    rotary, experts = getattr(args, "rotary_percent", 1.0), getattr(args, "num_experts", None)
    problems = [text for on, text in (
        (args.normalization != "RMSNorm", f"--normalization {args.normalization} (LlamaForCausalLM has RMSNorm)"),
        (getattr(args, "apply_layernorm_1p", False), "--apply-layernorm-1p (zero-centered norm weights)"),
        (args.add_bias_linear or getattr(args, "add_qkv_bias", False),
         "linear layers with biases (trained without --disable-bias-linear)"),
        (not args.swiglu, "a GELU MLP (trained without --swiglu)"),
        (args.position_embedding_type != "rope" or float(rotary) != 1.0,
         f"--position-embedding-type {args.position_embedding_type} --rotary-percent {rotary} (Llama rotates all "
         "dimensions)"),
        (getattr(args, "rotary_interleaved", False), "--rotary-interleaved"),
        (getattr(args, "qk_layernorm", False), "--qk-layernorm"),
        (experts, f"--num-experts {experts} (MoE)"),
        (getattr(args, "multi_latent_attention", False), "--multi-latent-attention"),
        (getattr(args, "mtp_num_layers", None), "--mtp-num-layers (multi-token prediction)"),
    ) if on]
    if problems:
        raise UnsupportedModel(f"this checkpoint's model has {'; '.join(problems)}: it is not a Llama architecture, so "
                               "no Hugging Face LlamaForCausalLM can reproduce it")


def split_qkv(qkv: torch.Tensor, arch: LlamaArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused qkv[g·(r+2)·d, h] → q[g·r·d, h], k[g·d, h], v[g·d, h] (copies)."""
    g, r, d, h = arch.shape
    w = qkv.reshape(g, r + 2, d, h)
    q, k, v = w[:, :r].reshape(g * r * d, h), w[:, r].reshape(g * d, h), w[:, r + 1].reshape(g * d, h)
    return q.clone(), k.clone(), v.clone()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: LlamaArch) -> torch.Tensor:
    """Inverse of `split_qkv`: q[g·r·d, h], k[g·d, h], v[g·d, h] → qkv[g·(r+2)·d, h]."""
    g, r, d, h = arch.shape
    parts = [q.reshape(g, r, d, h), k.reshape(g, 1, d, h), v.reshape(g, 1, d, h)]
    return torch.cat(parts, dim=1).reshape(g * (r + 2) * d, h)


def _layer_names(i: int) -> dict[str, str]:
    m, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
    return {m + "input_layernorm.weight": hf + "input_layernorm.weight",
            m + "self_attention.linear_proj.weight": hf + "self_attn.o_proj.weight",
            m + "pre_mlp_layernorm.weight": hf + "post_attention_layernorm.weight",
            m + "mlp.linear_fc2.weight": hf + "mlp.down_proj.weight"}


def megatron_to_hf(state: dict[str, torch.Tensor], model: LlamaArch) -> dict[str, torch.Tensor]:
    """A TP=1/PP=1 GPTModel state dict → LlamaForCausalLM tensors; a leftover tensor raises instead of being dropped."""
    left = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    vocab, ffn = int(model.vocab_size), model.ffn_hidden_size

    def take(name: str) -> torch.Tensor:
        if name not in left:
            raise UnsupportedModel(f"megatron state dict has no {name}: not a Llama model")
        return left.pop(name)

    out = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")[:vocab].clone()}
    for i in range(model.num_layers):
        for m_name, hf_name in _layer_names(i).items():
            out[hf_name] = take(m_name)
        if model.layernorm_scaling:  # RMSNorm(x)·γ·(1/√ℓ) = RMSNorm(x)·(γ/√ℓ): a plain Llama norm weight
            for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                out[f"model.layers.{i}.{norm}"] = out[f"model.layers.{i}.{norm}"] / math.sqrt(i + 1)
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
        raise UnsupportedModel(f"megatron parameters with no Llama counterpart: {', '.join(sorted(left)[:5])}; "
                               "refusing to drop them")
    return {k: v.contiguous() for k, v in out.items()}


def _leftover_reason(name: str) -> str:
    if name.endswith(".bias"):
        return "biases"
    if "q_norm" in name or "k_norm" in name:
        return "QK-norm"
    if "expert" in name or "router" in name or ".gate.weight" in name:
        return "mixture-of-experts (MoE) layers"
    return "tensors with no megatron counterpart"


def hf_to_megatron(state: dict[str, torch.Tensor], model: LlamaArch, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM tensors → a TP=1/PP=1 GPTModel state dict; a leftover tensor raises instead of being dropped."""
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

    g, r, d, h = model.shape
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
        raise UnsupportedModel(f"Hugging Face tensors with no counterpart in a megatron-core Llama "
                               f"({_leftover_reason(names[0])}): "
                               f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
    return out

