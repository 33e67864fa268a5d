"""megatron_jreg.fileio: a failed write leaves the old file and no temporary; a bad JSONL line is named."""

import json

import pytest

from megatron_jreg.fileio import JsonlError, atomic_folder, atomic_write, check_output_folder, read_jsonl, write_json


def test_atomic_write_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "a.json"
    write_json(path, {"x": 1})
    with pytest.raises(RuntimeError), atomic_write(path) as f:
        f.write("half")
        raise RuntimeError("crash")
    assert json.loads(path.read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_atomic_folder_replaces_only_when_complete(tmp_path):
    out = tmp_path / "out"
    with atomic_folder(out) as tmp:
        (tmp / "f").write_text("1")
    with pytest.raises(RuntimeError), atomic_folder(out) as tmp:
        (tmp / "f").write_text("2")
        raise RuntimeError("crash")
    assert (out / "f").read_text() == "1" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_read_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(b'{"a": 1}\n\n[1]\n')
    rows = read_jsonl(path)
    assert next(rows) == (1, {"a": 1})
    with pytest.raises(JsonlError, match=r"q.jsonl: line 3 is a JSON list"):
        next(rows)
    path.write_bytes(b'{"a": 1}\n\xff\n')
    with pytest.raises(JsonlError, match=r"line 2 is not a JSON line"):
        list(read_jsonl(path))


def test_check_output_folder_refuses_before_any_work(tmp_path):
    """The one output-folder check every command uses: a file, a file above, a non-empty folder where a new one
    is wanted are refused naming `what`; nothing is created unless asked, and no probe file stays behind."""
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for folder, kwargs, text in ((a_file, {}, "f is a file, not a folder"),
                                 (a_file / "sub", {}, "f is a file, not a folder"),
                                 (tmp_path, {"empty": True}, "--output X exists and is not empty")):
        with pytest.raises(ValueError, match=text):
            check_output_folder(folder, "--output X", **kwargs)
    assert check_output_folder(tmp_path / "new" / "deeper", "--output X") == tmp_path / "new" / "deeper"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # checked, not created, probe gone
    check_output_folder(tmp_path / "new", "--output X", create=True)
    assert (tmp_path / "new").is_dir() and not any((tmp_path / "new").iterdir())
