"""GGUF input of `megatron-jreg analyze`: tiny models written with the `gguf` package, read back through
transformers' GGUF support (dequantized), must measure like the Hugging Face folders they came from, or be
refused naming what transformers' loader would drop.

The writers below follow llama.cpp's conventions (convert_hf_to_gguf.py): tensor names from gguf's own name
map; for a Llama the rotary rows of Q and K interleaved per head and Llama-3.1 RoPE scaling stored as the
`rope_freqs` tensor; for a Gemma-2 the norm gains stored as 1 + w; a byte-level "gpt2" vocabulary with its
merges.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from megatron_jreg.data.text import lambada_passages
from tests._lazy import importorskip_lazy
from tests.test_analysis import VOCAB, family_config, one_thread  # noqa: F401 (one_thread: autouse fixture)

if TYPE_CHECKING:
    import torch

gguf = importorskip_lazy("gguf")
transformers = importorskip_lazy("transformers")


def llama_rotary_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows [heads·d, h] from Hugging Face's half-split rotary layout to llama.cpp's interleaved one."""
    rows_per_half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows_per_half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama-3.1-style scaling: the divisor of each rotary frequency."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _vocabulary(writer, tokenizer) -> None:
    from tests._toy import SPECIAL

    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(backend["vocab"].items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == SPECIAL else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)


def write_gguf(model, tokenizer, path: Path, quantize: bool = False, metadata: dict | None = None,
               tensors: dict | None = None, rotary_dims: int | None = None) -> Path:
    """Write a Llama or Gemma-2 `model` and its byte-level BPE tokenizer as llama.cpp would (F32 or Q8_0
    matrices); `metadata`/`tensors`: extra keys and tensors, for the refusals; `rotary_dims`: another
    rope.dimension_count."""
    cfg = model.config
    arch = {"llama": "llama", "gemma2": "gemma2"}[cfg.model_type]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name("jreg-tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "llama":
        writer.add_rope_dimension_count(rotary_dims or head_dim)
    else:
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for key, value in (metadata or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_float32 if isinstance(value, float)
         else writer.add_uint32)(key, value)
    _vocabulary(writer, tokenizer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.GEMMA2,
                                     cfg.num_hidden_layers)
    arrays = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        module, suffix = name.rsplit(".", 1)
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array = llama_rotary_order(array, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array = llama_rotary_order(array, cfg.num_key_value_heads)
        elif arch == "gemma2" and name.endswith("norm.weight"):
            array = array + 1  # llama.cpp stores Gemma's norm gains as 1 + w
        arrays[f"{names.get_name(module)}.{suffix}"] = array
    if arch == "llama" and (cfg.rope_parameters or {}).get("rope_type") == "llama3":
        arrays["rope_freqs.weight"] = llama3_rope_factors(cfg)
    arrays.update(tensors or {})
    for target, array in arrays.items():
        if quantize and array.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(target, gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(target, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(model, tokenizer, path: Path, quantize: bool = False) -> Path:
    return write_gguf(model, tokenizer, path, quantize)


@pytest.fixture(scope="module")
def tokenizer():
    from tests._toy import train_tokenizer

    return train_tokenizer(lambada_passages()[:200], vocab_size=VOCAB)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    passages = lambada_passages()
    return [" ".join(p.split()[:n]) for p, n in zip(passages[:4], (6, 25, 14, 30))]


def _psi(path: Path, texts: list[str], **load) -> list[float]:
    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.loading import ModelSpec, identify
    from megatron_jreg.analysis.measure import measure

    source = load_hf_source(path, label=path.name, **load)
    return measure(source, texts, ModelSpec(path, path.name, identify(path)[0]), batch_size=2).psi


def test_gguf_measures_like_its_hf_folder(tmp_path, tokenizer, texts):
    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.loading import identify
    from tests._toy import save_random_model

    config = family_config("llama", hidden=64)  # Q8_0 blocks are 32 wide
    folder = save_random_model(config, tmp_path / "hf", tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    f32 = write_gguf(model, tokenizer, tmp_path / "tiny-f32.gguf")
    q8 = write_gguf(model, tokenizer, tmp_path / "renamed.bin", quantize=True)  # found by magic bytes
    assert identify(f32)[0] == identify(q8)[0] == "gguf" and identify(folder)[0] == "hf"

    reference = _psi(folder, texts)
    ids = [load_hf_source(p, label="x").encode(texts) for p in (folder, f32, q8)]
    assert ids[1] == ids[2] == ids[0]  # the vocabulary in the GGUF file tokenizes identically
    assert _psi(f32, texts) == pytest.approx(reference, abs=1e-6)
    from_q8 = _psi(q8, texts)
    assert from_q8 == pytest.approx(reference, abs=2e-3)  # 8-bit weights: close, not equal
    assert from_q8 != pytest.approx(reference, abs=1e-7)


def _gemma2():
    config = family_config("gemma2", hidden=64)
    config.head_dim, config.query_pre_attn_scalar = 16, 16  # as Gemma-2 2B/9B: the scalar is the head size
    config.sliding_window, config.attn_logit_softcapping = 8, 5.0  # both shape Ψ on 30-token samples
    return config


def _llama(**extra):
    config = family_config("llama", hidden=64)
    for key, value in extra.items():
        setattr(config, key, value)
    return config


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}  # scales all but one frequency
# What transformers' GGUF loader alone drops (measured before the audit: the biased Llama gave
# Ψ = [0.166, 0.218, 0.243] against the folder's [0.480, 0.273, 0.222], exit 0).
APPLIED = {
    "llama_biases_and_head_dim": (lambda: _llama(attention_bias=True, mlp_bias=True, head_dim=32), {}),
    "llama3_rope_freqs": (lambda: _llama(rope_parameters=LLAMA3_ROPE), {}),
    "gemma2_scalar_window_softcapping": (_gemma2, {"tokenizer": "folder"}),
}


@pytest.mark.parametrize("name", sorted(APPLIED))
def test_what_the_loader_would_drop_is_applied(name, tmp_path, tokenizer, texts):
    import torch

    from megatron_jreg.analysis.hf_source import load_hf_source
    from tests._toy import save_random_model

    build, load = APPLIED[name]
    folder = save_random_model(build(), tmp_path / "hf", tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    path = write_gguf(model, tokenizer, tmp_path / f"{name}.gguf")
    load = {k: str(folder) if v == "folder" else v for k, v in load.items()}
    source = load_hf_source(path, label="g", **load)
    assert source.notes  # what was applied is said
    reference = _psi(folder, texts)
    assert _psi(path, texts, **load) == pytest.approx(reference, abs=1e-6)
    plain = build()
    for key in ("attention_bias", "mlp_bias"):
        if getattr(plain, key, False):
            setattr(plain, key, False)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    if name.startswith("gemma2"):
        plain.query_pre_attn_scalar, plain.attn_logit_softcapping = 256, 50.0  # transformers' defaults
    if name.startswith("gemma2"):  # the applied settings matter: the same weights without them differ
        again = save_random_model(plain, tmp_path / "plain", tokenizer)
        assert _psi(again, texts) != pytest.approx(reference, abs=2e-5)  # 20× the equality tolerance
    if name.startswith("llama3"):  # RoPE barely moves a random model's Ψ: compare the frequencies themselves
        scaled = model.model.rotary_emb.inv_freq
        got = source.base.rotary_emb.inv_freq
        assert torch.allclose(got, scaled, rtol=1e-6) and not torch.allclose(got, _default_inv_freq(plain), rtol=1e-3)


def _default_inv_freq(config) -> torch.Tensor:
    return transformers.LlamaForCausalLM(config).model.rotary_emb.inv_freq


REFUSED = {
    "sliding_window_key": ({"metadata": {"llama.attention.sliding_window": 8}}, "llama.attention.sliding_window"),
    "yarn_rope": ({"metadata": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}},
                  "rope.scaling"),
    "unknown_key": ({"metadata": {"llama.embedding_scale": 2.0}}, "llama.embedding_scale"),
    "unused_tensor": ({"tensors": {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}}, "blk.0.attn_q_norm.weight"),
    "partial_rotary": ({"rotary_dims": 8}, "llama.attention.key_length = 16"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_cannot_be_applied_is_refused_naming_it(name, tmp_path, tokenizer):
    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.source import AnalysisError
    from tests._toy import save_random_model

    extra, needle = REFUSED[name]
    folder = save_random_model(_llama(), tmp_path / "hf", tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    path = write_gguf(model, tokenizer, tmp_path / f"{name}.gguf", **extra)
    with pytest.raises(AnalysisError, match="would drop what changes the model") as e:
        load_hf_source(path, label="g")
    assert needle in str(e.value) and len(str(e.value).splitlines()) == 1


def test_dequantizing_bar_follows_the_progress_flag(tmp_path, tokenizer, capsys):
    """transformers' "Converting and de-quantizing GGUF tensors" bar is its own tqdm, which its
    disable_progress_bar does not reach: with --no-progress (or stderr not a terminal) it must not be drawn
    into the log, with --progress it is; and the bar is the library's own again afterwards."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from megatron_jreg.analysis.cli import main
    from tests._toy import save_random_model

    folder = save_random_model(family_config("llama", hidden=64), tmp_path / "hf", tokenizer)
    path = write_gguf(transformers.AutoModelForCausalLM.from_pretrained(folder), tokenizer, tmp_path / "tiny.gguf")
    bar = gguf_utils.tqdm
    argv = ["--model", str(path), "--num-samples", "2", "--max-length", "16"]
    for flags, drawn in (([], False), (["--no-progress"], False), (["--progress"], True)):
        assert main([*argv, *flags, "--output", str(tmp_path / f"out{len(flags)}{drawn}")]) == 0
        err = capsys.readouterr().err
        assert ("de-quantizing GGUF tensors" in err) is drawn, (flags, err)
        assert gguf_utils.tqdm is bar
