"""`megatron-jreg convert`: Megatron-LM checkpoints <-> Hugging Face Llama, checked by logits and round trips.

Three spawns (importing megatron costs seconds per process):
1. two gloo ranks train two tiny models with the training CLI and save them at TP=2 and at PP=2;
2. one process runs every conversion through the CLI's `main` (exports of both checkpoints, imports of
   the exports and of locally built Hugging Face models, the round trips back, each refusal) and records
   transformers' logits of the Hugging Face folders on a fixed batch;
3. two ranks load the imported checkpoints at TP=2 and at PP=2 (megatron-core, from the checkpoint's saved
   args): logits, and `megatron-jreg train --skip-train` with the flags the import printed, whose
   validation must reproduce the source run's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.distributed import run_ranks

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO / "examples" / "data" / "wikitext-2" / "valid.txt"
FP32 = 1e-4  # the float32 threshold

# Both runs: mock data, a 2-layer Llama of 64, validation once.
DATA = "--mock-data --train-iters 3 --eval-interval 3 --eval-iters 1 --micro-batch-size 1 --global-batch-size 2".split()
TRAIN = (
    "--model-preset tiny --num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --transformer-impl local --lr 1e-2 --log-interval 1 --no-progress "
    "--jreg-lambda 0.1 --save-interval 3"
).split() + DATA
# TP=2: grouped-query attention, untied output layer, float32, the Hugging Face tokenizer of the fixture
# (300 tokens: padded to 512 at TP=2, 384 at TP=1).
TP2 = ["--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2"]
# PP=2: multi-head attention, tied embeddings (Megatron-LM's default), bf16, the SentencePiece model of
# `train-tokenizer`'s default kind (384 pieces, eod 2: a multiple of 128, no padding).
PP2 = ["--num-query-groups", "4", "--tokenizer-type", "SentencePieceTokenizer", "--pipeline-model-parallel-size", "2",
       "--bf16"]


# ---------------------------------------------------------------------------------------------- in ranks
def input_tokens() -> torch.Tensor:
    """The token ids (2 × 24) that every logits check runs: seeded, the same tensor on every call and rank."""
    import torch

    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))


def _capture(fn, *args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = fn(*args)
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


def convert(argv: list[str]) -> tuple[int, str, str]:
    """`megatron-jreg convert ARGV` in this process: (exit code, stdout, stderr)."""
    from megatron_jreg.convert.cli import main

    return _capture(main, argv)


def train(argv: list[str]) -> tuple[int, str, str]:
    """`megatron-jreg train ARGV` in this process."""
    from megatron_jreg.train import main

    return _capture(main, argv)


def training_runs(rank: int, world: int, tmp: str, tokenizer: str, sp_model: str) -> dict:
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer]
    tp2 = train(TRAIN + TP2 + tok + ["--save", f"{tmp}/tp2", "--metrics-file", f"{tmp}/tp2.jsonl"])
    sp = ["--tokenizer-model", sp_model]
    pp2 = train(TRAIN + PP2 + sp + ["--save", f"{tmp}/pp2", "--metrics-file", f"{tmp}/pp2.jsonl"])
    return {"tp2": (tp2[0], tp2[2]), "pp2": (pp2[0], pp2[2])}


def _hf_models(tmp: Path, tokenizer: str) -> None:
    """Two Hugging Face Llamas built locally: tied MHA in safetensors with the tokenizer (RoPE base 5e5),
    and untied GQA in bf16 as a pickled pytorch_model.bin (old format, loaded with weights_only)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests._toy import perturb_vectors

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True,
                                                        rope_theta=500000.0))
    perturb_vectors(tied)  # uneven norm gains, so a norm mapping error would show
    tied.save_pretrained(tmp / "native_tied")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer) / name, tmp / "native_tied" / name)
    # Llama-3.1-style: RoPE scaling (rope_type llama3) and head_dim 32 != hidden / heads (--kv-channels)
    scaled = AutoModelForCausalLM.from_config(LlamaConfig(
        **common, num_key_value_heads=2, tie_word_embeddings=True, head_dim=32,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    perturb_vectors(scaled, seed=2)
    scaled.save_pretrained(tmp / "native_scaled")
    gqa = AutoModelForCausalLM.from_config(LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False))
    perturb_vectors(gqa, seed=1)
    gqa = gqa.to(torch.bfloat16)
    gqa.config.dtype = torch.bfloat16
    gqa.config.save_pretrained(tmp / "native_bin")
    torch.save(gqa.state_dict(), tmp / "native_bin" / "pytorch_model.bin")


def _refusal_folders(tmp: Path) -> dict[str, Path]:
    """config.json-only folders of architectures the converter must refuse, a Llama with an extra tensor,
    a .bin whose unpickling would run code, and a megatron checkpoint of a non-Llama model."""
    import torch
    from safetensors.torch import load_file, save_file

    base = json.loads((tmp / "native_tied" / "config.json").read_text())
    configs = {
        "bias": {**base, "attention_bias": True},
        "moe": {**base, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
        "sliding": {**base, "model_type": "mistral", "sliding_window": 16},
        "norm": {**base, "model_type": "gemma"},
        "rope_yarn": {**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}},
        "rope_llama3_odd": {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                        "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192}},
    }
    folders = {}
    for name, config in configs.items():
        folders[name] = tmp / "refuse" / name
        folders[name].mkdir(parents=True)
        (folders[name] / "config.json").write_text(json.dumps(config))
    extra = tmp / "refuse" / "qk_norm"
    extra.mkdir()
    (extra / "config.json").write_text(json.dumps(base))
    state = load_file(str(tmp / "native_tied" / "model.safetensors"))
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, str(extra / "model.safetensors"))
    folders["qk_norm"] = extra

    class RunsCode:  # unpickling this calls os.mkdir(marker): code execution, if the loader allowed it
        def __reduce__(self):
            return os.mkdir, (str(tmp / "pickle-ran"),)

    pickled = tmp / "refuse" / "pickle"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(base))
    torch.save({"model.embed_tokens.weight": RunsCode()}, pickled / "pytorch_model.bin")
    folders["pickle"] = pickled

    # A real Megatron-LM checkpoint of a GPT-2-style model (Megatron-LM's default architecture: LayerNorm,
    # GELU, biases, learned positions): saved args and weights, nothing Llama about it.
    from megatron_jreg.checkpoints import build_model
    from megatron_jreg.checkpoints.args import model_args
    from megatron_jreg.convert.from_hf import save_release_checkpoint

    args = model_args("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                      "--max-position-embeddings 32 --tokenizer-type NullTokenizer".split(), 300)
    fake = tmp / "refuse" / "layernorm_ckpt"
    save_release_checkpoint(fake, build_model(args), args, {})
    folders["layernorm_ckpt"] = fake
    return folders


def conversion_runs(rank: int, world: int, tmp: str, tokenizer: str, sp_model: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    t = Path(tmp)
    _hf_models(t, tokenizer)
    refuse = _refusal_folders(t)
    out: dict = {"export": {}, "import": {}, "roundtrip": {}, "refuse": {}}
    exports = {
        "hf_tp2": ["--load", f"{tmp}/tp2"],  # float32 run → float32, tokenizer from the run
        "hf_tp2_bf16": ["--load", f"{tmp}/tp2", "--dtype", "bfloat16"],  # rounds float32 weights
        "hf_pp2": ["--load", f"{tmp}/pp2", "--max-shard-size", "40KB"],  # bf16 run → bf16, several shards; its
        # SentencePiece model through transformers' own conversion
        "hf_pp2_fp32": ["--load", f"{tmp}/pp2", "--dtype", "float32"],
        "hf_tp2_no_tokenizer": ["--load", f"{tmp}/tp2", "--no-tokenizer"],
    }
    for name, argv in exports.items():
        out["export"][name] = convert(["mcore-to-hf", *argv, "--output", f"{tmp}/{name}"])
    imports = {
        "mc_tp2": ["--hf", f"{tmp}/hf_tp2", "--tensor-model-parallel-size", "2"],
        "mc_pp2": ["--hf", f"{tmp}/hf_pp2", "--pipeline-model-parallel-size", "2"],
        "mc_native_tied": ["--hf", f"{tmp}/native_tied", "--tensor-model-parallel-size", "2"],
        "mc_native_bin": ["--hf", f"{tmp}/native_bin", "--pipeline-model-parallel-size", "2", "--seq-length", "32"],
        "mc_native_scaled": ["--hf", f"{tmp}/native_scaled"],
    }
    for name, argv in imports.items():
        out["import"][name] = convert(["hf-to-mcore", *argv, "--output", f"{tmp}/{name}"])
        out["roundtrip"][name] = convert(["mcore-to-hf", "--load", f"{tmp}/{name}", "--output", f"{tmp}/rt_{name}"])
    cases = {name: ["hf-to-mcore", "--hf", str(folder)] for name, folder in refuse.items() if name != "layernorm_ckpt"}
    cases["layernorm_ckpt"] = ["mcore-to-hf", "--load", str(refuse["layernorm_ckpt"])]
    cases["tp3"] = ["hf-to-mcore", "--hf", f"{tmp}/native_tied", "--tensor-model-parallel-size", "3"]
    cases["verify_fails"] = ["mcore-to-hf", "--load", f"{tmp}/tp2", "--dtype", "bfloat16", "--verify-threshold", "1e-9"]
    cases["wrong_tokenizer"] = ["mcore-to-hf", "--load", f"{tmp}/pp2", "--tokenizer-model", tokenizer]
    cases["tokenizer_too_big"] = ["mcore-to-hf", "--load", f"{tmp}/mc_native_bin", "--tokenizer-model", sp_model]
    for name, argv in cases.items():
        out["refuse"][name] = convert([*argv, "--output", f"{tmp}/refused_{name}"])
    out["exists"] = convert(["hf-to-mcore", "--hf", f"{tmp}/native_tied", "--output", f"{tmp}/hf_tp2"])
    out["pickle_ran"] = (t / "pickle-ran").exists()
    # transformers' float32 logits of the Hugging Face folders, the reference for the layout checks
    reference = {}
    tokens = input_tokens()
    for name in ("hf_tp2", "hf_pp2", "native_tied", "native_bin", "native_scaled"):
        model = LlamaForCausalLM.from_pretrained(f"{tmp}/{name}", dtype=torch.float32, local_files_only=True)
        with torch.no_grad():
            reference[name] = model(input_ids=tokens).logits
    torch.save(reference, t / "reference_logits.pt")
    out["sp_logits"] = _sp_logits(t)
    return out


def _sp_logits(tmp: Path) -> dict:
    """The SentencePiece export, read as a user would: AutoTokenizer + AutoModelForCausalLM on a sentence,
    against the checkpoint's own model on the ids of the run's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_jreg.checkpoints.model import load_megatron_model

    text = WIKITEXT.read_text(encoding="utf-8")[20000:20400]
    hf_tok = AutoTokenizer.from_pretrained(str(tmp / "hf_pp2"), local_files_only=True)
    ids = hf_tok(text, return_tensors="pt")["input_ids"][:, :32]
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "hf_pp2"), dtype=torch.float32, local_files_only=True)
    ours = load_megatron_model(tmp / "pp2")
    with torch.no_grad():
        diff = float((model(input_ids=ids).logits - ours.logits(ids)).abs().max())
    return {"ids_equal": ids[0].tolist() == ours.tokenizer.tokenize(text)[:32], "diff": diff,
            "pad": hf_tok.pad_token_id, "eos": hf_tok.eos_token_id, "max_length": hf_tok.model_max_length}


def layout_logits(ckpt: str, tp: int, pp: int) -> torch.Tensor | None:
    """Load `ckpt` at TP=tp/PP=pp in float32 (megatron-core, the model from the checkpoint's saved args) and
    run input_tokens(); logits[b, t, V] on the last stage's first TP rank, None elsewhere."""
    import copy

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.argument_utils import core_transformer_config_from_args, gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_jreg.checkpoints import read_args, resolve
    from megatron_jreg.layer_spec import layer_spec

    path, _ = resolve(ckpt)
    args = copy.deepcopy(read_args(path))
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
    args.params_dtype, args.bf16, args.fp16 = torch.float32, False, False
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1)
    config = core_transformer_config_from_args(args)
    model_cfg = gpt_config_from_args(args, config)
    model_cfg.transformer_layer_spec = layer_spec
    model = GPTModelBuilder(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    model.load_state_dict(state["model"], strict=False)
    model.eval()
    tokens = input_tokens()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        if pp == 2:
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], args.hidden_size)
            if parallel_state.is_pipeline_first_stage():
                dist.send(model(tokens, positions, None).contiguous(), dst=1)
                parallel_state.destroy_model_parallel()
                return None
            dist.recv(hidden, src=0)
            model.set_input_tensor(hidden)
        logits = model(tokens, positions, None)
        logits = gather_from_tensor_model_parallel_region(logits)
    rank = parallel_state.get_tensor_model_parallel_rank()
    parallel_state.destroy_model_parallel()
    return None if rank != 0 else logits[..., : args.vocab_size].clone()


def _printed_flags(stdout: str) -> list[str]:
    """The `megatron-jreg train ...` flags an import printed (before the bracketed placeholder)."""
    line = next(line for line in stdout.splitlines() if line.strip().startswith("megatron-jreg train "))
    return line.strip().removeprefix("megatron-jreg train ").split(" [")[0].split()


def layout_runs(rank: int, world: int, tmp: str, printed: dict) -> dict:
    out: dict = {"logits": {}}
    for name, tp, pp in (("mc_tp2", 2, 1), ("mc_pp2", 1, 2), ("mc_native_tied", 2, 1), ("mc_native_bin", 1, 2)):
        out["logits"][name] = layout_logits(f"{tmp}/{name}", tp, pp)
    # The training CLI evaluates each import at its source run's layout, with the flags the import printed.
    for name in ("mc_tp2", "mc_pp2"):
        argv = printed[name] + DATA + ["--transformer-impl", "local", "--skip-train", "--no-progress",
                                       "--metrics-file", f"{tmp}/{name}-skip.jsonl"]
        rc, _, err = train(argv)
        out[f"skip_{name}"] = (rc, err)
    return out


# -------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_jreg.data.train_tokenizer import train_tokenizer

    tmp = tmp_path_factory.mktemp("convert")
    text = WIKITEXT.read_text(encoding="utf-8")[:20000]
    (tmp / "text.txt").write_text(text, encoding="utf-8")
    tokenizer = train_tokenizer([str(tmp / "text.txt")], str(tmp / "tok"), 300, kind="hf-bpe")
    sp_model = train_tokenizer([str(tmp / "text.txt")], str(tmp / "sp" / "sp"), 384, kind="sentencepiece")
    trained = run_ranks(training_runs, 2, str(tmp), tokenizer, sp_model)[0]
    assert all(rc == 0 for rc, _ in trained.values()), trained
    converted = run_ranks(conversion_runs, 1, str(tmp), tokenizer, sp_model)[0]
    printed = {name: _printed_flags(converted["import"][name][1]) for name in ("mc_tp2", "mc_pp2")}
    layouts = run_ranks(layout_runs, 2, str(tmp), printed)
    return {"tmp": tmp, "converted": converted, "layouts": layouts, "tokenizer": tokenizer}


def _diff(rc_out_err: tuple[int, str, str]) -> float:
    rc, out, err = rc_out_err
    assert rc == 0, out + err
    last = out.strip().splitlines()[-1]
    assert last.startswith("max_abs_logit_diff="), out
    return float(last.split("=", 1)[1])


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    import torch
    from safetensors.torch import load_file

    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", weights_only=True)
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def _first_validation(path: Path) -> dict:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("split") == "valid"][0]


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", ["hf_tp2", "hf_pp2", "hf_pp2_fp32", "hf_tp2_no_tokenizer"])
def test_export_matches_megatron_logits(runs, name):
    """Exports that keep the weights exact reproduce megatron's logits to float32 precision."""
    diff = _diff(runs["converted"]["export"][name])
    assert diff < FP32
    print(f"{name}: max_abs_logit_diff={diff:.3e}")


def test_bf16_export_of_float32_run_checks_the_rounded_weights(runs):
    """float32 weights written as bfloat16: the check compares both models on the rounded weights (exact
    mapping), and reports what the rounding itself did to the logits."""
    rc, out, err = runs["converted"]["export"]["hf_tp2_bf16"]
    assert _diff((rc, out, err)) < FP32
    rounding = float(out.split("moved the logits by up to ")[1].split()[0])
    assert FP32 < rounding < 0.2
    assert json.loads((runs["tmp"] / "hf_tp2_bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    print(f"hf_tp2_bf16: max_abs_logit_diff={_diff((rc, out, err)):.3e}, bf16 rounding effect {rounding:.3e}")


def test_export_writes_llama_config_shards_and_tokenizer(runs):
    tmp = runs["tmp"]
    config = json.loads((tmp / "hf_tp2" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 300  # not the padded 512
    assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4 and config["head_dim"] == 16
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] == 0  # <|endoftext|>
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 32
    assert json.loads((tmp / "hf_tp2" / "generation_config.json").read_text())["eos_token_id"] == 0
    # under --max-shard-size (5GB) one model.safetensors, as save_pretrained writes it
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (tmp / "hf_tp2" / name).is_file(), name
    pp2 = json.loads((tmp / "hf_pp2" / "config.json").read_text())
    assert pp2["tie_word_embeddings"] is True and pp2["num_key_value_heads"] == 4 and pp2["dtype"] == "bfloat16"
    index = json.loads((tmp / "hf_pp2" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp / "hf_pp2" / s).is_file() for s in shards)
    assert "lm_head.weight" not in index["weight_map"]
    assert not list(tmp.glob(".*partial*"))
    tokenizer_config = json.loads((tmp / "hf_tp2" / "tokenizer_config.json").read_text())
    assert tokenizer_config["pad_token"] == "<|endoftext|>" and config["pad_token_id"] == 0  # pad: the eod
    assert tokenizer_config["model_max_length"] == 32  # the model's context, not 1073741824
    assert not (tmp / "hf_tp2_no_tokenizer" / "tokenizer.json").exists()
    assert json.loads((tmp / "hf_tp2_no_tokenizer" / "config.json").read_text())["vocab_size"] == 300


def test_sentencepiece_run_exports_and_loads_in_transformers_with_equal_logits(runs):
    """The default `train-tokenizer` kind (the PP=2 run): the export carries transformers' conversion of the
    .model, whose ids equal the run's on a WikiText passage, and the exported model gives the checkpoint's
    logits on them."""
    sp = runs["converted"]["sp_logits"]
    assert sp["ids_equal"] and sp["diff"] < FP32
    assert (sp["eos"], sp["pad"], sp["max_length"]) == (2, 2, 32)
    config = json.loads((runs["tmp"] / "hf_pp2" / "config.json").read_text())
    assert config["vocab_size"] == 384 and config["eos_token_id"] == 2 and config["bos_token_id"] == 1
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        assert (runs["tmp"] / "hf_pp2" / name).is_file(), name
    print(f"hf_pp2: logits diff through AutoTokenizer ids {sp['diff']:.3e}")


@pytest.mark.parametrize("name,source", [
    ("mc_tp2", "hf_tp2"), ("mc_pp2", "hf_pp2"), ("mc_native_tied", "native_tied"), ("mc_native_bin", "native_bin"),
    ("mc_native_scaled", "native_scaled"),
])
def test_round_trip_hf_megatron_hf_is_bit_exact(runs, name, source):
    import torch

    conv = runs["converted"]
    assert _diff(conv["import"][name]) < FP32
    assert _diff(conv["roundtrip"][name]) < FP32
    before, after = _tensors(runs["tmp"] / source), _tensors(runs["tmp"] / f"rt_{name}")
    assert sorted(before) == sorted(after)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key


def test_import_is_a_megatron_lm_release_checkpoint_with_args(runs):
    """The import holds Megatron-LM's own args for the model (what pretrain_gpt.py and every megatron-jreg
    command rebuild it from), in Megatron-LM's release layout."""
    from megatron_jreg.checkpoints import read_args

    tmp = runs["tmp"]
    assert (tmp / "mc_native_tied" / "latest_checkpointed_iteration.txt").read_text() == "release"
    args = read_args(tmp / "mc_native_tied" / "release")
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (2, 64, 96, 4)
    assert args.num_query_groups == 4 and args.untie_embeddings_and_output_weights is False
    assert args.rotary_base == 500000 and args.layernorm_epsilon == 1e-5 and args.padded_vocab_size == 512
    assert args.seq_length == args.max_position_embeddings == 64 and args.tensor_model_parallel_size == 2
    assert args.normalization == "RMSNorm" and args.swiglu and not args.add_bias_linear
    assert args.tokenizer_type == "HuggingFaceTokenizer"
    assert args.tokenizer_model == str((tmp / "native_tied").resolve())
    scaled = read_args(tmp / "mc_native_scaled" / "release")
    assert scaled.use_rope_scaling and scaled.rope_scaling_factor == 32.0 and scaled.kv_channels == 32
    bin_args = read_args(tmp / "mc_native_bin" / "release")
    assert bin_args.seq_length == 32 and bin_args.bf16 is True
    out = runs["converted"]["import"]["mc_tp2"][1]
    assert "megatron-jreg train --load" in out and "--num-query-groups 2" in out


def test_export_config_carries_rope_for_every_reader(runs):
    """transformers 5 writes RoPE as rope_parameters only; the export adds rope_theta (+ rope_scaling), which
    transformers 4.x reads, so no reader falls back to a base of 10,000. Checked the 4.x way: the plain
    JSON fields."""
    tmp = runs["tmp"]
    plain = json.loads((tmp / "rt_mc_native_tied" / "config.json").read_text())
    assert plain["rope_theta"] == 500000.0 and plain["rope_parameters"]["rope_theta"] == 500000.0
    scaled = json.loads((tmp / "rt_mc_native_scaled" / "config.json").read_text())
    assert scaled["rope_theta"] == 500000.0 and scaled["head_dim"] == 32
    assert scaled["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("name,source,tp", [
    ("mc_tp2", "hf_tp2", 2), ("mc_pp2", "hf_pp2", 1), ("mc_native_tied", "native_tied", 2),
    ("mc_native_bin", "native_bin", 1),
])
def test_import_loads_at_requested_layout_with_same_logits(runs, name, source, tp):
    import torch

    reference = torch.load(runs["tmp"] / "reference_logits.pt", weights_only=True)[source]
    got = [r["logits"][name] for r in runs["layouts"] if r["logits"][name] is not None]
    assert len(got) == 1
    assert got[0].shape == reference.shape
    assert (got[0] - reference).abs().max() < FP32


@pytest.mark.parametrize("name,source", [("mc_tp2", "tp2"), ("mc_pp2", "pp2")])
def test_training_cli_loads_import_like_its_source_run(runs, name, source):
    """`megatron-jreg train` with the flags the import printed and --skip-train, at the source's layout,
    reproduces the source run's validation: the same Ψ per layer (every hidden state), and for the unpadded
    vocabulary the same loss. (With padding the loss differs: megatron's softmax spans the padded columns,
    whose rows Hugging Face does not keep and an import fills with zeros.)"""
    rc, err = runs["layouts"][0][f"skip_{name}"]
    assert rc == 0, err
    got = _first_validation(runs["tmp"] / f"{name}-skip.jsonl")
    ref = _first_validation(runs["tmp"] / f"{source}.jsonl")
    assert got["psi"] == pytest.approx(ref["psi"], rel=1e-5)
    if name == "mc_pp2":
        assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)


@pytest.mark.parametrize("case,needle", [
    ("bias", "attention_bias"),
    ("moe", "MoE"),
    ("sliding", "sliding_window"),
    ("norm", "different norm"),
    ("rope_yarn", "RoPE scaling 'yarn'"),
    ("rope_llama3_odd", "low_freq_factor"),
    ("qk_norm", "QK-norm"),
    ("pickle", "weights_only"),
    ("layernorm_ckpt", "--normalization LayerNorm"),
    ("tp3", "--tensor-model-parallel-size (3)"),
    ("wrong_tokenizer", "300 tokens, the run's SentencePieceTokenizer"),
    ("tokenizer_too_big", "384 tokens, the run's NullTokenizer (--vocab-size) has 300"),
])
def test_refuses_with_the_mismatch_and_writes_nothing(runs, case, needle):
    rc, out, err = runs["converted"]["refuse"][case]
    assert rc == 2, out + err
    assert needle in err and "Traceback" not in err
    assert not (runs["tmp"] / f"refused_{case}").exists()
    assert not list(runs["tmp"].glob(f".refused_{case}*"))


def test_wrong_tokenizer_names_both_vocabularies_and_eod_ids(runs):
    err = runs["converted"]["refuse"]["wrong_tokenizer"][2]
    assert "has 384" in err and "end-of-document id 0" in err and "has 2" in err and "--no-tokenizer" in err


def test_megatron_refusal_lists_every_non_llama_feature(runs):
    err = runs["converted"]["refuse"]["layernorm_ckpt"][2]
    assert "biases" in err and "GELU" in err


def test_pickled_code_is_never_run(runs):
    assert runs["converted"]["pickle_ran"] is False


def test_failed_verification_leaves_no_output(runs):
    rc, out, err = runs["converted"]["refuse"]["verify_fails"]
    assert rc == 1 and "max_abs_logit_diff=" in err and "exceeds the threshold" in err
    assert not (runs["tmp"] / "refused_verify_fails").exists()
    assert not list(runs["tmp"].glob(".refused_verify_fails*"))


def test_refuses_to_overwrite_an_existing_folder(runs):
    rc, _, err = runs["converted"]["exists"]
    assert rc == 2 and "exists and is not empty" in err
    assert (runs["tmp"] / "hf_tp2" / "config.json").is_file()
