"""A Hugging Face model folder checked before anything reads its tensors or allocates its model: what would hang,
exhaust memory, end in a library traceback or run a file's code is refused in one line naming the file and key
(the list: DEVELOPERS.md, "Hugging Face folders checked before they load")."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from megatron_jreg.dtypes import SAFETENSORS
from megatron_jreg.errors import BadConfigError, ModelFileError, one_line

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")

# config.json keys that count or size something: positive integers (experts: >= 0, 0 = dense).
_SIZES = (
    "num_hidden_layers", "n_layer", "num_layers", "hidden_size", "n_embd", "d_model", "num_attention_heads",
    "n_head", "num_key_value_heads", "intermediate_size", "n_inner", "ffn_dim", "vocab_size",
    "max_position_embeddings", "n_positions", "n_ctx", "head_dim",
)  # fmt: skip
_EXPERTS = ("num_local_experts", "num_experts", "num_experts_per_tok")
_NOT_NULL = {"num_hidden_layers", "n_layer", "hidden_size", "n_embd", "num_attention_heads", "n_head", "vocab_size"}
_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "rope_theta")
_ROPE_FLOATS = ("rope_theta", "factor")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head")


def read_config(folder: Path, flag: str) -> dict[str, Any]:
    """config.json of a model folder as a dict; bad JSON or a non-object is one line naming the file."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadConfigError(f"{flag} {folder}: cannot read {path} ({e}); restore the model's config.json") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise BadConfigError(f"{flag} {folder}: {path} is not a Hugging Face model config (a JSON object with a "
                             f"model_type); restore the model's config.json")
    return config


class WeightsError(ModelFileError):
    """A safetensors file or index that cannot be read as it describes itself; the message names the file."""


class NonFiniteWeights(ModelFileError):
    """A loaded model whose weights hold NaN or ±inf: every score and answer computed from it would be NaN
    (evaluate printing accuracy 0, generate writing empty answers), so the loaders refuse it."""


_FIXES = {  # the dtype the weights were loaded in -> what to do about ±inf that only the narrow type made
    "float16": "values beyond float16's range (±65504) become inf: load in bfloat16 or float32 (--dtype)",
    "bfloat16": "values beyond bfloat16's range become inf: load in float32 (--dtype float32)",
}


def check_finite_weights(named: Iterable[tuple[str, Any]], where: str) -> None:
    """Refuse weights that hold NaN or ±inf, naming the first bad tensor. `named`: (name, tensor) pairs."""
    import torch

    bad: list[tuple[str, int, int, torch.dtype]] = []
    for name, tensor in named:
        if tensor.is_floating_point():
            nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
            if nan or inf:
                bad.append((name, nan, inf, tensor.dtype))
    if not bad:
        return
    name, nan, inf, dtype = bad[0]
    dtype_name = str(dtype).removeprefix("torch.")
    what = ", ".join(f"{n:,} {kind}" for n, kind in ((nan, "NaN"), (inf, "inf")) if n)
    others = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    fix = (f"the file holds inf, or {_FIXES[dtype_name]}" if not any(b[1] for b in bad) and dtype_name in _FIXES
           else "the model diverged or the file is damaged: use an earlier checkpoint or download the model again")
    raise NonFiniteWeights(f"{where}: weight {name} holds {what} in {dtype_name}{others}; nothing computed from "
                           f"it would be a number: {fix}")


class NotRegularFile(OSError):
    """A path that is a FIFO, device or socket where a regular file is expected (reading it could block)."""


# Files that are what they claim to be.
_SPECIAL = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket"}


def special_kind(mode: int) -> str | None:
    """'a FIFO', 'a character device', ... for a stat mode that is neither a regular file nor a folder."""
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else _SPECIAL.get(stat.S_IFMT(mode), "not a regular file")


def relative_name(name: object) -> bool:
    """Whether a file name read from a file (an index, a manifest) stays below its folder: relative, no `..`."""
    return isinstance(name, str) and not Path(name).is_absolute() and ".." not in Path(name).parts


def open_regular(path: str | Path) -> IO[bytes]:
    """`open(path, "rb")` for a regular file only: opened non-blocking and checked with fstat, so a FIFO or
    device is refused (NotRegularFile) without waiting for a writer or reading without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{path} is {special_kind(mode) or 'a folder'}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def is_gguf_file(path: Path) -> bool:
    """A GGUF file: by its magic bytes, so a renamed file still counts."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def check_entries(folder: Path, flag: str) -> None:
    """Every entry of `folder` (not recursive: what transformers reads) is a regular file or a folder;
    a dangling symlink is left to whoever reads it (the hub cache reports those)."""
    for entry in sorted(Path(folder).iterdir()):
        try:
            kind = special_kind(os.stat(entry).st_mode)
        except OSError:
            continue
        if kind is not None:
            raise ModelFileError(f"{flag} {folder}: {entry.name} is {kind}, not a regular file (reading it could "
                                 "block forever); replace it with the real file")


# safetensors headers, read by the safetensors library.
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: dtype (safetensors' name), shape, absolute byte range [start, end)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_safetensors_header(path: str | Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, its header validated by `safetensors.safe_open` before any tensor is
    read; the byte ranges (for the streaming reader's plain reads) follow from that validated order."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with open_regular(path) as f:  # a FIFO or device is refused before the library maps it
            size = os.fstat(f.fileno()).st_size
        with safe_open(path, framework="np") as f:
            layout = [(name, f.get_slice(name)) for name in f.offset_keys()]
            layout = [(name, s.get_dtype(), tuple(s.get_shape())) for name, s in layout]
    except SafetensorError as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e}): truncated or corrupt; download it "
                           "again") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read it ({e}); restore the file") from None
    sizes = [math.prod(shape) * SAFETENSORS[dtype][1] // 8 for _, dtype, shape in layout]
    start, tensors = size - sum(sizes), {}
    for (name, dtype, shape), nbytes in zip(layout, sizes):
        tensors[name] = TensorEntry(path, dtype, shape, start, start + nbytes)
        start += nbytes
    return tensors


def _inside(folder: Path, name: Any, index: Path) -> Path:
    """folder/name for a weight-map file name that stays inside the folder (relative, no `..`)."""
    if not isinstance(name, str) or not name:
        raise WeightsError(f"{index}: file name {str(name)[:60]!r} is not a string; restore the file")
    if not relative_name(name):
        raise WeightsError(f"{index}: names {name[:120]!r}, outside {folder}; an index may only name files in its "
                           "own folder: restore the file (do not use this model if you did not edit it)")
    path = folder / name
    try:
        kind = special_kind(os.stat(path).st_mode)
    except OSError:
        raise WeightsError(f"{index}: lists {name}, which is not in {folder}; download it again") from None
    if kind is not None:
        raise WeightsError(f"{index}: {name} is {kind}, not a regular file; restore it")
    return path


def safetensors_sources(folder: Path) -> tuple[Path | None, dict[str, str] | None, list[Path]]:
    """(index, its weight map, the files) of a folder's safetensors: the index's shards (names checked), else all."""
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if not index.exists():
        return None, None, sorted(folder.glob("*.safetensors"))
    try:
        with open_regular(index) as f:
            weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is a {type(weight_map).__name__}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise WeightsError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); restore the file") from None
    bad = next((v for v in weight_map.values() if not isinstance(v, str)), None)
    if bad is not None:
        raise WeightsError(f"{index}: weight_map value {str(bad)[:60]} is not a file name; restore the file")
    return index, weight_map, [_inside(folder, name, index) for name in sorted(set(weight_map.values()))]


def read_safetensors_folder(folder: Path) -> dict[str, TensorEntry]:
    """Every tensor of a folder's safetensors files, headers checked, each of an index in the shard it names."""
    index, weight_map, files = safetensors_sources(folder)
    tensors: dict[str, TensorEntry] = {}
    for path in files:
        tensors.update(read_safetensors_header(path))
    for name, file in (weight_map or {}).items():
        info = tensors.get(name)
        if info is None or info.file.name != Path(file).name:
            raise WeightsError(f"{index}: {name} is not in {file}; download the model again")
    return tensors


# config.json values.
def _text_configs(config: dict) -> list[dict]:
    """The config and the nested text config of a multimodal model (where the decoder's sizes are)."""
    nested = [config[k] for k in ("text_config", "llm_config") if isinstance(config.get(k), dict)]
    return [config, *nested]


def _first(configs: Iterable[dict], names: tuple[str, ...]) -> tuple[str, int] | None:
    for config in configs:
        for name in names:
            if isinstance(config.get(name), int) and not isinstance(config[name], bool):
                return name, config[name]
    return None


# Config fields that hold the context window, in the order Hugging Face model families use them.
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length")


def declared_context(config: Any) -> int | None:
    """The context window a Hugging Face config (a dict or a transformers config) declares, the text decoder's
    for a multimodal model: the first of CONTEXT_FIELDS set to a positive int, else None."""
    if isinstance(config, dict):
        values = _text_configs(config)[-1]
        get = values.get
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        get = lambda name: getattr(text, name, None)  # noqa: E731 - attribute_map aliases resolve here
    for name in CONTEXT_FIELDS:
        value = get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_config(config: dict, where: str) -> None:
    """Types and ranges of the config.json values a model is built from."""
    for part in _text_configs(config):
        for key in (*_SIZES, *_EXPERTS):
            if key not in part:
                continue
            value, least = part[key], 0 if key in _EXPERTS else 1
            if value is None and key not in _NOT_NULL:
                continue
            if type(value) is not int or value < least:
                want = "a non-negative integer" if least == 0 else "a positive integer"
                raise BadConfigError(f"{where}: config.json: {key} must be {want}, found {json.dumps(value)[:40]}; "
                                     "restore the model's config.json")
        for key in _POSITIVE_FLOATS:
            _positive_number(part, key, key, where)
        for key in ("rope_scaling", "rope_parameters"):
            rope = part.get(key)
            if isinstance(rope, dict):  # per-layer-type parameters nest one level down
                for prefix, values in [("", rope), *((f"{k}.", v) for k, v in rope.items() if isinstance(v, dict))]:
                    for name in _ROPE_FLOATS:
                        _positive_number(values, name, f"{key}.{prefix}{name}", where)
        heads = _first([part], _HEADS)
        kv = part.get("num_key_value_heads")
        if heads and type(kv) is int and heads[1] % kv:
            raise BadConfigError(f"{where}: config.json: num_key_value_heads {kv} does not divide {heads[0]} "
                                 f"{heads[1]}; restore the model's config.json")
        hidden = _first([part], _HIDDEN)
        if heads and hidden and part.get("head_dim") is None and hidden[1] % heads[1]:
            raise BadConfigError(f"{where}: config.json: {hidden[0]} {hidden[1]} is not divisible by {heads[0]} "
                                 f"{heads[1]} (and no head_dim is given); restore the model's config.json")


def auto_config(folder: Path, flag: str = "--model") -> Any:
    """The transformers config of a model folder (`AutoConfig`, local files only, no custom code)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise BadConfigError(f"{flag} {folder}: transformers cannot read its config.json ({one_line(e, 300)})"
                             ) from None


def _positive_number(values: dict, key: str, label: str, where: str) -> None:
    if key not in values or values[key] is None:
        return
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise BadConfigError(f"{where}: config.json: {label} must be a positive finite number, found "
                             f"{json.dumps(value)[:40]}; restore the model's config.json")


def check_weights_fit(config: dict, stored: int, where: str, what: str) -> None:
    """Refuse sizes whose weights exceed the `stored` values the files hold (`what` says how counted): each bound is
    a lower bound on any decoder's weights, far below a real model's, so only sizes no file could back are refused."""
    configs = _text_configs(config)
    values = {k: v for part in reversed(configs) for k, v in part.items() if type(v) is int}
    hidden = _first(configs, _HIDDEN)
    if hidden is None:
        return
    h_key, h = hidden
    bounds: list[tuple[str, int, str]] = [(h_key, h * h // 2, f"{h_key}²/2 (one layer)")]
    for keys, per, text in ((("vocab_size",), h, "× {h} (the embedding)"),
                            (_LAYERS, h * h // 2, "× {h}²/2 (the layers)"),
                            (("intermediate_size", "n_inner", "ffn_dim"), h, "× {h} (one MLP matrix)"),
                            (("n_positions",), h, "× {h} (learned positions)"),
                            (("num_local_experts", "num_experts"), h, "× {h} (one vector per expert)")):
        found = _first(configs, keys)
        if found is not None:
            bounds.append((found[0], found[1] * per, f"{found[0]} {found[1]} " + text.format(h=f"{h_key} {h}")))
    heads, head_dim = _first(configs, _HEADS), values.get("head_dim")
    if heads and head_dim:
        bounds.append(("head_dim", heads[1] * head_dim * h, f"{heads[0]} × head_dim × {h_key} (the query projection)"))
    for key, need, text in bounds:
        if need > stored:
            raise BadConfigError(f"{where}: config.json: {key} {values.get(key)} does not fit the weight files: "
                                 f"{text} needs at least {need:,} weights, {what} hold {stored:,}; restore the "
                                 "model's config.json or download the model again")


# Code a folder would have run.
def _json(path: Path) -> dict:
    try:
        with open_regular(path) as f:
            value = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def custom_code(folder: Path, *, any_map: bool = False) -> str | None:
    """What in `folder` needs its own code (an `auto_map` for a model_type or tokenizer class transformers lacks;
    any_map: any `auto_map`, which trust_remote_code=True would run), for an error line; else None."""
    folder = Path(folder)
    config = _json(folder / "config.json")
    if isinstance(config.get("auto_map"), dict) and config["auto_map"]:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if any_map or config.get("model_type") not in CONFIG_MAPPING:
            first = next(iter(config["auto_map"].values()))
            return f"config.json: model_type {config.get('model_type')!r} is implemented by its own code ({first})"
    tokenizer = _json(folder / "tokenizer_config.json")
    auto = tokenizer.get("auto_map")
    ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else auto if isinstance(auto, list) else None
    if ref:
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        name = str(tokenizer.get("tokenizer_class") or "").removesuffix("Fast")
        if any_map or not name or (tokenizer_class_from_name(name) is None
                                   and tokenizer_class_from_name(name + "Fast") is None):
            shown = next((r for r in (ref if isinstance(ref, list) else [ref]) if r), ref)
            return f"tokenizer_config.json: tokenizer class {name or '?'} is implemented by its own code ({shown})"
    return None


def refuse_custom_code(folder: Path, flag: str) -> None:
    """ModelFileError when `folder` needs code of its own (see `custom_code`): megatron-jreg never runs it."""
    found = custom_code(folder)
    if found is not None:
        raise ModelFileError(f"{flag} {folder}: {found}, which megatron-jreg never runs (trust_remote_code=False); "
                             "use a folder that transformers' own classes load (e.g. a tokenizer.json)")


# The one check.
@dataclass(frozen=True)
class ModelFolder:
    """A checked Hugging Face folder: config.json and the safetensors headers, read once and carried along."""

    path: Path
    config: dict
    tensors: dict[str, TensorEntry]


def inspect_model_folder(
    folder: str | Path, flag: str, *, allow_pickle: bool = False, require_weights: bool = True
) -> ModelFolder:
    """Check a Hugging Face model folder before anything loads it. allow_pickle: pickle weights pass, unchecked,
    where there are no safetensors (`convert` reads them with weights_only=True); require_weights=False leaves a
    folder without weights to the caller (convert first refuses an architecture it cannot map)."""
    folder = Path(folder)
    where = f"{flag} {folder}"
    check_entries(folder, flag)
    config = read_config(folder, flag)
    check_config(config, where)
    refuse_custom_code(folder, flag)
    _, _, files = safetensors_sources(folder)
    tensors = read_safetensors_folder(folder) if files else {}
    single = folder / SAFETENSORS_SINGLE
    loaded = read_safetensors_header(single) if single.is_file() and single not in files else tensors
    if loaded or files:  # beside an index, transformers loads model.safetensors: its sizes are checked
        check_weights_fit(config, sum(t.numel for t in loaded.values()), where, "the safetensors headers")
        return ModelFolder(folder, config, tensors)
    pickles = sorted({p.name for pattern in PICKLE_PATTERNS for p in folder.glob(pattern)})
    if pickles and not allow_pickle:
        raise ModelFileError(f"{where}: pickle-format weights ({', '.join(pickles[:3])}): megatron-jreg does not "
                             "unpickle weight files (a pickle can run code); convert to safetensors where you trust "
                             "the file (save_pretrained(..., safe_serialization=True))")
    if not pickles and require_weights:
        raise ModelFileError(f"{where}: no weight files: no file named {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} "
                             "there; download the model again")
    return ModelFolder(folder, config, {})
