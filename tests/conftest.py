"""Test tiers: every `multirank` test is `slow` too, so `-m "not slow"` is the unit tier as well."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("multirank") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
