"""`megatron-jreg merge-datasets`: concatenate indexed-dataset shards into one `.bin/.idx` pair.
Every input is checked first: a damaged shard, or one made by another tokenizer, is named, not merged.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
from pathlib import Path

import numpy as np

from megatron_jreg.data import indexed
from megatron_jreg.data.checks import DataError, check_output_prefix
from megatron_jreg.data.indexed import bin_path, idx_path
from megatron_jreg.data.manifest import fingerprint, is_complete, read_manifest, write_manifest
from megatron_jreg.data.tokenizers import file_sha256
from megatron_jreg.errors import run_command
from megatron_jreg.usage import OneLineParser, example

PROG = "megatron-jreg merge-datasets"
_SUFFIX = re.compile(r"\.(bin|idx|manifest\.json)$")  # of a path that names a dataset by one of its files


def resolve_prefixes(patterns: list[str], exclude: str | None = None) -> list[str]:
    """Dataset prefixes named by prefixes, `.bin/.idx` paths, directories or globs (partial files ignored)."""
    prefixes: list[str] = []
    for pattern in patterns:
        if indexed.dataset_exists(stripped := _SUFFIX.sub("", pattern)):
            prefixes.append(stripped)
            continue
        if os.path.isdir(pattern):
            candidates = sorted(str(p)[:-4] for p in Path(pattern).glob("*.idx"))
        else:
            candidates = sorted({_SUFFIX.sub("", p) for p in glob.glob(pattern) if p.endswith((".bin", ".idx"))})
        found = [p for p in candidates if indexed.dataset_exists(p)]
        if not found:
            raise FileNotFoundError(f"--input {pattern}: no finished .bin/.idx pair there")
        prefixes.extend(found)
    unique = list(dict.fromkeys(os.path.abspath(p) for p in prefixes))
    return [p for p in unique if exclude is None or p != os.path.abspath(exclude)]


def merge_datasets(inputs: list[str], output_prefix: str) -> dict:
    """Merge datasets in the given order into `output_prefix`; returns the merged manifest. An identical earlier
    merge (same inputs, sizes and mtimes) is kept, not redone."""
    check_output_prefix(output_prefix)
    prefixes = resolve_prefixes(inputs, exclude=output_prefix)
    if not prefixes:
        raise DataError("--input: nothing to merge (only the output itself matched); name the shards to merge")
    indexes = [indexed.verify_dataset(p) for p in prefixes]
    for p, index in zip(prefixes, indexes):
        if index.dtype != indexes[0].dtype:
            dtypes = np.dtype(index.dtype).name, np.dtype(indexes[0].dtype).name
            raise DataError(f"{p}: tokens are {dtypes[0]} but {prefixes[0]} holds {dtypes[1]}; only datasets made "
                            "with the same tokenizer can be merged")
    manifests = [read_manifest(p, strict=True) for p in prefixes]
    tokenizers = {str(m["tokenizer"]) for m in manifests if m is not None}
    if len(tokenizers) > 1:
        raise ValueError("--input: the shards were made with different tokenizers (see their .manifest.json "
                         "'tokenizer'); merge only shards of one tokenizer")
    if None in manifests:
        _check_document_ends(prefixes)
    described = [[p, bin_path(p).stat().st_size, os.stat(idx_path(p)).st_mtime_ns] for p in prefixes]
    fp = fingerprint({"merge": described})
    done = is_complete(output_prefix, fp)
    if done is not None:
        print(f"{output_prefix}: already merged from the same inputs, skipped", file=sys.stderr)
        return done
    dtype = indexes[0].dtype
    indexed.remove_dataset(output_prefix)
    builder = indexed.Builder(output_prefix, dtype)  # Megatron-LM's tools/merge_datasets.py: add_index per input
    try:
        for p in prefixes:
            builder.add_index(p)
        builder.finalize()
    except BaseException:
        builder.abort()
        raise
    known = [m for m in manifests if m is not None]
    first, every = (known or [{}])[0], len(known) == len(prefixes)  # tokenizer and max_token_id: only if every
    skipped: collections.Counter = collections.Counter()
    for m in known:
        skipped.update(m.get("skipped", {}))
    largest = [m.get("max_token_id") for m in known]  # read by training's vocabulary check (else it scans the .bin)
    return write_manifest(
        output_prefix, fingerprint=fp, dtype=np.dtype(dtype).name, documents=sum(i.documents for i in indexes),
        sequences=sum(i.sequences for i in indexes), tokens=sum(i.tokens for i in indexes),
        max_token_id=max(largest) if every and all(isinstance(x, int) for x in largest) else None,
        tokenizer=first["tokenizer"] if every else None, append_eod=first.get("append_eod"),
        level=first.get("level"), filters=first.get("filters"), skipped=dict(sorted(skipped.items())),
        inputs=[{"prefix": p, "bin_bytes": bin_path(p).stat().st_size, "idx_bytes": idx_path(p).stat().st_size,
                 "bin_sha256": file_sha256(bin_path(p)), "idx_sha256": file_sha256(idx_path(p)),
                 "documents": index.documents, "manifest": m is not None}
                for p, m, index in zip(prefixes, manifests, indexes)],
    )


def _check_document_ends(prefixes: list[str]) -> None:
    """Shards without a manifest (Megatron-LM's tools write none) still tell the token every document ends with
    (the eod, with --append-eod): two shards ending with different ones were made differently, refused."""
    ends = [(p, end) for p in prefixes if (end := indexed.document_end_token(p)) is not None]
    for p, end in ends[1:]:
        if end != ends[0][1]:
            raise DataError(f"--input: every document of {ends[0][0]} ends with token {ends[0][1]} and every one of "
                            f"{p} with token {end} (each its tokenizer's end-of-document id): the shards were made "
                            "by different tokenizers, or one with --append-eod and one without; merge only shards "
                            "made alike")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0],
                      **example("megatron-jreg merge-datasets --input data/fwe_shard*_text_document "
                                "--output-prefix data/fwe_text_document"))
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes, directories or globs, in order")
    p.add_argument("--output-prefix", required=True, help="merged dataset prefix (no .bin/.idx)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        manifest = merge_datasets(args.input, args.output_prefix)
        print(f"merged {len(manifest['inputs'])} datasets into {args.output_prefix}.bin/.idx: "
              f"{manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']})")
        return 0

    return run_command(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
