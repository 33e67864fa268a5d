"""Layer streaming: Ψ of a Hugging Face model read one decoder layer at a time from its safetensors, since Ψ_ℓ needs
only h_{ℓ−1} and h_ℓ (memory and design: docs/analysis.md, DEVELOPERS.md)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor, nn

from megatron_jreg.analysis.hf_source import (
    HEAD,
    HFSource,
    decoder_stack,
    head_missing,
    load_tokenizer,
    other_towers,
    run_forward,
    weight_targets,
)
from megatron_jreg.analysis.source import (
    AnalysisError,
    UnsupportedArchitectureError,
    first_tensor,
    gather_rows,
    layer_input,
    masked_displacement_sum,
    planned_layers,
    real_rows,
    refused_as_analysis,
    state_totals,
    with_hidden,
)
from megatron_jreg.dtypes import SAFETENSORS
from megatron_jreg.hub import check_loading_info
from megatron_jreg.model_files import TensorEntry, WeightsError, auto_config, read_safetensors_folder
from megatron_jreg.progress import library_bars

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, t) for name, (t, _) in SAFETENSORS.items() if t}

class _LayerDone(Exception):  # noqa: N818 - control flow, not an error: the forward stops after layer ℓ
    pass


@dataclasses.dataclass
class _Batch:
    """One right-padded batch and the latest layer's full output (what the layers already done return instead)."""

    ids: Tensor
    mask: Tensor
    rows: Tensor | None
    tokens: int
    output: Any = None


def _skeleton(config: Any, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    """`config`'s causal LM with its parameters on the meta device and its buffers real (on `device`), as
    from_pretrained has them before loading: buffers re-made by the model's own `_init_weights`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[name] = torch.empty_like(buffer, device="cpu")
        for tensor in [*module._buffers.values(), *module._parameters.values(), module]:
            if tensor is not None and hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized
    model.initialize_weights()  # as from_pretrained re-makes buffers; on meta parameters it does nothing
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return model.eval()


def not_streamable(folder: Path, config: Any = None) -> str | None:
    """Why layer streaming cannot read `folder` (a sentence), or None when it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if not any(Path(folder).glob("*.safetensors")):
        return "no *.safetensors weights (streaming reads safetensors only)"
    config = config or auto_config(folder)
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", "?")
        return f"quantized weights ({method}): transformers' quantizer must load them whole"
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return f"model_type {config.model_type!r} has no transformers causal-LM class"
    try:
        base, layer_path, _ = decoder_stack(_skeleton(config, torch.float32))
    except UnsupportedArchitectureError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a model transformers cannot build on the meta device
        return f"transformers cannot build {type(config).__name__} on the meta device ({type(e).__name__}: {e})"
    names: dict[int, list[str]] = {}  # a layer's parameter under several names: shared between layers or with the rest
    for name, param in base.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    shared = sorted(n for group in names.values() if len(group) > 1 for n in group if f".{layer_path}." in f".{n}")
    if shared:
        return f"its decoder layers share weights ({', '.join(shared[:3])}), so no layer can be read alone"
    return None


class SafetensorsFolder:
    """Every tensor of a model folder's safetensors, read by plain reads (headers and index checked by
    `model_files.read_safetensors_folder`)."""

    def __init__(self, folder: Path, tensors: dict[str, TensorEntry] | None = None):
        self.folder = Path(folder)
        self.tensors = tensors or read_safetensors_folder(self.folder)  # headers read by `inspect_model_folder`
        for entry in self.tensors.values():
            if entry.dtype not in DTYPES:
                raise WeightsError(f"{entry.file}: dtype {entry.dtype} cannot be streamed (supported: "
                                   f"{', '.join(DTYPES)}); analyze the model without --stream")

    @staticmethod
    def _read(f: BinaryIO, info: TensorEntry, start: int, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        f.seek(start)
        if f.readinto(buf.numpy()) != nbytes:
            raise WeightsError(f"{info.file}: ended early while reading at byte {start}; download it again")
        return buf

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, in their stored dtype; each file is opened once and read in offset order."""
        wanted = sorted(names, key=lambda n: (self.tensors[n].file, self.tensors[n].start))
        out: dict[str, torch.Tensor] = {}
        for path, group in itertools.groupby(wanted, key=lambda n: self.tensors[n].file):
            with open(path, "rb") as f:
                for name in group:
                    info = self.tensors[name]
                    buf = self._read(f, info, info.start, info.end - info.start)
                    out[name] = buf.view(DTYPES[info.dtype]).reshape(info.shape)
        return out

    def rows(self, name: str, ids: Sequence[int]) -> torch.Tensor:
        """Rows `ids` (sorted, distinct) of a 2-D tensor, read in contiguous runs, in the stored dtype."""
        info = self.tensors[name]
        dtype, width = DTYPES[info.dtype], info.shape[1]
        row_bytes = width * dtype.itemsize
        out = torch.empty((len(ids), width), dtype=dtype)
        with open(info.file, "rb") as f:
            for _, group in itertools.groupby(enumerate(ids), key=lambda p: p[1] - p[0]):  # runs of consecutive ids
                run = list(group)
                (i, first), count = run[0], len(run)
                buf = self._read(f, info, info.start + first * row_bytes, count * row_bytes)
                out[i : i + count] = buf.view(dtype).reshape(count, width)
        return out


class StreamingSource(HFSource):
    """An `HFSource` whose parameters stay on the meta device until their layer is read: all batches go through one
    layer at a time (`stream_stats`, `stream_removal`)."""

    streamed = True

    def __init__(self, folder: Path, tokenizer: Any, label: str, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", include_final_norm: bool = False, config: Any,
                 tensors: dict[str, TensorEntry] | None = None):
        from transformers.conversion_mapping import get_model_conversion_mapping

        with contextlib.suppress(OSError, AttributeError):  # glibc mmaps blocks >= 1 MiB: a dropped layer is freed
            ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD := 1 MiB
        self.folder = Path(folder)
        reason = not_streamable(self.folder, config)
        if reason is not None:
            raise AnalysisError(f"--model {folder}: --stream cannot read this model: {reason}; drop --stream")
        with refused_as_analysis(f"--model {folder}: "):
            self.weights = SafetensorsFolder(self.folder, tensors)
        self.dtype = dtype
        super().__init__(_skeleton(config, dtype, device), tokenizer, label, include_final_norm)
        self.device = torch.device(device)
        self.model_class = f"{type(self.model).__name__} (streamed)"
        self._towers = other_towers(config)  # a multimodal checkpoint's vision/audio parts: not read
        self._mapping = get_model_conversion_mapping(self.model)
        self._base_prefix = next(n for n, m in self.model.named_modules() if m is self.base)
        self.head_missing = head_missing(self.model, self.folder, None, self.weights.tensors)
        self._groups, self._embedding = self._plan()
        self._load(self._groups["rest"], "the modules outside the decoder layers")

    # ----------------------------------------------------------------------------------- the files
    def _plan(self) -> tuple[dict[str, list[str]], str]:
        """The file's tensors by the layer they load into ("rest": outside the layers), missing, unknown or misshaped
        ones refused before any work as a strict load would; and the input embedding's tensor (rows read as used)."""
        meta = self.model.state_dict()
        targets_of = functools.partial(weight_targets, self.model, self._mapping, keys=meta)
        base = f"{self._base_prefix}." if self._base_prefix else ""
        embedding_module = self.model.get_input_embeddings()
        embedding_key = next(f"{n}.weight" for n, m in self.model.named_modules() if m is embedding_module)
        ignored = set(self.model._keys_to_ignore_on_load_unexpected or ())
        if any(n.endswith("rotary_emb.inv_freq") for n, _ in self.model.named_buffers()):
            ignored.add(r"rotary_emb\.inv_freq")  # legacy per-layer buffers, which transformers skips too
        ignore = re.compile("|".join(f"({p})" for p in [*ignored, r"(^|\.)position_ids$"]))
        groups: dict[str, list[str]] = {"rest": []}
        covered, unexpected, misshaped, embedding_file = set(), [], [], None
        layer_prefix = f"{base}{self.layer_path}."
        for name, info in self.weights.tensors.items():
            targets = targets_of(name)
            if not all(t in meta for t in targets):
                if not (ignore.search(name) or name.startswith((HEAD, *self._towers)) or targets[0].startswith(HEAD)):
                    unexpected.append(name)
                continue
            covered.update(targets)
            if not targets[0].startswith(base):
                groups.setdefault("head", []).append(name)  # the LM head: read for layer removal only
                continue
            if targets in ([name], [embedding_key]) and tuple(info.shape) != tuple(meta[targets[0]].shape):
                misshaped.append(name)  # converted tensors are checked as they load
            if targets == [embedding_key]:
                embedding_file = name
            elif targets[0].startswith(layer_prefix):
                groups.setdefault(targets[0][len(layer_prefix):].split(".", 1)[0], []).append(name)
            else:
                groups["rest"].append(name)
        tied = getattr(self.model, "all_tied_weights_keys", {}) or {}
        if embedding_file is None and embedding_key in tied.values():
            head = next((k for k, v in tied.items() if v == embedding_key and k in covered), None)
            embedding_file = next((n for n in self.weights.tensors if targets_of(n) == [head]), None)
            covered.add(embedding_key)
        skip = [re.compile(p) for p in (self.model._keys_to_ignore_on_load_missing or ())]
        buffers = {n for n, _ in self.model.named_buffers()}
        missing = sorted(k for k in meta if k.startswith(base) and k not in covered and k not in buffers
                         and not any(p.search(k) for p in skip))
        info = {"missing_keys": missing, "unexpected_keys": sorted(unexpected), "mismatched_keys": misshaped}
        with refused_as_analysis():
            check_loading_info(info, type(self.base).__name__, f"--model {self.folder}")
        return groups, embedding_file

    def _load(self, names: list[str], what: str) -> None:
        """Read `names` into the model through transformers' own renaming/conversion; each must land, shaped right."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        if not names:
            return
        with refused_as_analysis(f"--model {self.folder}: "):
            tensors = self.weights.load(names)
        config = LoadStateDictConfig(dtype=self.dtype, device_map={"": self.device}, weight_mapping=self._mapping)
        with library_bars(False):  # no "Loading weights" bar per layer: the analysis shows its own
            info, _ = convert_and_load_state_dict_in_model(self.model, tensors, config)
        problems = {"unexpected_keys": sorted(info.unexpected_keys) + sorted(info.conversion_errors or ()),
                    "mismatched_keys": sorted(info.mismatched_keys)}
        with refused_as_analysis():
            check_loading_info(problems, type(self.base).__name__, f"--model {self.folder} ({what})")

    def _start(self, batches: Sequence[tuple[Tensor, Tensor, Tensor]], select: bool = True
               ) -> tuple[torch.utils.hooks.RemovableHandle, list[_Batch]]:
        """(hook, batches on the device) for right-padded (ids, mask, select or targets) batches: the embedding holds
        only the rows of the tokens in use, and the hook (removed by the caller) maps token ids to those rows."""
        if any(bool((mask[:, :-1] < mask[:, 1:]).any()) for _, mask, _ in batches):
            raise ValueError("layer streaming needs right-padded batches (padding_side='right')")
        used = torch.unique(torch.cat([ids.reshape(-1) for ids, _, _ in batches]))
        vocab = self.weights.tensors[self._embedding].shape[0]
        if int(used[-1]) >= vocab or int(used[0]) < 0:
            raise AnalysisError(
                f"--model {self.folder}: token id {int(used[-1])} is outside its {vocab}-row embedding; the "
                "tokenizer does not belong to this model (pass the right one with --tokenizer)"
            )
        module = self.model.get_input_embeddings()
        table = self.weights.rows(self._embedding, used.tolist()).to(device=self.device, dtype=self.dtype)
        module.weight = nn.Parameter(table, requires_grad=False)
        used = used.to(self.device)
        to_rows = module.register_forward_pre_hook(lambda _, args: (torch.searchsorted(used, args[0]), *args[1:]))
        on = [(ids.to(self.device), mask.to(self.device), rows.to(self.device)) for ids, mask, rows in batches]
        return to_rows, [
            _Batch(ids, mask, real_rows(rows) if select else None, int(mask.sum())) for ids, mask, rows in on]

    def _advance(self, i: int, batch: _Batch, final_norm: bool = False) -> tuple[Tensor | None, Tensor | None]:
        """Batch through layer i, the layers before it answering with `batch.output`, which becomes layer i's output;
        returns (layer i's input, with final_norm the final norm's output (`HFSource._hidden_states`), else None)."""
        layer, captured, normed = self.layers[i], {}, None

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured["h_in"] = layer_input(module, args, kwargs)

        def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            batch.output = output
            if not final_norm:
                raise _LayerDone

        with (layer.register_forward_pre_hook(pre, with_kwargs=True),
              layer.register_forward_hook(post, with_kwargs=True),
              planned_layers(self.layers, batch.output, i), contextlib.suppress(_LayerDone)):
            if final_norm:
                normed = self._hidden_states(batch.ids, batch.mask)[-1]
            else:
                run_forward(self.base, batch.ids, batch.mask)
        return captured.get("h_in"), normed

    def _layer_pass(self, i: int, batch: _Batch, kind: str, final_norm: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Batch through layer i (see `_advance`): ([Σ d, count], layer i's input, its output or the final norm's)."""
        h_in, normed = self._advance(i, batch, final_norm)
        measured = first_tensor(batch.output) if normed is None else normed
        if h_in is None or measured is None or measured.shape != h_in.shape:
            raise UnsupportedArchitectureError(
                f"{type(self.model).__name__}: decoder layer {i + 1} does not map hidden states of shape "
                f"{tuple(h_in.shape) if h_in is not None else '?'} to the same shape"
            )
        return torch.stack(masked_displacement_sum(h_in, measured, batch.rows, kind)), h_in, measured

    def _each_layer(self) -> Iterator[int]:
        """Each layer's index in turn, its tensors read before and dropped after: one layer in memory at a time."""
        for i, layer in enumerate(self.layers):
            self._load(self._groups.get(str(i), []), f"decoder layer {i + 1}")
            unloaded = [n for n, p in layer.named_parameters() if p.device.type == "meta"]
            if unloaded:
                raise AnalysisError(f"--model {self.folder}: decoder layer {i + 1} got no tensor for "
                                    f"{', '.join(unloaded[:3])}; download or convert the model again")
            yield i
            layer.to("meta")

    @torch.no_grad()
    def stream_stats(self, batches: Sequence[tuple[Tensor, Tensor, Tensor]], kind: str,
                     on_batch: Callable[[int], None] | None = None) -> dict[str, Tensor]:
        """`layer_stats` summed over right-padded (ids, mask, select) batches, one layer in memory at a time; h_0..h_L
        of the selected tokens kept on the CPU. on_batch(tokens) after each batch of each layer."""
        hook, state = self._start(batches)
        kept: list[list[Tensor]] = [[] for _ in state]
        pairs = []
        with hook:
            for i in self._each_layer():
                final_norm = self.include_final_norm and i == self.num_layers - 1
                partial = []
                for batch, states in zip(state, kept):
                    pair, h_in, h_out = self._layer_pass(i, batch, kind, final_norm)
                    partial.append(pair)
                    if i == 0:
                        states.append(gather_rows(h_in, batch.rows).cpu())
                    states.append(gather_rows(h_out, batch.rows).cpu())
                    if on_batch is not None:
                        on_batch(batch.tokens)
                pairs.append(torch.stack(partial))  # [batches, 2]
        table = torch.stack(pairs).double().sum(1).cpu()  # [L, 2]
        per_batch = [state_totals([h.to(self.device) for h in states], kind) for states in kept]
        totals = {key: sum(t[key].cpu() for t in per_batch) for key in per_batch[0]}
        return {"sums": table[:, 0], "counts": table[:, 1], **totals}

    def _load_head(self) -> None:
        """Read the LM head (the embedding table, whole, when the two are tied), for layer removal."""
        head = self.model.get_output_embeddings()
        if head is None:
            raise AnalysisError(f"--model {self.folder}: {type(self.model).__name__} has no LM head; layer removal "
                                "needs one")
        if all(p.device.type != "meta" for p in head.parameters()):
            return
        if self.head_missing:
            raise AnalysisError(f"--model {self.folder}: layer removal needs the LM head, but {self.head_missing}")
        self._load(self._groups.get("head", []), "the LM head")
        if head.weight.device.type == "meta":
            table = self.weights.load([self._embedding])[self._embedding]
            head.weight = nn.Parameter(table.to(device=self.device, dtype=self.dtype), requires_grad=False)
        unloaded = [n for n, p in head.named_parameters() if p.device.type == "meta"]
        if unloaded:
            raise AnalysisError(f"--model {self.folder}: the LM head got no tensor for {', '.join(unloaded)}")

    @torch.no_grad()
    def stream_removal(self, batches: Sequence[tuple[Tensor, Tensor, Tensor]], top_k: Sequence[int],
                       ce_sum: Callable[[Tensor, Tensor], Tensor], on_pass: Callable[[int], None] | None = None
                       ) -> Tensor:
        """Layer removal one layer in memory at a time: Σ CE [1 + L + len(top_k)] float64 of the model, without each
        layer, without the top k; on_pass(layers) per batch and pass."""
        self._load_head()
        hook, base = self._start(batches, select=False)
        targets = [t.to(self.device) for _, _, t in batches]
        skips: dict[int, list[_Batch]] = {}
        finals: dict[int, list[Any]] = {}  # k → the model's output after layer L − k, per batch
        tick = on_pass or (lambda n: None)

        def ce(outputs: Iterable[Any]) -> Tensor:
            """Σ CE over the batches when the last decoder layer's outputs are `outputs` (every layer answers with
            them): the final norm, the head and whatever the family does after the layers."""
            tick(len(base))
            total = []
            for batch, output, target in zip(base, outputs, targets):
                with planned_layers(self.layers, output, self.num_layers):
                    total.append(ce_sum(self.logits(batch.ids, batch.mask), target))
            return sum(total)

        with hook:
            for i in self._each_layer():
                for states in skips.values():
                    for batch in states:
                        self._advance(i, batch)
                        tick(1)
                if i > 0:
                    skips[i] = [dataclasses.replace(b) for b in base]
                for batch in base:
                    h_in, _ = self._advance(i, batch)
                    if i == 0:
                        skip = dataclasses.replace(batch, output=with_hidden(batch.output, h_in))  # from the embeddings
                        skips.setdefault(0, []).append(skip)
                    tick(1)
                for k in top_k:
                    if self.num_layers - k == i + 1:
                        finals[k] = [b.output for b in base]
                    elif k == self.num_layers and i == 0:
                        finals[k] = [b.output for b in skips[0]]
            sums = [ce(b.output for b in base), *(ce(b.output for b in skips.pop(j)) for j in range(self.num_layers)),
                    *(ce(finals[k]) for k in top_k)]
        return torch.stack(sums).double().cpu()

    def layer_stats(self, input_ids: Tensor, attention_mask: Tensor, kind: str, select: Tensor | None = None
                    ) -> dict[str, Tensor]:
        """One batch through all layers (reads every layer once per call: use `stream_stats` for many)."""
        return self.stream_stats([(input_ids, attention_mask, attention_mask if select is None else select)], kind)

    def close(self) -> None:
        super().close()
        del self.weights


def load_stream_source(path: Path, *, tokenizer: str | None = None, with_tokenizer: bool = True, config: Any = None,
                       tensors: dict[str, TensorEntry] | None = None, **options: Any) -> StreamingSource:
    """`hf_source.load_hf_source` for layer streaming; `options`: StreamingSource's."""
    config = config or auto_config(Path(path))
    tok = load_tokenizer(Path(path), None, tokenizer, config) if with_tokenizer else None
    return StreamingSource(Path(path), tok, config=config, tensors=tensors, **options)
