"""Leadership (weightcache.standby): real processes compete for one flock; a SIGKILLed holder hands over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import wait_until

import weightcache as wc
from weightcache.rundir import ensure_private_dir


def contender(socket_dir: Path, name: str = "m", *, block: bool = True) -> subprocess.Popen[str]:
    """A process that takes the leadership (blocking or not), prints what happened, and holds it until its stdin
    closes."""
    code = textwrap.dedent(
        f"""
        import sys, time
        from weightcache.standby import Leadership
        leader = Leadership({name!r}, socket_dir={str(socket_dir)!r})
        print("trying", flush=True)
        got = leader.acquire() if {block!r} else leader.try_acquire()
        print(f"{{'leader' if got else 'refused'}} {{time.monotonic()!r}}", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "trying\n", proc.stderr.read() if proc.stderr else ""
    return proc


def outcome(proc: subprocess.Popen[str]) -> tuple[str, float]:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line, proc.stderr.read() if proc.stderr else ""
    return line[0], float(line[1])


def finish(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.fixture
def lock_dir(socket_dir: Path) -> Path:
    return ensure_private_dir(socket_dir)


def test_waiter_takes_over_when_the_holder_is_killed(lock_dir: Path) -> None:
    holder = contender(lock_dir)
    waiter = None
    try:
        assert outcome(holder)[0] == "leader"
        leader = wc.Leadership("m", socket_dir=lock_dir)
        assert leader.holder() == holder.pid
        waiter = contender(lock_dir)
        # The waiter sits in the kernel's queue for the lock (not polling, not refused).
        assert wait_until(lambda: waiter is not None and leader.waiters() == [waiter.pid], timeout=30)
        assert waiter.poll() is None
        t_kill = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        state, t_leader = outcome(waiter)
        assert state == "leader"
        assert t_leader >= t_kill  # never while the old holder lived
        assert holder.wait(10) == -signal.SIGKILL
        assert leader.holder() == waiter.pid and leader.waiters() == []
        # A third process is refused while the new leader lives; this object too.
        late = contender(lock_dir, block=False)
        assert outcome(late)[0] == "refused"
        finish(late)
        assert leader.try_acquire() is False and not leader.held
    finally:
        finish(holder, *([waiter] if waiter else []))


def test_release_and_context_manager(lock_dir: Path) -> None:
    leader = wc.Leadership("m", socket_dir=lock_dir)
    assert leader.try_acquire() and leader.held
    assert leader.holder() == os.getpid()
    assert (lock_dir / "leader-m.lock").read_text() == f"{os.getpid()}\n"
    other = wc.Leadership("m", socket_dir=lock_dir)  # a second open file: a competitor, even in this process
    assert other.try_acquire() is False
    with pytest.raises(RuntimeError, match="already held"):
        leader.try_acquire()
    proc = contender(lock_dir, block=False)
    assert outcome(proc)[0] == "refused"
    finish(proc)
    leader.release()
    assert not leader.held and leader.holder() is None
    leader.release()  # idempotent
    with wc.Leadership("m", socket_dir=lock_dir) as again:
        assert again.held and again.holder() == os.getpid()
    assert again.holder() is None
    # Other names are other locks.
    with wc.Leadership("a", socket_dir=lock_dir), wc.Leadership("b", socket_dir=lock_dir):
        pass


def test_a_released_lock_wakes_a_blocked_waiter(lock_dir: Path) -> None:
    leader = wc.Leadership("m", socket_dir=lock_dir)
    assert leader.try_acquire()
    waiter = contender(lock_dir)
    try:
        assert wait_until(lambda: leader.waiters() == [waiter.pid], timeout=30)
        t_release = time.monotonic()
        leader.release()
        state, t_leader = outcome(waiter)
        assert state == "leader" and t_leader >= t_release
    finally:
        finish(waiter)


def test_the_lock_is_not_inherited_by_exec(lock_dir: Path) -> None:
    with wc.Leadership("m", socket_dir=lock_dir) as leader:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            leader.release()
            assert leader.holder() is None  # the child did not keep it
        finally:
            finish(child)  # type: ignore[arg-type]


def test_clear_errors(socket_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(wc.SocketDirError, match="does not exist.*Start the keeper"):
        wc.Leadership("m", socket_dir=socket_dir).acquire()
    socket_dir.mkdir(mode=0o755)
    os.chmod(socket_dir, 0o755)
    with pytest.raises(wc.SocketDirError, match="0755"):
        wc.Leadership("m", socket_dir=socket_dir).try_acquire()
    for bad in ("", "../x", "a/b", ".hidden", "x" * 101):
        with pytest.raises(ValueError, match="leadership name"):
            wc.Leadership(bad, socket_dir=socket_dir)
    with pytest.raises(ValueError, match="not both"):
        wc.Leadership("m", socket_dir=socket_dir, path=tmp_path / "l")
    with pytest.raises(wc.SocketDirError, match="does not exist"):
        wc.Leadership(path=tmp_path / "missing" / "l.lock").try_acquire()
    (tmp_path / "target").write_text("")
    (tmp_path / "link.lock").symlink_to(tmp_path / "target")
    with pytest.raises(wc.SocketDirError, match="symlink"):
        wc.Leadership(path=tmp_path / "link.lock").try_acquire()
    os.mkfifo(tmp_path / "fifo.lock")
    with pytest.raises(wc.SocketDirError, match="not a regular file"):
        wc.Leadership(path=tmp_path / "fifo.lock").try_acquire()
    # An explicit path works anywhere this user can create a file.
    with wc.Leadership(path=tmp_path / "ok.lock") as leader:
        assert leader.held
