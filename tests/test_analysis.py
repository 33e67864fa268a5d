"""Jump analysis of Hugging Face models: hooks against a plain reference, on every supported family.

Tiny randomly initialised models (3 layers, hidden 32) are built from each family's config class and
saved locally; nothing is downloaded. The reference below is deliberately naive: one sample at a
time, no padding, `output_hidden_states` with the final norm swapped for the identity, and the angle
as float64 arccos of the cosine.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from megatron_jreg.data.text import lambada_passages
from tests._lazy import importorskip_lazy

if TYPE_CHECKING:
    import torch
    from torch import nn

    from megatron_jreg.analysis.loading import ModelSpec

transformers = importorskip_lazy("transformers")

VOCAB = 320
# Final norm attribute of each family's base model: used by the reference only (the code under test
# never needs it).
FAMILIES = {
    "llama": ("LlamaConfig", "norm"),
    "mistral": ("MistralConfig", "norm"),
    "qwen2": ("Qwen2Config", "norm"),
    "qwen3": ("Qwen3Config", "norm"),
    "gemma": ("GemmaConfig", "norm"),
    "gemma2": ("Gemma2Config", "norm"),
    "gpt_neox": ("GPTNeoXConfig", "final_layer_norm"),
    "olmo": ("OlmoConfig", "norm"),
    "olmo2": ("Olmo2Config", "norm"),
    "gpt2": ("GPT2Config", "ln_f"),
    "phi": ("PhiConfig", "final_layernorm"),
}


def family_config(family: str, layers: int = 3, hidden: int = 32):
    """A tiny config of `family` (4 heads, 2 KV heads where the family has GQA)."""
    cls = getattr(transformers, FAMILIES[family][0])
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if family == "gpt2":
        return cls(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=4, n_positions=256, **ids)
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=256,
        **ids,
    )
    if family not in ("gpt_neox", "phi"):
        kwargs["num_key_value_heads"] = 2
    if family in ("qwen3", "gemma", "gemma2"):
        kwargs["head_dim"] = hidden // 4
    return cls(**kwargs)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run ~30x faster on one thread than on two contended ones (shared CI cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Six LAMBADA passages cut to different lengths, so batches need padding."""
    passages = lambada_passages()[:6]
    return [" ".join(p.split()[:n]) for p, n in zip(passages, (5, 31, 12, 26, 8, 18))]


@pytest.fixture(scope="module")
def tokenizer():
    from tests._toy import train_tokenizer

    return train_tokenizer(lambada_passages()[:200], vocab_size=VOCAB)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """family → folder of a saved tiny model (built once per module)."""
    from tests._toy import save_random_model

    root = tmp_path_factory.mktemp("hf")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = save_random_model(family_config(family), root / family, tokenizer)
        return made[family]

    return get


def spec_of(path: Path) -> ModelSpec:
    from megatron_jreg.analysis.loading import ModelSpec

    return ModelSpec(path, path.name, "hf")


@contextlib.contextmanager
def final_norm_removed(base: nn.Module, attr: str):
    from torch import nn

    norm = getattr(base, attr)
    setattr(base, attr, nn.Identity())
    try:
        yield
    finally:
        setattr(base, attr, norm)


def reference_psi(folder: Path, family: str, texts: list[str], with_final_norm: bool = False) -> list[float]:
    """Ψ_ℓ (ℓ = 1..L) the plain way: per sample, float64 arccos(cos)/π, token-weighted mean."""
    import torch

    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        base = model.base_model
        guard = contextlib.nullcontext() if with_final_norm else final_norm_removed(base, FAMILIES[family][1])
        sums, count = None, 0
        with guard:
            for text in texts:
                ids = torch.tensor([tok(text)["input_ids"]])
                hidden = [h[0].double() for h in base(input_ids=ids, output_hidden_states=True).hidden_states]
                angles = torch.stack(
                    [
                        torch.arccos(torch.cosine_similarity(a, b, dim=-1).clamp(-1, 1)).sum() / math.pi
                        for a, b in zip(hidden[:-1], hidden[1:])
                    ]
                )
                sums = angles if sums is None else sums + angles
                count += ids.shape[1]
        return (sums / count).tolist()


def run(folder: Path, texts: list[str], batch_size: int = 4, padding_side: str = "right", **load):
    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.measure import measure

    source = load_hf_source(folder, label=folder.name, **load)
    result = measure(source, texts, spec_of(folder), batch_size=batch_size, padding_side=padding_side)
    return source, result


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_reference_and_final_norm_convention(family, model_dir, texts):
    """Hooks find the layers of every family and give the reference Ψ; --include-final-norm differs
    from the default exactly by the final norm (layers 1..L-1 equal, Ψ_L = the normed reference)."""
    from megatron_jreg.analysis.source import FINAL_NORM, LAYER_IO

    folder = model_dir(family)
    source, result = run(folder, texts)
    assert source.num_layers == 3 and source.convention == LAYER_IO
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in source.layers)
    expected = reference_psi(folder, family, texts)
    assert result.psi == pytest.approx(expected, abs=1e-5)
    assert result.truncated_samples == 0
    total_tokens = sum(len(ids) for ids in source.encode(texts))
    assert result.counts == [total_tokens] * 3

    _, normed = run(folder, texts, include_final_norm=True)
    assert normed.convention == FINAL_NORM
    assert normed.psi[:-1] == pytest.approx(result.psi[:-1], abs=1e-6)
    assert normed.psi[-1] == pytest.approx(reference_psi(folder, family, texts, with_final_norm=True)[-1], abs=1e-5)
    assert normed.psi[-1] != pytest.approx(result.psi[-1], abs=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_padding_invariance(family, model_dir, texts):
    """Batch of 1 (no padding) vs right- and left-padded batches: same Ψ and token counts. GPT-2 has
    absolute positions, so left padding only works because positions come from the mask."""
    folder = model_dir(family)
    _, single = run(folder, texts, batch_size=1)
    for side in ("right", "left"):
        _, padded = run(folder, texts, batch_size=6, padding_side=side)
        assert padded.counts == single.counts
        assert padded.psi == pytest.approx(single.psi, abs=1e-5), side


def test_bfloat16_close_to_float32(model_dir, texts):
    import torch

    folder = model_dir("llama")
    _, fp32 = run(folder, texts)
    source, bf16 = run(folder, texts, dtype=torch.bfloat16)
    assert next(source.base.parameters()).dtype == torch.bfloat16
    assert bf16.psi == pytest.approx(fp32.psi, rel=0.05, abs=5e-3)
    assert bf16.psi != fp32.psi  # the bf16 model really ran in bf16


def test_zeta_from_jreg(model_dir, texts):
    """ζ and the three reported jumps come from jreg's definitions of the measured Ψ."""
    import torch

    from megatron_jreg import jreg

    _, result = run(model_dir("qwen3"), texts)
    psi = torch.tensor(result.psi, dtype=torch.float64)
    assert result.zeta == pytest.approx(jreg.jump_rates(psi).tolist())
    assert result.final_jumps == pytest.approx(jreg.final_jumps(psi), nan_ok=True)
    assert result.middle_layers == (2, 2) and result.psi_mid_median == result.psi[1]


def test_unknown_architecture_names_the_class():
    from torch import nn

    from megatron_jreg.analysis.hf_source import find_decoder_layers
    from megatron_jreg.analysis.source import UnsupportedArchitectureError

    class Sequential(nn.Module):
        """Layers in an nn.Sequential, not a ModuleList: what `find_decoder_layers` must reject."""

        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    with pytest.raises(UnsupportedArchitectureError, match="cannot find the decoder layers of Sequential"):
        find_decoder_layers(Sequential(), expected=2)
    mixed = nn.Module()
    mixed.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
    with pytest.raises(UnsupportedArchitectureError, match="3 identical blocks"):
        find_decoder_layers(mixed, expected=3)


def test_unknown_architecture_through_loader(tmp_path, tokenizer):
    """A registered transformers model whose blocks are not in a ModuleList fails at load, by class name."""
    from torch import nn

    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.source import UnsupportedArchitectureError

    class BlockConfig(transformers.PretrainedConfig):
        model_type = "jreg_test_blocks"

        def __init__(self, vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, **kwargs):
            self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
            super().__init__(**kwargs)

    class BlockForCausalLM(transformers.PreTrainedModel):
        config_class = BlockConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.block_a = nn.Linear(config.hidden_size, config.hidden_size)
            self.block_b = nn.Linear(config.hidden_size, config.hidden_size)
            self.post_init()

    transformers.AutoConfig.register("jreg_test_blocks", BlockConfig)
    transformers.AutoModelForCausalLM.register(BlockConfig, BlockForCausalLM)
    BlockForCausalLM(BlockConfig()).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="BlockForCausalLM"):
        load_hf_source(tmp_path, label="blocks")


def test_hooks_sequence_first_mask_and_in_place_layers():
    """The generic hooks on a megatron-like layout: [s, b, h] states, mask [s, b], tuple outputs.
    An in-place layer is detected; clone_inputs=True then gives the exact per-layer sums."""
    import torch
    from torch import nn

    from megatron_jreg import jreg
    from megatron_jreg.analysis.source import LayerDisplacementHooks

    class AddInPlace(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.proj = nn.Linear(width, width)

        def forward(self, hidden_states: torch.Tensor, context: str = "") -> tuple[torch.Tensor, None]:
            return hidden_states.add_(self.proj(hidden_states)), None  # megatron-style (h, context) output

    with torch.no_grad():
        torch.manual_seed(0)
        layers = nn.ModuleList([AddInPlace(16) for _ in range(3)])
        x = torch.randn(5, 2, 16)
        mask = torch.ones(5, 2, dtype=torch.bool)
        mask[3:, 1] = False  # second sample is 3 tokens long

        def forward(h: torch.Tensor) -> list[torch.Tensor]:
            states = [h.clone()]
            for layer in layers:
                h, _ = layer(hidden_states=h)
                states.append(h.clone())
            return states

        with pytest.raises(RuntimeError, match="clone_inputs=True"):
            with LayerDisplacementHooks(layers, mask, "cosine"):
                forward(x.clone())
        with LayerDisplacementHooks(layers, mask, "cosine", clone_inputs=True) as hooks:
            states = forward(x.clone())
        for i in range(3):
            total, count = jreg.displacement_sum(states[i], states[i + 1], mask, "cosine")
            assert hooks.sums[i].item() == pytest.approx(total.item(), rel=1e-6)
            assert hooks.counts[i].item() == count.item() == 8


def test_source_is_a_hidden_state_source(model_dir):
    """HFSource exposes the protocol the megatron source will implement too."""
    import torch

    from megatron_jreg.analysis.hf_source import HFSource, load_hf_source

    source = load_hf_source(model_dir("gpt2"), label="g")
    assert isinstance(source, HFSource)
    assert source.layer_path == "h" and source.context_length == 256 and source.pad_id == 0
    ids, mask = torch.tensor([[5, 6, 7, 0]]), torch.tensor([[1, 1, 1, 0]])
    sums, counts = source.layer_sums(ids, mask, "angular")
    assert sums.dtype == counts.dtype == torch.float64 and counts.tolist() == [3.0] * 3
