"""Inputs (FineWeb-Edu parquet, HF dataset folders, JSONL(.gz/.zst)) as work units in a fixed order, so the
output does not depend on the number of workers, and as records that say where each came from or why it is bad.
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_jreg.data.compressed import StreamDamaged, compression_of, iter_decompressed

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd")
TEXT_SUFFIXES = (".txt",)  # plain text: only for tokenizer training (one sample per line)
SUPPORTED_SUFFIXES = (".parquet", ".arrow", *JSONL_SUFFIXES)

# Reasons a record is skipped that are errors (--on-error fail stops at the first); the others are filters
# (below_min_int_score, too_short) or nothing to read (empty, blank_line).
ERROR_REASONS = (
    "malformed_json", "missing_key", "not_a_string", "not_utf8", "missing_int_score",
    "not_token_ids",  # NullTokenizer: text that is not space-separated ids below --vocab-size
    "unreadable_file",  # nothing of the file could be read
    "corrupt_stream",  # a .gz/.zst that ends early or is corrupt: complete lines before it are kept
)


@dataclass(frozen=True)
class InputFile:
    path: str
    kind: str  # "jsonl" | "parquet" | "arrow" | "text"
    size: int


def _kind(path: str, allow_text: bool) -> str | None:
    name = path.lower()
    if name.endswith(".manifest.json"):  # our own manifests, when outputs sit next to the inputs
        return None
    kinds = {"parquet": (".parquet",), "arrow": (".arrow",), "jsonl": JSONL_SUFFIXES, "text": TEXT_SUFFIXES}
    return next((k for k, suffixes in kinds.items() if name.endswith(suffixes) and (allow_text or k != "text")), None)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--input {path}: unreadable {what} ({e}); re-save the dataset folder") from None


def _hf_folder_files(folder: Path, split: str | None) -> list[Path] | None:
    """The .arrow files of a `datasets` save_to_disk folder (DatasetDict: the `split`), or None."""
    if (folder / "dataset_dict.json").is_file():
        splits = _read_json(folder / "dataset_dict.json", "DatasetDict index").get("splits", [])
        split = split or ("train" if "train" in splits else None)
        if split not in splits:
            raise ValueError(f"--input {folder}: a DatasetDict with splits {splits}; choose one with --hf-split")
        folder = folder / split
    if not (folder / "state.json").is_file():
        return None
    state = _read_json(folder / "state.json", "dataset state")
    try:
        return [folder / f["filename"] for f in state["_data_files"]]
    except (KeyError, TypeError):
        raise ValueError(f"--input {folder / 'state.json'}: no '_data_files' list; re-save the dataset "
                         "folder") from None


def _walk(folder: Path, allow_text: bool) -> list[Path]:
    """Input files under `folder`, hidden ones skipped; an unreadable subfolder is an error, not a gap."""

    def fail(error: OSError) -> None:
        raise ValueError(f"--input {error.filename}: cannot list this folder ({error.strerror}); fix its permissions "
                         "or leave it out of --input")

    found = []
    for root, dirs, names in os.walk(folder, onerror=fail):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, n) for n in names if not n.startswith(".") and _kind(n, allow_text)]
    return sorted(p for p in found if p.is_file())


def resolve_inputs(patterns: list[str], hf_split: str | None = None, allow_text: bool = False) -> list[InputFile]:
    """Files named by `--input` (a file, a directory searched recursively or a HF dataset folder, a glob): each
    pattern's files sorted by path, patterns in the order given."""
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_file():
            if _kind(str(path), allow_text) is None:
                raise ValueError(f"--input {path}: unsupported file type; use {', '.join(SUPPORTED_SUFFIXES)}")
            files.append(path)
        elif path.is_dir() and (hf := _hf_folder_files(path, hf_split)) is not None:
            files.extend(hf)
        elif path.is_dir():
            found = _walk(path, allow_text)
            if not found:
                raise ValueError(f"--input {path}: no {', '.join(SUPPORTED_SUFFIXES)} files in this directory")
            files.extend(found)
        else:
            found = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if _kind(p, allow_text))
            if not found:
                raise FileNotFoundError(f"--input {pattern}: no such file, directory, or matching input files")
            files.extend(found)
    unique = list(dict.fromkeys(p.resolve() for p in files))
    for p in unique:
        if not os.access(p, os.R_OK):
            raise ValueError(f"--input {p}: permission denied (not readable by this user); fix its permissions or "
                             "leave it out of --input")
    return [InputFile(str(p), _kind(str(p), allow_text) or "", p.stat().st_size) for p in unique]


@dataclass
class Unit:
    """One piece of work, processed by one worker call; units of a file come in file order."""

    path: str
    kind: str
    index: int  # block / row group / slice number within the file
    input_bytes: int  # share of the file's on-disk bytes (progress and ETA)
    first_line: int = 1  # jsonl: line number of data's first line
    data: bytes | None = None  # jsonl: whole lines
    table: Any = None  # arrow: a pyarrow Table slice
    first_row: int = 0  # arrow/parquet: row number of the first row
    error: str | None = None  # the file (or its rest, from first_line on) could not be read: why
    error_reason: str = "unreadable_file"  # or corrupt_stream: a damaged tail after readable lines


def _jsonl_units(file: InputFile, block_bytes: int) -> Iterator[Unit]:
    """Blocks of whole lines; damage in a compressed file ends it with one error unit, after every complete line
    before it (`corrupt_stream`, or `unreadable_file` when nothing could be read)."""
    line, index, consumed, parts, size = 1, 0, 0, [], 0
    damage = None
    try:
        with open(file.path, "rb") as raw:  # raw.tell() is the on-disk position: progress and ETA
            for piece in iter_decompressed(raw, compression_of(file.path)):
                parts.append(piece)
                size += len(piece)
                if size < block_bytes:
                    continue
                data = b"".join(parts)
                cut = data.rfind(b"\n") + 1
                parts, size = [data[cut:]], len(data) - cut
                if cut:
                    position = raw.tell()
                    yield Unit(file.path, "jsonl", index, max(position - consumed, 0), line, data[:cut])
                    consumed, index = max(position, consumed), index + 1
                    line += data.count(b"\n", 0, cut)
    except (StreamDamaged, OSError) as e:
        damage = str(e)
    data = b"".join(parts)
    cut = len(data) if damage is None else data.rfind(b"\n") + 1
    if cut:
        yield Unit(file.path, "jsonl", index, file.size - consumed if damage is None else 0, line, data[:cut])
        index, line = index + 1, line + data.count(b"\n", 0, cut)
    if damage is not None:
        tail = f"; {len(data) - cut} bytes of an incomplete line dropped" if len(data) > cut else ""
        yield Unit(file.path, "jsonl", index, file.size - consumed, line, error=f"{damage}{tail}",
                   error_reason="unreadable_file" if index == 0 and not data else "corrupt_stream")


def _parquet_units(file: InputFile) -> Iterator[Unit]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file.path).metadata
    except Exception as e:  # any reader failure: unreadable
        yield Unit(file.path, "parquet", 0, file.size, error=f"{type(e).__name__}: {e}")
        return
    rows = max(meta.num_rows, 1)
    first = 0
    for rg in range(meta.num_row_groups):
        n = meta.row_group(rg).num_rows
        yield Unit(file.path, "parquet", rg, file.size * n // rows, first_row=first)
        first += n


def _arrow_units(file: InputFile, columns: list[str], rows_per_unit: int) -> Iterator[Unit]:
    import pyarrow as pa

    try:
        source = pa.memory_map(file.path)
        try:
            table = pa.ipc.open_stream(source).read_all()  # `datasets` writes the streaming format
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(source).read_all()
    except Exception as e:
        yield Unit(file.path, "arrow", 0, file.size, error=f"{type(e).__name__}: {e}")
        return
    wanted = [c for c in columns if c in table.column_names]
    if len(wanted) == len(columns):  # else keep every column, for the message naming them
        table = table.select(wanted)
    rows = max(table.num_rows, 1)
    for index, start in enumerate(range(0, table.num_rows, rows_per_unit)):
        piece = table.slice(start, rows_per_unit)
        yield Unit(file.path, "arrow", index, file.size * piece.num_rows // rows, table=piece, first_row=start)


def iter_units(files: list[InputFile], columns: list[str], block_bytes: int = 1 << 20) -> Iterator[Unit]:
    """Work units of `files` in order; `columns` are the text keys (+ int_score when filtering)."""
    for file in files:
        if file.kind == "jsonl":
            yield from _jsonl_units(file, block_bytes)
        elif file.kind == "parquet":
            yield from _parquet_units(file)
        elif file.kind == "arrow":
            yield from _arrow_units(file, columns, rows_per_unit=2048)
        else:
            raise ValueError(f"{file.path}: {file.kind} input is only supported for tokenizer training")


@dataclass
class Records:
    """Records of one unit: texts[key][i], int_scores[i], and bad records as (position, reason, where)."""

    texts: dict[str, list[str]] = field(default_factory=dict)
    int_scores: list[Any] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # record ordinal within the unit
    where: list[str] = field(default_factory=list)  # file:line / file:row of each good record
    bad: list[tuple[int, str, str]] = field(default_factory=list)
    count: int = 0  # records seen (good + bad)


def jsonl_lines(unit: Unit) -> Iterator[tuple[str, Any, str | None]]:
    """(file:line, the parsed JSON, None) per line of a JSONL unit; for a line that cannot be read, or the
    unit's unreadable rest, (file:line (why), None, the skip reason)."""
    if unit.error is not None:
        yield f"{unit.path}:{unit.first_line} ({unit.error})", None, unit.error_reason
        return
    for offset, raw in enumerate(unit.data.removesuffix(b"\n").split(b"\n")):
        where = f"{unit.path}:{unit.first_line + offset}"
        if not raw.strip():
            yield where, None, "blank_line"
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            yield f"{where} ({e.reason} at byte {e.start})", None, "not_utf8"
            continue
        except ValueError as e:
            yield f"{where} ({e})", None, "malformed_json"
            continue
        yield where, record, None


def _jsonl_records(unit: Unit, keys: list[str], want_score: bool) -> Records:
    out = Records(texts={k: [] for k in keys})
    for pos, (where, record, reason) in enumerate(jsonl_lines(unit)):
        out.count += 1
        fields = record if isinstance(record, dict) else {}
        values = [fields.get(k) for k in keys]
        missing = [k for k, v in zip(keys, values) if v is None]
        score = fields.get("int_score") if want_score else None
        if reason is not None:
            out.bad.append((pos, reason, where))
        elif not isinstance(record, dict):
            out.bad.append((pos, "malformed_json", f"{where} (a JSON {type(record).__name__}, not an object)"))
        elif missing:
            out.bad.append((pos, "missing_key", f"{where} (no {missing[0]!r}; keys: {sorted(record)[:8]})"))
        elif not all(isinstance(v, str) for v in values):
            out.bad.append((pos, "not_a_string", f"{where} ({keys[0]!r} holds a non-string value)"))
        elif want_score and (isinstance(score, bool) or not isinstance(score, int | float)):
            out.bad.append((pos, "missing_int_score", f"{where} (no numeric 'int_score' for --min-int-score)"))
        else:
            for k, v in zip(keys, values):
                out.texts[k].append(v)
            out.int_scores.append(score)
            out.positions.append(pos)
            out.where.append(where)
    return out


def _table_records(unit: Unit, table: Any, keys: list[str], want_score: bool,
                   file_columns: list[str] | None = None) -> Records:
    """Records of an Arrow table; `file_columns`: the file's columns when `table` holds only the wanted ones
    (named in the message when one is missing)."""
    import pyarrow as pa

    n, label = table.num_rows, f"{unit.path}:row"
    out = Records(texts={k: [] for k in keys}, count=n)
    missing = [k for k in [*keys, *(["int_score"] if want_score else [])] if k not in table.column_names]
    if missing:
        reason = "missing_key" if missing[0] in keys else "missing_int_score"
        names = list(file_columns if file_columns is not None else table.column_names)
        shown = ", ".join(names[:10]) + (f", … ({len(names)} in all)" if len(names) > 10 else "")
        out.bad = [(i, reason, f"{label} {unit.first_row + i} (no column {missing[0]!r}; columns: {shown or 'none'})")
                   for i in range(n)]
        return out
    columns = []
    for k in keys:  # values of a column that holds neither text nor bytes become TypeError
        kind = table.column(k).type
        text = any(is_text(kind) for is_text in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                                                 pa.types.is_large_binary))
        columns.append([v if text or v is None else TypeError for v in table.column(k).to_pylist()])
    scores = table.column("int_score").to_pylist() if want_score else [None] * n
    for i, values in enumerate(zip(*columns)):
        where = f"{label} {unit.first_row + i}"
        if any(v is None for v in values):
            out.bad.append((i, "missing_key", f"{where} (null {keys[0]!r})"))
            continue
        try:
            values = [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]
        except UnicodeDecodeError:
            out.bad.append((i, "not_utf8", where))
            continue
        if any(v is TypeError for v in values):
            out.bad.append((i, "not_a_string", f"{where} ({keys[0]!r} is {table.column(keys[0]).type})"))
        elif want_score and (isinstance(scores[i], bool) or not isinstance(scores[i], int | float)):
            out.bad.append((i, "missing_int_score", where))
        else:
            for k, v in zip(keys, values):
                out.texts[k].append(v)
            out.int_scores.append(scores[i])
            out.positions.append(i)
            out.where.append(where)
    return out


def read_records(unit: Unit, keys: list[str], want_score: bool) -> Records:
    """Parse a unit into records (runs in a worker). An unreadable file yields one `unreadable_file` entry."""
    if unit.kind == "jsonl":
        return _jsonl_records(unit, keys, want_score)
    if unit.error is not None:
        bad = [(0, unit.error_reason, f"{unit.path} ({unit.error})")]
        return Records(texts={k: [] for k in keys}, bad=bad, count=1)
    if unit.kind == "arrow":
        return _table_records(unit, unit.table, keys, want_score)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(unit.path)
        present = list(pf.schema_arrow.names)
        wanted = [c for c in [*keys, *(["int_score"] if want_score else [])] if c in present]
        table = pf.read_row_group(unit.index, columns=wanted)
    except Exception as e:  # a corrupt row group
        bad = [(0, "unreadable_file", f"{unit.path} row group {unit.index} ({type(e).__name__}: {e})")]
        return Records(texts={k: [] for k in keys}, count=1, bad=bad)
    return _table_records(unit, table, keys, want_score, present)


def iter_texts(files: list[InputFile], key: str = "text", skipped: Counter | None = None) -> Iterator[str]:
    """Every readable text of `files` in order (tokenizer and Punkt training); bad records counted in `skipped`."""
    for file in files:
        if file.kind == "text":
            with open(file.path, encoding="utf-8", errors="replace") as f:
                yield from (line for line in f if line.strip())
            continue
        for unit in iter_units([file], [key]):
            records = read_records(unit, [key], want_score=False)
            if skipped is not None:
                skipped.update(reason for _, reason, _ in records.bad if reason != "blank_line")
            yield from records.texts[key]
