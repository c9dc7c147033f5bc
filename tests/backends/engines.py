"""Helpers for the engine adapter tests, which run in each engine's own virtual environment (`make test-engines`).

In an environment without the engine they are skipped, unless WEIGHTCACHE_ENGINE_TESTS names the engine (the
Makefile sets it), in which case a missing engine is a failure: CI must never pass by skipping them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

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


#: How long a GPU test worker may take to print its result before it is stopped with SIGABRT (its faulthandler
#: then prints every thread's stack into the log the failure shows), below the device's 600 s a command: a hung
#: engine (the CUPTI callback's deadlock on the H100, 2026-12-05, held a lease's test for 8 minutes with nothing
#: in its log) fails with where it hung. SIGKILL follows 30 s later.
RESULT_TIMEOUT_S = float(os.environ.get("WEIGHTCACHE_ENGINE_RESULT_TIMEOUT", "300"))


class EngineProcess:
    """One engine in its own process (a GPU test worker: ``python WORKER '<json spec>'``), kept running until
    closed. The worker prints ``RESULT <json>`` after its first generation and after each ``generate`` command read
    on stdin, and stops on ``quit``; every other line it prints is kept in ``log``. The worker leads a process
    group of its own (its engine core processes with it); a worker that prints no result in
    :data:`RESULT_TIMEOUT_S` gets SIGABRT (each Python process there prints its stacks: faulthandler), then
    SIGKILL; the group is killed when the worker is closed or its start fails, and the workers ask the kernel to
    kill them when the test process dies (``PR_SET_PDEATHSIG``)."""

    def __init__(self, name: str, worker: Path, spec: dict[str, Any], env: dict[str, str], quit_s: float) -> None:
        self.name = name
        self.quit_s = quit_s
        self.aborted = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, str(worker), json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **env),
            start_new_session=True,  # its own process group: a SIGABRT reaches an engine core process too
        )
        self.log: list[str] = []
        try:
            self.result = self.read()
        except BaseException:
            self._signal(signal.SIGKILL)
            raise

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        watchdog = threading.Timer(RESULT_TIMEOUT_S, self._abort)
        watchdog.daemon = True
        watchdog.start()
        try:
            for line in self.proc.stdout:
                if line.startswith("RESULT "):
                    return dict(json.loads(line.removeprefix("RESULT ")))
                self.log.append(line)
        finally:
            watchdog.cancel()
        code = self.proc.wait()
        hung = f" (no result in {RESULT_TIMEOUT_S:.0f} s: stopped with SIGABRT)" if self.aborted.is_set() else ""
        stacks = next((i for i, line in enumerate(self.log) if "most recent call first" in line), None)
        shown = self.log[-80:] if stacks is None else self.log[max(0, stacks - 20) :][-800:]
        raise AssertionError(f"{self.name} engine exited ({code}){hung}:\n{''.join(shown)}")

    def _abort(self) -> None:
        """SIGABRT to the worker's process group: each Python process there prints every thread's stack and ends;
        SIGKILL 30 s later for any that did not (one asleep in a driver call)."""
        self.aborted.set()
        self._signal(signal.SIGABRT)
        later = threading.Timer(30, self._signal, (signal.SIGKILL,))
        later.daemon = True
        later.start()

    def _signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, number)

    def generate(self) -> list[int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("generate\n")
        self.proc.stdin.flush()
        return list(self.read()["tokens"])

    def close(self) -> None:
        """``quit``, then a kill if it has not ended in ``quit_s`` (or its stdin is already gone)."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(self.quit_s)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._signal(signal.SIGKILL)  # what the worker started and left behind (an engine core process)


def within(a: float, b: float, fraction: float) -> bool:
    """Whether ``a`` and ``b`` differ by at most ``fraction`` of the larger."""
    return abs(a - b) <= fraction * max(a, b)


def republished(socket_dir: Path, killed_pid: int, digest: str) -> Callable[[], bool]:
    """For ``wait_until``: a keeper other than ``killed_pid`` serves in ``socket_dir``, holding exactly the entry
    ``digest`` (the running engines re-published it after the old keeper's SIGKILL)."""
    from conftest import keeper_pid

    import weightcache as wc

    def done() -> bool:
        try:
            return keeper_pid(socket_dir) not in (None, killed_pid) and [
                e.digest for e in wc.Cache(socket_dir).entries()
            ] == [digest]
        except wc.KeeperUnavailable:
            return False

    return done
