"""Shared fixtures: private socket directories, real keeper processes, tiny checkpoints."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from models import make_checkpoint  # noqa: E402

import weightcache as wc  # noqa: E402
from weightcache.client import KeeperConnection  # noqa: E402
from weightcache.rundir import INSTANCE_LOCK_NAME  # noqa: E402


def benchmark(name: str) -> types.ModuleType:
    """``benchmarks/<name>.py`` loaded as a module (the benchmarks are scripts, not a package), for the tests that
    run its workers or its parsers."""
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (marked cuda)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def keeper_pid(socket_dir: Path) -> int | None:
    try:
        text = (socket_dir / INSTANCE_LOCK_NAME).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def wait_until(condition: Callable[[], bool], timeout: float = 2.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; return its last value. For what the keeper
    does asynchronously (noticing a closed connection, exiting, removing its socket)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return condition()
        time.sleep(0.01)
    return True


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def open_fds(pid: int) -> int:
    """How many fds process ``pid`` holds open."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def sealed_memfd(size: int, seal: bool = True) -> int:
    """A memfd of ``size`` bytes, its pages allocated as a publisher's written segment's are (the keeper's budget
    counts the memory a segment really holds), sealed against write, shrink and grow as publishers seal theirs (or
    not)."""
    import fcntl

    fd = os.memfd_create("weightcache", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if size:
        os.posix_fallocate(fd, 0, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def one_tensor_manifest(
    fingerprint: dict,
    *,
    size: int = 512,
    offset: int = 0,
    placement: str = "cpu",
    name: str = "w",
    kind: str = "tensor",
    requires_grad: bool = False,
) -> dict:
    """A manifest as the wire carries it: one float32 tensor of 4 elements in one memfd segment."""
    from weightcache.manifest import MANIFEST_VERSION

    return {
        "version": MANIFEST_VERSION,
        "fingerprint": fingerprint,
        "segments": [{"kind": "memfd", "size": size, "placement": placement}],
        "tensors": {
            "name": [name],
            "segment": [0],
            "offset": [offset],
            "dtype": ["float32"],
            "shape": [[4]],
            "stride": [[1]],
            "kind": [kind],
            "requires_grad": [requires_grad],
            "digest": [None],
        },
    }


def stop_keeper(socket_dir: Path) -> None:
    """Stop whatever keeper serves socket_dir (politely, then SIGKILL)."""
    pid = keeper_pid(socket_dir)
    with contextlib.suppress(wc.WeightCacheError), KeeperConnection.connect(socket_dir) as conn:
        conn.request({"op": "stop"})
    if pid and not wait_until(lambda: process_gone(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A fresh, short socket directory path (not created), with any keeper in it stopped afterwards."""
    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    path = base / "s"
    yield path
    stop_keeper(path)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def keeper(socket_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A keeper running in the foreground as a child process (`weightcache serve`)."""
    proc = start_keeper(socket_dir)
    yield proc
    terminate_keeper(proc)


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in /proc/PID/task/TID/stat)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rpartition(")")[2].split()[0])
        except OSError:
            continue
    return bool(states) and all(state in ("T", "t") for state in states)


def terminate_keeper(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop a :func:`start_keeper` keeper with SIGTERM and wait for it. One that has not exited after ``timeout``
    seconds fails the test with its log and every thread's stack (SIGUSR1), then is killed."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    log = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    pytest.fail(f"the keeper (pid {proc.pid}) did not stop within {timeout} s of SIGTERM; its log:\n{log}")


def serve_detached(socket_dir: Path, *args: str) -> None:
    """A keeper in the background (`weightcache serve --detach --socket-dir socket_dir *args`), once it serves,
    logging to its keeper.log: for tests whose keeper logs much (a :func:`start_keeper` keeper's stderr is a pipe
    nobody reads, which blocks the keeper once ~1,000 log lines fill it). Stop it with ``Cache.stop``."""
    command = [sys.executable, "-m", "weightcache", "serve", "--socket-dir", str(socket_dir), "--detach", *args]
    subprocess.run(command, check=True, timeout=60, capture_output=True)


def start_keeper(socket_dir: Path, *args: str, nofile: int | None = None) -> subprocess.Popen[bytes]:
    """A foreground keeper (`weightcache serve --socket-dir socket_dir *args`) as a child, once it serves;
    ``nofile`` sets its open-file limit (soft and hard)."""
    import resource

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightcache",
            "serve",
            "--socket-dir",
            str(socket_dir),
            "--ready-fd",
            str(write_fd),
            *args,
        ],
        pass_fds=(write_fd,),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=limit,
    )
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        status = ready.readline().strip()
    if status != b"ok":
        proc.kill()
        raise RuntimeError(f"keeper did not start: {status!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "ckpt")


def run_worker(command: str, spec: dict, timeout: float = 120) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "worker.py"), command, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise AssertionError(f"worker failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Holder:
    """A worker process in `hold` mode: attached, computing on request."""

    def __init__(self, spec: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "worker.py"), "hold", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"holder failed to attach:\n{err[-4000:]}")
        self.info = json.loads(line)

    def compute(self) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"holder died:\n{err[-4000:]}")
        return json.loads(line)

    def leased_again(self, timeout: float = 10.0) -> bool:
        """Wait until this holder sees its lease held again. The keeper counts a re-published lease as its publish
        ends, the holder a moment later (when the republisher takes the connection), so a test that saw the
        keeper's count must still wait for the holder's."""
        return wait_until(lambda: self.compute()["leased"] is True, timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
