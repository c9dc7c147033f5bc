"""The GPU engine tests' harness (tests/backends/engines.py), on the CPU: a worker that hangs is stopped and its
stacks are shown."""

from __future__ import annotations

from pathlib import Path

import engines
import pytest

HANGING = """
import time  # (no faulthandler of its own: the harness's PYTHONFAULTHANDLER must give the stacks)
print("engine starting", flush=True)

def stuck_in_the_driver():
    time.sleep(3600)

stuck_in_the_driver()
"""


def test_a_worker_that_prints_no_result_is_stopped_and_its_stacks_end_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found on the H100 (2026-12-05): a hung engine held the vLLM test for 8 minutes of a lease with nothing in its
    log. A worker with no result in RESULT_TIMEOUT_S is sent SIGABRT, and the failure shows where it hung."""
    worker = tmp_path / "worker.py"
    worker.write_text(HANGING)
    monkeypatch.setattr(engines, "RESULT_TIMEOUT_S", 2.0)
    with pytest.raises(AssertionError) as failed:
        engines.EngineProcess("hanging", worker, {}, {}, quit_s=5)
    text = str(failed.value)
    assert "no result in 2 s: stopped with SIGABRT" in text, text
    assert "stuck_in_the_driver" in text and "engine starting" in text, text
