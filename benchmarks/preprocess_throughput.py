"""`megatron-jreg preprocess` against Megatron-LM's tools/preprocess_data.py, per kind of tokenizer, in one run.

For each tokenizer kind, both tools run on the same JSONL with the same tokenizer, `--workers` and
`--append-eod`, in interleaved rounds, and once more on the input's first document alone (start-up: imports,
tokenizer, workers). Per tool: the wall time of the whole input, the start-up's, and the work = the first less
the second (the best of --repeats rounds each; the same in CPU-s, steadier on a shared machine); per kind: the
ratio of the work (Megatron-LM's / ours; also in CPU-s, and by each tool's own processing time from its log),
the start-ups, whether the outputs are byte-identical, and which engine ours ran (`tiktoken`, or why not). Then
each kind's tokenizer alone, one process: our engine's MB/s of CPU time against megatron-core's tokenize (the
same ids checked), and the wall time of `--help` of both entry points and of Megatron-LM's tool. Ends with:

    min_work_ratio=<..> <kind>_work_ratio=<..> ... min_work_cpu_ratio=<..> min_processing_ratio=<..>
    max_startup_ratio=<..> identical=<all|no> help_s=<..>

The tokenizers are stand-ins trained here (nothing is downloaded; the real ones are not on this machine), on
WikiText-2 (valid + test) and the Python standard library's sources (tests/_tokenizers.py builds them):
- `gpt2`: a GPT-2-style byte-level BPE (`train-tokenizer --kind hf-bpe`, all 256 bytes, --vocab-size);
- `smollm2`: like SmolLM2-135M's: 49,152 pieces, its 17 special tokens first, trained without an initial
  alphabet so that bytes are missing from the vocabulary, and `\\n\\n` both a piece and an added token;
- `llama3`: like Llama-3's: 128,256 pieces, its regex as a Split pre-tokenizer, ignore_merges, a BOS
  post-processor, 256 special tokens;
- `sentencepiece`: a SentencePiece BPE of 32,000 pieces with byte fallback (Llama-2's kind);
- `nfkc`: the gpt2 stand-in with an NFKC normalizer, which has no exact tiktoken conversion (the `tokenizers`
  engine runs: that such a tokenizer runs, and how fast).
`--tokenizer-model` (with `--tokenizer-type`) adds yours, as kind `yours`. The input is FineWeb-Edu-sized
documents (WikiText-2 sections, ~3 KB) repeated to --mb MB (not committed), or yours (`--input`).

Megatron-LM is not a dependency: pass its checkout with --megatron-lm; without one the benchmark says so and
exits 0. `--flags` adds Megatron-LM flags to both command lines; `--compare-with DIR` (a folder holding another
version's `megatron_jreg`, e.g. `git archive REV megatron_jreg | tar -x -C DIR`) runs that version in the same
rounds too, its work ratio printed per kind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_jreg.data.text import wikitext_articles  # noqa: E402

WIKI = ROOT / "examples" / "data" / "wikitext-2"
_SECTION = re.compile(r"\n(?= = = [^=])")
KINDS = ("gpt2", "smollm2", "llama3", "sentencepiece", "nfkc")


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


def training_texts() -> list[str]:
    """WikiText-2 articles and the standard library's sources: enough text for 128,000 merges."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.rglob("*.py"))]
    return [*wikitext_articles(WIKI / "valid.txt"), *wikitext_articles(WIKI / "test.txt"), *code]


def build_tokenizer(kind: str, folder: Path, vocab_size: int) -> tuple[str, str]:
    """(`--tokenizer-type`, `--tokenizer-model`) of a stand-in, trained once into `folder` (kept for reruns)."""
    from tests import _tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    done = folder / f"{kind}.done"
    path = folder / kind
    if kind == "sentencepiece":
        model = f"{path}.model"
        if not done.exists():
            corpus = folder / "corpus.txt"
            corpus.write_text("\n".join(training_texts()), encoding="utf-8")
            _tokenizers.sentencepiece_bpe(path, [str(corpus)], 32_000)
        done.touch()
        return "SentencePieceTokenizer", model
    if not done.exists():
        if kind == "smollm2":
            _tokenizers.smollm2_style(path, training_texts())
        elif kind == "llama3":
            _tokenizers.llama3_style(path, training_texts())
        elif kind == "gpt2":
            from megatron_jreg.data.train_tokenizer import train_tokenizer

            train_tokenizer([str(WIKI / "valid.txt"), str(WIKI / "test.txt")], str(path), vocab_size, "hf-bpe")
        else:  # nfkc: the gpt2 stand-in with a normalizer
            from tokenizers import Tokenizer, normalizers

            shutil.copytree(build_tokenizer("gpt2", folder, vocab_size)[1], path, dirs_exist_ok=True)
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            tokenizer.normalizer = normalizers.NFKC()
            tokenizer.save(str(path / "tokenizer.json"))
        done.touch()
    return "HuggingFaceTokenizer", str(path)


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


def processing_seconds(name: str, log: str, docs: int) -> float:
    """A tool's own time from its first document to its last, from its log: Megatron-LM's `Processed N documents
    (D docs/s, ...)` (printed every --log-interval documents, timed from the end of its start-up; the interval is
    the document count), ours `done: ... in Ts` (timed from the workers' start). One run, no start-up to subtract:
    steadier than the wall times on a busy machine."""
    if name == "megatron":
        return docs / float(re.findall(rf"Processed {docs} documents \(([0-9.e+]+) docs/s", log)[-1])
    return float(re.findall(r"\bin ([0-9.]+)s \(", log)[-1])


def _each(tokenize):  # noqa: ANN001, ANN202 - megatron-core's tokenize over a list
    return lambda texts: [tokenize(t) for t in texts]


def engine_rates(kind: str, model: str, source: Path, megabytes: float, repeats: int) -> tuple[float, float]:
    """(MB/s of our engine, MB/s of megatron-core's own tokenize) on the first `megabytes` of the input's texts,
    one process, best of `repeats` in CPU time; the ids must be equal."""
    from megatron_jreg.data.tokenizers import build_tokenizer as load

    texts, size = [], 0
    with open(source, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= megabytes * 1e6:
                break
    tok = load(kind, model)
    best: dict[str, float] = {}
    ids: dict[str, list] = {}
    for _ in range(repeats):
        for name, encode in (("ours", tok.tokenize_batch), ("megatron-core", _each(tok.megatron.tokenize))):
            start = time.process_time()
            ids[name] = encode(texts)
            best[name] = min(best.get(name, float("inf")), time.process_time() - start)
    if ids["ours"] != [list(i) for i in ids["megatron-core"]]:
        raise RuntimeError(f"{kind} {model}: our engine gave other ids than megatron-core's tokenizer")
    return size / 1e6 / best["ours"], size / 1e6 / best["megatron-core"]


def help_seconds(megatron_lm: Path, megatron_python: str) -> dict[str, float]:
    """Wall seconds of `--help`: ours (both entry points) and Megatron-LM's tool, best of three."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    theirs = megatron_lm / "tools" / "preprocess_data.py"
    commands = {
        "megatron-jreg preprocess --help": [sys.executable, "-m", "megatron_jreg.cli", "preprocess", "--help"],
        "tools/preprocess_data.py --help": [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--help"],
        "Megatron-LM tools/preprocess_data.py --help": [megatron_python, str(theirs), "--help"],
    }
    times = {}
    for name, cmd in commands.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run(cmd, env={**env, "PYTHONWARNINGS": "ignore"}, capture_output=True, check=True)
            best = min(best, time.perf_counter() - start)
        times[name] = best
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"), help="Megatron-LM checkout")
    p.add_argument("--megatron-python", default=sys.executable, help="python that can import torch")
    p.add_argument("--input", default=None, help="JSONL with a 'text' key (default: generated)")
    p.add_argument("--mb", type=float, default=64.0, help="size of the generated input (default: %(default)s)")
    p.add_argument("--kinds", default=None, help=f"tokenizer kinds, of {', '.join(KINDS)} (default: all, or none "
                   "with --tokenizer-model)")
    p.add_argument("--tokenizer-model", default=None, help="your tokenizer too (a folder or .model), as kind 'yours'")
    p.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", help="of --tokenizer-model (default: "
                   "%(default)s)")
    p.add_argument("--vocab-size", type=int, default=16384, help="the gpt2 stand-in's (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workdir", default=None, help="inputs, outputs, the trained stand-ins (default: a temp dir)")
    p.add_argument("--compare-with", default=None, help="folder with another version's megatron_jreg package")
    p.add_argument("--flags", default="", help="more Megatron-LM flags for both tools, e.g. '--split-sentences'")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else [] if args.tokenizer_model else list(KINDS)
    if set(kinds) - set(KINDS):
        p.error(f"--kinds: choose from {', '.join(KINDS)}")
    if args.tokenizer_model:
        kinds.append("yours")

    tool = Path(args.megatron_lm or "") / "tools" / "preprocess_data.py"
    if not args.megatron_lm or not tool.is_file():
        print(f"skipped: no Megatron-LM checkout (pass --megatron-lm PATH with tools/preprocess_data.py); got "
              f"{args.megatron_lm!r}")
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="preprocess_bench_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    source = Path(args.input).resolve() if args.input else work / "input.jsonl"
    if not args.input:
        make_input(source, args.mb)
    size = source.stat().st_size
    with open(source, "rb") as f:
        docs = sum(1 for _ in f)
    one = work / "one_document.jsonl"  # start-up alone: imports, tokenizer, workers, for one document
    with open(source, encoding="utf-8") as f:
        one.write_text(f.readline(), encoding="utf-8")
    print(f"input: {source.name} ({size / 1e6:.1f} MB, {docs:,} documents); {args.workers} workers; "
          f"--append-eod {args.flags}".rstrip())

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    menv = {**os.environ, "PYTHONPATH": str(Path(args.megatron_lm).resolve()), "PYTHONWARNINGS": "ignore"}
    tools = {
        "ours": ([sys.executable, "-m", "megatron_jreg.data.preprocess"], env),
        "megatron": ([args.megatron_python, str(tool.resolve())], menv),
    }
    if args.compare_with:
        tools["compared"] = (tools["ours"][0], {**env, "PYTHONPATH": str(Path(args.compare_with).resolve())})
    results: dict[str, dict] = {}
    for kind in kinds:
        start = time.perf_counter()
        tokenizer_type, model = (args.tokenizer_type, str(Path(args.tokenizer_model).resolve())) if kind == "yours" \
            else build_tokenizer(kind, work / "tokenizers", args.vocab_size)
        print(f"\n{kind}: {tokenizer_type} {Path(model).name} (trained or reused: {time.perf_counter() - start:.0f}s)")
        common = ["--tokenizer-type", tokenizer_type, "--tokenizer-model", model, "--append-eod",
                  "--workers", str(args.workers), "--log-interval", str(docs), *shlex.split(args.flags)]
        wall: dict[str, float] = {}
        startup: dict[str, float] = {}
        cpu: dict[str, float] = {}
        cpu_startup: dict[str, float] = {}
        processing: dict[str, float] = {}
        backend = ""
        for r in range(args.repeats):
            for name, (cmd, tool_env) in tools.items():
                for inp, kept, kept_cpu in ((source, wall, cpu), (one, startup, cpu_startup)):
                    prefix = work / f"{name}_{kind}{'_one' if inp == one else ''}"
                    seconds, cpu_s, log = run_tool([*cmd, "--input", str(inp), "--output-prefix", str(prefix),
                                                    *common], tool_env, prefix)
                    kept[name] = min(kept.get(name, float("inf")), seconds)
                    kept_cpu[name] = min(kept_cpu.get(name, float("inf")), cpu_s)
                    if inp == source:
                        processing[name] = min(processing.get(name, float("inf")), processing_seconds(name, log, docs))
                    if inp == source and name == "ours":
                        backend = re.search(r"tokenizer backend (.*?)\) in ", log).group(1)
                print(f"  round {r + 1} {name:8s}: {wall[name]:6.1f}s wall ({processing[name]:5.1f}s processing by its "
                      f"log), {cpu[name]:6.1f} CPU-s; one document (start-up): {startup[name]:5.1f}s wall, "
                      f"{cpu_startup[name]:5.1f} CPU-s", flush=True)
        identical = all(
            (work / f"ours_{kind}_text_document{s}").read_bytes()
            == (work / f"{name}_{kind}_text_document{s}").read_bytes()
            for s in (".bin", ".idx") for name in tools
        )
        work_s = {name: wall[name] - startup[name] for name in tools}
        for name in tools:
            print(f"  {name:8s}: work {work_s[name]:5.1f}s ({size / 1e6 / work_s[name]:6.2f} MB/s), start-up "
                  f"{startup[name]:4.1f}s")
        ours_mb, core_mb = engine_rates(tokenizer_type, model, source, 4.0, 2)
        work_cpu = {name: cpu[name] - cpu_startup[name] for name in tools}  # steadier than wall on a busy machine
        results[kind] = {"work": work_s["megatron"] / work_s["ours"], "identical": identical, "engine": backend,
                         "work_cpu": work_cpu["megatron"] / work_cpu["ours"],
                         "processing": processing["megatron"] / processing["ours"],
                         "startup": startup["ours"] / startup["megatron"], "rates": (ours_mb, core_mb),
                         "mb_s": {name: size / 1e6 / work_s[name] for name in tools}, "startup_s": startup}
        vs = ""
        if "compared" in tools:
            vs = f"; the compared version's work / ours {work_s['compared'] / work_s['ours']:.2f}"
        print(f"  tokenize alone, one process: ours {ours_mb:.2f} MB/s, megatron-core's {core_mb:.2f} MB/s "
              f"(same ids){vs}")
    print("\nper tokenizer kind (work = wall less the one-document run's start-up; MB/s of the input):")
    for kind, r in results.items():
        ours, theirs = r["mb_s"]["ours"], r["mb_s"]["megatron"]
        print(f"{kind:13s} work {r['work']:5.2f}x Megatron-LM's ({ours:5.2f} vs {theirs:5.2f} MB/s; CPU-s "
              f"{r['work_cpu']:4.2f}x; by the logs {r['processing']:4.2f}x), start-up "
              f"{r['startup_s']['ours']:4.1f}s vs {r['startup_s']['megatron']:4.1f}s, byte-identical "
              f"{r['identical']}, tokenize alone {r['rates'][0] / r['rates'][1]:4.2f}x megatron-core's, engine "
              f"{r['engine']}")
    print()
    helps = help_seconds(Path(args.megatron_lm).resolve(), args.megatron_python)
    for name, seconds in helps.items():
        print(f"{name}: {seconds:.2f}s wall")
    ours_help = max(helps[n] for n in helps if not n.startswith("Megatron-LM"))
    ratios = " ".join(f"{kind}_work_ratio={r['work']:.2f}" for kind, r in results.items())
    print(f"min_work_ratio={min(r['work'] for r in results.values()):.2f} {ratios} "
          f"min_work_cpu_ratio={min(r['work_cpu'] for r in results.values()):.2f} "
          f"min_processing_ratio={min(r['processing'] for r in results.values()):.2f} "
          f"max_startup_ratio={max(r['startup'] for r in results.values()):.2f} "
          f"identical={'all' if all(r['identical'] for r in results.values()) else 'no'} help_s={ours_help:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
