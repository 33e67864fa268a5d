"""Layer streaming (`analyze --stream`): the same Ψ as the in-memory path, one decoder layer in memory at a time.

Tiny random models of many families (dense, MoE, post-norm, sliding window, soft-capping, parallel blocks,
learned positions), saved in small safetensors shards so that a layer spans several files; samples of
different lengths in batches of 3, so every batch is padded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_jreg.data.text import lambada_passages
from tests._lazy import importorskip_lazy
from tests.test_analysis import VOCAB, family_config, one_thread  # noqa: F401 (one_thread: autouse fixture)

transformers = importorskip_lazy("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    from tests._toy import train_tokenizer

    return train_tokenizer(lambada_passages()[:200], vocab_size=VOCAB)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    passages = lambada_passages()[10:17]
    return [" ".join(p.split()[:n]) for p, n in zip(passages, (4, 33, 12, 27, 9, 19, 40))]


SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)
# Families family_config does not build: MoE (per-expert tensors in the files, fused experts in transformers 5),
# and Phi-3 (fused qkv and gate/up projections).
OTHER_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=16, shared_expert_intermediate_size=32),
    "phi3": lambda: transformers.Phi3Config(**SIZES),
}


def _config(family: str, **extra):
    config = OTHER_CONFIGS[family]() if family in OTHER_CONFIGS else family_config(family, layers=4)
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def _save_sharded(config, folder: Path, tokenizer) -> Path:
    """save_random_model, then re-saved in ~8 KB shards (several files per layer) with an index."""
    from tests._toy import save_random_model

    save_random_model(config, folder, tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    model.save_pretrained(folder, max_shard_size="8KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def _psi(source, texts, batch_size=3) -> list[float]:
    from megatron_jreg.analysis.loading import ModelSpec
    from megatron_jreg.analysis.measure import measure

    path = Path(getattr(source, "folder", "m"))
    return measure(source, texts, ModelSpec(path, "m", "hf"), batch_size=batch_size).psi


VARIANTS = {
    # GQA (4 query heads, 2 KV heads) and RoPE, as family_config builds them.
    "llama": ("llama", {}),
    # Llama-3.1-style frequency scaling of RoPE.
    "llama3_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    # A sliding window shorter than the samples, so the window changes the attention.
    "mistral_window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen3": ("qwen3", {}),  # per-head q/k norms
    "mixtral": ("mixtral", {}),  # sparse MoE, experts fused on load
    "qwen2_moe": ("qwen2_moe", {}),  # MoE with a gated shared expert
    # post-norms, soft-capping, scaled embeddings, alternating sliding-window layers (window < samples)
    "gemma2": ("gemma2", {"sliding_window": 8, "query_pre_attn_scalar": 8}),
    "olmo2": ("olmo2", {}),  # post-norms and QK-norm
    "phi3": ("phi3", {}),  # fused qkv and gate/up
    "gpt_neox": ("gpt_neox", {}),  # parallel attention/MLP, partial rotary, LayerNorm with bias
    "gpt2": ("gpt2", {}),  # learned absolute positions, Conv1D
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_streaming_equals_in_memory(variant, tokenizer, texts, tmp_path):
    from megatron_jreg.analysis import stream_source
    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.stream_source import load_stream_source

    family, extra = VARIANTS[variant]
    folder = _save_sharded(_config(family, **extra), tmp_path / variant, tokenizer)
    reference = _psi(load_hf_source(folder, label="m"), texts)
    streamed_source = load_stream_source(folder, label="m")
    assert stream_source.not_streamable(folder) is None
    streamed = _psi(streamed_source, texts)
    assert streamed == pytest.approx(reference, abs=1e-5)
    assert len(set(reference)) == len(reference)  # distinct layers: a swapped or skipped layer would show
    print(f"{variant}: max |Ψ streamed - Ψ in memory| = {max(abs(a - b) for a, b in zip(streamed, reference)):.1e}")
    if variant in ("mistral_window", "gemma2"):  # the window matters: without it Ψ is different
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "sliding_window": None if variant == "mistral_window"
                                                        else 4096}))
        assert _psi(load_stream_source(folder, label="m"), texts) != pytest.approx(reference, abs=1e-5)


def test_legacy_rotary_buffers_in_the_files_are_ignored_as_transformers_ignores_them(tokenizer, texts, tmp_path):
    """Old Llama checkpoints carry `layers.N.self_attn.rotary_emb.inv_freq`, which transformers skips on load:
    so does streaming (which the automatic choice picks for exactly the big, often old, models)."""
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.stream_source import load_stream_source
    from tests._toy import save_random_model

    folder = save_random_model(_config("llama"), tmp_path / "m", tokenizer)
    tensors = load_file(folder / "model.safetensors")
    for i in range(4):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    reference = _psi(load_hf_source(folder, label="m"), texts)
    assert _psi(load_stream_source(folder, label="m"), texts) == pytest.approx(reference, abs=1e-5)


def test_streaming_final_norm_and_bfloat16(tokenizer, texts, tmp_path):
    import torch

    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.stream_source import load_stream_source

    folder = _save_sharded(_config("llama"), tmp_path / "m", tokenizer)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        ref = _psi(load_hf_source(folder, label="m", dtype=dtype, include_final_norm=True), texts)
        got = _psi(load_stream_source(folder, label="m", dtype=dtype, include_final_norm=True), texts)
        assert got == pytest.approx(ref, abs=tol)
        plain = _psi(load_stream_source(folder, label="m", dtype=dtype), texts)
        assert got[:-1] == pytest.approx(plain[:-1]) and got[-1] != pytest.approx(plain[-1], abs=1e-4)


def test_one_layer_in_memory_at_a_time(tokenizer, texts, tmp_path, monkeypatch):
    """Every read is one layer's tensors (or the embedding rows in use), and no two decoder layers ever
    hold real tensors at the same time."""
    from megatron_jreg.analysis.stream_source import SafetensorsFolder, StreamingSource, load_stream_source

    folder = _save_sharded(_config("llama"), tmp_path / "m", tokenizer)
    source = load_stream_source(folder, label="m")
    reads: list[set[str]] = []
    live: list[int] = []
    original_read, original_load = SafetensorsFolder.load, StreamingSource._load

    def read(self, names):
        reads.append({n.split(".")[2] if ".layers." in n else n for n in names})
        return original_read(self, names)

    def load(self, names, what):
        live.append(sum(any(p.device.type != "meta" for p in layer.parameters()) for layer in self.layers))
        return original_load(self, names, what)

    monkeypatch.setattr(SafetensorsFolder, "load", read)
    monkeypatch.setattr(StreamingSource, "_load", load)
    _psi(source, texts)
    assert reads == [{str(i)} for i in range(4)]  # one read per layer, of that layer only
    assert live == [0, 0, 0, 0]  # when a layer is read, no other layer holds tensors
    assert all(p.device.type == "meta" for layer in source.layers for p in layer.parameters())  # none left


def test_embedding_rows_read_in_runs(tokenizer, tmp_path):
    import torch
    from safetensors.torch import load_file

    from megatron_jreg.analysis.stream_source import SafetensorsFolder
    from tests._toy import save_random_model

    folder = save_random_model(_config("llama"), tmp_path / "m", tokenizer)
    weights = SafetensorsFolder(folder)
    full = load_file(folder / "model.safetensors")["model.embed_tokens.weight"]
    ids = [0, 1, 2, 7, 9, 10, VOCAB - 1]
    assert torch.equal(weights.rows("model.embed_tokens.weight", ids), full[ids])


def test_auto_streams_when_the_model_does_not_fit(tokenizer, tmp_path, monkeypatch, capsys):
    from megatron_jreg.analysis import loading
    from megatron_jreg.analysis.cli import main
    from tests._toy import save_random_model

    folder = save_random_model(_config("llama"), tmp_path / "m", tokenizer)
    argv = ["--model", str(folder), "--num-samples", "3", "--max-length", "40", "--no-progress"]
    assert main([*argv, "--output", str(tmp_path / "mem")]) == 0
    monkeypatch.setattr(loading, "available_bytes", lambda device: 1000)
    assert main([*argv, "--output", str(tmp_path / "auto")]) == 0
    err = capsys.readouterr().err
    assert "in memory: the weights need" in err and "streaming layer by layer" in err
    mem = json.loads((tmp_path / "mem" / "results.json").read_text())["models"][0]
    auto = json.loads((tmp_path / "auto" / "results.json").read_text())["models"][0]
    assert (mem["streamed"], auto["streamed"]) == (False, True)
    assert auto["psi"] == pytest.approx(mem["psi"], abs=1e-5)
    assert auto["peak_memory_bytes"] > 0 and auto["model_class"] == "LlamaForCausalLM (streamed)"


def test_streaming_refuses_what_it_cannot_read(tokenizer, tmp_path, monkeypatch, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_jreg.analysis import loading
    from megatron_jreg.analysis.source import AnalysisError
    from megatron_jreg.analysis.stream_source import SafetensorsFolder, WeightsError, load_stream_source
    from tests._toy import save_random_model

    quantized = save_random_model(_config("llama"), tmp_path / "quantized", tokenizer)
    config = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(AnalysisError, match=r"--stream cannot read this model: quantized weights \(awq\)"):
        load_stream_source(quantized, label="q")
    monkeypatch.setattr(loading, "available_bytes", lambda device: 1000)
    spec = loading.resolve_models([str(quantized)], None)[0]  # its headers read once, carried in the spec
    stream, why = loading.should_stream(spec, torch.float32, torch.device("cpu"))
    assert not stream and "in memory although the weights need" in why and "quantized weights (awq)" in why

    folder = save_random_model(_config("llama"), tmp_path / "m", tokenizer)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    tensors["model.layers.2.mlp.extra.weight"] = torch.zeros(3)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AnalysisError, match=r"1 weight\(s\) missing.*layers\.2\.mlp\.up_proj.*extra"):
        load_stream_source(folder, label="m")

    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"model.safetensors: not a readable safetensors file .*truncated or "):
        SafetensorsFolder(folder)


def test_multimodal_folder_measures_its_text_decoder(tokenizer, texts, tmp_path):
    """A Llama-4 image-text folder: its text decoder (2 layers; the vision encoder has 3) is measured, in memory
    and streamed alike, and its vision tower's weights are left unread (said in a note), not refused."""
    import torch

    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.stream_source import load_stream_source

    text = dict(SIZES, num_hidden_layers=2, intermediate_size_mlp=64, head_dim=8, num_local_experts=2)
    vision = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=56,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text,
                                                                                   vision_config=vision))
    model.save_pretrained(tmp_path / "l4")
    tokenizer.save_pretrained(tmp_path / "l4")
    source = load_hf_source(tmp_path / "l4", label="l4")
    assert source.num_layers == 2 and any("vision_model" in note for note in source.notes)
    reference = _psi(source, texts)
    assert _psi(load_stream_source(tmp_path / "l4", label="l4"), texts) == pytest.approx(reference, abs=1e-6)
