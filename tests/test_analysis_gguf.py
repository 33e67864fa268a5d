"""GGUF input of `megatron-jreg analyze`: a tiny Llama written with the `gguf` package, read back through
transformers' GGUF support (dequantized), must measure like the Hugging Face folder it came from.

The writer below follows llama.cpp's conventions for a Llama (tensor names from gguf's own name map,
rotary rows of Q and K interleaved per head, a byte-level "gpt2" vocabulary with its merges).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_jreg.analysis.hf_source import load_hf_source
from megatron_jreg.analysis.measure import measure
from megatron_jreg.analysis.source import ModelSpec, model_kind
from megatron_jreg.analysis.toy import SPECIAL, save_random_model, train_tokenizer
from megatron_jreg.data.text import lambada_passages
from tests.test_analysis import VOCAB, family_config, one_thread  # noqa: F401 (one_thread: autouse fixture)

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


def llama_rotary_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows [heads·d, h] from Hugging Face's half-split rotary layout to llama.cpp's interleaved one."""
    rows_per_half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows_per_half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model, tokenizer, path: Path, quantize: bool = False) -> Path:
    """Write `model` (LlamaForCausalLM) and its byte-level BPE tokenizer as GGUF (F32 or Q8_0 matrices)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("jreg-tiny-llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(backend["vocab"].items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == SPECIAL else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        module, suffix = name.rsplit(".", 1)
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = llama_rotary_order(array, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_rotary_order(array, cfg.num_key_value_heads)
        target = f"{names.get_name(module)}.{suffix}"
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


def test_gguf_measures_like_its_hf_folder(tmp_path):
    passages = lambada_passages()
    tokenizer = train_tokenizer(passages[:200], vocab_size=VOCAB)
    config = family_config("llama", hidden=64)  # Q8_0 blocks are 32 wide
    folder = save_random_model(config, tmp_path / "hf", tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    f32 = write_llama_gguf(model, tokenizer, tmp_path / "tiny-f32.gguf")
    q8 = write_llama_gguf(model, tokenizer, tmp_path / "renamed.bin", quantize=True)  # found by magic bytes
    assert model_kind(f32) == model_kind(q8) == "gguf" and model_kind(folder) == "hf"

    texts = [" ".join(p.split()[:n]) for p, n in zip(passages[:4], (6, 25, 14, 30))]

    def psi(path: Path) -> tuple[list[float], list[list[int]]]:
        source = load_hf_source(path, label=path.name)
        result = measure(source, texts, ModelSpec(path, path.name, model_kind(path)), batch_size=2)
        return result.psi, source.encode(texts)

    reference, ids = psi(folder)
    from_f32, ids_f32 = psi(f32)
    from_q8, ids_q8 = psi(q8)
    assert ids_f32 == ids_q8 == ids  # the vocabulary in the GGUF file tokenizes identically
    assert from_f32 == pytest.approx(reference, abs=1e-6)
    assert from_q8 == pytest.approx(reference, abs=2e-3)  # 8-bit weights: close, not equal
    assert from_q8 != pytest.approx(reference, abs=1e-7)
