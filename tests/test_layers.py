"""The package's import layers: imports only point down (import-linter's contract in pyproject.toml), and every
module of the package has its place in a layer, so a new one cannot sit outside the contract."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [[name.strip() for name in re.split(r"[|:]", layer)] for layer in contract["layers"]]


def test_every_module_has_a_layer():
    package = ROOT / "megatron_jreg"
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    modules |= {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    placed = {name for layer in _layers() for name in layer}
    assert modules - placed == set(), "modules with no layer in pyproject.toml's import contract"
    assert placed - modules == set(), "layers naming modules that do not exist"


def test_imports_only_point_down():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken." in result.stdout
