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
    from tests._toy import save_random_model, train_tokenizer

    tokenizer = train_tokenizer(lambada_passages()[:200], vocab_size=VOCAB)
    config = family_config("llama", layers=LAYERS)
    config.initializer_range = 0.15
    config.tie_word_embeddings = False
    return save_random_model(config, tmp_path_factory.mktemp("removal") / "llama", tokenizer)


@pytest.fixture(scope="module")
def windows():
    import torch

    return torch.randint(0, VOCAB, (5, 19), generator=torch.Generator().manual_seed(0))


# Where each family keeps its decoder layers (named here, not found by the code under test); others: model.layers.
LAYERS_AT = {"gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers"}


def decoder_layers(model) -> list:
    return list(model.get_submodule(LAYERS_AT.get(model.config.model_type, "model.layers")))


def own_input(module, args: tuple, kwargs: dict, out):
    """A forward hook that skips its layer: the layer's input, in the structure of its output (a tensor, or a
    tuple led by the hidden states)."""
    import torch

    hidden = args[0] if args else kwargs["hidden_states"]
    return hidden if isinstance(out, torch.Tensor) else (hidden, *out[1:])


def reference(folder: Path, windows, top_k=TOP_K) -> dict:
    """CE of the model and of each variant, skipping by forward hooks that return the layer's input."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    layers = decoder_layers(model)
    num = len(layers)

    def ce(skipped) -> float:
        handles = [layers[i].register_forward_hook(own_input, with_kwargs=True) for i in skipped]
        try:
            with torch.no_grad():
                logits = model(windows[:, :-1]).logits.double()
        finally:
            for h in handles:
                h.remove()
        flat = logits.reshape(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(flat, windows[:, 1:].reshape(-1)).item()

    base = ce([])
    return {"base_ce": base, "ce_skip": [ce([i]) for i in range(num)],
            "ce_skip_top": [ce(range(num - k, num)) for k in top_k]}


def assert_matches(result: dict, ref: dict, matter: float = 100) -> None:
    """result equals ref to REL, and skipping any one layer moves CE by at least `matter` × that tolerance."""
    assert result["base_ce"] == pytest.approx(ref["base_ce"], rel=REL)
    assert result["ce_skip"] == pytest.approx(ref["ce_skip"], rel=REL)
    assert result["ce_skip_top"] == pytest.approx(ref["ce_skip_top"], rel=REL)
    delta = [c - ref["base_ce"] for c in ref["ce_skip"]]
    assert result["delta_ce"] == pytest.approx(delta, abs=REL * ref["base_ce"])
    assert min(abs(d) for d in delta) > matter * REL * ref["base_ce"]  # the layers really matter


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


def test_layer_removal_of_a_gguf_file_equals_the_reference(llama, windows, tmp_path):
    """The same model written as a GGUF file (F32, untied: its output.weight is the LM head)."""
    from megatron_jreg.analysis.removal import layer_removal
    from tests.test_analysis_gguf import write_llama_gguf

    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    path = write_llama_gguf(model, transformers.AutoTokenizer.from_pretrained(llama), tmp_path / "llama.gguf")
    assert_matches(layer_removal(path, windows, top_k=TOP_K, batch_size=5), reference(llama, windows))


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


def megatron_removal(rank: int, world: int, hf: str, tmp: str, windows, samples: list[list[int]]) -> dict:
    """In a fresh process (megatron-core's global state): the HF model as megatron-jreg checkpoints saved for
    TP=1/PP=1 and TP=2/PP=2, each measured from its path; one also loaded first (`MegatronModel`), and measured
    on padded text batches (all tokens and the last of each sample) as `analyze` measures them."""
    import torch

    from megatron_jreg.analysis.measure import padded_batches
    from megatron_jreg.analysis.megatron_source import MegatronSource
    from megatron_jreg.analysis.removal import layer_removal, next_token_targets, removal_totals
    from megatron_jreg.analysis.source import last_token_mask
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
    source = MegatronSource(loaded, "mcore")
    for positions in ("all", "last"):
        batches = list(padded_batches(samples, 3, 0))
        stats = None
        for ids, mask in batches:
            select = last_token_mask(mask) if positions == "last" else mask
            batch = source.layer_stats(ids, mask, "angular", select)
            stats = batch if stats is None else {k: stats[k] + batch[k] for k in stats}
        targets = [(ids, mask, next_token_targets(ids, mask, positions)) for ids, mask in batches]
        out[positions] = {"stats": {k: v.tolist() for k, v in stats.items()},
                          "removal": removal_totals(source, targets, TOP_K).as_dict()}
    return out


@pytest.mark.multirank
def test_megatron_checkpoints_equal_the_hf_references(llama, windows, samples, tmp_path):
    """Layer removal on windows (from checkpoint paths of two saved layouts and from a loaded model) and on
    padded text batches, the distances between any two layers and the residual norms of the megatron-jreg
    checkpoint equal the references computed on the Hugging Face model it was converted from."""
    from tests.distributed import run_ranks

    _, ids = samples
    results = run_ranks(megatron_removal, 1, str(llama), str(tmp_path), windows, ids, timeout=900)[0]
    ref = reference(llama, windows)
    for name in ("tp1pp1", "tp2pp2", "loaded"):
        result = results[name]
        assert result["num_layers"] == LAYERS and result["predicted_tokens"] == 5 * 18, name
        assert_matches(result, ref)
    for positions in ("all", "last"):
        measured = results[positions]
        assert_matches(measured["removal"], reference_on_samples(llama, ids, positions))
        norms, dist = reference_states(llama, ids, positions)
        stats = measured["stats"]
        tokens = stats["counts"][0]
        assert [n / tokens for n in stats["norm_sums"]] == pytest.approx(norms, rel=1e-5)
        for i in range(LAYERS + 1):
            for j in range(i + 1, LAYERS + 1):
                assert stats["distance_sums"][i][j] / tokens == pytest.approx(dist[i][j], abs=2e-6), (i, j)
        psi = [s / c for s, c in zip(stats["sums"], stats["counts"])]
        assert [stats["distance_sums"][i][i + 1] / tokens for i in range(LAYERS)] == pytest.approx(psi, abs=1e-6)


# ----------------------------------------------------------------------------------------------------------
# On text samples (what `analyze --remove-layers` measures): padded batches, all tokens or each sample's last.


def reference_on_samples(folder: Path, samples: list[list[int]], positions: str, top_k=TOP_K) -> dict:
    """As `reference`, one sample at a time (no padding): CE of every next-token prediction inside the sample,
    or only of its last token."""
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    layers = decoder_layers(model)
    num = len(layers)

    def ce(skipped) -> float:
        handles = [layers[i].register_forward_hook(own_input, with_kwargs=True) for i in skipped]
        total, count = 0.0, 0
        try:
            for ids in samples:
                ids = torch.tensor([ids])
                with torch.no_grad():
                    logits = model(ids).logits[0, :-1].double()
                targets = ids[0, 1:]
                if positions == "last":
                    logits, targets = logits[-1:], targets[-1:]
                total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
                count += len(targets)
        finally:
            for h in handles:
                h.remove()
        return total / count

    return {"base_ce": ce([]), "ce_skip": [ce([i]) for i in range(num)],
            "ce_skip_top": [ce(range(num - k, num)) for k in top_k]}


def reference_states(folder: Path, samples: list[list[int]], positions: str) -> tuple[list, list]:
    """(mean ‖h_ℓ‖ for ℓ = 0..L, mean angular d(h_i, h_j) [L+1][L+1]) the plain way: output_hidden_states with
    the final norm swapped for the identity, one sample at a time, float64 arccos of the cosine."""
    import math

    import torch

    from tests.test_analysis import final_norm_removed

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    size = LAYERS + 1
    norms = torch.zeros(size, dtype=torch.float64)
    dist = torch.zeros(size, size, dtype=torch.float64)
    count = 0
    with torch.no_grad(), final_norm_removed(model.model, "norm"):
        for ids in samples:
            hidden = [h[0].double() for h in model.model(input_ids=torch.tensor([ids]),
                                                         output_hidden_states=True).hidden_states]
            if positions == "last":
                hidden = [h[-1:] for h in hidden]
            count += hidden[0].shape[0]
            for i in range(size):
                norms[i] += hidden[i].norm(dim=-1).sum()
                for j in range(i + 1, size):
                    cos = torch.cosine_similarity(hidden[i], hidden[j], dim=-1).clamp(-1, 1)
                    dist[i, j] += (torch.arccos(cos) / math.pi).sum()
    return (norms / count).tolist(), (dist / count).tolist()


@pytest.fixture(scope="module")
def samples(llama) -> tuple[list[str], list[list[int]]]:
    """Seven LAMBADA passages cut to different lengths (one of a single word), and their token ids."""
    texts = [" ".join(p.split()[:n]) for p, n in zip(lambada_passages()[:7], (5, 31, 12, 1, 26, 8, 18))]
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama)
    return texts, [tokenizer(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("positions", ["all", "last"])
def test_measure_on_samples_equals_references(llama, samples, positions):
    """`measure` (what analyze runs): padded batches of text samples, in memory and streamed. Layer removal
    equals the hook reference, the distance between any two layers and the residual norms the plain
    output_hidden_states reference, and the n = 1 row of the distances is Ψ."""
    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.loading import ModelSpec
    from megatron_jreg.analysis.measure import measure
    from megatron_jreg.analysis.stream_source import load_stream_source

    texts, ids = samples
    spec = ModelSpec(llama, "llama", "hf")
    ref = reference_on_samples(llama, ids, positions)
    norms, dist = reference_states(llama, ids, positions)
    results = []
    for load in (load_hf_source, load_stream_source):
        source = load(llama, label="llama")
        results.append(measure(source, texts, spec, batch_size=3, positions=positions, remove_layers=TOP_K))
    for result in results:
        assert result.positions == positions and result.tokens == (len(ids) if positions == "last" else
                                                                   sum(map(len, ids)))
        predicted = [len(i) - 1 if positions == "all" else 1 for i in ids if len(i) > 1]
        assert result.removal["predicted_tokens"] == sum(predicted)
        assert_matches(result.removal, ref)
        assert result.residual_norms == pytest.approx(norms, rel=1e-5)
        for n, row in enumerate(result.layer_distances, start=1):
            assert row == pytest.approx([dist[i][i + n] for i in range(LAYERS + 1 - n)], abs=2e-6)
        assert result.layer_distances[0] == pytest.approx(result.psi, abs=1e-7)
        assert result.zero_tokens == [0] * (LAYERS + 1)
    assert results[1].removal["ce_skip"] == pytest.approx(results[0].removal["ce_skip"], rel=1e-6)


# ----------------------------------------------------------------------------------------------------------
# Other families: removal swaps each decoder layer's forward (`source.planned_layers`), whatever the layer returns
# and whatever the model does between layers.

FAMILY_CONFIGS = {
    "gpt2": lambda: family_config("gpt2", layers=LAYERS),  # learned positions, Conv1D, tied head
    "gpt_neox": lambda: family_config("gpt_neox", layers=LAYERS),  # parallel attention/MLP, partial rotary
    "mixtral": lambda: transformers.MixtralConfig(  # sparse MoE: router, per-expert tensors fused on load
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
        bos_token_id=0, eos_token_id=0, pad_token_id=0),
}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_other_families_equal_the_hook_reference(family, llama, samples, windows, tmp_path):
    """GPT-2, GPT-NeoX and Mixtral, tiny and random (initial weights of std 0.3, so that each layer matters): layer
    removal on token windows and on padded text samples, in memory and streamed, equals the hook reference."""
    from megatron_jreg.analysis.hf_source import load_hf_source
    from megatron_jreg.analysis.loading import ModelSpec
    from megatron_jreg.analysis.measure import measure
    from megatron_jreg.analysis.removal import layer_removal
    from megatron_jreg.analysis.stream_source import load_stream_source
    from tests._toy import save_random_model

    config = FAMILY_CONFIGS[family]()
    config.initializer_range = 0.3  # GPT-2 scales its output projections down by depth: larger than the Llama's
    texts, ids = samples  # the Llama's tokenizer, saved with this model too
    folder = save_random_model(config, tmp_path / family, transformers.AutoTokenizer.from_pretrained(llama))
    ref = reference(folder, windows)
    for stream in (False, True):  # random layers move CE less than the Llama's: ≥ 20x the tolerance, not 100x
        assert_matches(layer_removal(folder, windows, top_k=TOP_K, batch_size=2, stream=stream), ref, matter=20)
    ref = reference_on_samples(folder, ids, "all")
    for load in (load_hf_source, load_stream_source):
        result = measure(load(folder, label=family), texts, ModelSpec(folder, family, "hf"), batch_size=3,
                         remove_layers=TOP_K)
        assert_matches(result.removal, ref, matter=20)


# SmolLM2-135M-Instruct (Q4_1 GGUF), docs/results/analyze_smollm2.txt: Ψ of the 100-passage run, layer removal of the
# 20-passage run (30 layers, 1,661 predicted tokens)
SMOLLM2_PSI = [0.4966, 0.1920, 0.0902, 0.0778, 0.0810, 0.0811, 0.0819, 0.0835, 0.0931, 0.0870, 0.0936, 0.0924, 0.0774,
               0.0730, 0.0713, 0.0749, 0.0773, 0.0694, 0.0855, 0.0897, 0.1030, 0.0942, 0.0948, 0.0959, 0.1769, 0.0685,
               0.0753, 0.0943, 0.1023, 0.2225]
SMOLLM2_DELTA_CE = [7.7435, 3.6309, 1.1914, 0.1326, 0.1350, 0.0722, 0.1500, 0.1081, 0.7421, 0.2550, 0.3171, 2.0484,
                    0.1429, 0.1251, 0.0963, 0.1706, 0.1500, 0.0822, 0.1299, 0.1542, 0.1655, 0.2363, 0.2230, 0.1930,
                    0.6240, 0.2006, 0.2401, 0.3214, 1.2246, 1.8147]


def _removal_result(psi: list[float], delta_ce: list[float], top: list[float]):
    from megatron_jreg.analysis.measure import ModelResult

    removal = {"base_ce": 3.6198, "delta_ce": delta_ce, "top_k": [1, 2, 3][: len(top)], "delta_ce_top": top}
    return ModelResult(label="m", path="", kind="hf", model_class="", convention="hooks", step=None,
                       sums=[p * 10 for p in psi], counts=[10] * len(psi), samples=1, truncated_samples=0,
                       removal=removal)


def test_the_reading_names_the_cheapest_block_to_remove_not_the_smallest_psi():
    """issue 46.6: the reading named only the costliest layer; it now names the cheapest contiguous block of those
    measured (each layer alone, the top k) and, when that is another layer, what the layer of smallest Ψ costs: a
    layer that barely moves the hidden state is not necessarily cheap to remove (SmolLM2-135M: Ψ is smallest at
    layer 26, which costs nearly 3 × the cheapest layer's ΔCE)."""
    from megatron_jreg.analysis.report import reading

    text = reading(_removal_result(SMOLLM2_PSI, SMOLLM2_DELTA_CE, [1.8147, 3.0544, 4.3789]))
    assert ("Layer removal (CE 3.6198 nats): layer 1 costs most (+7.7435); the cheapest block measured is layer 6 "
            "alone (+0.0722), not layer 26 of the smallest Ψ (+0.2006); top 1: +1.8147, top 2: +3.0544, top 3: "
            "+4.3789") in text, text
    # JREG's near-identity top layers: skipping the top two lowers CE, cheaper than any layer alone
    jreg = reading(_removal_result([0.2, 0.1, 0.15, 0.01], [2.0, 0.5, 0.05, 0.02], [0.02, -0.6250]))
    assert "the cheapest block measured is layers 3-4, the top 2 (-0.6250), not layer 4 of the smallest Ψ" in jreg
    assert "layer 1 costs most (+2.0000)" in jreg
    same = reading(_removal_result([0.2, 0.1, 0.01, 0.15], [2.0, 0.5, 0.05, 0.3], [0.3, 0.4]))
    assert "the cheapest block measured is layer 3 alone (+0.0500); top 1" in same  # the smallest Ψ: nothing to add
