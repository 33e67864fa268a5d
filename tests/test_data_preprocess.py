"""Preprocessing behaviour: round trips, FineWeb-Edu parquet filters, bad input, interruption (kill -9 and
Ctrl-C), shards, sentence splitting."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_jreg.data import merge
from megatron_jreg.data import preprocess as pp
from megatron_jreg.data.indexed import dataset_exists, verify_dataset
from megatron_jreg.data.manifest import read_manifest
from megatron_jreg.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from megatron_jreg.data.text import wikitext_articles
from megatron_jreg.data.tokenizers import build_tokenizer
from megatron_jreg.data.train_tokenizer import train_tokenizer
from tests._indexed import read_documents
from tests._terminal import sigint_default

ROOT = Path(__file__).resolve().parent.parent
WIKI = ROOT / "examples" / "data" / "wikitext-2"
FINEWEB_COLUMNS = [
    "text",
    "id",
    "dump",
    "url",
    "file_path",
    "language",
    "language_score",
    "token_count",
    "score",
    "int_score",
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tok") / "bpe"
    return train_tokenizer([str(WIKI / "valid.txt")], str(out), 600, "hf-bpe", max_chars=150_000)


@pytest.fixture(scope="module")
def tok(bpe):
    return build_tokenizer("HuggingFaceTokenizer", bpe)


@pytest.fixture(scope="module")
def articles() -> list[str]:
    return wikitext_articles(WIKI / "valid.txt")[:24]


def _write_jsonl(path: Path, texts: list[str], **extra) -> Path:
    lines = "".join(
        json.dumps({"text": t, **{k: v[i] for k, v in extra.items()}}) + "\n" for i, t in enumerate(texts)
    )
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(lines.encode()))
    elif path.suffix == ".zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def _run(bpe: str, inputs, prefix: Path, **kw) -> dict:
    inputs = [str(p) for p in (inputs if isinstance(inputs, list) else [inputs])]
    cfg = PreprocessConfig(
        input=inputs,
        output_prefix=str(prefix),
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=bpe,
        append_eod=True,
        **kw,
    )
    return preprocess(cfg)


def _docs(prefix: Path, level: str = "document") -> list[list[int]]:
    return [d.tolist() for d in read_documents(f"{prefix}_text_{level}")]


def _bytes(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}_text_document.bin").read_bytes(), Path(f"{prefix}_text_document.idx").read_bytes()


def test_round_trip_any_compression_any_worker_count(bpe, tok, articles, tmp_path):
    """Tokens read back equal direct tokenization + eod: .jsonl/.gz/.zst, 1 or 2 workers, any unit size."""
    plain = _write_jsonl(tmp_path / "a.jsonl", articles)
    summary = _run(bpe, plain, tmp_path / "plain")
    assert _docs(tmp_path / "plain") == [tok.tokenize(t) + [tok.eod] for t in articles]
    assert summary["documents"] == len(articles) and summary["tokenizer_backend"] == "tiktoken"
    assert summary["dtype"] == "uint16" and verify_dataset(tmp_path / "plain_text_document").dtype == np.uint16
    manifest = read_manifest(tmp_path / "plain_text_document")
    assert manifest["documents"] == len(articles) and manifest["tokens"] == summary["tokens"]
    assert manifest["tokenizer"]["eod"] == tok.eod and len(manifest["inputs"][0]["sha256"]) == 64
    assert manifest["max_token_id"] == max(max(d) for d in _docs(tmp_path / "plain"))

    expected = _bytes(tmp_path / "plain")
    for suffix in (".jsonl.gz", ".jsonl.zst"):
        _run(bpe, _write_jsonl(tmp_path / f"a{suffix}", articles), tmp_path / suffix[-3:], block_mb=0.05)
        assert _bytes(tmp_path / suffix[-3:]) == expected
    _run(bpe, plain, tmp_path / "two", workers=2, block_mb=0.03)
    assert _bytes(tmp_path / "two") == expected


def _fineweb_table(texts: list[str]):
    import pyarrow as pa

    n = len(texts)
    return pa.table(
        {
            "text": texts,
            "id": [f"<urn:uuid:{i}>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{i}" for i in range(n)],
            "file_path": ["s3://commoncrawl/x.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": [0.95] * n,
            "token_count": [len(t.split()) for t in texts],
            "score": [(i % 6) + 0.25 for i in range(n)],
            "int_score": [i % 6 for i in range(n)],
        }
    )


def test_fineweb_parquet_filters_and_hf_folder(bpe, tok, articles, tmp_path):
    import pyarrow.parquet as pq

    table = _fineweb_table(articles)
    assert table.column_names == FINEWEB_COLUMNS
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 14), tmp_path / "pq" / "000_00000.parquet", row_group_size=5)
    pq.write_table(table.slice(14), tmp_path / "pq" / "001_00000.parquet", row_group_size=4)

    summary = _run(bpe, tmp_path / "pq", tmp_path / "edu", min_int_score=3)
    kept = [t for i, t in enumerate(articles) if i % 6 >= 3]
    assert _docs(tmp_path / "edu") == [tok.tokenize(t) + [tok.eod] for t in kept]
    assert summary["skipped"] == {"below_min_int_score": len(articles) - len(kept)}
    assert read_manifest(tmp_path / "edu_text_document")["filters"]["min_int_score"] == 3

    min_chars = min(len(t) for t in kept[:5]) + 1  # at least one short document before the --max-documents cut
    summary = _run(
        bpe,
        str(tmp_path / "pq" / "*.parquet"),
        tmp_path / "short",
        min_int_score=3,
        min_chars=min_chars,
        max_documents=4,
    )
    long_enough = [t for t in kept if len(t) >= min_chars]
    assert _docs(tmp_path / "short") == [tok.tokenize(t) + [tok.eod] for t in long_enough[:4]]
    before_cut = kept[: kept.index(long_enough[3])]  # records after the 4th kept document are not read
    assert summary["skipped"]["too_short"] == sum(len(t) < min_chars for t in before_cut) >= 1

    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(table.to_pydict()).save_to_disk(str(tmp_path / "hf"))
    _run(bpe, tmp_path / "hf", tmp_path / "hfout", min_int_score=3)
    assert _bytes(tmp_path / "hfout") == _bytes(tmp_path / "edu")


def test_bad_input_is_counted_by_reason(bpe, tok, articles, tmp_path, capsys):
    good = articles[:3]
    lines = [
        json.dumps({"text": good[0]}).encode(),
        b'{"text": "unterminated',  # line 2
        json.dumps({"body": "no text key"}).encode(),
        b'{"text": "caf\xe9 in latin-1"}',  # not UTF-8
        json.dumps({"text": ""}).encode(),
        b"",  # blank line
        json.dumps({"text": None}).encode(),
        json.dumps({"text": 42}).encode(),
        b'{"text": "lone surrogate \\ud800"}',
        b"[1, 2, 3]",
        json.dumps({"text": good[1]}).encode(),
        json.dumps({"text": " "}).encode(),  # whitespace has tokens: kept, as Megatron-LM does
    ]
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (folder / "b.parquet").write_bytes(b"PAR1 this is not a parquet file")
    (folder / "c.jsonl.gz").write_bytes(gzip.compress(json.dumps({"text": good[2]}).encode() * 50)[:40])
    _write_jsonl(folder / "d.jsonl", [good[2]])

    summary = _run(bpe, folder, tmp_path / "out", log_interval=1)
    assert summary["skipped"] == {
        "blank_line": 1,
        "empty": 1,
        "malformed_json": 2,
        "missing_key": 2,
        "not_a_string": 1,
        "not_utf8": 2,
        "unreadable_file": 2,  # b.parquet, and c.jsonl.gz: cut before any text could be decompressed
    }
    assert _docs(tmp_path / "out") == [tok.tokenize(t) + [tok.eod] for t in [good[0], good[1], " ", good[2]]]
    assert summary["skipped_examples"]["malformed_json"][0].startswith(f"{folder / 'a.jsonl'}:2 ")
    assert read_manifest(tmp_path / "out_text_document")["skipped"] == summary["skipped"]
    progress = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("processed ")]
    assert [ln.split(" (")[0] for ln in progress] == ["processed 3 docs", "processed 4 docs"]
    assert "ETA" in progress[0]

    with pytest.raises(PreprocessError, match=rf"{folder / 'a.jsonl'}:2 .*malformed_json.*--on-error skip"):
        _run(bpe, folder, tmp_path / "strict", on_error="fail")
    assert not list(tmp_path.glob("strict*"))  # nothing left behind, not even partial files
    assert (
        pp.main(
            [
                "--input",
                str(folder),
                "--output-prefix",
                str(tmp_path / "cli"),
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                bpe,
                "--on-error",
                "fail",
            ]
        )
        == 2
    )
    assert "a.jsonl:2" in capsys.readouterr().err


KILL_SCRIPT = """
import json, os, signal, sys
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_jreg.data.preprocess import PreprocessConfig, preprocess
add, calls = IndexedDatasetBuilder.add_document, []
def add_then_die(self, *args):
    add(self, *args)
    calls.append(1)
    if len(calls) == 12:
        self.data_file.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # as abrupt as a node failure: no cleanup runs
IndexedDatasetBuilder.add_document = add_then_die
preprocess(PreprocessConfig(**json.loads(sys.argv[1])))
"""


def test_interrupted_run_leaves_no_complete_output_then_resumes(bpe, tok, articles, tmp_path):
    src = _write_jsonl(tmp_path / "a.jsonl", articles)
    prefix = tmp_path / "out"
    args = {
        "input": [str(src)],
        "output_prefix": str(prefix),
        "tokenizer_type": "HuggingFaceTokenizer",
        "tokenizer_model": bpe,
        "append_eod": True,
        "block_mb": 0.02,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, json.dumps(args)], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert Path(f"{prefix}_text_document.bin.partial").stat().st_size > 0  # it was killed mid-write
    assert not dataset_exists(f"{prefix}_text_document")
    assert not Path(f"{prefix}_text_document.manifest.json").exists()

    summary = preprocess(PreprocessConfig(**args))  # the same command again redoes the shard
    assert summary["shards"]["written"] == [0]
    assert _docs(prefix) == [tok.tokenize(t) + [tok.eod] for t in articles]
    assert not list(tmp_path.glob("*.partial"))
    mtime = Path(f"{prefix}_text_document.bin").stat().st_mtime_ns
    summary = preprocess(PreprocessConfig(**args))  # and now skips it
    assert summary["shards"] == {"written": [], "already_complete": [0], "not_written": []}
    assert summary["documents"] == len(articles)
    assert Path(f"{prefix}_text_document.bin").stat().st_mtime_ns == mtime


INTERRUPT_SCRIPT = """
import sys, time
from megatron_jreg.data.preprocess import cli, worker
process = worker.process_unit
def slow(unit):  # the second file's units take long enough for Ctrl-C to land in its shard
    if unit.path.endswith("b.jsonl"):
        time.sleep(0.3)
    return process(unit)
worker.process_unit = slow
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_ctrl_c_ends_in_one_line_and_the_same_command_resumes(bpe, tok, articles, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) while shard 1 of 2 is written: one line
    says what is kept and how to resume, exit 130, no traceback from the main process or a worker, no partial
    files; the same command then skips shard 0 and writes shard 1."""
    import signal

    files = [_write_jsonl(tmp_path / "a.jsonl", articles[:8]), _write_jsonl(tmp_path / "b.jsonl", articles[8:])]
    argv = ["--input", *map(str, files), "--output-prefix", str(tmp_path / "out" / "x"), "--output-shards", "2",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe, "--append-eod", "--workers", "2",
            "--block-mb", "0.005"]
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPT_SCRIPT, *argv], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            preexec_fn=sigint_default)
    before = []
    for line in proc.stderr:
        before.append(line)
        if line.startswith("shard 0: wrote"):
            break
    os.killpg(proc.pid, signal.SIGINT)
    after = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, "".join(before) + after
    # "partial files were removed" when the signal found shard 1 started (almost always; a busy machine may still
    # be between the two shards, with nothing partial to remove)
    assert len(after.strip().splitlines()) == 1 and re.fullmatch(
        r"megatron-jreg preprocess: error: interrupted: shard 0 of 2 finished and kept; (shard 1's partial files were "
        r"removed; )?run the same command again to resume \(finished shards are skipped, an unfinished one is "
        r"redone\)", after.strip()), after
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [f"x_00000_text_document{s}" for s in (".bin", ".idx",
                                                                                          ".manifest.json")]
    assert pp.main(argv) == 0
    expected = [tok.tokenize(t) + [tok.eod] for t in articles]
    assert _docs(out / "x_00000") + _docs(out / "x_00001") == expected
    assert not list(out.glob("*.partial"))


@pytest.mark.parametrize("where", ["builder opened", "shard finished, manifest not yet written"])
def test_ctrl_c_anywhere_in_a_shard_leaves_only_finished_shards(bpe, articles, tmp_path, monkeypatch, where):
    """Wherever Ctrl-C lands in shard 1 (its partial .bin just opened, or its dataset renamed into place before its
    manifest is written), the one line names shard 0 as kept and nothing of shard 1 stays on disk."""
    from megatron_jreg.data.preprocess import driver
    from megatron_jreg.errors import Interrupted

    files = [_write_jsonl(tmp_path / "a.jsonl", articles[:8]), _write_jsonl(tmp_path / "b.jsonl", articles[8:])]
    if where == "builder opened":
        class Interrupting(driver.Builder):
            def __init__(self, prefix, dtype):
                super().__init__(prefix, dtype)
                if "_00001_" in str(prefix):
                    raise KeyboardInterrupt
        monkeypatch.setattr(driver, "Builder", Interrupting)
    else:
        write = driver.write_manifest

        def interrupting(prefix, **fields):
            if "_00001_" in str(prefix):
                raise KeyboardInterrupt
            return write(prefix, **fields)
        monkeypatch.setattr(driver, "write_manifest", interrupting)
    with pytest.raises(Interrupted, match="shard 0 of 2 finished and kept; shard 1's partial files were removed"):
        _run(bpe, files, tmp_path / "out" / "x", output_shards=2)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"x_00000_text_document{s}" for s in (".bin", ".idx", ".manifest.json")]


def test_output_shards_resume_and_merge(bpe, articles, tmp_path):
    files = [_write_jsonl(tmp_path / f"part{i}.jsonl", articles[i * 8 : (i + 1) * 8]) for i in range(3)]
    _run(bpe, files, tmp_path / "single")
    summary = _run(bpe, str(tmp_path / "part*.jsonl"), tmp_path / "sh", output_shards=2)
    shard_prefixes = [f"{tmp_path}/sh_{i:05d}_text_document" for i in range(2)]
    assert summary["outputs"] == shard_prefixes and summary["shards"]["written"] == [0, 1]
    assert [len(read_manifest(p)["inputs"]) for p in shard_prefixes] == [2, 1]

    summary = _run(bpe, str(tmp_path / "part*.jsonl"), tmp_path / "node", output_shards=2, shard_ids=[1])
    assert summary["outputs"] == [f"{tmp_path}/node_00001_text_document"]  # one node's share of the shards
    assert _bytes(tmp_path / "node_00001") == _bytes(tmp_path / "sh_00001")

    files[1].write_text(files[1].read_text() + json.dumps({"text": "one more document"}) + "\n")
    summary = _run(bpe, str(tmp_path / "part*.jsonl"), tmp_path / "sh", output_shards=2)
    assert summary["shards"]["written"] == [0] and summary["shards"]["already_complete"] == [1]

    files[1].write_text("".join(files[1].read_text().splitlines(keepends=True)[:-1]))
    _run(bpe, str(tmp_path / "part*.jsonl"), tmp_path / "sh", output_shards=2)
    assert (
        merge.main(
            [
                "--input",
                str(tmp_path / "sh_*_text_document.idx"),
                "--output-prefix",
                str(tmp_path / "merged_text_document"),
            ]
        )
        == 0
    )
    assert _bytes(tmp_path / "merged") == _bytes(tmp_path / "single")
    merged = read_manifest(tmp_path / "merged_text_document")
    assert merged["documents"] == len(articles) and [i["prefix"] for i in merged["inputs"]] == shard_prefixes
    assert merged["tokenizer"] == read_manifest(shard_prefixes[0])["tokenizer"]
    assert merged["max_token_id"] == max(read_manifest(p)["max_token_id"] for p in shard_prefixes)
    with pytest.raises(ValueError, match="--output-shards 4 but the input has only 3 file"):
        _run(bpe, files, tmp_path / "too_many", output_shards=4)


def _sequence_lengths(prefix: Path) -> list[int]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))  # alive while its arrays are read: it unmaps them when dropped
    return dataset.sequence_lengths.tolist()


def _punkt_tab(texts: list[str], nltk_data: Path) -> None:
    """An nltk_data folder with a punkt_tab model for English, trained on `texts` (nltk's own download is
    not available here; what it installs has this layout)."""
    from nltk.tokenize.punkt import PunktTrainer, save_punkt_params

    trainer = PunktTrainer()
    trainer.train("\n".join(texts), finalize=True)
    folder = nltk_data / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True)
    save_punkt_params(trainer.get_params(), str(folder))


@pytest.mark.parametrize("keep_newlines", [False, True])
def test_split_sentences_uses_nltk_punkt_from_the_data_path(bpe, tok, articles, tmp_path, monkeypatch, keep_newlines):
    """--split-sentences: one sequence per sentence of nltk's Punkt for --lang (Megatron-LM's splitter, pieces of
    1,000,000 characters, eod after the last sentence); without Punkt data, one line names the fix."""
    import nltk.data
    from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer, PunktTokenizer

    from megatron_jreg.data.checks import DataError

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data")])  # empty, then with punkt_tab
    src = _write_jsonl(tmp_path / "a.jsonl", articles[:6])
    with pytest.raises(DataError, match="--split-sentences: no nltk Punkt model for --lang english"):
        _run(bpe, src, tmp_path / "none", split_sentences=True)
    assert not list(tmp_path.glob("none*"))

    _punkt_tab(articles, tmp_path / "nltk_data")
    summary = _run(bpe, src, tmp_path / "s", split_sentences=True, keep_newlines=keep_newlines)
    docs = _docs(tmp_path / "s", "sentence")
    lengths = _sequence_lengths(tmp_path / "s_text_sentence")
    assert len(lengths) > 3 * len(docs) and summary["level"] == "sentence"  # really split
    splitter = PunktTokenizer("english")
    if keep_newlines:  # Megatron-LM's CustomLanguageVars (tools/preprocess_data.py, core_v0.19.0), as it is there
        class CustomLanguageVars(PunktLanguageVars):
            _period_context_fmt = r"""
                \S*                          # some word material
                %(SentEndChars)s             # a potential sentence ending
                \s*                       #  <-- THIS is what I changed
                (?=(?P<after_tok>
                    %(NonWord)s              # either other punctuation
                    |
                    (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
                ))"""

        splitter = PunktSentenceTokenizer(train_text=splitter._params, lang_vars=CustomLanguageVars())
        newlines = [tok.detokenize(d[:-1]).count("\n") for d in docs]
        assert sum(newlines) > 0.9 * sum(a.count("\n") for a in articles[:6])  # Punkt drops a few at quotes
    expected_docs, expected_lengths = [], []
    for text in articles[:6]:
        sentences = [ids for ids in map(tok.tokenize, splitter.tokenize(text)) if ids]
        sentences[-1].append(tok.eod)
        expected_docs.append([t for s in sentences for t in s])
        expected_lengths += [len(s) for s in sentences]
    assert docs == expected_docs and lengths == expected_lengths


def test_configuration_errors_name_the_flag(bpe, articles, tmp_path):
    src = _write_jsonl(tmp_path / "a.jsonl", articles[:2])
    from tokenizers import Tokenizer

    Tokenizer.from_file(f"{bpe}/tokenizer.json").save(str(tmp_path / "tokenizer.json"))  # no eos_token config
    with pytest.raises(ValueError, match="--append-eod"):
        _run(str(tmp_path), src, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="--input .*nothing_here"):
        _run(bpe, tmp_path / "nothing_here*.jsonl", tmp_path / "x")
    with pytest.raises(ValueError, match="--workers must be a finite number >= 1"):
        _run(bpe, src, tmp_path / "x", workers=0)
    with pytest.raises(ValueError, match="--keep-newlines only applies with --split-sentences"):
        _run(bpe, src, tmp_path / "x", keep_newlines=True)


def test_progress_line_eta_counts_hours_past_a_day():
    """A long shard's ETA (tqdm's format): 99 hours, not 99 mod 24."""
    from megatron_jreg.data.preprocess.progress import Progress

    progress = Progress(total_input_bytes=100, interval=1)
    progress.start -= 3600  # one hour in, 1 % of the input read
    progress.update(docs=1, text_bytes=10, tokens=3, input_bytes=1)
    assert re.search(r"input 1\.0% ETA 99:0[01]:\d\d$", progress.line()), progress.line()  # 99 h (+ test time)


@pytest.mark.parametrize("entry", ["tools/preprocess_data.py", "megatron-jreg preprocess"])
def test_help_and_bad_flags_are_answered_before_torch_loads(entry, tmp_path):
    """issue 48: `--help` took 6.7 s (torch and megatron-core loaded to build the parser); the flags are now read
    and checked first, by both entry points, and neither --help nor a bad flag loads torch, megatron or numpy."""
    if entry.endswith(".py"):
        script = str(ROOT / entry)
        call = f"sys.argv = [{script!r}, *{{argv}}]; import runpy; runpy.run_path({script!r}, run_name='__main__')"
    else:
        call = "from megatron_jreg.cli import main; sys.exit(main(['preprocess', *{argv}]))"
    loaded = "sorted(m for m in ('torch', 'megatron', 'numpy') if m in sys.modules)"
    for argv, status, says in (
        (["--help"], 0, "--tokenizer-special-tokens"),
        (["--input", "a.jsonl", "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "8", "--workers", "0"], 2, "--workers must be a finite number >= 1"),
    ):
        report = f"import sys, atexit\natexit.register(lambda: print({loaded}, file=sys.stderr))\n"
        proc = subprocess.run([sys.executable, "-c", report + call.format(argv=argv)], cwd=ROOT, capture_output=True,
                              text=True)
        assert proc.returncode == status, proc.stderr
        assert says in proc.stdout + proc.stderr
        assert proc.stderr.rstrip().endswith("[]"), proc.stderr  # nothing heavy was imported


def test_a_tokenizer_without_a_fast_path_says_so_once_in_the_progress_line(bpe, articles, tmp_path, capsys):
    """A tokenizer.json with a normalizer has no exact tiktoken conversion: the `tokenizers` library's batch
    encoding runs, the first progress line says so (not every line), and the output is megatron-core's ids."""
    from tokenizers import Tokenizer, normalizers

    folder = tmp_path / "nfkc"
    folder.mkdir()
    hf = Tokenizer.from_file(f"{bpe}/tokenizer.json")
    hf.normalizer = normalizers.NFKC()
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    summary = _run(str(folder), _write_jsonl(tmp_path / "a.jsonl", articles), tmp_path / "out", log_interval=5,
                   block_mb=0.02)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("processed")]
    note = "tokenizer tokenizers (no exact tiktoken conversion: a normalizer)"
    assert len(lines) > 1 and lines[0].endswith(f" | {note}") and not any(note in line for line in lines[1:])
    assert summary["tokenizer_backend"] == note.removeprefix("tokenizer ")
    tok = build_tokenizer("HuggingFaceTokenizer", str(folder))
    assert _docs(tmp_path / "out") == [list(tok.megatron.tokenize(t)) + [tok.eod] for t in articles]


def test_the_throughput_benchmark_the_docs_quote_reads_its_flags():
    """docs/data.md quotes `python benchmarks/preprocess_throughput.py --input SAMPLE.jsonl --tokenizer-model TOK
    --megatron-lm PATH`, `... --megatron-lm PATH` and the recorded `--kinds sentencepiece,smollm2,llama3`: the flags
    parse, and without a Megatron-LM checkout it says so and exits 0 (it measures nothing here); an unknown --kinds
    is a usage error."""
    bench = [sys.executable, str(ROOT / "benchmarks" / "preprocess_throughput.py")]
    recorded = ["--kinds", "sentencepiece,smollm2,llama3"]
    for extra in (["--input", "SAMPLE.jsonl", "--tokenizer-model", "TOK"], [], recorded):
        proc = subprocess.run([*bench, *extra, "--megatron-lm", "PATH"], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.startswith("skipped: no Megatron-LM checkout"), proc.stderr
    proc = subprocess.run([*bench, "--kinds", "gpt2,bert"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--kinds: choose from gpt2, smollm2, llama3, sentencepiece, nfkc" in proc.stderr


def _record(signum, frame) -> None:  # a handler that only records, as a training run's save-on-SIGTERM one does
    pass


def test_workers_die_on_sigterm_whatever_handler_the_parent_has(monkeypatch):
    """pool.terminate() must end every worker: one stuck before its first line (a lock inherited from the
    parent's threads at the fork) never runs a Python handler, so a worker inherits SIGTERM's default action
    (the suite hung in terminate() waiting on such a worker); the parent keeps its own handler."""
    import signal

    from megatron_jreg.data.preprocess import driver

    previous = signal.signal(signal.SIGTERM, _record)
    try:
        pool = driver._start_pool(PreprocessConfig(input=["x"], output_prefix="y", tokenizer_type="NullTokenizer",
                                                   workers=2))
        try:
            assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
        finally:
            pool.terminate()
        assert signal.getsignal(signal.SIGTERM) is _record
    finally:
        signal.signal(signal.SIGTERM, previous)
