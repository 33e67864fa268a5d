"""Bad input for the data commands (preprocess, train-tokenizer, merge-datasets), one table row per case.

Each row builds its input in a fresh folder and runs the command's `main(argv)` in this process (rows about
permissions run it in a subprocess that has given up root's permission override, so that they hold when
the suite runs as root too). Every row asserts:

- the exit status: 2 for bad input or a bad flag (argparse's own status for a usage error), 0 when the input
  is partly usable;
- on an error, exactly one stderr line `<command>: error: ...` that names the file or flag (and no traceback:
  an exception escaping `main` fails the row);
- that nothing is lost: after an error nothing is left that looks like output; after a partly usable input
  every good document is in the output and the damage is counted by reason.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_jreg.data import merge, train_tokenizer
from megatron_jreg.data import preprocess as pp
from megatron_jreg.data.tokenizers import build_tokenizer
from tests._indexed import read_documents

ROOT = Path(__file__).resolve().parent.parent
WIKI = ROOT / "examples" / "data" / "wikitext-2"
MAINS = {"preprocess": pp.main, "train-tokenizer": train_tokenizer.main, "merge-datasets": merge.main}
PROGS = {name: f"megatron-jreg {name}" for name in MAINS}
GOOD = [f"Document {i}: the quick brown fox jumps over the lazy dog, {i * 7} times." for i in range(6)]
LINES = [json.dumps({"text": f"line {i} of a long file with some words in it"}) + "\n" for i in range(1000)]


@dataclass(frozen=True)
class Env:
    """What every row may use: tokenizers, a good JSONL, and two finished datasets to merge."""

    bpe: str
    sp: str
    good: Path
    shards: tuple[str, str]
    expected: tuple[tuple[int, ...], ...]  # the good documents as token ids (+ eod)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    root = tmp_path_factory.mktemp("env")
    bpe = train_tokenizer.train_tokenizer([str(WIKI / "valid.txt")], str(root / "bpe"), 300, "hf-bpe", max_chars=40_000)
    sp = train_tokenizer.train_tokenizer([str(WIKI / "valid.txt")], str(root / "sp"), 500, max_chars=40_000)
    good = root / "good.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in GOOD))
    shards = []
    for i, part in enumerate((GOOD[:3], GOOD[3:])):
        (root / f"part{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        argv = _tok(bpe) + ["--input", str(root / f"part{i}.jsonl"), "--output-prefix", str(root / f"shard{i}")]
        assert pp.main(argv + ["--append-eod"]) == 0
        shards.append(str(root / f"shard{i}_text_document"))
    tok = build_tokenizer("HuggingFaceTokenizer", bpe)
    expected = tuple(tuple(tok.tokenize(t) + [tok.eod]) for t in GOOD)
    return Env(bpe, sp, good, tuple(shards), expected)


def _tok(bpe: str) -> list[str]:
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe]


def pre(env: Env, tmp: Path, *inputs: Path | str, extra: str = "", prefix: Path | str | None = None) -> list[str]:
    """A preprocess command line: the BPE tokenizer, --append-eod, output tmp/out/x unless `prefix`."""
    paths = [str(p) for p in inputs] or [str(env.good)]
    prefix = prefix or tmp / "out" / "x"
    return ["--input", *paths, "--output-prefix", str(prefix), *_tok(env.bpe), "--append-eod", *extra.split()]


def tt(tmp: Path, *inputs: Path | str, extra: str = "", output: Path | None = None) -> list[str]:
    """A train-tokenizer command line (hf-bpe unless `extra` says otherwise), output tmp/out/tok."""
    paths = [str(p) for p in inputs] or [str(WIKI / "valid.txt")]
    output = output or tmp / "out" / "tok"
    return ["--input", *paths, "--output", str(output), "--max-chars", "20000", "--vocab-size", "300", *extra.split()]


def mg(env: Env, tmp: Path, *inputs: str, prefix: Path | None = None) -> list[str]:
    return ["--input", *(inputs or env.shards), "--output-prefix", str(prefix or tmp / "out" / "merged")]


def copy_shard(env: Env, tmp: Path, i: int = 0) -> Path:
    """A copy of one finished dataset (with its manifest) in tmp/in, to damage."""
    (tmp / "in").mkdir(exist_ok=True)
    for suffix in (".bin", ".idx", ".manifest.json"):
        shutil.copy(env.shards[i] + suffix, tmp / "in" / f"s{i}{suffix}")
    return tmp / "in" / f"s{i}"


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def gz_prefix(blob: bytes) -> bytes:
    """What zlib can decompress from a damaged gzip blob, 1 byte at a time (an independent reference)."""
    d, out = zlib.decompressobj(31), []
    for i in range(len(blob)):
        try:
            out.append(d.decompress(blob[i : i + 1]))
        except zlib.error:
            break
    return b"".join(out)


def zst_frames(lines: list[str], per_frame: int) -> bytes:
    import zstandard

    c = zstandard.ZstdCompressor()
    return b"".join(c.compress("".join(lines[i : i + per_frame]).encode()) for i in range(0, len(lines), per_frame))


# ---------------------------------------------------------------------------------------------- checks


def no_output(tmp: Path) -> None:
    """Nothing under tmp/out that looks like output (a folder the check created may remain, empty)."""
    left = [p for p in (tmp / "out").rglob("*") if p.is_file()] if (tmp / "out").exists() else []
    assert not left, left


def nothing_written(tmp: Path, env: Env, out: str) -> None:
    """No output, and no line claiming one ("shard 0: wrote ... (0 docs)")."""
    no_output(tmp)
    assert "wrote" not in out, out


def kept(texts: list[str] | None = None, **skipped: int) -> Callable[[Path, Env, str], None]:
    """The output holds exactly the documents of `texts` (GOOD when None), and the skips by reason."""

    def check(tmp: Path, env: Env, out: str) -> None:
        docs = [tuple(d.tolist()) for d in read_documents(tmp / "out" / "x_text_document")]
        manifest = json.loads((tmp / "out" / "x_text_document.manifest.json").read_text())
        if texts is None:
            assert docs == list(env.expected)
        else:
            tok = build_tokenizer("HuggingFaceTokenizer", env.bpe)
            assert docs == [tuple(tok.tokenize(t) + [tok.eod]) for t in texts]
        assert manifest["skipped"] == skipped
        for reason in skipped:
            assert f"{reason} " in out

    return check


def kept_readable_lines(name: str, decompress: Callable[[bytes], bytes]) -> Callable[[Path, Env, str], None]:
    """Every complete line an independent decoder reads before the damage is kept (or counted if not JSON)."""

    def check(tmp: Path, env: Env, out: str) -> None:
        lines = decompress((tmp / "in" / name).read_bytes()).split(b"\n")[:-1]
        texts = []
        for line in lines:
            try:
                texts.append(json.loads(line)["text"])
            except (ValueError, KeyError, TypeError):
                pass
        assert len(lines) >= 100  # the damage comes after many good lines
        manifest = json.loads((tmp / "out" / "x_text_document.manifest.json").read_text())
        skipped = dict(manifest["skipped"])
        assert skipped.pop("corrupt_stream") == 1 and sum(skipped.values()) == len(lines) - len(texts)
        kept(texts, **manifest["skipped"])(tmp, env, out)

    return check


def zst_prefix(blob: bytes) -> bytes:
    """What zstd can decompress from a damaged blob, frame by frame (an independent reference)."""
    import zstandard

    out = []
    while blob:
        d = zstandard.ZstdDecompressor().decompressobj()
        try:
            out.append(d.decompress(blob))
        except zstandard.ZstdError:
            break
        blob = d.unused_data if d.eof else b""
    return b"".join(out)


def merged_nothing(tmp: Path, env: Env, out: str) -> None:
    no_output(tmp)
    assert all(Path(p + ".idx").stat().st_size > 0 for p in env.shards)  # the shards are untouched


# ---------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    command: str
    build: Callable[[Env, Path], list[str]]  # makes the input under tmp, returns argv
    rc: int
    names: tuple[str, ...] = ()  # in the error line ("{tmp}" is the row's folder); on success, in stdout
    check: Callable[[Path, Env, str], None] | None = None  # nothing lost
    privileged: bool = False  # about permissions: run without root's override
    setup: Callable[[Env, Path], None] | None = field(default=None)


def _mkdir(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _ro(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    return folder


def _unreadable(path: Path) -> Path:
    path.chmod(0)
    return path


CASES: dict[str, Case] = {
    # ---- damaged compressed input: every complete line before the damage is kept, the tail is counted
    "pre-gz-truncated": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.jsonl.gz", _truncated_gz())),
        0,
        ("a.jsonl.gz:", "truncated"),
        kept_readable_lines("a.jsonl.gz", gz_prefix),
    ),
    "pre-zst-truncated": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.jsonl.zst", zst_frames(LINES, 100)[:-40])),
        0,
        ("a.jsonl.zst:901 (the zstd frame ends",),
        kept([json.loads(line)["text"] for line in LINES[:900]], corrupt_stream=1),
    ),
    "pre-zst-cut-at-a-frame-start": Case(  # used to pass silently: the lost frame held whole lines
        "preprocess",
        lambda e, t: pre(
            e, t, write(t / "in" / "a.jsonl.zst", zst_frames(LINES, 500)[: len(zst_frames(LINES[:500], 500)) + 6])
        ),
        0,
        ("a.jsonl.zst:501 (the zstd frame ends",),
        kept_readable_lines("a.jsonl.zst", zst_prefix),
    ),
    "pre-gz-bit-flip": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.jsonl.gz", _flip(gzip.compress("".join(LINES).encode()), 0.7))),
        0,
        ("corrupt gzip data",),
        kept_readable_lines("a.jsonl.gz", gz_prefix),
    ),
    "pre-gz-not-gzip-next-to-good": Case(
        "preprocess",
        lambda e, t: pre(e, t, e.good, write(t / "in" / "b.jsonl.gz", "".join(LINES[:3]))),
        0,
        ("b.jsonl.gz",),
        kept(unreadable_file=1),
    ),
    "pre-parquet-truncated-next-to-good": Case(
        "preprocess",
        lambda e, t: pre(e, t, e.good, write(t / "in" / "b.parquet", _parquet_bytes()[:300])),
        0,
        ("b.parquet",),
        kept(unreadable_file=1),
    ),
    "pre-binary-garbage-next-to-good": Case(
        "preprocess",
        lambda e, t: pre(
            e, t, e.good, write(t / "in" / "b.jsonl", bytes(b for b in range(256) if b != 10) * 4 + b"\n{\x00}\n")
        ),
        0,
        ("b.jsonl:1",),
        kept(not_utf8=1, malformed_json=1),
    ),
    # ---- input with nothing to keep: an error, and no empty dataset that looks finished
    "pre-empty-file": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.jsonl", b"")),
        2,
        ("a.jsonl", "no documents"),
        lambda t, e, o: no_output(t),
    ),
    "pre-empty-gz": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.jsonl.gz", gzip.compress(b""))),
        2,
        ("a.jsonl.gz", "no records"),
        lambda t, e, o: no_output(t),
    ),
    "pre-only-blank-lines": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.jsonl", "\n \n\t\n")),
        2,
        ("blank_line 3",),
        lambda t, e, o: no_output(t),
    ),
    "pre-parquet-without-text-column": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.parquet", _parquet_bytes(column="body"))),
        2,
        ("a.parquet", "no column 'text'; columns: body, score", "--json-keys"),
        nothing_written,
    ),
    "pre-arrow-without-text-column": Case(  # a `datasets` .arrow file (Arrow's streaming format)
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.arrow", _arrow_bytes(column="body"))),
        2,
        ("a.arrow", "no column 'text'; columns: body, score", "--json-keys"),
        nothing_written,
    ),
    "pre-jsonl-without-the-key": Case(
        "preprocess",
        lambda e, t: pre(e, t, extra="--json-keys body"),
        2,
        ("good.jsonl:1", "no 'body'", "--json-keys"),
        lambda t, e, o: no_output(t),
    ),
    "pre-on-error-fail": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.jsonl", LINES[0] + "{oops\n" + LINES[1]), extra="--on-error fail"),
        2,
        ("a.jsonl:2", "malformed_json", "--on-error skip"),
        lambda t, e, o: no_output(t),
    ),
    # ---- paths of the wrong kind
    "pre-readonly-output-folder": Case(
        "preprocess",
        lambda e, t: pre(e, t, prefix=_ro(t / "out") / "x"),
        2,
        ("--output-prefix", "{tmp}/out", "writable"),
        lambda t, e, o: no_output(t),
        privileged=True,
    ),
    "pre-output-parent-is-a-file": Case(
        "preprocess",
        lambda e, t: pre(e, t, prefix=write(t / "out" / "f", "x") / "x"),
        2,
        ("--output-prefix", "out/f is a file"),
        lambda t, e, o: [p.name for p in (t / "out").iterdir()] == ["f"] or pytest.fail("output left"),
    ),
    "pre-output-prefix-ends-with-a-slash": Case(
        "preprocess",
        lambda e, t: pre(e, t, prefix=str(_mkdir(t / "out")) + "/"),
        2,
        ("--output-prefix", "is a folder"),
        lambda t, e, o: no_output(t),
    ),
    "pre-output-prefix-is-an-existing-folder": Case(
        "preprocess",
        lambda e, t: pre(e, t, prefix=_mkdir(t / "out")),
        2,
        ("--output-prefix", "is a folder"),
        lambda t, e, o: no_output(t),
    ),
    "pre-manifest-cannot-be-written": Case(  # a folder where the manifest goes: no dataset without its manifest
        "preprocess",
        lambda e, t: pre(e, t) if _mkdir(t / "out" / "x_text_document.manifest.json") else [],
        2,
        ("x_text_document.manifest.json",),
        lambda t, e, o: no_output(t),
    ),
    "pre-output-in-a-missing-folder": Case(  # created, as a user would want
        "preprocess", lambda e, t: pre(e, t), 0, ("out/x_text_document.bin",), kept()
    ),
    "pre-unreadable-input-file": Case(
        "preprocess",
        lambda e, t: pre(e, t, _unreadable(write(t / "in" / "a.jsonl", LINES[0]))),
        2,
        ("--input", "a.jsonl", "permission"),
        lambda t, e, o: no_output(t),
        privileged=True,
    ),
    "pre-unreadable-subfolder": Case(
        "preprocess",
        lambda e, t: pre(e, t, _with_locked_subfolder(t / "in")),
        2,
        ("--input", "in/locked", "cannot list"),
        lambda t, e, o: no_output(t),
        privileged=True,
    ),
    "pre-input-empty-folder": Case(
        "preprocess",
        lambda e, t: pre(e, t, _mkdir(t / "in")),
        2,
        ("--input", "no .parquet"),
        lambda t, e, o: no_output(t),
    ),
    "pre-input-glob-matches-nothing": Case(
        "preprocess",
        lambda e, t: pre(e, t, t / "nothing*.jsonl"),
        2,
        ("--input", "nothing*.jsonl"),
        lambda t, e, o: no_output(t),
    ),
    "pre-input-unsupported-type": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "a.csv", "text\nhi\n")),
        2,
        ("--input", "a.csv", "unsupported"),
        lambda t, e, o: no_output(t),
    ),
    "pre-hf-folder-corrupt-index": Case(
        "preprocess",
        lambda e, t: pre(e, t, write(t / "in" / "ds" / "dataset_dict.json", "{splits").parent),
        2,
        ("dataset_dict.json",),
        lambda t, e, o: no_output(t),
    ),
    # ---- tokenizers: missing, of the wrong kind, damaged
    "pre-tokenizer-model-missing": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-model", str(t / "nope")],
        2,
        ("--tokenizer-model", "nope"),
        lambda t, e, o: no_output(t),
    ),
    "pre-sp-model-is-a-folder": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-type", "SentencePieceTokenizer"],
        2,
        ("--tokenizer-model", ".model file"),
        lambda t, e, o: no_output(t),
    ),
    "pre-hf-type-given-an-sp-model": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-model", e.sp],
        2,
        ("--tokenizer-model", "sp.model", "SentencePieceTokenizer"),
        lambda t, e, o: no_output(t),
    ),
    "pre-sp-type-given-a-tokenizer-json": Case(
        "preprocess",
        lambda e, t: (
            pre(e, t) + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{e.bpe}/tokenizer.json"]
        ),
        2,
        ("--tokenizer-model", "tokenizer.json", "not a SentencePiece model"),
        lambda t, e, o: no_output(t),
    ),
    "pre-tiktoken-garbage": Case(
        "preprocess",
        lambda e, t: (
            pre(e, t) + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(write(t / "t.json", "[{]"))]
        ),
        2,
        ("--tokenizer-model", "t.json", "tiktoken JSON"),
        lambda t, e, o: no_output(t),
    ),
    "pre-gpt2-garbage-vocab": Case(
        "preprocess",
        lambda e, t: (
            pre(e, t)
            + [
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                str(write(t / "v.json", "{]")),
                "--merge-file",
                str(write(t / "m.txt", "a b")),
            ]
        ),
        2,
        ("--vocab-file", "v.json"),
        lambda t, e, o: no_output(t),
    ),
    "pre-hf-corrupt-tokenizer-config": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-model", str(_bpe_copy(e, t, '{"eos_token": '))],
        2,
        ("--tokenizer-model", "tokenizer_config.json"),
        lambda t, e, o: no_output(t),
    ),
    "pre-append-eod-without-eos": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-model", str(_bpe_copy(e, t, "{}"))],
        2,
        ("--append-eod", "eos_token"),
        lambda t, e, o: no_output(t),
    ),
    "pre-refused-tokenizer-type": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-type", "BertWordPieceCase"],
        2,
        ("--tokenizer-type BertWordPieceCase",),
        lambda t, e, o: no_output(t),
    ),
    "pre-unknown-tokenizer-type": Case(
        "preprocess", lambda e, t: pre(e, t) + ["--tokenizer-type", "Bert"], 2, ("--tokenizer-type", "invalid choice")
    ),
    "pre-sp-special-tokens-without-legacy": Case(
        "preprocess",
        lambda e, t: (
            pre(e, t, extra="--tokenizer-special-tokens <x>")
            + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", e.sp]
        ),
        2,
        ("--tokenizer-special-tokens", "--tokenizer-sentencepiece-legacy"),
        lambda t, e, o: no_output(t),
    ),
    "pre-sp-legacy-with-append-eod": Case(
        "preprocess",
        lambda e, t: (
            pre(e, t, extra="--tokenizer-sentencepiece-legacy")
            + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", e.sp]
        ),
        2,
        ("--tokenizer-sentencepiece-legacy", "--append-eod"),
        lambda t, e, o: no_output(t),
    ),
    "pre-empty-special-token": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-special-tokens", ""],
        2,
        ("--tokenizer-special-tokens", "empty"),
    ),
    "pre-null-without-vocab-size": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-type", "NullTokenizer"],
        2,
        ("NullTokenizer", "--vocab-size"),
        lambda t, e, o: no_output(t),
    ),
    "pre-null-eod-outside-vocabulary": Case(
        "preprocess",
        lambda e, t: (
            pre(e, t) + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "5", "--null-tokenizer-eod-id", "9"]
        ),
        2,
        ("--null-tokenizer-eod-id 9", "0..4"),
        lambda t, e, o: no_output(t),
    ),
    "pre-metadata-other-library": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-metadata", str(write(t / "m.json", '{"library": "sentencepiece"}'))],
        2,
        ("--tokenizer-metadata", "m.json", "'huggingface'"),
        lambda t, e, o: no_output(t),
    ),
    "pre-metadata-not-json": Case(
        "preprocess",
        lambda e, t: pre(e, t) + ["--tokenizer-metadata", str(write(t / "m.json", "lib"))],
        2,
        ("--tokenizer-metadata", "m.json"),
        lambda t, e, o: no_output(t),
    ),
    "pre-trust-remote-code-with-code": Case(
        "preprocess",
        lambda e, t: (
            pre(e, t, extra="--trust-remote-code")
            + ["--tokenizer-model", str(_bpe_copy(e, t, json.dumps({"auto_map": {"AutoTokenizer": ["my.Tok", None]}})))]
        ),
        2,
        ("--trust-remote-code", "never runs"),
        lambda t, e, o: no_output(t),
    ),
    "pre-partitions-with-output-shards": Case(
        "preprocess",
        lambda e, t: pre(e, t, extra="--partitions 2 --output-shards 2"),
        2,
        ("--partitions 2", "--output-shards"),
        lambda t, e, o: no_output(t),
    ),
    "pre-keep-newlines-without-split": Case(
        "preprocess", lambda e, t: pre(e, t, extra="--keep-newlines"), 2, ("--keep-newlines",)
    ),
    "pre-shard-ids-out-of-range": Case(
        "preprocess", lambda e, t: pre(e, t, extra="--output-shards 1 --shard-ids 3"), 2, ("--shard-ids",)
    ),
    "pre-more-shards-than-files": Case(
        "preprocess",
        lambda e, t: pre(e, t, extra="--output-shards 3"),
        2,
        ("--output-shards 3",),
        lambda t, e, o: no_output(t),
    ),
    "pre-tiktoken-pattern-v3": Case(
        "preprocess", lambda e, t: pre(e, t, extra="--tiktoken-pattern v3"), 2, ("--tiktoken-pattern",)
    ),
    # ---- numbers: NaN, inf, zero, negative, out of range; all before any work
    **{
        f"pre-{flag.strip('-')}-{value}": Case(
            "preprocess",
            (lambda f, v: lambda e, t: pre(e, t) + [f, v])(flag, value),
            rc,
            (flag,),
            lambda t, e, o: no_output(t),
        )
        for flag, value, rc in [
            ("--workers", "0", 2),
            ("--workers", "-2", 2),
            ("--workers", "nan", 2),
            ("--block-mb", "nan", 2),
            ("--block-mb", "inf", 2),
            ("--block-mb", "-1", 2),
            ("--log-interval", "0", 2),
            ("--partitions", "0", 2),
            ("--output-shards", "0", 2),
            ("--min-chars", "-1", 2),
            ("--punkt-train-chars", "10", 2),
            ("--max-documents", "0", 2),
            ("--workers-to-check", "0", 2),
            ("--vocab-size", "-5", 2),
            ("--vocab-extra-ids", "-1", 2),
            ("--tiktoken-num-special-tokens", "-1", 2),
            ("--min-int-score", "inf", 2),
        ]
    },
    # ---- train-tokenizer
    "tt-empty-input": Case(
        "train-tokenizer",
        lambda e, t: tt(t, write(t / "in" / "a.jsonl", "")),
        2,
        ("--input", "a.jsonl", "no text"),
        lambda t, e, o: no_output(t),
    ),
    "tt-key-missing": Case(
        "train-tokenizer",
        lambda e, t: tt(t, e.good, extra="--json-key body"),
        2,
        ("--json-key 'body'", "missing_key 6"),
        lambda t, e, o: no_output(t),
    ),
    "tt-vocab-size-0": Case(
        "train-tokenizer",
        lambda e, t: tt(t, extra="--vocab-size 0"),
        2,
        ("--vocab-size",),
        lambda t, e, o: no_output(t),
    ),
    "tt-vocab-size-nan": Case("train-tokenizer", lambda e, t: tt(t, extra="--vocab-size nan"), 2, ("--vocab-size",)),
    "tt-vocab-too-large-sentencepiece": Case(
        "train-tokenizer",
        lambda e, t: tt(t, e.good, extra="--vocab-size 5000"),
        2,
        ("--vocab-size", "SentencePiece"),
        lambda t, e, o: no_output(t),
    ),
    "tt-vocab-too-large-hf-bpe": Case(
        "train-tokenizer",
        lambda e, t: tt(t, e.good, extra="--vocab-size 5000 --kind hf-bpe"),
        2,
        ("--vocab-size 5000", "only"),
        lambda t, e, o: no_output(t),
    ),
    "tt-max-chars-0": Case(
        "train-tokenizer",
        lambda e, t: tt(t, extra="--vocab-size 400") + ["--max-chars", "0"],
        2,
        ("--max-chars",),
        lambda t, e, o: no_output(t),
    ),
    "tt-input-missing": Case(
        "train-tokenizer",
        lambda e, t: tt(t, t / "no.txt", extra="--vocab-size 400"),
        2,
        ("--input", "no.txt"),
        lambda t, e, o: no_output(t),
    ),
    "tt-readonly-output-folder": Case(
        "train-tokenizer",
        lambda e, t: tt(t, extra="--vocab-size 400", output=_ro(t / "out") / "tok"),
        2,
        ("--output", "{tmp}/out", "writable"),
        lambda t, e, o: no_output(t),
        privileged=True,
    ),
    "tt-hf-output-is-a-file": Case(
        "train-tokenizer",
        lambda e, t: tt(t, extra="--vocab-size 400 --kind hf-bpe", output=write(t / "out" / "tok", "x")),
        2,
        ("--output", "is a file"),
        lambda t, e, o: (t / "out" / "tok").read_text() == "x" or pytest.fail("overwritten"),
    ),
    "tt-sp-output-is-a-folder": Case(
        "train-tokenizer",
        lambda e, t: tt(t, extra="--vocab-size 400", output=_mkdir(t / "out")),
        2,
        ("--output", "is a folder"),
        lambda t, e, o: no_output(t),
    ),
    "tt-truncated-gz-input": Case(  # trains on the readable lines and says what it skipped
        "train-tokenizer",
        lambda e, t: tt(
            t,
            write(t / "in" / "a.jsonl.gz", _truncated_gz()),
            extra="--vocab-size 300 --kind hf-bpe --max-chars 1000000",
        ),
        0,
        ("corrupt_stream 1",),
        lambda t, e, o: (t / "out" / "tok" / "tokenizer.json").is_file() or pytest.fail("no tokenizer"),
    ),
    # ---- merge-datasets: damaged shards are named before anything is written
    "mg-truncated-idx": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, str(_truncate(copy_shard(e, t), ".idx", 50)), e.shards[1]),
        2,
        ("s0.idx", "truncated"),
        merged_nothing,
    ),
    "mg-truncated-bin": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, str(_truncate(copy_shard(e, t), ".bin", 3)), e.shards[1]),
        2,
        ("s0.bin", "truncated"),
        merged_nothing,
    ),
    "mg-zero-byte-idx": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, str(_truncate(copy_shard(e, t), ".idx", 0)), e.shards[1]),
        2,
        ("s0.idx",),
        merged_nothing,
    ),
    "mg-bad-magic": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, str(_overwrite(copy_shard(e, t), ".idx", 0, b"XXXX")), e.shards[1]),
        2,
        ("s0.idx", "bad header"),
        merged_nothing,
    ),
    "mg-inconsistent-document-index": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, str(_overwrite(copy_shard(e, t), ".idx", -8, b"\x07" * 8)), e.shards[1]),
        2,
        ("s0.idx", "inconsistent"),
        merged_nothing,
    ),
    "mg-corrupt-manifest": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, str(_overwrite(copy_shard(e, t), ".manifest.json", 0, b"<<")), e.shards[1]),
        2,
        ("s0.manifest.json",),
        merged_nothing,
    ),
    "mg-other-tokenizer": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, str(_other_tokenizer(copy_shard(e, t))), e.shards[1]),
        2,
        ("different tokenizers",),
        merged_nothing,
    ),
    # issue 46.11: shards without manifests (Megatron-LM's tools write none) of two tokenizers merged without a word
    "mg-two-tokenizers-without-manifests": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, str(_manifestless(t, "a", 0)), str(_manifestless(t, "b", 299))),
        2,
        ("every document of {tmp}/in/a ends with token 0 and every one of {tmp}/in/b with token 299",
         "different tokenizers"),
        merged_nothing,
    ),
    "mg-one-tokenizer-without-manifests": Case(  # the same end-of-document token: merged, no tokenizer claimed
        "merge-datasets",
        lambda e, t: mg(e, t, str(_manifestless(t, "a", 0)), str(_manifestless(t, "b", 0)), e.shards[0]),
        0,
        ("merged 3 datasets",),
        lambda t, e, o: json.loads((t / "out" / "merged.manifest.json").read_text())["tokenizer"] is None
        or pytest.fail("the merged manifest claims a tokenizer for shards without one"),
    ),
    "mg-nothing-matches": Case(
        "merge-datasets", lambda e, t: mg(e, t, str(t / "none*.idx")), 2, ("--input", "none*.idx"), merged_nothing
    ),
    "mg-readonly-output-folder": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, prefix=_ro(t / "out") / "m"),
        2,
        ("--output-prefix", "{tmp}/out", "writable"),
        merged_nothing,
        privileged=True,
    ),
    "mg-output-prefix-is-a-folder": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, prefix=_mkdir(t / "out")),
        2,
        ("--output-prefix", "is a folder"),
        merged_nothing,
    ),
    "mg-output-parent-is-a-file": Case(
        "merge-datasets",
        lambda e, t: mg(e, t, prefix=write(t / "f", "x") / "m"),
        2,
        ("--output-prefix", "is a file"),
        merged_nothing,
    ),
}


def _truncated_gz() -> bytes:
    blob = gzip.compress("".join(LINES).encode())
    return blob[: len(blob) * 2 // 3]


def _flip(blob: bytes, where: float) -> bytes:
    i = int(len(blob) * where)
    return blob[:i] + bytes([blob[i] ^ 0x55]) + blob[i + 1 :]


def _parquet_bytes(column: str = "text") -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.table({column: GOOD, "score": list(range(len(GOOD)))}), sink)
    return sink.getvalue()


def _arrow_bytes(column: str = "text") -> bytes:
    import pyarrow as pa

    table = pa.table({column: GOOD, "score": list(range(len(GOOD)))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _with_locked_subfolder(folder: Path) -> Path:
    write(folder / "a.jsonl", LINES[0])
    write(folder / "locked" / "b.jsonl", LINES[1])
    (folder / "locked").chmod(0)
    return folder


def _bpe_copy(env: Env, tmp: Path, config: str) -> Path:
    folder = tmp / "tok"
    folder.mkdir()
    shutil.copy(Path(env.bpe) / "tokenizer.json", folder)
    write(folder / "tokenizer_config.json", config)
    return folder


def _truncate(prefix: Path, suffix: str, size: int) -> Path:
    path = Path(f"{prefix}{suffix}")
    path.write_bytes(path.read_bytes()[:size])
    return prefix


def _overwrite(prefix: Path, suffix: str, at: int, data: bytes) -> Path:
    path = Path(f"{prefix}{suffix}")
    blob = bytearray(path.read_bytes())
    blob[at : at + len(data) if at + len(data) != 0 else None] = data
    path.write_bytes(bytes(blob))
    return prefix


def _manifestless(tmp: Path, name: str, end: int) -> Path:
    """A dataset of 30 documents whose every one ends with token `end` (a tokenizer's end-of-document id), without
    a manifest, as Megatron-LM's preprocess_data.py writes it."""
    import numpy as np

    from megatron_jreg.data.indexed import Builder

    prefix = tmp / "in" / name
    builder = Builder(prefix, np.uint16)
    for i in range(30):
        builder.add_document(np.array([5 + i % 7, 40 + i, 7, end], dtype=np.int64), [4])
    builder.finalize()
    return prefix


def _other_tokenizer(prefix: Path) -> Path:
    path = Path(f"{prefix}.manifest.json")
    manifest = json.loads(path.read_text())
    manifest["tokenizer"]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    return prefix


# ---------------------------------------------------------------------------------------------- running


def _run(case: Case, argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the command; an exception escaping `main` fails the row."""
    if case.privileged:
        prefix: list[str] = []
        if os.geteuid() == 0:  # root ignores permission bits unless it gives up these capabilities
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv: cannot drop the permission override")
            prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
        cmd = [*prefix, sys.executable, "-m", "megatron_jreg.cli", case.command, *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        return proc.returncode, proc.stdout, proc.stderr
    try:
        rc = MAINS[case.command](argv)
    except SystemExit as e:  # argparse
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, env, tmp_path, capsys):
    case = CASES[name]
    argv = case.build(env, tmp_path)
    capsys.readouterr()  # building may print (e.g. a tokenizer's training)
    try:
        rc, out, err = _run(case, argv, capsys)
    finally:
        for path in tmp_path.rglob("*"):  # let pytest clean up what the row locked
            if not path.is_symlink():
                path.chmod(0o755)
    assert "Traceback" not in err, err[-3000:]
    assert rc == case.rc, f"exit {rc}\nstdout: {out[-1500:]}\nstderr: {err[-1500:]}"
    names = [n.format(tmp=tmp_path) for n in case.names]
    if rc:
        errors = [line for line in err.splitlines() if line.startswith(f"{PROGS[case.command]}: error: ")]
        assert len(errors) == 1 and err.strip().endswith(errors[0]), err
        assert all(n in errors[0] for n in names), errors[0]
    else:
        assert all(n in out + err for n in names), out + err
    if case.check is not None:
        case.check(tmp_path, env, out + err)
