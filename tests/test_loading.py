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

from weightcache.client import first_load, load_key

KEY = load_key("d" * 64, "cpu")

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from weightcache.client import first_load
    with first_load(Path(sys.argv[1]), sys.argv[2]) as first:
        print("first" if first else "waited", flush=True)
        time.sleep(float(sys.argv[3]))
    """
)


def holding(directory: Path, seconds: float) -> subprocess.Popen[str]:
    """A process that takes the load of KEY and holds it ``seconds`` (it prints "first" once it holds it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), KEY, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "first"
    return proc


def test_the_first_loads_and_the_next_waits_for_that_load_to_end(tmp_path: Path) -> None:
    holder = holding(tmp_path, 2.0)
    t0 = time.monotonic()
    with first_load(tmp_path, KEY) as first:
        waited = time.monotonic() - t0
    assert not first and 1.0 < waited < 10, waited  # it looked again once the holder's load ended
    assert holder.wait(10) == 0
    assert not list(tmp_path.glob("load-*.lock"))
    with first_load(tmp_path, KEY) as first:  # nobody loads now: this one does
        assert first


def test_a_loader_killed_mid_load_releases_its_waiters_at_once(tmp_path: Path) -> None:
    holder = holding(tmp_path, 60.0)
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1); os.kill({holder.pid}, 9)"])
    t0 = time.monotonic()
    with first_load(tmp_path, KEY) as first:
        waited = time.monotonic() - t0
    assert not first and waited < 10, waited
    assert holder.wait(10) == -signal.SIGKILL and killer.wait(10) == 0


def test_a_waiter_gives_up_after_wait_seconds(tmp_path: Path) -> None:
    holder = holding(tmp_path, 60.0)
    try:
        t0 = time.monotonic()
        with first_load(tmp_path, KEY, wait=0.5) as first:
            waited = time.monotonic() - t0
        assert not first and 0.4 < waited < 5, waited  # the caller looks again and loads its own
    finally:
        holder.kill()
        holder.wait()


def test_other_entries_and_other_placements_load_at_once(tmp_path: Path) -> None:
    holder = holding(tmp_path, 60.0)
    try:
        for key in (load_key("e" * 64, "cpu"), load_key("d" * 64, "GPU-0a1b")):
            t0 = time.monotonic()
            with first_load(tmp_path, key) as first:
                assert first and time.monotonic() - t0 < 1
    finally:
        holder.kill()
        holder.wait()


def test_a_missing_socket_directory_is_made_private(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "s"
    with first_load(directory, KEY) as first:
        assert first
    assert directory.is_dir() and os.stat(directory).st_mode & 0o777 == 0o700
