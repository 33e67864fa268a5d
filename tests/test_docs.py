"""Figures in the docs are backed: every cited docs/results file exists, says how it was made, and agrees.

A results file (written by benchmarks/record.py) starts with the command that produced it, the commit, the
date and the machine. The docs, the Slurm scripts and the code cite them by path; a citation of a file that
is not there, a results file nobody cites, or a quoted figure that differs from its file fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
CITING = sorted({ROOT / "README.md", ROOT / "DEVELOPERS.md", ROOT / "benchmarks" / "README.md",
                 *ROOT.glob("docs/*.md"), *ROOT.glob("examples/slurm/*"),
                 *ROOT.glob("examples/sft/*.sbatch"), *ROOT.glob("examples/*.py"), *ROOT.glob("benchmarks/*.py"),
                 *ROOT.glob("megatron_jreg/**/*.py")})
# a cited path; the full stop ending a sentence is not part of it
CITATION = re.compile(r"docs/results/[A-Za-z0-9_\-][A-Za-z0-9_.\-/]*[A-Za-z0-9_\-]")
RELATIVE = re.compile(r"\]\((results/[^)#\s]+)\)")  # a link from docs/*.md
HEADER = (r"# command: \S.*", r"# commit: [0-9a-f]{40}( \(.*\))?", r"# date: \d{4}-\d\d-\d\d .*",
          r"# machine: .*CPU.*", r"# wall: \d+ s(; CPU \d+ core-s)?")


def citations() -> dict[Path, list[str]]:
    """Results file → the files that cite it."""
    cited: dict[Path, list[str]] = {}
    for path in CITING:
        text = path.read_text(encoding="utf-8")
        found = {ROOT / m for m in CITATION.findall(text)}
        if path.parent == ROOT / "docs":
            found |= {ROOT / "docs" / m for m in RELATIVE.findall(text)}
        for target in found:
            cited.setdefault(target, []).append(str(path.relative_to(ROOT)))
    return cited


def results_file(name: str) -> list[str]:
    return (RESULTS / name).read_text(encoding="utf-8").splitlines()


def test_every_cited_results_file_exists_and_starts_with_how_it_was_made():
    cited = citations()
    assert len(cited) >= 3, "the docs cite no docs/results files: the pattern or the docs changed"
    for target, sources in sorted(cited.items()):
        assert target.is_file(), f"{', '.join(sources)} cite(s) {target.relative_to(ROOT)}, which does not exist"
        head = target.read_text(encoding="utf-8").splitlines()[: len(HEADER)]
        for pattern, line in zip(HEADER, head + [""] * len(HEADER)):
            assert re.fullmatch(pattern, line), f"{target.relative_to(ROOT)}: expected {pattern!r}, found {line!r}"


def test_every_results_file_is_cited():
    cited = citations()
    for path in sorted(RESULTS.iterdir()):
        assert path in cited, f"{path.name} is cited nowhere: cite it where its figures are used, or drop it"


def _params() -> dict[tuple[str, int], int]:
    rows = {}
    for line in results_file("preset_params.txt"):
        m = re.fullmatch(r"(\S+)\s+(\d+)\s+\d+\s+(yes|no)\s+([\d,]+)\s+[\d,]+", line)
        if m and m.group(3) == "yes":
            rows[(m.group(1), int(m.group(2)))] = int(m.group(4).replace(",", ""))
    return rows


def _short(n: int) -> str:
    """The docs' rounding: 174.0M, 1.24B."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def test_preset_parameter_counts_in_the_docs_are_the_results_file():
    params = _params()
    presets = ("llama-170m", "llama-1b", "llama-3.4b", "tiny")
    assert {p for p, _ in params} == set(presets), params
    readme = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    scaling = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    arguments = (ROOT / "megatron_jreg" / "training" / "flags.py").read_text(encoding="utf-8")
    for preset in presets:
        llama3, sentencepiece = _short(params[(preset, 128_256)]), _short(params[(preset, 32_000)])
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{preset}` |"))
        assert f"| {llama3} / {sentencepiece} " in row, (row, llama3, sentencepiece)
        if preset != "tiny":
            for text in (scaling, arguments):
                assert llama3 in text and sentencepiece in text, (preset, llama3, sentencepiece)


@pytest.mark.parametrize("doc", ["docs/analysis.md"])
def test_analysis_sample_rows_are_the_results_file(doc):
    recorded = set(results_file("analysis_sample.txt"))
    rows = [line for line in (ROOT / doc).read_text(encoding="utf-8").splitlines() if line.startswith("iter_0000")]
    assert rows, f"{doc} quotes no row of docs/results/analysis_sample.txt"
    for row in rows:
        assert row in recorded, f"{doc}: {row!r} is not a line of docs/results/analysis_sample.txt"


def test_console_line_in_the_training_docs_is_the_results_file():
    readme = " ".join((ROOT / "docs" / "training.md").read_text(encoding="utf-8").split())
    quoted = readme.split("` iteration 2/ 4 | ", 1)[1].split(" |`", 1)[0]
    fields = [f for f in quoted.split(" | ") if f != "…"]
    recorded = next(line for line in results_file("console_line.txt") if re.search(r"iteration +2/ +4 \|", line))
    assert len(fields) >= 5, fields
    for field in fields:
        assert f"| {field} |" in recorded, \
            f"docs/training.md's console line: {field!r} is not in docs/results/console_line.txt"


def _caption(text: str) -> bool:
    """A paragraph that is one parenthesis, e.g. "(two of the four checkpoints of ...)."."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return i > 0 and text[0] == "(" and text[i + 1:] in ("", ".")
    return False


def _quoted_blocks(text: str, doc: Path) -> list[tuple[Path, list[str]]]:
    """(cited results file, the block's lines) for each fenced block introduced by a paragraph ending in ":"
    or captioned by one starting with "(" that cites exactly one results file."""
    lines = text.splitlines()
    fences = [i for i, line in enumerate(lines) if line.strip().startswith("```")]
    found = []
    for start, end in zip(fences[::2], fences[1::2]):
        before, i = [], start - 1
        while i >= 0 and not lines[i].strip():
            i -= 1
        while i >= 0 and lines[i].strip() and not lines[i].strip().startswith("```"):
            before.append(lines[i])
            if lines[i].lstrip().startswith("- "):  # a list item is its own paragraph
                break
            i -= 1
        after, j = [], end + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        while j < len(lines) and lines[j].strip() and not lines[j].strip().startswith("```"):
            after.append(lines[j])
            j += 1
        before_text, after_text = " ".join(reversed(before)).strip(), " ".join(after).strip()
        for text_ in (before_text if before_text.endswith(":") else "", after_text if _caption(after_text) else ""):
            cited = {ROOT / m for m in CITATION.findall(text_)}
            if doc.parent == ROOT / "docs":
                cited |= {ROOT / "docs" / m for m in RELATIVE.findall(text_)}
            if len(cited) == 1:
                found.append((cited.pop(), lines[start + 1:end]))
                break
    return found


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))])
def test_blocks_quoting_a_results_file_are_its_lines(doc):
    path = ROOT / doc
    for target, block in _quoted_blocks(path.read_text(encoding="utf-8"), path):
        recorded = {line.strip() for line in target.read_text(encoding="utf-8").splitlines()}
        for line in block:
            assert not line.strip() or line.strip() in recorded, \
                f"{doc}: {line.strip()!r} is not a line of {target.relative_to(ROOT)}"


def test_quoted_blocks_are_found():
    docs = [ROOT / "README.md", *ROOT.glob("docs/*.md")]
    pairs = {(d.name, t.name) for d in docs for t, _ in _quoted_blocks(d.read_text(encoding="utf-8"), d)}
    assert {("analysis.md", "analysis_sample.txt"),
            ("analysis.md", "analyze_throughput.txt"), ("analysis.md", "analyze_stream.txt"),
            ("sft.md", "prepare_chat.txt"), ("gpu.md", "gpu_check_dry_run.txt"),
            ("README.md", "demo.txt")} <= pairs, pairs


def test_convert_logit_differences_are_the_results_files():
    recorded = " ".join(results_file("convert_logits.txt") + results_file("convert_logit_rounding.txt"))
    quoted = re.findall(r"\d\.\d{3}e-\d\d", (ROOT / "docs" / "convert.md").read_text(encoding="utf-8"))
    assert len(quoted) >= 4, quoted
    for number in quoted:
        assert number in recorded, \
            f"docs/convert.md: {number} is in neither docs/results/convert_logits.txt nor convert_logit_rounding.txt"


def test_record_writes_the_header_the_docs_test_reads(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "r.txt"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), str(out), "--", "python", "-c",
                           "print('figure=1')"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = out.read_text(encoding="utf-8").splitlines()
    for pattern, line in zip(HEADER, lines):
        assert re.fullmatch(pattern, line), (pattern, line)
    assert lines[0] == "# command: python -c 'print('\"'\"'figure=1'\"'\"')'" and lines[len(HEADER):] == ["figure=1"]
    failed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record.py"), str(tmp_path / "no.txt"), "--",
                             "python", "-c", "raise SystemExit(3)"], capture_output=True, text=True)
    assert failed.returncode == 1 and not (tmp_path / "no.txt").exists() and "exited 3" in failed.stderr
