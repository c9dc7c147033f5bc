"""Helpers for the engine adapter tests, which run in each engine's own virtual environment (`make test-engines`).

In an environment without the engine they are skipped, unless WEIGHTCACHE_ENGINE_TESTS names the engine (the
Makefile sets it), in which case a missing engine is a failure: CI must never pass by skipping them.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def require_engine(module: str) -> ModuleType:
    required = {e.strip() for e in os.environ.get("WEIGHTCACHE_ENGINE_TESTS", "").split(",") if e.strip()}
    if module in required:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed here (make test-engines runs these)")
