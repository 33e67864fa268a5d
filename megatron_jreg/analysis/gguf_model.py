"""GGUF files as transformers models, audited first: transformers' GGUF loader drops metadata keys and tensors it does
not know without a word, which would measure another model; every one is read, applied or refused by name."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron_jreg.analysis.source import AnalysisError
from megatron_jreg.errors import one_line
from megatron_jreg.hub import named_keys

IGNORED_PREFIXES = ("general.", "tokenizer.", "quantize.", "split.", "GGUF.")
# llama.cpp's layer counts of the 27B layouts, whose attention scale is 1/sqrt(hidden/heads).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_BIAS_TENSORS = {
    "attention_bias": re.compile(r"^blk\.\d+\.attn_(q|k|v|output)\.bias$"),
    "mlp_bias": re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.bias$"),
}
_EXPERTS = re.compile(r"_(ch)?exps\.")


@dataclass
class GgufPlan:
    """What loading a GGUF file takes: the config, rotary frequency factors to divide by, notes for the log."""

    config: Any
    tensor_names: set[str] = field(default_factory=set)
    rope_freqs: torch.Tensor | None = None
    notes: list[str] = field(default_factory=list)


def read_gguf(path: Path) -> Any:
    """A GGUF file's reader, with its header, metadata and tensor table parsed and every tensor's bytes checked to
    be in the file, so a truncated or corrupt download is one line naming the file instead of a parser traceback."""
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path))
        tensors = list(reader.tensors)
    except Exception as e:  # noqa: BLE001 - any parse failure of the file is the thing to report
        raise AnalysisError(f"--model {path}: not a readable GGUF file ({size} bytes; {type(e).__name__}: "
                            f"{one_line(e, 300)}); it is truncated or corrupt: download or convert it again") from None
    if not tensors:
        raise AnalysisError(f"--model {path}: the GGUF file holds no tensors; download or convert it again")
    end = max(t.data_offset + t.n_bytes for t in tensors)
    if end > size:
        raise AnalysisError(
            f"--model {path}: the GGUF file is truncated ({size} of {end} bytes); download or convert it again"
        )
    return reader


def _fields(reader: Any) -> dict[str, Any]:
    """{key: value} of the file's metadata (one-element lists unpacked), as transformers reads them."""
    from transformers.integrations import _gguf_parse_value

    parsed = {key: [_gguf_parse_value(item.parts[i], item.types) for i in item.data]
              for key, item in reader.fields.items()}
    return {key: value[0] if len(value) == 1 else value for key, value in parsed.items()}


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _rotary_dim(config: Any) -> int:
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    factor = factor or getattr(config, "rotary_pct", None) or 1.0
    return int(_head_dim(config) * float(factor))


def _apply_metadata(plan: GgufPlan, arch: str, values: dict[str, Any], consumed: set[str]) -> list[str]:
    """Check, apply or collect for refusal every metadata key but the ignored ones (`consumed`: the
    `arch.` names transformers reads); returns the refused keys with why."""
    config = plan.config
    refused = []
    scaling = {k.split("rope.scaling.", 1)[1]: v for k, v in values.items() if ".rope.scaling." in k}
    for key, value in values.items():
        if key.startswith(IGNORED_PREFIXES) or ".rope.scaling." in key:
            continue
        name = key.split(".", 1)[1] if key.startswith(f"{arch}.") else key
        if name in ("attention.key_length", "attention.value_length"):
            if int(value) != _head_dim(config):
                refused.append(f"{key} = {value} (the model's head_dim is {_head_dim(config)})")
        elif name == "rope.dimension_count":
            if int(value) != _rotary_dim(config):
                refused.append(f"{key} = {value} (transformers' {config.model_type} rotates {_rotary_dim(config)} "
                               "dimensions per head)")
        elif name == "attention.sliding_window":
            if getattr(config, "sliding_window", None) == value:
                continue
            if not hasattr(config, "sliding_window") or hasattr(config, "use_sliding_window"):
                refused.append(f"{key} = {value} (sliding-window attention, which transformers' "
                               f"{config.model_type} does not apply as llama.cpp does)")
            else:
                config.sliding_window = int(value)
                plan.notes.append(f"applied {key} = {value}")
        elif name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hasattr(config, name):
                setattr(config, name, float(value))
            elif name == "attn_logit_softcapping":
                refused.append(f"{key} = {value} (attention logit soft-capping, which {config.model_type} lacks)")
        elif name == "attention.scale" and arch in _GEMMA_27B_LAYERS:
            config.query_pre_attn_scalar = float(value) ** -2
            plan.notes.append(f"applied {key} = {value} (query_pre_attn_scalar {config.query_pre_attn_scalar:g})")
        elif name not in consumed and name not in ("vocab_size", "context_length"):
            refused.append(f"{key} = {value}")
    if scaling:
        kind = str(scaling.get("type", "none"))
        if kind == "linear" and "factor" in scaling:
            rope = dict(getattr(config, "rope_parameters", None) or {})
            config.rope_parameters = {**rope, "rope_type": "linear", "factor": float(scaling["factor"])}
            plan.notes.append(f"applied linear RoPE scaling, factor {scaling['factor']}")
        elif kind != "none" or set(scaling) - {"type"}:
            refused.append(f"{arch}.rope.scaling.* = {scaling} (RoPE scaling transformers' GGUF loader does not "
                           "read)")
    if arch in _GEMMA_27B_LAYERS and f"{arch}.attention.scale" not in values:
        big = config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else _head_dim(config)
        plan.notes.append(f"query_pre_attn_scalar = {config.query_pre_attn_scalar} by llama.cpp's rule for {arch} "
                          "(the file does not store the attention scale)")
    return refused


def _unused_tensors(config: Any, arch: str, names: list[str]) -> list[str]:
    """The `names` transformers maps to no parameter of `config`'s model (from its own name map on a model built on
    the meta device), but MoE expert tensors where its processor routes them itself."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    processor_class = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    processor = processor_class(config=config.to_dict())
    routes_experts = "_set_moe_expert_tensor" in vars(processor_class) or "_split_moe_expert_tensor" in vars(
        processor_class)
    mapped = set(get_gguf_hf_weights_map(model, processor))
    return [n for n in names if n not in mapped and not (routes_experts and _EXPERTS.search(n))]


def plan_gguf(path: Path, where: str) -> GgufPlan:
    """The config to load a GGUF file with, or an AnalysisError naming every key or tensor transformers would drop."""
    from transformers import AutoConfig
    from transformers.integrations import GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import is_gguf_arch_supported

    reader = read_gguf(path)
    values = _fields(reader)
    arch = str(values.get("general.architecture", ""))
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True,
                                            trust_remote_code=False)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise AnalysisError(f"{where}: transformers cannot read the GGUF metadata of architecture {arch!r} "
                            f"({str(e).splitlines()[0][:200]})") from None
    names = [t.name for t in reader.tensors]
    plan = GgufPlan(config, set(names))
    if is_gguf_arch_supported(arch):  # transformers' own path reports unused tensors (hub.check_loading_info)
        return plan
    model_type = str(config.get_text_config().model_type)
    # the `ARCH.` key names transformers reads into the config, under any of the architecture's names (the file's,
    # and the model type it renames it to, e.g. qwen2moe → qwen2_moe)
    prefixes = {arch, model_type, model_type.removesuffix("_text")}
    consumed = {key for prefix in prefixes for key in GGUF_CONFIG_MAPPING.get(prefix, {})}
    refused = _apply_metadata(plan, arch, values, consumed)
    unused = _unused_tensors(config, arch, names)
    for flag, pattern in _BIAS_TENSORS.items():
        if any(pattern.match(n) for n in unused) and getattr(config, flag, None) is False:
            setattr(config, flag, True)
            plan.notes.append(f"applied {flag} = true (the file holds {flag.split('_')[0]} biases)")
    if "rope_freqs.weight" in unused:
        tensor = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        plan.rope_freqs = torch.from_numpy(tensor.data.astype("float32").copy()).reshape(-1)
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            refused.append(f"rope_freqs.weight with RoPE type {rope.get('rope_type')!r}")
        plan.notes.append("applied rope_freqs.weight: the rotary frequencies divided by its factors, as llama.cpp "
                          "does (Llama-3.1-style RoPE scaling)")
    if plan.notes:
        unused = _unused_tensors(config, arch, names)
    unused = [n for n in unused if n != "rope_freqs.weight"]
    if unused:
        refused.append(f"{len(unused)} tensor(s) {named_keys(unused)} (no parameter of transformers' "
                       f"{config.model_type} model takes them)")
    if refused:
        raise AnalysisError(
            f"{where}: transformers' GGUF loader would drop what changes the model: {'; '.join(refused)}. "
            "Measure the model's Hugging Face folder instead (its config.json states these), or convert it again")
    return plan


def apply_rope_freqs(model: nn.Module, freqs: torch.Tensor, where: str) -> None:
    """Divide every rotary embedding's frequencies by llama.cpp's `rope_freqs` factors (Llama-3.1-style
    scaling stored as a tensor: θ_i = position · base^(-2i/d) / factor_i)."""
    rotaries = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not rotaries or any(m.inv_freq.shape != freqs.shape for m in rotaries):
        shapes = sorted({tuple(m.inv_freq.shape) for m in rotaries})
        raise AnalysisError(f"{where}: rope_freqs.weight has {freqs.numel()} factors, the model's rotary "
                            f"frequencies {shapes or 'none'}: the file does not fit its metadata")
    with torch.no_grad():
        for module in rotaries:
            module.inv_freq = module.inv_freq / freqs.to(module.inv_freq)
            if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
                module.original_inv_freq = module.inv_freq.clone()
