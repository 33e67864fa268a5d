"""Hugging Face folders and GGUF files as hidden-state sources: loaded by transformers, only the base model runs (never
the LM head's [b, t, V] logits), decoder layers found generically."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from megatron_jreg.analysis.gguf_model import apply_rope_freqs, plan_gguf
from megatron_jreg.analysis.source import (
    FINAL_NORM,
    LAYER_IO,
    AnalysisError,
    HiddenStateSource,
    LayerDisplacementHooks,
    UnsupportedArchitectureError,
    batch_stats,
    gather_rows,
    masked_displacement_sum,
    real_rows,
)
from megatron_jreg.errors import ModelFileError, one_line
from megatron_jreg.hub import load_causal_lm
from megatron_jreg.model_files import (
    auto_config,
    check_entries,
    declared_context,
    is_gguf_file,
    read_safetensors_folder,
    refuse_custom_code,
)

HEAD = "lm_head."  # the LM head: never run by the analysis, so it may be absent from the files

# Where the families of the issue keep their decoder layers (for the error message; discovery is generic).
KNOWN_LAYOUTS = "Llama/Mistral/Qwen/Gemma/OLMo/Phi/GPT-NeoX: `<base>.layers`, GPT-2: `transformer.h`"


def _declared(config: Any, name: str) -> int | None:
    """The (text) config's `name` when it is a positive int, else None; transformers' attribute_map resolves a
    family's own name (GPT-2's n_layer for num_hidden_layers)."""
    value = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, name, None)
    return value if isinstance(value, int) and value > 0 else None


def find_decoder_layers(model: nn.Module, expected: int | None = None) -> tuple[str, list[nn.Module]]:
    """(qualified name, layers) of the decoder stack: an `nn.ModuleList` of one block class, of length `expected` when
    given, else the one with the most parameters (shallowest wins a tie); generic, not a table of names."""
    candidates = [(0 if expected else -sum(p.numel() for p in module.parameters()), name.count("."), name, list(module))
                  for name, module in model.named_modules() if isinstance(module, nn.ModuleList) and len(module)
                  and len({type(block) for block in module}) == 1 and expected in (None, len(module))]
    if not candidates:
        want = f"{expected} identical blocks" if expected is not None else "identical blocks"
        raise UnsupportedArchitectureError(
            f"cannot find the decoder layers of {type(model).__name__}: expected an nn.ModuleList of {want} "
            f"({KNOWN_LAYOUTS}). This architecture is not supported by `megatron-jreg analyze`"
        )
    _, _, name, layers = min(candidates, key=lambda c: c[:3])
    return name, layers


def decoder_stack(model: nn.Module) -> tuple[nn.Module, str, list[nn.Module]]:
    """(the module measured, the qualified name of its decoder layers in it, the layers): the base model, or a
    multimodal model's text decoder (`get_decoder()`), which runs alone on text."""
    config = model.config
    base = model.base_model
    if hasattr(config, "get_text_config") and config.get_text_config() is not config and hasattr(model, "get_decoder"):
        base = model.get_decoder()
    if base is model and isinstance(getattr(model, "model", None), nn.Module):
        base = model.model  # e.g. Llama4ForCausalLM, whose base_model_prefix names no attribute: not the LM head
    return base, *find_decoder_layers(base, _declared(config, "num_hidden_layers"))


def other_towers(config: Any) -> tuple[str, ...]:
    """Weight-name prefixes of a multimodal checkpoint's non-text parts (the top-level modules of its `architectures`
    class besides the language model), which its causal LM lacks; () for a text-only config."""
    import transformers

    cls = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    if config.get_text_config() is config or cls is None:
        return ()
    with torch.device("meta"):
        full = cls._from_config(config)
    prefixes = []
    for holder in (full, getattr(full, "model", None)):
        if not isinstance(holder, nn.Module):
            continue
        for name, child in holder.named_children():
            text = child is getattr(full, "language_model", None) or name in ("language_model", "lm_head", "model")
            if not text and any(True for _ in child.parameters()):
                prefixes += [f"{name}.", f"model.{name}."]
    return tuple(dict.fromkeys(prefixes))


def run_forward(module: nn.Module, input_ids: Tensor, attention_mask: Tensor, **kwargs: Any) -> Any:
    """module(input_ids, attention_mask, use_cache=False, **kwargs), with explicit positions where it takes them:
    left padding needs them for absolute-position models (GPT-2); harmless for RoPE."""
    if "position_ids" in inspect.signature(module.forward).parameters:
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    return module(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)


class HFSource(HiddenStateSource):
    """A transformers causal LM measured layer by layer (`HiddenStateSource`); its `base_model` runs."""

    def __init__(self, model: nn.Module, tokenizer: Any, label: str, include_final_norm: bool = False):
        self.model = model.eval()
        self.base, self.layer_path, self.layers = decoder_stack(model)
        self.tokenizer = tokenizer
        self.label = label
        self.model_class = type(model).__name__
        self.num_layers = len(self.layers)
        self.include_final_norm = include_final_norm
        self.convention = FINAL_NORM if include_final_norm else LAYER_IO
        self.context_length = declared_context(model.config)
        self.vocab_size = _declared(model.config, "vocab_size")
        pads = (tokenizer.pad_token_id, tokenizer.eos_token_id) if tokenizer is not None else ()
        self.pad_id = int(next((t for t in pads if t is not None), 0))  # any id: padding is masked anyway
        self.head_missing: str | None = None  # why the LM head was not loaded (Ψ never runs it)
        self.notes: list[str] = []  # what loading applied or left out, for the log
        self.device = next(self.base.parameters()).device

    @torch.no_grad()
    def logits(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """logits[b, t, V] of the causal LM (its head, soft-capping and scaling included) for layer removal."""
        if self.head_missing:
            raise AnalysisError(f"{self.label}: layer removal needs the LM head, but {self.head_missing}")
        return run_forward(self.model, input_ids.to(self.device), attention_mask.to(self.device)).logits

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the tokenizer's usual special tokens (e.g. BOS for Llama), untruncated."""
        if self.tokenizer is None:
            raise AnalysisError(f"{self.label}: loaded without a tokenizer; pass token ids, or load it with one")
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]]

    @torch.no_grad()
    def layer_stats(self, input_ids: Tensor, attention_mask: Tensor, kind: str, select: Tensor | None = None
                    ) -> dict[str, Tensor]:
        """See `HiddenStateSource.layer_stats`: Ψ by hooks on the layers, h_0..h_L kept at the selected tokens."""
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        select = attention_mask if select is None else select.to(self.device)
        if self.include_final_norm:
            hidden = self._hidden_states(input_ids, attention_mask)
            rows = real_rows(select)
            pairs = torch.stack([torch.stack(masked_displacement_sum(a, b, rows, kind))
                                 for a, b in zip(hidden[:-1], hidden[1:])])  # [L, 2]
            return batch_stats(pairs[:, 0], pairs[:, 1], [gather_rows(h, rows) for h in hidden], kind)
        with LayerDisplacementHooks(self.layers, select, kind) as hooks:
            run_forward(self.base, input_ids, attention_mask)
        return batch_stats(hooks.sums, hooks.counts, hooks.states, kind)

    def _hidden_states(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, ...]:
        """The `output_hidden_states` convention: hs[0] the embeddings, hs[ℓ] layer ℓ's output, hs[L] =
        final_norm(h_L); refused when there are not L + 1 of one width."""
        hidden = run_forward(self.base, input_ids, attention_mask, output_hidden_states=True).hidden_states
        if len(hidden) != self.num_layers + 1:
            raise UnsupportedArchitectureError(
                f"{self.model_class} returned {len(hidden)} hidden states for {self.num_layers} layers; "
                "--include-final-norm needs L + 1 (embeddings and every layer): drop the flag"
            )
        widths = [h.shape[-1] for h in hidden]
        if len(set(widths)) > 1:
            raise UnsupportedArchitectureError(
                f"--include-final-norm: {self.model_class}'s output_hidden_states are {widths[0]} wide but the last "
                f"one is {widths[-1]} (a projection after the final norm, as in OPT-350m): Ψ_L cannot compare "
                "vectors of different widths; drop --include-final-norm (the default measures the layers themselves)"
            )
        return hidden

    def close(self) -> None:
        del self.model, self.base, self.layers


def load_tokenizer(path: Path, gguf_file: str | None, tokenizer: str | None, config: Any = None) -> Any:
    """The model's own tokenizer (from its folder or GGUF file; `config`, the folder's transformers config, picks
    its class where tokenizer_config.json does not), or the --tokenizer folder when given."""
    from transformers import AutoTokenizer

    source, flag = (tokenizer, "--tokenizer") if tokenizer is not None else (str(path), "--model")
    where = f"--tokenizer {tokenizer}" if tokenizer else f"the GGUF file {path / gguf_file}" if gguf_file else str(path)
    try:
        if Path(source).is_dir() and (tokenizer is not None or config is None):  # else identify checked it
            check_entries(Path(source), flag)
            refuse_custom_code(Path(source), flag)
        own = {} if tokenizer else {"gguf_file": gguf_file} if gguf_file else {"config": config}
        return AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=False, **own)
    except ModelFileError as e:
        raise AnalysisError(str(e)) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AnalysisError(f"cannot load a tokenizer from {where}: {one_line(e, 300)}. Pass --tokenizer DIR (a folder "
                            "with tokenizer.json or the model's original Hugging Face folder)") from e


def load_hf_source(path: Path, *, label: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   include_final_norm: bool = False, tokenizer: str | None = None, with_tokenizer: bool = True,
                   config: Any = None, tensors: dict[str, Any] | None = None) -> HFSource:
    """A local Hugging Face folder or GGUF file as a source, loaded strictly (`hub.load_causal_lm`) but for the LM
    head (`head_missing`); config, tensors: what `loading.identify` read."""
    path = Path(path)
    gguf_file = path.name if config is None and is_gguf_file(path) else None  # a config: a folder identify read
    folder = path.parent if gguf_file else path
    plan = plan_gguf(path, f"--model {path}") if gguf_file else None  # nothing in the file may be dropped by the loader
    checked = plan is not None or config is not None  # loading.identify checked the folder when it read its config
    config = plan.config if plan else config or auto_config(folder)
    towers = () if gguf_file else other_towers(config)
    try:
        model = load_causal_lm(folder, where=f"--model {path}", ignore=(HEAD, *towers), gguf_file=gguf_file,
                               dtype=dtype, config=config, checked=checked)
    except ModelFileError as e:
        raise AnalysisError(str(e)) from None
    except (ValueError, KeyError, OSError) as e:
        raise AnalysisError(f"--model {path}: transformers cannot load it as a causal LM ({one_line(e, 300)}); the "
                            "folder needs the model's config.json and weight files") from e
    if plan is not None and plan.rope_freqs is not None:
        apply_rope_freqs(model, plan.rope_freqs, f"--model {path}")
    model.to(device)
    tok = load_tokenizer(folder, gguf_file, tokenizer, None if gguf_file else config) if with_tokenizer else None
    source = HFSource(model, tok, label, include_final_norm)
    source.head_missing = head_missing(model, path, plan.tensor_names if plan else None, tensors)
    source.notes = plan.notes if plan else []
    if towers:
        parts = ", ".join(t.rstrip(".") for t in towers if not t.startswith("model."))
        source.notes.append(f"multimodal model: measured its text decoder; {parts} (not the text model) not loaded")
    return source


def head_missing(model: nn.Module, path: Path, gguf_tensors: set[str] | None = None,
                 tensors: dict[str, Any] | None = None) -> str | None:
    """Why the LM head was not loaded (None when it was, or is tied): Ψ never runs it, so loaders let it be absent;
    gguf_tensors: a GGUF file's names, else `tensors` (the folder's headers) when already read."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        return None
    if gguf_tensors is not None:
        return None if "output.weight" in gguf_tensors else f"{path} holds no output.weight (the LM head)"
    names = list(tensors or read_safetensors_folder(path))
    if any(f".{HEAD}" in f".{name}" for name in names):
        return None
    head_key = next(f"{n}.weight" for n, m in model.named_modules() if m is head)
    mapping, keys = get_model_conversion_mapping(model), model.state_dict()
    if any(head_key in weight_targets(model, mapping, name, keys) for name in names):  # GPT-NeoX's embed_out
        return None
    return f"{path} holds no {HEAD}* tensor (the LM head) and its embeddings are not tied"


def weight_targets(model: nn.Module, mapping: list, name: str, keys: dict) -> list[str]:
    """The keys of `model` (`keys`: its state dict) that checkpoint tensor `name` loads into as `from_pretrained`
    renames and converts it under `mapping` (GPT-NeoX's `embed_out.weight` → `lm_head.weight`; a fused qkv)."""
    from transformers.core_model_loading import WeightConverter, rename_source_key

    renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    renamed, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, keys)
    if pattern is None:
        return [renamed]
    converter = next(c for c in converters if pattern in c.source_patterns)
    return [renamed.replace(converter.target_patterns[0], t) for t in converter.target_patterns]
