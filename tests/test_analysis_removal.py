"""Layer removal against an independent reference: the model's own forward with forward hooks that return each
skipped layer's input (instead of its output), and float64 cross-entropy of the logits. In memory, streamed, and
for the same model converted to a megatron-jreg checkpoint (several saved layouts).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_jreg.data.text import lambada_passages
from tests._lazy import importorskip_lazy
from tests.test_analysis import VOCAB, family_config, one_thread  # noqa: F401 (one_thread: autouse fixture)

transformers = importorskip_lazy("transformers")
LAYERS = 4
TOP_K = (1, 2, LAYERS)
REL = 1e-5


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny untied Llama whose layers matter: larger initial weights than transformers' 0.02, so that
    skipping a layer moves the cross-entropy by far more than float rounding."""
    from megatron_jreg.analysis.toy import save_random_model, train_tokenizer

    tokenizer = train_tokenizer(lambada_passages()[:200], vocab_size=VOCAB)
    config = family_config("llama", layers=LAYERS)
    config.initializer_range = 0.15
    config.tie_word_embeddings = False
    return save_random_model(config, tmp_path_factory.mktemp("removal") / "llama", tokenizer)


@pytest.fixture(scope="module")
def windows():
    import torch

    return torch.randint(0, VOCAB, (5, 19), generator=torch.Generator().manual_seed(0))


def reference(folder: Path, windows, top_k=TOP_K) -> dict:
    """CE of the model and of each variant, skipping by forward hooks that return the layer's input."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    layers = model.model.layers

    def ce(skipped) -> float:
        handles = [layers[i].register_forward_hook(lambda m, args, kwargs, out: args[0] if args else
                                                   kwargs["hidden_states"], with_kwargs=True) for i in skipped]
        try:
            with torch.no_grad():
                logits = model(windows[:, :-1]).logits.double()
        finally:
            for h in handles:
                h.remove()
        flat = logits.reshape(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(flat, windows[:, 1:].reshape(-1)).item()

    base = ce([])
    return {"base_ce": base, "ce_skip": [ce([i]) for i in range(LAYERS)],
            "ce_skip_top": [ce(range(LAYERS - k, LAYERS)) for k in top_k]}


def assert_matches(result: dict, ref: dict) -> None:
    assert result["base_ce"] == pytest.approx(ref["base_ce"], rel=REL)
    assert result["ce_skip"] == pytest.approx(ref["ce_skip"], rel=REL)
    assert result["ce_skip_top"] == pytest.approx(ref["ce_skip_top"], rel=REL)
    delta = [c - ref["base_ce"] for c in ref["ce_skip"]]
    assert result["delta_ce"] == pytest.approx(delta, abs=REL * ref["base_ce"])
    assert min(abs(d) for d in delta) > 100 * REL * ref["base_ce"]  # the layers really matter


def test_layer_removal_equals_hook_reference_in_memory_and_streamed(llama, windows):
    from megatron_jreg.analysis.removal import layer_removal

    ref = reference(llama, windows)
    in_memory = layer_removal(llama, windows, top_k=TOP_K, batch_size=2)
    assert in_memory["num_layers"] == LAYERS and in_memory["predicted_tokens"] == 5 * 18
    assert in_memory["top_k"] == list(TOP_K)
    assert_matches(in_memory, ref)
    streamed = layer_removal(llama, windows, top_k=TOP_K, batch_size=3, stream=True)
    assert_matches(streamed, ref)
    assert streamed["ce_skip"] == pytest.approx(in_memory["ce_skip"], rel=1e-6)
    # the top-1 variant is the variant without layer L; the defaults measure k = 1, 2, 3
    assert in_memory["ce_skip_top"][0] == pytest.approx(in_memory["ce_skip"][-1], rel=1e-7)
    assert layer_removal(llama, windows)["top_k"] == [1, 2, 3]


def test_layer_removal_of_a_loaded_model_leaves_it_unchanged(llama, windows):
    """A transformers model passed in: same figures, and afterwards no layer answers from a recording."""
    import torch

    from megatron_jreg.analysis.removal import layer_removal

    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    with torch.no_grad():
        before = model(windows[:, :-1]).logits
    result = layer_removal(model, windows, top_k=(2,), batch_size=5)
    assert_matches(result, reference(llama, windows, top_k=(2,)))
    assert all("forward" not in vars(layer) and not layer._forward_hooks for layer in model.model.layers)
    with torch.no_grad():
        assert torch.equal(model(windows[:, :-1]).logits, before)


def megatron_removal(rank: int, world: int, hf: str, tmp: str, windows) -> dict:
    """In a fresh process (megatron-core's global state): the HF model as megatron-jreg checkpoints saved for
    TP=1/PP=1 and TP=2/PP=2, each measured from its path; one also loaded first (`MegatronModel`)."""
    import torch

    from megatron_jreg.analysis.removal import layer_removal
    from megatron_jreg.checkpoints import load_megatron_model
    from megatron_jreg.convert.from_hf import hf_to_mcore

    torch.set_num_threads(1)
    out = {}
    for tp, pp in ((1, 1), (2, 2)):
        ckpt = Path(tmp) / f"mcore-tp{tp}-pp{pp}"
        hf_to_mcore(hf, ckpt, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, verify=False)
        out[f"tp{tp}pp{pp}"] = layer_removal(ckpt, windows, top_k=TOP_K, batch_size=2)
    loaded = load_megatron_model(Path(tmp) / "mcore-tp1-pp1", load_tokenizer=False)
    out["loaded"] = layer_removal(loaded, windows, top_k=TOP_K, batch_size=5)
    return out


@pytest.mark.multirank
def test_layer_removal_of_megatron_checkpoints_equals_the_hf_reference(llama, windows, tmp_path):
    from tests.distributed import run_ranks

    results = run_ranks(megatron_removal, 1, str(llama), str(tmp_path), windows, timeout=900)[0]
    ref = reference(llama, windows)
    for name, result in results.items():
        assert result["num_layers"] == LAYERS and result["predicted_tokens"] == 5 * 18, name
        assert_matches(result, ref)
