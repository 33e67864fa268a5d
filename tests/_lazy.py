"""Imports deferred to first use, so that collecting the tests stays fast (torch, transformers: seconds each)."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import pytest


class LazyModule:
    """Stands for module `name` and imports it on the first attribute access (`transformers.LlamaConfig`)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pytest's collection probes module globals (`__test__`, ...): no import for that
            raise AttributeError(attr)
        module: ModuleType = importlib.import_module(self._name)
        return getattr(module, attr)


def importorskip_lazy(name: str) -> Any:
    """pytest.importorskip at module level without the import: skips the module when `name` is not installed,
    else a LazyModule for it."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"could not import {name!r}: not installed", allow_module_level=True)
    return LazyModule(name)
