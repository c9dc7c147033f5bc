"""Leadership (weightcache.standby): real processes compete for one flock; a SIGKILLed holder hands over."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from conftest import process_gone, wait_until

import weightcache as wc
from weightcache.rundir import ensure_private_dir

#: How long a test waits for a child's next line before it fails (and kills its children) instead of hanging.
LINE_TIMEOUT = 30.0


class Contender:
    """A child process that takes the leadership and reports, one line at a time, what happened."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid

    def line(self, timeout: float = LINE_TIMEOUT) -> str:
        """The child's next line; fails (never hangs) if none comes within ``timeout`` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        data = b""
        # One byte per read: nothing is buffered past the newline, so select() stays truthful for the next line.
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.fail(f"no line within {timeout} s (got {data!r})")
            byte = os.read(fd, 1)
            if not byte:
                self.fail(f"exited with {self.proc.wait(10)} before a full line (got {data!r})")
            data += byte
        return data.decode()

    def quiet_for(self, seconds: float) -> bool:
        """Whether the child prints nothing for ``seconds``."""
        assert self.proc.stdout is not None
        return not select.select([self.proc.stdout.fileno()], [], [], seconds)[0]

    def outcome(self) -> tuple[str, float]:
        """('leader' or 'refused', the child's time.monotonic() at that moment)."""
        state, when = self.line().split()
        return state, float(when)

    def fail(self, why: str) -> NoReturn:
        self.finish()
        assert self.proc.stderr is not None
        pytest.fail(f"contender {self.pid}: {why}; its stderr: {self.proc.stderr.read().decode(errors='replace')}")

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def spawn() -> Iterator[Callable[[str], Contender]]:
    """Start ``python -c CODE`` children that print lines; every one is killed when the test ends, passed or not."""
    started: list[Contender] = []

    def start(code: str) -> Contender:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        started.append(Contender(proc))
        return started[-1]

    yield start
    for child in started:
        child.finish()


@pytest.fixture
def contender(spawn: Callable[[str], Contender]) -> Callable[..., Contender]:
    """A process that takes the leadership (blocking or not), prints what happened, and holds it until its stdin
    closes."""

    def start(socket_dir: Path, name: str = "m", *, block: bool = True) -> Contender:
        child = spawn(
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
        assert child.line() == "trying\n"
        return child

    return start


@pytest.fixture
def lock_dir(socket_dir: Path) -> Path:
    return ensure_private_dir(socket_dir)


def test_waiter_takes_over_when_the_holder_is_killed(lock_dir: Path, contender: Callable[..., Contender]) -> None:
    holder = contender(lock_dir)
    assert holder.outcome()[0] == "leader"
    leader = wc.Leadership("m", socket_dir=lock_dir)
    assert leader.holder() == holder.pid
    waiter = contender(lock_dir)
    # The waiter sits in the kernel's queue for the lock (not polling, not refused).
    assert wait_until(lambda: leader.waiters() == [waiter.pid], timeout=30)
    assert waiter.proc.poll() is None
    t_kill = time.monotonic()
    os.kill(holder.pid, signal.SIGKILL)
    state, t_leader = waiter.outcome()
    assert state == "leader"
    assert t_leader >= t_kill  # never while the old holder lived
    assert holder.proc.wait(10) == -signal.SIGKILL
    assert leader.holder() == waiter.pid and leader.waiters() == []
    # A third process is refused while the new leader lives; this object too.
    assert contender(lock_dir, block=False).outcome()[0] == "refused"
    assert leader.try_acquire() is False and not leader.held


def test_release_and_context_manager(lock_dir: Path, contender: Callable[..., Contender]) -> None:
    leader = wc.Leadership("m", socket_dir=lock_dir)
    assert leader.try_acquire() and leader.held
    assert leader.holder() == os.getpid()
    assert (lock_dir / "leader-m.lock").read_text() == f"{os.getpid()}\n"
    other = wc.Leadership("m", socket_dir=lock_dir)  # a second open file: a competitor, even in this process
    assert other.try_acquire() is False
    with pytest.raises(RuntimeError, match="already held"):
        leader.try_acquire()
    assert contender(lock_dir, block=False).outcome()[0] == "refused"
    leader.release()
    assert not leader.held and leader.holder() is None
    leader.release()  # idempotent
    with wc.Leadership("m", socket_dir=lock_dir) as again:
        assert again.held and again.holder() == os.getpid()
    assert again.holder() is None
    # Other names are other locks.
    with wc.Leadership("a", socket_dir=lock_dir), wc.Leadership("b", socket_dir=lock_dir):
        pass


def test_a_released_lock_wakes_a_blocked_waiter(lock_dir: Path, contender: Callable[..., Contender]) -> None:
    leader = wc.Leadership("m", socket_dir=lock_dir)
    assert leader.try_acquire()
    waiter = contender(lock_dir)
    assert wait_until(lambda: leader.waiters() == [waiter.pid], timeout=30)
    t_release = time.monotonic()
    leader.release()
    state, t_leader = waiter.outcome()
    assert state == "leader" and t_leader >= t_release


def test_the_lock_is_not_inherited_by_exec(lock_dir: Path) -> None:
    with wc.Leadership("m", socket_dir=lock_dir) as leader:
        # close_fds=False: the child gets every inheritable fd, so only the lock fd's close-on-exec keeps it out.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False)
        try:
            leader.release()
            # The child's copy, if any, is dropped during its exec, which may finish a moment after Popen returns:
            # wait a little. An inherited lock would stay held for the child's 60 s.
            assert wait_until(lambda: leader.holder() is None, timeout=10)  # the child did not keep it
            assert child.poll() is None
            assert wc.Leadership("m", socket_dir=lock_dir).try_acquire()
        finally:
            child.kill()
            child.wait(10)


def test_a_waiter_on_a_deleted_lock_file_does_not_lead_beside_the_new_holder(
    lock_dir: Path, contender: Callable[..., Contender]
) -> None:
    first = wc.Leadership("m", socket_dir=lock_dir)
    assert first.try_acquire()
    waiter = contender(lock_dir)
    assert wait_until(lambda: first.waiters() == [waiter.pid], timeout=30)
    os.unlink(first.path)  # unsupported while a leader lives (see Leadership); here: what the waiter does then
    new = wc.Leadership("m", socket_dir=lock_dir)
    assert new.try_acquire()  # a new file, so a new lock: it leads
    assert new.holder() == os.getpid()
    first.release()
    # The waiter wakes with the lock of a file nobody can open any more; it must see that, open the file that
    # is there now and wait behind its holder, not report leadership beside it.
    assert wait_until(lambda: new.waiters() == [waiter.pid], timeout=10)
    assert waiter.quiet_for(0.2)
    new.release()
    assert waiter.outcome()[0] == "leader"
    assert new.holder() == waiter.pid


def test_a_forked_child_does_not_keep_the_lock(
    lock_dir: Path, spawn: Callable[[str], Contender], contender: Callable[..., Contender]
) -> None:
    leader = spawn(
        f"""
        import os, sys, time
        from weightcache.standby import Leadership
        leader = Leadership("m", socket_dir={str(lock_dir)!r})
        assert leader.acquire()
        worker = os.fork()  # as multiprocessing's fork start method does: no exec
        if worker == 0:
            time.sleep(60)
            os._exit(0)
        print(worker, flush=True)
        sys.stdin.read()
        """
    )
    worker = int(leader.line())
    try:
        observer = wc.Leadership("m", socket_dir=lock_dir)
        lock_file = str(observer.path)
        # The worker closed its copy of the fd; that did not unlock the leader's open file, nor erase its pid.
        assert wait_until(
            lambda: all(os.readlink(f"/proc/{worker}/fd/{fd}") != lock_file for fd in os.listdir(f"/proc/{worker}/fd"))
        )
        assert observer.holder() == leader.pid and observer.try_acquire() is False
        assert observer.path.read_text() == f"{leader.pid}\n"
        waiter = contender(lock_dir)
        assert wait_until(lambda: observer.waiters() == [waiter.pid], timeout=30)
        os.kill(leader.pid, signal.SIGKILL)
        assert waiter.outcome()[0] == "leader"  # while the worker lives on
        assert not process_gone(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def test_a_lock_file_or_directory_others_can_use_is_refused(lock_dir: Path, tmp_path: Path) -> None:
    (lock_dir / "leader-m.lock").touch(0o644)
    with pytest.raises(wc.SocketDirError, match=r"mode 0644.*Run: chmod 600 "):
        wc.Leadership("m", socket_dir=lock_dir).acquire()  # refused, not a wait that may never end
    os.chmod(lock_dir / "leader-m.lock", 0o600)
    assert wc.Leadership("m", socket_dir=lock_dir).try_acquire()
    # path=: others must not be able to delete the file and create their own, unless the directory is sticky.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(wc.SocketDirError, match=r"mode 0777\).*delete and recreate.*chmod go-w"):
        wc.Leadership(path=shared / "l.lock").try_acquire()
    os.chmod(shared, 0o1777)  # like /tmp
    with wc.Leadership(path=shared / "l.lock") as leader:
        assert leader.held
    assert stat.S_IMODE(os.stat(shared / "l.lock").st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a process as another user")
def test_another_user_cannot_hold_the_lock(spawn: Callable[[str], Contender]) -> None:
    nobody = 65534
    directory = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    try:
        os.chmod(directory, 0o755)  # others may enter, as in a shared socket directory
        path = directory / "l.lock"
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
        os.chmod(path, 0o644)
        intruder = f"""
            import fcntl, os, sys
            os.setgroups([])
            os.setgid({nobody})
            os.setuid({nobody})
            try:
                fd = os.open({str(path)!r}, os.O_RDONLY)
            except PermissionError:
                print("denied", flush=True)
                sys.exit()
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("holding", flush=True)
            sys.stdin.read()
            """
        # A read-only fd is enough for flock: with a 0644 file another user holds the lock as long as it likes.
        holder = spawn(intruder)
        assert holder.line() == "holding\n"
        with pytest.raises(wc.SocketDirError, match=rf"mode 0644.*Run: chmod 600 {path}"):
            wc.Leadership(path=path).try_acquire()  # refused (acquire() would have waited forever)
        holder.finish()
        os.chmod(path, 0o600)
        assert spawn(intruder).line() == "denied\n"  # a 0600 file cannot be opened by another user at all
        with wc.Leadership(path=path) as leader:
            assert leader.held
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_clear_errors(socket_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(wc.SocketDirError, match="does not exist.*Start the keeper"):
        wc.Leadership("m", socket_dir=socket_dir).acquire()
    socket_dir.mkdir(mode=0o755)
    os.chmod(socket_dir, 0o755)
    with pytest.raises(wc.SocketDirError, match="0755"):
        wc.Leadership("m", socket_dir=socket_dir).try_acquire()
    for bad in ("", "../x", "a/b", ".hidden", "x" * 101, 123):  # a name that is no string too (was a TypeError)
        with pytest.raises(wc.InvalidArgument, match="leadership name"):
            wc.Leadership(bad, socket_dir=socket_dir)
    with pytest.raises(wc.InvalidArgument, match="not both"):
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
