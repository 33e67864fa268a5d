"""Settings of `megatron-jreg analyze`, validated once (each check names its flag and the fix), plus the data."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megatron_jreg import hub, jreg
from megatron_jreg.analysis.source import AnalysisError
from megatron_jreg.data import text
from megatron_jreg.dtypes import torch_dtype
from megatron_jreg.fileio import check_output_folder

DTYPES = ("float32", "bfloat16")  # of dtypes.WEIGHT_DTYPES: float16 overflows in the residual stream of deep models
DATA_FORMATS = ("lambada", "wikitext", "jsonl", "text")
PADDING_SIDES = ("right", "left")
POSITIONS = ("all", "last")


@dataclass
class AnalyzeConfig:
    """One field per CLI flag (`--num-samples` → num_samples): the library and the CLI share one set of defaults."""

    models: list[str] = field(default_factory=list)
    checkpoints: str | None = None
    data: str = "lambada"
    num_samples: int | None = 100  # None: all; a LAMBADA sample is a whole passage
    batch_size: int = 8
    max_length: int | None = None
    dtype: str = "float32"
    distance: str = "angular"
    include_final_norm: bool = False
    output: Path = Path("jump_analysis")
    device: str = "auto"
    tokenizer: str | None = None
    padding_side: str = "right"  # no flag; recorded in results.json
    stream: bool | None = None  # None: `loading.should_stream` per model
    progress: bool | None = None  # None: when stderr is a terminal
    remove_layers: bool = False
    top_k: tuple[int, ...] | None = None  # None: `removal.default_top_k` per model
    positions: str = "all"
    revisions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.output = Path(self.output)
        if not self.models and not self.checkpoints:
            raise AnalysisError("nothing to analyze: give --model PATH (repeatable) or --checkpoints GLOB")
        for flag, value, alternative in (("--num-samples", self.num_samples, " (or 'all')"),
                                         ("--batch-size", self.batch_size, ""), ("--max-length", self.max_length, "")):
            if value is not None and value < 1:
                raise AnalysisError(f"{flag} must be >= 1{alternative}, got {value}")
        for flag, value, allowed in (("--dtype", self.dtype, DTYPES), ("--distance", self.distance, jreg.DISTANCES),
                                     ("--positions", self.positions, POSITIONS),
                                     ("padding_side", self.padding_side, PADDING_SIDES)):
            if value not in allowed:
                raise AnalysisError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        if self.top_k is not None:
            self.top_k = tuple(self.top_k)
            if not self.top_k or any(not isinstance(k, int) or k < 1 for k in self.top_k):
                raise AnalysisError(f"--top-k {','.join(map(str, self.top_k))}: each k must be a whole number >= 1, "
                                    "e.g. --top-k 1,2,3")
            if not self.remove_layers:
                raise AnalysisError("--top-k is the k of layer removal: add --remove-layers (or drop --top-k)")
        if self.revisions:
            if not self.models:
                raise AnalysisError("--revision needs --model ORG/NAME (a hub id in the local cache)")
            for revision in self.revisions:
                if not revision or "/" in revision or "@" in revision:
                    raise AnalysisError(f"--revision {revision!r}: name branches, tags or commits separated by commas, "
                                        "e.g. --revision step1000,step2000")
            for model in self.models:
                if "@" in model or Path(model).exists():
                    raise AnalysisError(f"--revision with --model {model}: give the hub id without @REVISION (a local "
                                        "folder has no revisions)")
        if self.device != "auto":
            try:
                device = torch.device(self.device)
            except RuntimeError as e:
                raise AnalysisError(f"--device {self.device!r} is not a torch device (use auto, cpu, cuda:0)") from e
            if device.type == "cuda" and not torch.cuda.is_available():
                raise AnalysisError(f"--device {self.device}: no CUDA device here; use --device cpu (or auto)")
        if self.tokenizer is not None:
            self.tokenizer = str(hub.resolve(self.tokenizer, "--tokenizer"))
            if not Path(self.tokenizer).exists():
                raise AnalysisError(f"--tokenizer {self.tokenizer}: no such folder; pass a folder with tokenizer.json")
        check_output_folder(self.output, f"--output {self.output}")
        parse_data_spec(self.data)  # fail on a bad --data before any model is loaded

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def settings(self) -> dict:
        """The settings as written into results.json (paths as strings)."""
        out = {key: value for key, value in asdict(self).items() if key != "progress"}
        return {**out, "output": str(self.output), "device": str(self.torch_device)}


def parse_data_spec(spec: str) -> tuple[str, Path, str | None]:
    """`--data` → (format, file, jsonl key). `lambada` alone is the vendored LAMBADA test set."""
    fmt, _, rest = spec.partition(":")
    if fmt not in DATA_FORMATS:
        raise AnalysisError(f"--data {spec!r}: format must be one of {DATA_FORMATS}, e.g. --data lambada:FILE")
    if fmt == "lambada" and not rest:
        return fmt, text.DEFAULT_LAMBADA, None
    key = None
    if fmt == "jsonl":
        rest, sep, key = rest.rpartition(":")
        if not sep or not key or not rest:
            raise AnalysisError(f"--data {spec!r}: jsonl needs a key, e.g. --data jsonl:data.jsonl:text")
    if not rest:
        raise AnalysisError(f"--data {spec!r}: give a file, e.g. --data {fmt}:FILE")
    path = Path(rest)
    if not path.is_file():
        raise AnalysisError(f"--data {spec!r}: no such file {path}; pass an existing file")
    return fmt, path, key


def load_texts(spec: str, num_samples: int | None) -> list[str]:
    """The first `num_samples` non-empty samples of `--data` (all when None), in file order."""
    fmt, path, key = parse_data_spec(spec)
    read = {"lambada": text.lambada_passages, "wikitext": text.wikitext_articles, "text": text.text_paragraphs,
            "jsonl": lambda p: list(text.iter_jsonl(p, key or "text"))}[fmt]
    try:
        texts = read(path)
    except UnicodeDecodeError as e:
        raise AnalysisError(
            f"--data {spec!r}: {path} is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8"
        ) from None
    except ValueError as e:  # iter_jsonl: "<file>:<line>: cannot read key ..."
        raise AnalysisError(f"--data {spec!r}: {e}; fix or drop that line") from None
    texts = [t for t in texts if t.strip()][:num_samples]
    if not texts:
        raise AnalysisError(f"--data {spec!r}: no non-empty samples in {path}; pass a file that holds text")
    return texts
