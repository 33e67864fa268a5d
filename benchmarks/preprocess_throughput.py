"""Throughput of `megatron-jreg preprocess` against Megatron-LM's tools/preprocess_data.py, in one run.

Same JSONL input, same Hugging Face BPE tokenizer, same --workers, --append-eod for both. Throughput is
input MB / processing time, where processing time is each tool's own first-to-last-document time from its
log (start-up excluded: both import torch and megatron-core, ~10 s; each tool's start-up is then timed alone
on a one-document input), best of --repeats interleaved rounds (the machine may be shared). Both outputs are
compared byte for byte. Ends with:

    throughput_ratio=<ours / megatron> ours_mb_s=<..> megatron_mb_s=<..> fast_path_ratio=<..>

`fast_path_ratio` is what the tiktoken fast path for byte-level BPE earns: its tokenize rate over megatron-core's
own HuggingFaceTokenizer.tokenize (what a worker would run without it), one process, same ids checked.

With `--compare-with DIR` (a folder holding another version's `megatron_jreg` package, e.g. `git archive REV
megatron_jreg | tar -x -C DIR`) that version runs in the same rounds too, and the last line adds
`vs_compared=<ours / it>` (processing rates) and `vs_compared_cpu=<its CPU-s / ours>` (CPU-s of the work
beyond start-up; meaningful when the work's CPU-s dwarf the spread of start-up's, e.g. with --mb 64 or more):
a change's speed measured side by side with the code before it.

Megatron-LM is not a dependency: pass its checkout with --megatron-lm; without one the benchmark says so
and exits 0. `--flags` adds Megatron-LM flags to both command lines (e.g. `--flags "--tokenizer-special-tokens
<x>"`), which checks byte identity for them on a large input. By default the
input is FineWeb-Edu-sized documents (WikiText-2 sections, ~3 KB) repeated to --mb MB and the tokenizer a
byte-level BPE trained on WikiText-2 (--vocab-size).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_jreg.data.indexed import verify_dataset  # noqa: E402
from megatron_jreg.data.text import wikitext_articles  # noqa: E402
from megatron_jreg.data.train_tokenizer import train_tokenizer  # noqa: E402

WIKI = ROOT / "examples" / "data" / "wikitext-2"
_SECTION = re.compile(r"\n(?= = = [^=])")


def make_input(path: Path, megabytes: float) -> int:
    """FineWeb-Edu-like JSONL: WikiText-2 sections (~3 KB docs) repeated to `megabytes`; returns docs."""
    docs = [
        s.strip()
        for f in ("valid.txt", "test.txt")
        for a in wikitext_articles(WIKI / f)
        for s in _SECTION.split(a)
        if len(s.strip()) > 200
    ]
    lines = [json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)]
    written, n = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            line = lines[n % len(lines)]
            f.write(line)
            written += len(line.encode())
            n += 1
    return n


def run_tool(cmd: list[str], env: dict, prefix: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the tool and its workers, stdout+stderr) of one run from scratch, in the
    tool's own tree (its PYTHONPATH: `python -m` puts the working directory first on the path)."""
    for stale in prefix.parent.glob(f"{prefix.name}_text_document*"):
        stale.unlink()  # never let a finished earlier run be resumed or skipped
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=env["PYTHONPATH"], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return elapsed, cpu, proc.stdout + proc.stderr


def processing_seconds(name: str, log: str, docs: int) -> float | None:
    """The tool's own time from its first document to its last (start-up excluded), read from its log.

    Megatron-LM prints `Processed N documents (D docs/s, ...)` every --log-interval documents, timed from
    the start of processing; with the interval set to the document count it prints once, at the end.
    Ours prints `done: ... in Ts` timed from the first unit submitted (worker start-up included). None when
    Megatron-LM printed no such line.
    """
    if name == "megatron":  # ours and the compared version print the same done line
        match = re.findall(rf"Processed {docs} documents \(([0-9.e+]+) docs/s", log)
        return docs / float(match[-1]) if match else None
    return float(re.findall(r"\bin ([0-9.]+)s \(", log)[-1])


def fast_path(tokenizer: str, source: Path, megabytes: float, repeats: int) -> tuple[float, float]:
    """(MB/s of the tiktoken fast path, MB/s of megatron-core's own HuggingFaceTokenizer.tokenize) on the first
    `megabytes` of the input's texts, one process, best of `repeats`; the ids must be equal."""
    from megatron_jreg.data.tokenizers import build_tokenizer

    texts, size = [], 0
    with open(source, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= megabytes * 1e6:
                break
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer)
    if tok.backend != "tiktoken":
        raise RuntimeError(f"{tokenizer}: no fast path ({tok.backend})")
    best = {}
    for _ in range(repeats):
        for name, encode in (("fast", tok.tokenize), ("megatron-core", tok.megatron.tokenize)):
            start = time.perf_counter()
            ids = [encode(t) for t in texts]
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
            best[f"{name} ids"] = ids
    if best["fast ids"] != [list(i) for i in best["megatron-core ids"]]:
        raise RuntimeError("the fast path gave other ids than megatron-core's tokenizer")
    return size / 1e6 / best["fast"], size / 1e6 / best["megatron-core"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"), help="Megatron-LM checkout")
    p.add_argument("--megatron-python", default=sys.executable, help="python that can import torch")
    p.add_argument("--input", default=None, help="JSONL with a 'text' key (default: generated)")
    p.add_argument("--mb", type=float, default=16.0, help="size of the generated input")
    p.add_argument("--tokenizer-model", default=None, help="HF tokenizer folder (default: trained BPE)")
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where inputs/outputs go (default: a temp dir)")
    p.add_argument("--compare-with", default=None, help="folder with another version's megatron_jreg package")
    p.add_argument("--flags", default="", help="more Megatron-LM flags for both tools, e.g. '--split-sentences'")
    args = p.parse_args(argv)

    tool = Path(args.megatron_lm or "") / "tools" / "preprocess_data.py"
    if not args.megatron_lm or not tool.is_file():
        print(
            f"skipped: no Megatron-LM checkout (pass --megatron-lm PATH with tools/preprocess_data.py); "
            f"got {args.megatron_lm!r}"
        )
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="preprocess_bench_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    source = Path(args.input).resolve() if args.input else work / "input.jsonl"
    if not args.input:
        docs = make_input(source, args.mb)
        print(f"input: {source} ({source.stat().st_size / 1e6:.1f} MB, {docs:,} documents)")
    tokenizer = Path(args.tokenizer_model).resolve() if args.tokenizer_model else train_tokenizer(
        [str(WIKI / "valid.txt"), str(WIKI / "test.txt")], str(work / "bpe"), args.vocab_size, "hf-bpe"
    )
    common = [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tokenizer),
        "--append-eod",
        "--workers",
        str(args.workers),
        *shlex.split(args.flags),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    menv = {**os.environ, "PYTHONPATH": str(Path(args.megatron_lm).resolve()), "PYTHONWARNINGS": "ignore"}
    tools = {
        "ours": lambda i, o: (
            [
                sys.executable,
                "-m",
                "megatron_jreg.data.preprocess",
                "--input",
                str(i),
                "--output-prefix",
                str(o),
                *common,
            ],
            env,
        ),
        "megatron": lambda i, o: (
            [args.megatron_python, str(tool.resolve()), "--input", str(i), "--output-prefix", str(o), *common],
            menv,
        ),
    }
    if args.compare_with:
        compared = {**env, "PYTHONPATH": str(Path(args.compare_with).resolve())}
        tools["compared"] = lambda i, o: (tools["ours"](i, o)[0], compared)
    size = source.stat().st_size
    with open(source, "rb") as f:
        docs = sum(1 for _ in f)
    common += ["--log-interval", str(docs)]
    best: dict[str, float] = {}
    least_cpu: dict[str, float] = {}
    for r in range(args.repeats):
        for name, make in tools.items():
            wall, cpu, log = run_tool(*make(source, work / name), work / name)
            seconds = processing_seconds(name, log, docs) or wall  # wall: start-up included
            best[name] = min(best.get(name, float("inf")), seconds)
            least_cpu[name] = min(least_cpu.get(name, float("inf")), cpu)
            print(
                f"round {r + 1} {name:8s}: {size / 1e6 / seconds:6.2f} MB/s ({seconds:5.1f}s processing, "
                f"{wall:5.1f}s wall with start-up, {cpu:5.1f} CPU-s)"
            )
    one = work / "one_document.jsonl"  # start-up alone: imports, tokenizer, workers, for one document
    with open(source, encoding="utf-8") as f:
        one.write_text(f.readline(), encoding="utf-8")
    work_cpu = {}  # CPU-s of the work itself: the least of the rounds less start-up (steadier than wall on a busy box)
    for name, make in tools.items():
        wall, cpu, _ = run_tool(*make(one, work / f"{name}_one"), work / f"{name}_one")
        work_cpu[name] = least_cpu[name] - cpu
        print(f"start-up {name:8s}: {wall:5.1f}s wall, {cpu:5.1f} CPU-s (one document); the work itself "
              f"{work_cpu[name]:.1f} CPU-s")
    tokens = verify_dataset(work / "ours_text_document").tokens
    identical = all(
        (work / f"ours_text_document{s}").read_bytes() == (work / f"{name}_text_document{s}").read_bytes()
        for s in (".bin", ".idx") for name in tools
    )
    rates = {name: (size / 1e6 / t, tokens / t) for name, t in best.items()}
    for name, (mb_s, tok_s) in rates.items():
        print(f"{name:8s}: {mb_s:7.2f} MB/s  {tok_s / 1e6:6.2f}M tokens/s  ({args.workers} workers)")
    print(f"outputs byte-identical: {identical}")
    ratio = rates["ours"][0] / rates["megatron"][0]
    ours, megatron = rates["ours"][0], rates["megatron"][0]
    vs = ""
    if "compared" in rates:
        cpu_ratio = work_cpu["compared"] / work_cpu["ours"]
        vs = f" vs_compared={ours / rates['compared'][0]:.2f} vs_compared_cpu={cpu_ratio:.2f}"
    fast, core = fast_path(str(tokenizer), source, 4.0, args.repeats)
    print(f"tokenize, one process: tiktoken fast path {fast:.2f} MB/s, megatron-core's tokenizer {core:.2f} MB/s "
          "(same ids)")
    print(f"throughput_ratio={ratio:.2f} ours_mb_s={ours:.2f} megatron_mb_s={megatron:.2f}{vs} "
          f"fast_path_ratio={fast / core:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
