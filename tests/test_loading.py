"""One load per entry (weightcache.client.loading): an engine that misses an entry another engine is loading waits
for that load, for at most one load and at most ``wait`` seconds, with real processes holding the lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from weightcache.client import first_load, load_key

KEY = load_key("d" * 64, "cpu")

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from weightcache.client import first_load
    with first_load(Path(sys.argv[1]), sys.argv[2]) as turn:
        print("first" if turn.first else "waited", flush=True)
        time.sleep(float(sys.argv[3]))
        turn.done()  # published: the waiters may go
        time.sleep(float(sys.argv[4]))  # serving what it published
    """
)


def holding(directory: Path, seconds: float, after: float = 0.0) -> subprocess.Popen[str]:
    """A process that takes the load of KEY, holds it ``seconds``, ends its turn and stays ``after`` seconds more
    in the block (it prints "first" once it holds the load)."""
    command = [sys.executable, "-c", HOLDER, str(directory), KEY, str(seconds), str(after)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "first"
    return proc


def test_the_first_loads_and_the_next_waits_for_that_load_to_end(tmp_path: Path) -> None:
    holder = holding(tmp_path, 2.0, after=30.0)
    t0 = time.monotonic()
    with first_load(tmp_path, KEY) as turn:
        waited = time.monotonic() - t0
    # it looked again once the holder's turn ended (its publish), not when the holder left the block
    assert not turn.first and 1.0 < waited < 10, waited
    assert not list(tmp_path.glob("load-*.lock"))
    with first_load(tmp_path, KEY) as turn:  # nobody loads now: this one does
        assert turn.first
        assert list(tmp_path.glob("load-*.lock"))
    assert not list(tmp_path.glob("load-*.lock"))
    holder.kill()
    holder.wait()


def test_a_loader_killed_mid_load_releases_its_waiters_at_once(tmp_path: Path) -> None:
    holder = holding(tmp_path, 60.0)
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1); os.kill({holder.pid}, 9)"])
    t0 = time.monotonic()
    with first_load(tmp_path, KEY) as turn:
        waited = time.monotonic() - t0
    assert not turn.first and waited < 10, waited
    assert holder.wait(10) == -signal.SIGKILL and killer.wait(10) == 0


def test_a_waiter_gives_up_after_wait_seconds(tmp_path: Path) -> None:
    holder = holding(tmp_path, 60.0)
    try:
        t0 = time.monotonic()
        with first_load(tmp_path, KEY, wait=0.5) as turn:
            waited = time.monotonic() - t0
        assert not turn.first and 0.4 < waited < 5, waited  # the caller looks again and loads its own
    finally:
        holder.kill()
        holder.wait()


def test_other_entries_and_other_placements_load_at_once(tmp_path: Path) -> None:
    holder = holding(tmp_path, 60.0)
    try:
        for key in (load_key("e" * 64, "cpu"), load_key("d" * 64, "GPU-0a1b")):
            t0 = time.monotonic()
            with first_load(tmp_path, key) as turn:
                assert turn.first and time.monotonic() - t0 < 1
    finally:
        holder.kill()
        holder.wait()


def test_a_missing_socket_directory_is_made_private(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "s"
    with first_load(directory, KEY) as turn:
        assert turn.first
    assert directory.is_dir() and os.stat(directory).st_mode & 0o777 == 0o700


def test_a_waiter_says_what_it_waits_for(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="weightcache")
    holder = holding(tmp_path, 1.0)
    with first_load(tmp_path, KEY, what="0123456789ab on cpu") as turn:
        assert not turn.first
    assert holder.wait(10) == 0
    [line] = [r.getMessage() for r in caplog.records if r.name == "weightcache"]
    assert line == "weightcache: another engine is loading 0123456789ab on cpu; waiting for it (at most 600 s)"
