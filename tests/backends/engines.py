"""Helpers for the engine adapter tests, which run in each engine's own virtual environment (`make test-engines`).

In an environment without the engine they are skipped, unless WEIGHTCACHE_ENGINE_TESTS names the engine (the
Makefile sets it), in which case a missing engine is a failure: CI must never pass by skipping them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest


def require_engine(module: str) -> ModuleType:
    required = {e.strip() for e in os.environ.get("WEIGHTCACHE_ENGINE_TESTS", "").split(",") if e.strip()}
    if module in required:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is not installed here (make test-engines runs these)")


@contextlib.contextmanager
def failing_publish(socket_dir: Path, failure: str) -> Iterator[tuple[dict[str, int], str]]:
    """A keeper in ``socket_dir`` that an engine in mode daemon cannot publish to, for a ``failure`` of
    ``"budget"`` (its budget is far below any model) or ``"allocation"`` (the keeper is fine, but the worker gets
    ``fsize_limit``: no memfd segment can grow past 64 KiB). Yields the worker spec's extra keys and the error
    class the FallbackWarning must name; stops the keeper afterwards."""
    from conftest import start_keeper

    keeper: subprocess.Popen[bytes] = start_keeper(socket_dir, *(["--max-bytes", "64K"] if failure == "budget" else []))
    try:
        if failure == "budget":
            yield {}, "BudgetExceeded"
        else:
            yield {"fsize_limit": 1 << 16}, "SegmentError"
    finally:
        keeper.terminate()
        keeper.wait(10)
