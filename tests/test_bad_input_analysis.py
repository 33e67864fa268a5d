"""Bad input for `analyze`, `evaluate`, `compare` and `convert hf-to-mcore`: every case exits non-zero with one
error line that names the file or flag and says what to do; no traceback, no result written, nothing passes
silently.

Each case builds its bad input from the tiny models and files of the module fixtures (`Inputs`), runs the
command's `main` in this process and checks exit code, the error line and that no output appeared. Hostile
model folders (absurd configs, forged safetensors headers and indexes, pickles and code that would create a
marker folder when run, FIFOs) are built by the cases themselves (`HOSTILE`); each is refused before anything
loads, and the marker never appears.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import os
import pickle
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from megatron_jreg.data.text import lambada_passages
from tests._lazy import importorskip_lazy
from tests.test_analysis import VOCAB, family_config, one_thread  # noqa: F401 (one_thread: autouse fixture)
from tests.test_analysis_gguf import write_gguf, write_llama_gguf

transformers = importorskip_lazy("transformers")
# Each command's module (its `main(argv)`), imported when a case runs: collecting this file imports no torch.
COMMANDS: dict[str, str] = {
    "analyze": "megatron_jreg.analysis.cli",
    "evaluate": "megatron_jreg.evaluate.cli",
    "compare": "megatron_jreg.evaluate.compare",
    "convert": "megatron_jreg.convert.cli",
}


@dataclass
class Inputs:
    """The good inputs that bad ones are made from, and a scratch folder per case."""

    llama: Path
    gguf: Path
    tokenizer: object
    root: Path
    tmp: Path = Path()

    def copy(self, name: str) -> Path:
        """A private copy of the Llama folder to break."""
        return Path(shutil.copytree(self.llama, self.tmp / name))

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def lambada(self, *records: object) -> Path:
        return self.file("lambada.jsonl", "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))

    def result(self, name: str, seed: int | None, acc: object = 0.5, shots: int | None = None, fields=()) -> Path:
        """A compare input; `fields` add top-level keys (samples, higher_is_better, n_shot, ...)."""
        record = {"results": {"lambada": {"acc": acc}}, "seed": seed, "config": {"num_fewshot": shots}, **dict(fields)}
        return self.file(name, json.dumps(record))  # json writes NaN/Infinity as Python reads them back


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Inputs:
    from tests._toy import save_random_model, train_tokenizer

    root = tmp_path_factory.mktemp("good")
    tokenizer = train_tokenizer(lambada_passages()[:200], vocab_size=VOCAB)
    llama = save_random_model(family_config("llama", hidden=64), root / "llama", tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    gguf = write_llama_gguf(model, tokenizer, root / "llama.gguf")
    return Inputs(llama, gguf, tokenizer, root)


# ---------------------------------------------------------------------------------------------------
# The bad inputs. Each builder returns the argv; `expect` are fragments of the one error line.


def truncated_gguf(size: int):
    def build(i: Inputs) -> list[str]:
        return ["--model", str(i.file("cut.gguf", i.gguf.read_bytes()[:size]))]

    return build


def mixtral_without_experts(i: Inputs) -> Path:
    from safetensors.torch import load_file, save_file

    from tests._toy import save_random_model

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    folder = save_random_model(config, i.tmp / "mixtral", i.tokenizer)
    tensors = {k: v for k, v in load_file(folder / "model.safetensors").items() if ".experts." not in k}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def edited_weights(edit: Callable[[dict], None]):
    def build(i: Inputs) -> Path:
        from safetensors.torch import load_file, save_file

        folder = i.copy("edited")
        tensors = load_file(folder / "model.safetensors")
        edit(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder

    return build


def with_config(text: str):
    def build(i: Inputs) -> Path:
        folder = i.copy("config")
        (folder / "config.json").write_text(text)
        return folder

    return build


def with_config_value(key: str, value: object):
    def build(i: Inputs) -> Path:
        folder = i.copy("config")
        config = json.loads((folder / "config.json").read_text())
        config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return build


def truncated_safetensors(i: Inputs) -> Path:
    folder = i.copy("cut")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


def without(*names: str):
    def build(i: Inputs) -> Path:
        folder = i.copy("partial")
        for pattern in names:
            for path in folder.glob(pattern):
                path.unlink()
        return folder

    return build


def gguf_with(**extra):
    """The Llama as a GGUF file with extra metadata keys or tensors that transformers' loader would drop."""

    def build(i: Inputs) -> list[str]:
        model = transformers.AutoModelForCausalLM.from_pretrained(i.llama)
        return ["--model", str(write_gguf(model, i.tokenizer, i.tmp / "extra.gguf", **extra))]

    return build


def opt_350m_style(i: Inputs) -> Path:
    """OPT-350m's layout: post-norm layers (no final norm) and a projection to a narrower width after them."""
    from tests._toy import save_random_model

    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=16, ffn_dim=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, do_layer_norm_before=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return save_random_model(config, i.tmp / "opt", i.tokenizer)


def quantized_config(i: Inputs) -> Path:
    folder = i.copy("quantized")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    return folder


def bin_weights(i: Inputs) -> Path:
    """The Llama folder with its weights as a pickled pytorch_model.bin instead of safetensors."""
    import torch
    from safetensors.torch import load_file

    folder = i.copy("bin")
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


PAYLOAD = "payload-ran"  # a folder that hostile files create if their code ever runs


class RunsCode:
    """Unpickling this creates the PAYLOAD marker folder: code execution, if a loader allowed it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def with_config_values(**values: object):
    def build(i: Inputs) -> Path:
        folder = i.copy("config")
        config = json.loads((folder / "config.json").read_text())
        config.update(values)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return build


def with_raw_value(key: str, literal: str):
    """config.json with `key` set to a JSON literal as written (e.g. 1e9, which JSON reads as a float)."""

    def build(i: Inputs) -> Path:
        config = json.loads((i.llama / "config.json").read_text())
        config[key] = "__RAW__"
        return with_config(json.dumps(config).replace('"__RAW__"', literal))(i)

    return build


def edited_header(edit: Callable[[dict], None] | None = None, raw: Callable[[bytes], bytes] | None = None):
    """The Llama folder with its model.safetensors header edited as JSON (the data left where it is), or
    the whole file rewritten by `raw`."""

    def build(i: Inputs) -> Path:
        folder = i.copy("header")
        path = folder / "model.safetensors"
        data = path.read_bytes()
        if raw is not None:
            path.write_bytes(raw(data))
            return folder
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        edit(header)
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
        return folder

    return build


def _grow_shape(header: dict) -> None:
    header["model.norm.weight"]["shape"] = [header["model.norm.weight"]["shape"][0] + 1]


def _overlap(header: dict) -> None:
    """The last tensor moved 4 bytes back, into the one before it."""
    last = max((e for k, e in header.items() if k != "__metadata__"), key=lambda e: e["data_offsets"][0])
    last["data_offsets"] = [x - 4 for x in last["data_offsets"]]


def index_naming(target: str):
    """A sharded-looking folder whose model.safetensors.index.json maps every tensor to `target`."""
    def build(i: Inputs) -> Path:
        from safetensors.torch import load_file

        folder = i.copy("index")
        names = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, target)}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return folder

    return build


def pickled(content: Callable[[Inputs], object] | None = None, raw: bytes | None = None):
    """The Llama folder with a pytorch_model.bin instead of safetensors: a torch.save of `content(i)`, or
    `raw` bytes (a bare pickle)."""

    def build(i: Inputs) -> Path:
        import torch

        folder = i.copy("pickled")
        (folder / "model.safetensors").unlink()
        if raw is not None:
            (folder / "pytorch_model.bin").write_bytes(raw)
        else:
            torch.save(content(i), folder / "pytorch_model.bin")
        return folder

    return build


def hostile_bin(i: Inputs) -> object:
    return {"model.embed_tokens.weight": RunsCode(i.tmp / PAYLOAD)}


def custom_tokenizer(i: Inputs, folder: Path | None = None) -> Path:
    """A tokenizer whose tokenizer_config.json names its own class in a Python file that creates the marker
    on import (transformers without trust_remote_code=False asks "Do you wish to run the custom code?")."""
    folder = folder or i.copy("custom-tokenizer")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    code = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config.update(tokenizer_class="EvilTokenizer", auto_map=code)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text(f"import os\nos.mkdir({str(i.tmp / PAYLOAD)!r})\n")
    return folder


def custom_model(i: Inputs) -> Path:
    """A config.json of a model type transformers does not know, implemented by the folder's own code."""
    folder = i.copy("custom-model")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                               "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (folder / name).write_text(f"import os\nos.mkdir({str(i.tmp / PAYLOAD)!r})\n")
    return folder


def fifo_weights(i: Inputs) -> Path:
    folder = i.copy("fifo")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    return folder


def separate_custom_tokenizer(i: Inputs) -> list[str]:
    tokenizer = i.tmp / "tokenizer"
    tokenizer.mkdir()
    i.tokenizer.save_pretrained(tokenizer)
    return ["--model", str(i.llama), "--tokenizer", str(custom_tokenizer(i, tokenizer))]


# Hostile model folders refused in one line by analyze, evaluate and convert (the `model_files` checks):
# name -> (builder, fragments of the error line).
HOSTILE: dict[str, tuple[Callable[[Inputs], Path], tuple[str, ...]]] = {
    "config-layers-1e9": (with_config_value("num_hidden_layers", 10**9), ("num_hidden_layers 1000000000",
                                                                            "does not fit the weight files")),
    "config-heads-0": (with_config_value("num_attention_heads", 0), ("num_attention_heads must be a positive",)),
    "config-hidden-1e9-float": (with_raw_value("hidden_size", "1e9"), ("hidden_size must be a positive integer",)),
    "config-hidden-1e9": (with_config_value("hidden_size", 10**9), ("hidden_size 1000000000", "does not fit")),
    "config-layers-string": (with_config_value("num_hidden_layers", "twelve"), ('num_hidden_layers', '"twelve"')),
    "config-layers-null": (with_config_value("num_hidden_layers", None), ("num_hidden_layers", "null")),
    "config-layers-bool": (with_config_value("num_hidden_layers", True), ("num_hidden_layers", "true")),
    "config-vocab-1e10": (with_config_value("vocab_size", 10**10), ("vocab_size 10000000000", "does not fit")),
    "config-vocab-negative": (with_config_value("vocab_size", -5), ("vocab_size must be a positive integer", "-5")),
    "config-eps-negative": (with_config_value("rms_norm_eps", -1e-5), ("rms_norm_eps must be a positive finite",)),
    "config-rope-theta-zero": (with_config_values(rope_theta=0, rope_parameters={"rope_type": "default",
                                                                                "rope_theta": 0}), ("rope_theta",)),
    "config-kv-heads-not-dividing": (with_config_value("num_key_value_heads", 3), ("num_key_value_heads 3",)),
    "config-experts-1e9": (with_config_value("num_local_experts", 10**9), ("num_local_experts 1000000000",)),
    "safetensors-header-huge": (edited_header(raw=lambda d: struct.pack("<Q", 2**62) + d[8:]),
                                ("model.safetensors", "header too large", "download it again")),
    "safetensors-header-past-end": (edited_header(raw=lambda d: struct.pack("<Q", len(d)) + d[8:]),
                                    ("model.safetensors", "invalid header length")),
    "safetensors-8-bytes": (edited_header(raw=lambda d: d[:8]), ("model.safetensors", "invalid header length")),
    "safetensors-4-bytes": (edited_header(raw=lambda d: d[:4]), ("model.safetensors", "header too small")),
    "safetensors-header-not-json": (edited_header(raw=lambda d: d[:8] + b"\xff" * 16 + d[24:]),
                                    ("model.safetensors", "invalid UTF-8 in header")),
    "safetensors-shape-vs-offsets": (edited_header(_grow_shape),
                                     ("model.safetensors", "invalid shape, data type, or offset")),
    "safetensors-overlap": (edited_header(_overlap), ("invalid offset for tensor `model.norm.weight`",)),
    "safetensors-dtype-unknown": (edited_header(lambda h: h["model.norm.weight"].update(dtype="F128")),
                                  ("unknown variant `F128`",)),
    "safetensors-offsets-negative": (edited_header(lambda h: h["model.norm.weight"].update(data_offsets=[-4, 0])),
                                     ("integer `-4`",)),
    "index-names-etc-passwd": (index_naming("/etc/passwd"), ("model.safetensors.index.json", "'/etc/passwd'",
                                                             "outside")),
    "index-names-parent": (index_naming("../llama/model.safetensors"), ("'../llama/model.safetensors'", "outside")),
    "index-names-missing-file": (index_naming("model-00002-of-00002.safetensors"), ("not in",)),
    "pickle-hostile": (pickled(hostile_bin), ("pytorch_model.bin", "pickle-format weights", "safetensors")),
    "pickle-raw": (pickled(raw=pickle.dumps({"model.embed_tokens.weight": [1.0, 2.0]})), ("pickle-format weights",)),
    "custom-tokenizer-code": (custom_tokenizer, ("tokenizer_config.json", "EvilTokenizer", "never runs")),
    "custom-model-code": (custom_model, ("model_type 'evil'", "never runs")),
    "fifo-weights": (fifo_weights, ("model.safetensors is a FIFO",)),
}


def model(build: Callable[[Inputs], Path], *extra: str):
    return lambda i: ["--model", str(build(i)), *extra]


def hf(build: Callable[[Inputs], Path], *extra: str):
    return lambda i: ["--hf", str(build(i)), "--tasks", "lambada", *extra]


def good_llama(i: Inputs) -> Path:
    return i.llama


def lambada_file(*records: object):
    return lambda i: ["--hf", str(i.llama), "--lambada-file", str(i.lambada(*records))]


def arms(baseline: list[tuple], jreg: list[tuple], *extra: str):
    """compare --baseline/--jreg over result files given as (seed, acc[, num_fewshot[, {top-level key: value}]])."""

    def build(i: Inputs) -> list[str]:
        b = [str(i.result(f"b{n}.json", *r)) for n, r in enumerate(baseline)]
        j = [str(i.result(f"j{n}.json", *r)) for n, r in enumerate(jreg)]
        return ["--baseline", *b, "--jreg", *j, *extra]

    return build


def raw_arms(baseline_text: str):
    def build(i: Inputs) -> list[str]:
        return ["--baseline", str(i.file("bad.json", baseline_text)), str(i.result("b1.json", 2)),
                "--jreg", str(i.result("j0.json", 1)), str(i.result("j1.json", 2))]  # fmt: skip

    return build


NAN_WEIGHT = edited_weights(lambda t: t["model.layers.1.mlp.down_proj.weight"].fill_(math.nan))


def _add_extra_tensor(tensors: dict) -> None:
    import torch

    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(3)


EXTRA_TENSOR = edited_weights(_add_extra_tensor)
ZERO_EMBEDDINGS = edited_weights(lambda t: t["model.embed_tokens.weight"].zero_())  # every h_ℓ is then 0
NO_HEAD = edited_weights(lambda t: t.pop("lm_head.weight"))  # untied: Ψ needs no head, layer removal does
GOOD = [(1, 0.5), (2, 0.6)]

CASES: dict[str, tuple[str, Callable[[Inputs], list[str]], tuple[str, ...]]] = {
    # analyze: model files
    "analyze/gguf-truncated-20KB": ("analyze", truncated_gguf(20_000), ("cut.gguf", "truncated or corrupt")),
    "analyze/gguf-truncated-100B": ("analyze", truncated_gguf(100), ("cut.gguf", "truncated or corrupt")),
    "analyze/gguf-magic-only": ("analyze", truncated_gguf(4), ("cut.gguf", "truncated or corrupt")),
    "analyze/mixtral-missing-experts": (
        "analyze", model(mixtral_without_experts), ("mixtral", "missing from the files", "experts", "download")
    ),
    "analyze/unexpected-tensor": ("analyze", model(EXTRA_TENSOR), ("not in the model", "mlp.extra.weight")),
    "analyze/shape-mismatch": (
        "analyze", model(with_config_value("intermediate_size", 96)), ("of the wrong shape", "mlp.down_proj")
    ),
    "analyze/shape-mismatch-stream": (
        "analyze", model(with_config_value("intermediate_size", 96), "--stream"), ("of the wrong shape",)
    ),
    "analyze/config-bad-json": ("analyze", model(with_config("{not json")), ("config.json", "restore")),
    "analyze/config-a-list": ("analyze", model(with_config("[1, 2]")), ("config.json", "not a Hugging Face")),
    "analyze/config-empty": ("analyze", model(with_config("")), ("config.json", "restore")),
    "analyze/no-weights": ("analyze", model(without("*.safetensors")), ("partial", "no file named")),
    "analyze/safetensors-truncated": (
        "analyze", model(truncated_safetensors, "--no-stream"), ("model.safetensors", "truncated or corrupt")
    ),
    "analyze/safetensors-truncated-stream": (
        "analyze", model(truncated_safetensors, "--stream"), ("model.safetensors", "truncated or corrupt")
    ),
    "analyze/safetensors-truncated-auto": (
        "analyze", model(truncated_safetensors), ("model.safetensors", "truncated or corrupt")
    ),
    "analyze/nan-weights": ("analyze", model(NAN_WEIGHT), ("edited", "not finite at layer(s) [2, 3]", "weights")),
    "analyze/nan-weights-stream": ("analyze", model(NAN_WEIGHT, "--stream"), ("not finite at layer(s) [2, 3]",)),
    "analyze/no-tokenizer": ("analyze", model(without("tokenizer*")), ("partial", "--tokenizer DIR")),
    "analyze/zero-hidden-states": ("analyze", model(ZERO_EMBEDDINGS), ("edited", "exactly zero", "Ψ = 0.5")),
    "analyze/zero-hidden-states-stream": ("analyze", model(ZERO_EMBEDDINGS, "--stream"), ("exactly zero",)),
    "analyze/remove-layers-no-head": ("analyze", model(NO_HEAD, "--remove-layers"), ("--remove-layers", "LM head")),
    "analyze/remove-layers-no-head-stream": (
        "analyze", model(NO_HEAD, "--remove-layers", "--stream"), ("--remove-layers", "LM head", "edited")
    ),
    "analyze/tokenizer-missing": (
        "analyze", model(good_llama, "--tokenizer", "/nonexistent/tok"), ("--tokenizer /nonexistent/tok",)
    ),
    "analyze/hub-id-not-cached": ("analyze", lambda i: ["--model", "org/absent"], ("org/absent", "hf download")),
    # analyze: --stream on what cannot stream
    "analyze/stream-gguf": ("analyze", lambda i: ["--model", str(i.gguf), "--stream"], ("--stream", "gguf")),
    "analyze/stream-quantized": ("analyze", model(quantized_config, "--stream"), ("--stream", "quantized weights")),
    # analyze: GGUF files whose keys or tensors transformers' loader would drop
    "analyze/gguf-unknown-key": (
        "analyze", gguf_with(metadata={"llama.attention.sliding_window": 8}), ("extra.gguf", "sliding_window")
    ),
    "analyze/gguf-unused-tensor": (
        "analyze", gguf_with(tensors={"blk.1.attn_k_norm.weight": np.ones(16, np.float32)}), ("blk.1.attn_k_norm",)
    ),
    # analyze: family edge cases
    "analyze/final-norm-projection": (
        "analyze", model(opt_350m_style, "--include-final-norm"), ("--include-final-norm", "different widths")
    ),
    "analyze/final-norm-projection-stream": (
        "analyze", model(opt_350m_style, "--include-final-norm", "--stream"), ("--include-final-norm",)
    ),
    "analyze/stream-bin-weights": ("analyze", model(bin_weights, "--stream"), ("pickle-format weights",)),
    "analyze/bin-weights": ("analyze", model(bin_weights), ("pytorch_model.bin", "pickle-format weights")),
    "analyze/tokenizer-custom-code": ("analyze", separate_custom_tokenizer, ("--tokenizer", "never runs")),
    # analyze: flags
    "analyze/num-samples-0": ("analyze", model(good_llama, "--num-samples", "0"), ("--num-samples",)),
    "analyze/num-samples-negative": ("analyze", model(good_llama, "--num-samples", "-3"), ("--num-samples",)),
    "analyze/num-samples-nan": ("analyze", model(good_llama, "--num-samples", "nan"), ("--num-samples",)),
    "analyze/batch-size-0": ("analyze", model(good_llama, "--batch-size", "0"), ("--batch-size",)),
    "analyze/batch-size-inf": ("analyze", model(good_llama, "--batch-size", "inf"), ("--batch-size",)),
    "analyze/max-length-0": ("analyze", model(good_llama, "--max-length", "0"), ("--max-length",)),
    "analyze/max-length-negative": ("analyze", model(good_llama, "--max-length", "-5"), ("--max-length",)),
    "analyze/dtype-unknown": ("analyze", model(good_llama, "--dtype", "float64"), ("--dtype",)),
    "analyze/distance-unknown": ("analyze", model(good_llama, "--distance", "euclid"), ("--distance",)),
    "analyze/device-garbage": ("analyze", model(good_llama, "--device", "gpu7"), ("--device", "not a torch device")),
    "analyze/output-is-a-file": (
        "analyze", lambda i: ["--model", str(i.llama), "--output", str(i.file("f", "x"))], ("--output", "is a file")
    ),
    "analyze/no-model": ("analyze", lambda i: [], ("--model",)),
    "analyze/top-k-0": ("analyze", model(good_llama, "--remove-layers", "--top-k", "0"), ("--top-k 0", ">= 1")),
    "analyze/top-k-not-numbers": ("analyze", model(good_llama, "--remove-layers", "--top-k", "1,b"), ("--top-k",)),
    "analyze/top-k-beyond-layers": (
        "analyze", model(good_llama, "--remove-layers", "--top-k", "2,9"), ("--top-k 9", "3 decoder layers")
    ),
    "analyze/top-k-without-remove-layers": ("analyze", model(good_llama, "--top-k", "2"), ("--remove-layers",)),
    "analyze/positions-unknown": ("analyze", model(good_llama, "--positions", "middle"), ("--positions",)),
    "analyze/revision-of-a-folder": ("analyze", model(good_llama, "--revision", "step1"), ("--revision", "local")),
    "analyze/revision-empty": ("analyze", lambda i: ["--model", "org/x", "--revision", "a,,b"], ("--revision ''",)),
    "analyze/revision-without-model": (
        "analyze", lambda i: ["--checkpoints", str(i.root / "*"), "--revision", "step1"], ("--revision needs --model",)
    ),
    # analyze: data
    "analyze/data-malformed-jsonl": (
        "analyze",
        lambda i: ["--model", str(i.llama), "--data", f"jsonl:{i.file('d.jsonl', '{\"text\": \"a b\"}\n{oops')}:text"],
        ("--data", "d.jsonl:2"),
    ),
    "analyze/data-not-utf8": (
        "analyze", lambda i: ["--model", str(i.llama), "--data", f"text:{i.file('d.txt', b'ok\xff\xfe')}"],
        ("--data", "not UTF-8"),
    ),
    "analyze/data-empty": (
        "analyze", lambda i: ["--model", str(i.llama), "--data", f"text:{i.file('d.txt', '')}"], ("no non-empty",)
    ),
    "analyze/data-missing-file": ("analyze", model(good_llama, "--data", "lambada:/nonexistent"), ("--data",)),
    # evaluate: LAMBADA files
    "evaluate/lambada-only-empty": (
        "evaluate", lambada_file({"text": ""}, {"text": "   "}), ("--lambada-file", "2 empty", "no passage can be")
    ),
    "evaluate/lambada-only-one-word": (
        "evaluate", lambada_file({"text": "word"}, {"text": " lone"}), ("--lambada-file", "2 one_word")
    ),
    "evaluate/lambada-not-strings": (
        "evaluate", lambada_file({"text": 5}, {"text": None}, {"text": ["a", "b"]}), ("3 not_a_string",)
    ),
    "evaluate/lambada-no-last-word": ("evaluate", lambada_file({"text": "ends with a space "}), ("1 no_last_word",)),
    "evaluate/lambada-malformed": (
        "evaluate", lambada_file({"text": "a good passage"}, "{broken"), ("lambada.jsonl: line 2", "not a JSON line")
    ),
    "evaluate/lambada-no-text-field": (
        "evaluate", lambada_file({"body": "a b c"}), ('lambada.jsonl: line 1', '"text"')
    ),
    "evaluate/lambada-a-list": ("evaluate", lambada_file('["a b c"]'), ('lambada.jsonl: line 1', '"text"')),
    "evaluate/lambada-empty-file": ("evaluate", lambada_file(), ("--lambada-file", "no passages")),
    "evaluate/lambada-not-utf8": (
        "evaluate",
        lambda i: ["--hf", str(i.llama), "--lambada-file", str(i.file("l.jsonl", b'{"text": "a \xff b"}\n'))],
        ("--lambada-file", "can't decode"),
    ),
    "evaluate/lambada-is-a-folder": ("evaluate", hf(good_llama, "--lambada-file", "/tmp"), ("--lambada-file /tmp",)),
    # evaluate: model files
    "evaluate/config-bad-json": ("evaluate", hf(with_config("{not json")), ("--hf", "config.json", "restore")),
    "evaluate/mixtral-missing-experts": (
        "evaluate", hf(mixtral_without_experts), ("--hf", "missing from the files", "experts")
    ),
    "evaluate/unexpected-tensor": ("evaluate", hf(EXTRA_TENSOR), ("--hf", "mlp.extra.weight")),
    "evaluate/no-tokenizer": ("evaluate", hf(without("tokenizer*")), ("--hf", "cannot load its tokenizer")),
    "evaluate/no-weights": ("evaluate", hf(without("*.safetensors")), ("--hf", "no file named")),
    "evaluate/safetensors-truncated": ("evaluate", hf(truncated_safetensors), ("model.safetensors", "truncated")),
    "evaluate/hub-id-not-cached": ("evaluate", lambda i: ["--hf", "org/absent"], ("--hf org/absent", "hf download")),
    # evaluate: flags
    "evaluate/limit-0": ("evaluate", hf(good_llama, "--limit", "0"), ("--limit 0",)),
    "evaluate/limit-negative": ("evaluate", hf(good_llama, "--limit", "-2"), ("--limit -2",)),
    "evaluate/batch-size-0": ("evaluate", hf(good_llama, "--batch-size", "0"), ("--batch-size 0",)),
    "evaluate/batch-size-nan": ("evaluate", hf(good_llama, "--batch-size", "nan"), ("--batch-size",)),
    "evaluate/max-length-1": ("evaluate", hf(good_llama, "--max-length", "1"), ("--max-length 1",)),
    "evaluate/bootstrap-negative": ("evaluate", hf(good_llama, "--bootstrap-iters", "-1"), ("--bootstrap-iters",)),
    "evaluate/num-fewshot-negative": ("evaluate", hf(good_llama, "--num-fewshot", "-1"), ("--num-fewshot -1",)),
    "evaluate/num-fewshot-with-lambada": (
        "evaluate", hf(good_llama, "--num-fewshot", "2"), ("--num-fewshot 2", "zero-shot")
    ),
    "evaluate/device-garbage": ("evaluate", hf(good_llama, "--device", "gpu7"), ("--device gpu7",)),
    "evaluate/output-is-a-folder": ("evaluate", lambda i: hf(good_llama, "--output", str(i.tmp))(i), ("is a folder",)),
    "evaluate/dtype-unknown": ("evaluate", hf(good_llama, "--dtype", "int8"), ("--dtype",)),
    "evaluate/bin-weights": ("evaluate", hf(bin_weights), ("pytorch_model.bin", "pickle-format weights")),
    # hostile model folders (HOSTILE, below) for both
    # compare
    "compare/accuracy-nan": ("compare", arms([(1, math.nan), (2, 0.6)], GOOD), ("b0.json", "lambada acc is nan")),
    "compare/accuracy-inf": ("compare", arms(GOOD, [(1, 0.5), (2, math.inf)]), ("j1.json", "inf")),
    "compare/accuracy-boolean": ("compare", arms([(1, True), (2, 0.6)], GOOD), ("b0.json", "True")),
    "compare/confidence-nan": ("compare", arms(GOOD, GOOD, "--confidence", "nan"), ("--confidence nan",)),
    "compare/confidence-above-1": ("compare", arms(GOOD, GOOD, "--confidence", "1.5"), ("--confidence 1.5",)),
    "compare/bad-json": ("compare", raw_arms("{not json"), ("bad.json", "not a result file")),
    "compare/empty-file": ("compare", raw_arms(""), ("bad.json", "not a result file")),
    "compare/results-a-list": ("compare", raw_arms('{"results": [1, 2]}'), ("bad.json", "not a result file")),
    "compare/same-file-twice": (
        "compare",
        lambda i: ["--baseline", str(i.result("a.json", 1)), str(i.result("b.json", 2)), "--jreg",
                   str(i.tmp / "a.json"), str(i.result("c.json", 3))],  # fmt: skip
        ("given twice",),
    ),
    "compare/fewshot-mismatch": (
        "compare", arms([(1, 0.5, 0), (2, 0.6, 0)], [(1, 0.5, 5), (2, 0.6, 5)]), ("--num-fewshot", "b0.json: 0")
    ),
    "compare/unequal-arms": ("compare", arms(GOOD, [*GOOD, (3, 0.1)]), ("--baseline has 2 files and --jreg 3",)),
    "compare/output-is-a-folder": ("compare", lambda i: arms(GOOD, GOOD, "--output", str(i.tmp))(i), ("is a folder",)),
    "compare/no-seed": (
        "compare", arms([(None, 0.5), (2, 0.6)], GOOD), ("b0.json", 'no "seed" field', "--pair-by-order")
    ),
    "compare/pair-by-order-other-seeds": (
        "compare", arms(GOOD, [(2, 0.6), (1, 0.5)], "--pair-by-order"), ("--pair-by-order pairs", "b0.json (seed 1)")
    ),
    "compare/sample-counts-differ": (
        "compare",
        arms([(1, 0.5, None, {"samples": {"lambada": 5153}}), (2, 0.6)], [(1, 0.5, None, {"samples": {"lambada": 200}}),
             (2, 0.6)]),  # fmt: skip
        ("lambada", "numbers of examples", "b0.json: 5153", "j0.json: 200", "--limit"),
    ),
    "compare/lm-eval-shots-differ": (
        "compare", arms(GOOD, [(1, 0.5, None, {"n_shot": {"lambada": 5}}), (2, 0.6, None, {"n_shot": {"lambada": 0}})]),
        ("lambada", "few-shot counts", "j0.json: 5", "j1.json: 0"),
    ),
    "compare/directions-disagree": (
        "compare",
        arms([(1, 0.5, None, {"higher_is_better": {"lambada": {"acc": True}}}), (2, 0.6)],
             [(1, 0.5, None, {"higher_is_better": {"lambada": {"acc": False}}}), (2, 0.6)]),  # fmt: skip
        ("lambada acc", "b0.json: higher", "j0.json: lower", "--higher-is-better acc"),
    ),
    "compare/both-directions": (
        "compare", arms(GOOD, GOOD, "--higher-is-better", "acc", "--lower-is-better", "acc"), ("both name acc",)
    ),
    "compare/missing-file": (
        "compare", lambda i: ["--baseline", "/nonexistent.json", str(i.result("b.json", 2)),
                              "--jreg", str(i.result("j.json", 1)), str(i.result("k.json", 2))],  # fmt: skip
        ("/nonexistent.json",),
    ),
}


STREAMED = ("config-layers-1e9", "safetensors-overlap", "index-names-etc-passwd", "custom-model-code")  # --stream too
for _name, (_build, _expect) in HOSTILE.items():
    CASES[f"analyze/{_name}"] = ("analyze", model(_build), _expect)
    if _name in STREAMED:
        CASES[f"analyze/{_name}-stream"] = ("analyze", model(_build, "--stream"), _expect)
    CASES[f"evaluate/{_name}"] = ("evaluate", hf(_build), _expect)
    if not _name.startswith("pickle-"):  # convert imports .bin weights with torch.load(weights_only=True)
        CASES[f"convert/{_name}"] = ("convert", lambda i, b=_build: ["hf-to-mcore", "--hf", str(b(i))], _expect)


def bin_config_value(key: str, value: object):
    """bin_weights with config.json's `key` set to `value`."""

    def build(i: Inputs) -> Path:
        folder = bin_weights(i)
        config = json.loads((folder / "config.json").read_text())
        config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    return build


# convert imports .bin weights through torch.load(weights_only=True) and maps each by name and shape.
for _name, (_build, _expect) in {
    "pickle-hostile": (pickled(hostile_bin), ("pytorch_model.bin", "refused to load", "GLOBAL posix.mkdir")),
    "pickle-raw": (pickled(raw=pickle.dumps({"model.embed_tokens.weight": [1.0, 2.0]})),
                   ("pytorch_model.bin", "refused to load", "Unsupported operand")),
    "pickle-not-tensors": (pickled(lambda i: {"model.embed_tokens.weight": [1.0, 2.0]}),
                           ("not a state dict of tensors", "'model.embed_tokens.weight' is a list")),
    "bin-layers-1e9": (bin_config_value("num_hidden_layers", 10**9), ("no model.layers.", "not a complete Llama")),
    "bin-hidden-1e9": (bin_config_value("hidden_size", 10**9), ("model.embed_tokens.weight has shape",
                                                                "config.json implies")),
}.items():
    CASES[f"convert/{_name}"] = ("convert", lambda i, b=_build: ["hf-to-mcore", "--hf", str(b(i))], _expect)


# convert's flags, refused by ConvertConfig before any checkpoint or model is read (the folders are good ones).
for _name, (_argv, _expect) in {
    "flag-tp-0": (["--tensor-model-parallel-size", "0"], ("--tensor-model-parallel-size 0", "at least 1")),
    "flag-pp-negative": (["--pipeline-model-parallel-size", "-2"], ("--pipeline-model-parallel-size -2",)),
    "flag-seq-length-0": (["--seq-length", "0"], ("--seq-length 0",)),
    "flag-threshold-nan": (["--verify-threshold", "nan"], ("--verify-threshold nan", "positive finite")),
    "flag-threshold-without-check": (["--no-verify", "--verify-threshold", "1e-3"], ("drop --no-verify",)),
}.items():
    CASES[f"convert/hf-to-mcore-{_name}"] = ("convert", lambda i, a=_argv: ["hf-to-mcore", "--hf", str(i.llama), *a],
                                             _expect)
for _name, (_argv, _expect) in {
    "flag-shard-size": (["--max-shard-size", "5XB"], ("--max-shard-size '5XB'", "5GB")),
    "flag-iteration-negative": (["--iteration", "-1"], ("--iteration -1",)),
    "flag-no-tokenizer-and-model": (["--no-tokenizer", "--tokenizer-model", "tok.model"], ("--no-tokenizer",)),
}.items():
    CASES[f"convert/mcore-to-hf-{_name}"] = ("convert", lambda i, a=_argv: ["mcore-to-hf", "--load", str(i.root), *a],
                                             _expect)


def run(command: str, argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of one command run in this process; argparse's exit counts as a return."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = importlib.import_module(COMMANDS[command]).main(argv)
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, err.getvalue()


@pytest.fixture
def case_inputs(inputs, tmp_path, monkeypatch) -> Inputs:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))  # hub ids: none cached
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    work = tmp_path / "case"
    work.mkdir()
    return Inputs(inputs.llama, inputs.gguf, inputs.tokenizer, inputs.root, work)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_clear_line(name, case_inputs, tmp_path):
    import torch

    command, build, expect = CASES[name]
    if "--device" in name and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    argv = build(case_inputs)
    out = tmp_path / "out"
    if command == "analyze":  # small defaults first, so that a case's own flag wins
        argv = ["--num-samples", "2", "--max-length", "24", "--no-progress", *argv]
        if "--output" not in argv:
            argv += ["--output", str(out)]
    elif command == "evaluate":
        argv = ["--limit", "2", *argv]
        if "--output" not in argv:
            argv += ["--output", str(out / "r.json")]
    elif command == "convert":
        argv += ["--output", str(out)]
    rc, err = run(command, argv)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert rc == 2, (name, rc, err[-2000:])
    assert "Traceback" not in err, err
    assert len(errors) == 1, errors
    assert err.rstrip().endswith(errors[0]), err[-2000:]  # nothing after the line (a message of one line)
    for fragment in expect:
        assert fragment in errors[0], (fragment, errors[0])
    assert not out.exists(), "a failed run wrote output"
    assert not (case_inputs.tmp / PAYLOAD).exists(), "a hostile file's code ran"
    assert "[y/N]" not in err, "asked a question"


def test_partly_bad_lambada_file_is_scored_and_reported(case_inputs, tmp_path):
    """Unscoreable passages among good ones are skipped and counted by reason, on stderr and in the results."""
    good = [" ".join(p.split(" ")[-12:]) for p in lambada_passages()[:3]]
    records = [{"text": good[0]}, {"text": ""}, {"text": 7}, {"text": good[1]}, {"text": "alone"}, {"text": good[2]}]
    out = tmp_path / "r.json"
    argv = ["--hf", str(case_inputs.llama), "--lambada-file", str(case_inputs.lambada(*records)), "--output", str(out)]
    rc, err = run("evaluate", argv)
    assert rc == 0, err
    assert "lambada: skipped 3 example(s): 1 empty, 1 not_a_string, 1 one_word" in err
    saved = json.loads(out.read_text())
    assert saved["samples"] == {"lambada": 3}
    assert saved["skipped"] == {"lambada": {"empty": 1, "not_a_string": 1, "one_word": 1}}


# `analysis.removal.layer_removal` (the library entry): each bad argument is one AnalysisError line naming it.
REMOVAL_CASES: dict[str, tuple[Callable, dict, tuple[str, ...]]] = {
    "windows-float": (lambda torch: torch.rand(2, 5), {}, ("windows", "integer tensor [N, S]", "2-D")),
    "windows-1d": (lambda torch: torch.arange(5), {}, ("windows", "1-D",)),
    "windows-a-list": (lambda torch: [[1, 2, 3]], {}, ("windows", "got list")),
    "windows-one-token": (lambda torch: torch.zeros(3, 1, dtype=torch.long), {}, ("windows", "no prediction")),
    "windows-beyond-vocabulary": (lambda torch: torch.full((2, 4), VOCAB), {}, ("windows", f"vocabulary of {VOCAB}")),
    "windows-negative": (lambda torch: torch.full((2, 4), -1), {}, ("windows", "-1..-1")),
    "top-k-0": (None, {"top_k": (0,)}, ("top_k 0",)),
    "top-k-beyond-layers": (None, {"top_k": (1, 4)}, ("top_k 4", "3 decoder layers")),
    "batch-size-0": (None, {"batch_size": 0}, ("batch_size", "0")),
    "model-missing": (None, {"model": "/nonexistent/model"}, ("/nonexistent/model", "no such file")),
    "model-of-another-kind": (None, {"model": 42}, ("cannot use a int as a model",)),
}


@pytest.mark.parametrize("name", sorted(REMOVAL_CASES))
def test_layer_removal_bad_input_is_one_clear_error(name, inputs):
    import torch

    from megatron_jreg.analysis.removal import layer_removal
    from megatron_jreg.analysis.source import AnalysisError

    make, kwargs, expect = REMOVAL_CASES[name]
    windows = make(torch) if make else torch.randint(0, VOCAB, (2, 6))
    kwargs = {"model": inputs.llama, **kwargs}
    with pytest.raises(AnalysisError) as error:
        layer_removal(kwargs.pop("model"), windows, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    for fragment in expect:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("layers", [1, 2])
def test_remove_layers_on_a_shallow_model_keeps_the_default_top_k_within_it(inputs, tmp_path, layers):
    """issue 46.12: `analyze --remove-layers` on a 1- or 2-layer model refused "--top-k 2,3", which the user never
    passed; the default 1,2,3 is capped at the model's layers (for analyze and the library entry), while a --top-k
    the user gives is still checked against them."""
    import torch

    from megatron_jreg.analysis.removal import layer_removal
    from megatron_jreg.analysis.source import AnalysisError
    from tests._toy import save_random_model

    folder = save_random_model(family_config("llama", layers=layers), tmp_path / "shallow", inputs.tokenizer)
    rc, err = run("analyze", ["--model", str(folder), "--num-samples", "2", "--remove-layers", "--no-progress",
                              "--output", str(tmp_path / "out")])
    assert rc == 0, err
    removal = json.loads((tmp_path / "out" / "results.json").read_text())["models"][0]["layer_removal"]
    assert removal["top_k"] == list(range(1, layers + 1)), removal
    windows = torch.randint(0, VOCAB, (2, 6))
    assert layer_removal(folder, windows)["top_k"] == list(range(1, layers + 1))
    rc, err = run("analyze", ["--model", str(folder), "--num-samples", "2", "--remove-layers", "--top-k", "1,3",
                              "--output", str(tmp_path / "out")])
    assert rc == 2 and "--top-k 3: k must be between 1 and the model's" in err, err
    with pytest.raises(AnalysisError, match="top_k 3"):
        layer_removal(folder, windows, top_k=(3,))
