"""Fault injection with real processes: keepers and clients SIGKILLed at awkward moments, restarts, races,
bad checkpoints, full or unwritable socket directories, and long attach/detach runs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import (
    Holder,
    all_threads_stopped,
    keeper_pid,
    open_fds,
    process_gone,
    run_worker,
    start_keeper,
    terminate_keeper,
    wait_until,
)
from models import make_checkpoint, meta_model

import weightcache as wc
from weightcache.client import KeeperConnection
from weightcache.client.connection import REPLY_TIMEOUT_S

#: How long a client may take to notice a new keeper and re-publish (it polls at most once a second).
REPUBLISH_S = 15.0


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def entries(socket_dir: Path) -> list[wc.EntryInfo]:
    try:
        return wc.Cache(socket_dir).entries()
    except wc.KeeperUnavailable:
        return []


# --- item 1: the cache survives its keeper -----------------------------------------------------------------


def test_restarted_keeper_gets_entries_back_from_clients(checkpoint: Path, socket_dir: Path) -> None:
    """Keeper SIGKILLed under two attached engines; a new keeper starts; both engines re-publish the entry
    (one creates it, the other becomes a lease holder), and a third engine attaches it from the cache."""
    keeper = start_keeper(socket_dir)
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir)}
    publisher = run_worker("attach", {**spec, "mode": "daemon"})
    holders = [Holder({**spec, "mode": "client"}) for _ in range(2)]
    try:
        kill(keeper)
        for h in holders:  # attached engines never notice
            assert h.compute()["output"] == publisher["output"]
        assert entries(socket_dir) == []
        new_keeper = start_keeper(socket_dir)
        try:
            assert wait_until(lambda: [e.leases for e in entries(socket_dir)] == [2], REPUBLISH_S)
            [entry] = entries(socket_dir)
            assert entry.digest == publisher["digest"]
            assert {pid for pid, _ in entry.holders} == {h.info["pid"] for h in holders}
            third = run_worker("attach", {**spec, "mode": "client", "strict": True})
            assert third["source"] == "cache" and third["output"] == publisher["output"]
            for h in holders:
                assert h.leased_again()
                assert h.compute() == {"output": publisher["output"], "leased": True}
        finally:
            for h in holders:
                h.close()
            assert wait_until(lambda: [e.leases for e in entries(socket_dir)] == [0])
            terminate_keeper(new_keeper)
    finally:
        for h in holders:
            h.close()


def test_daemon_mode_engine_respawns_a_crashed_keeper_and_republishes(checkpoint: Path, socket_dir: Path) -> None:
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir)}
    holder = Holder({**spec, "mode": "daemon"})
    try:
        old = keeper_pid(socket_dir)
        assert old
        os.kill(old, signal.SIGKILL)
        assert wait_until(lambda: process_gone(old))
        assert wait_until(lambda: [e.leases for e in entries(socket_dir)] == [1], REPUBLISH_S)
        new = keeper_pid(socket_dir)
        assert new and new != old
        third = run_worker("attach", {**spec, "mode": "client", "strict": True})
        assert third["source"] == "cache" and third["output"] == holder.info["output"]
    finally:
        holder.close()


def test_a_stopped_keeper_is_not_respawned_but_a_new_one_gets_the_entries(checkpoint: Path, socket_dir: Path) -> None:
    """`weightcache stop` means stop: engines do not start another keeper. A keeper started later (an upgrade)
    gets their entries back."""
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir)}
    holder = Holder({**spec, "mode": "daemon"})
    try:
        old = keeper_pid(socket_dir)
        wc.Cache(socket_dir).stop()
        assert old and wait_until(lambda: process_gone(old))
        cpu_before = cpu_seconds(holder.proc.pid)
        assert not wait_until(lambda: keeper_pid(socket_dir) not in (None, old), 3.0), "a stopped keeper came back"
        assert cpu_seconds(holder.proc.pid) - cpu_before < 0.3, "waiting for a keeper must not spin"
        assert holder.compute()["leased"] is False
        upgraded = start_keeper(socket_dir)
        try:
            assert wait_until(lambda: [e.leases for e in entries(socket_dir)] == [1], REPUBLISH_S)
            assert holder.leased_again()
            assert holder.compute() == {"output": holder.info["output"], "leased": True}
        finally:
            holder.close()
            terminate_keeper(upgraded)
    finally:
        holder.close()


def test_a_deliberate_stop_stays_a_stop_for_every_entry_point(checkpoint: Path, socket_dir: Path) -> None:
    """After `weightcache stop` (or SIGTERM), nothing starts a keeper by itself: a new engine in mode daemon loads
    from disk with a FallbackWarning that says the keeper was stopped on purpose and how to start it (strict: that
    error), `weightcache load` and `Cache(spawn=True)` refuse with the same words. `weightcache serve` starts one
    again, and mode daemon publishes to it."""
    keeper = start_keeper(socket_dir)
    wc.Cache(socket_dir).stop()
    keeper.wait(30)
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir), "mode": "daemon"}
    engine = run_worker("attach", spec)
    assert engine["source"] == "disk" and keeper_pid(socket_dir) is None
    [warning] = engine["warnings"]  # FallbackWarnings only
    assert "the keeper was stopped on purpose" in warning and "weightcache serve --detach --socket-dir" in warning
    strict = run_worker("attach", {**spec, "strict": True})
    assert strict["error"] == "KeeperUnavailable" and "the keeper was stopped on purpose" in strict["message"]
    load = subprocess.run(
        [sys.executable, "-m", "weightcache", "load", str(checkpoint), "--socket-dir", str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert load.returncode == 1 and "the keeper was stopped on purpose" in load.stderr, load.stderr
    with pytest.raises(wc.KeeperUnavailable, match="stopped on purpose"):
        wc.Cache(socket_dir, spawn=True)
    assert keeper_pid(socket_dir) is None
    keeper = start_keeper(socket_dir)
    try:
        assert run_worker("attach", spec)["warnings"] == []
        assert len(wc.Cache(socket_dir).entries()) == 1
    finally:
        terminate_keeper(keeper)


def test_handle_closed_while_its_keeper_is_gone_is_not_republished(checkpoint: Path, socket_dir: Path) -> None:
    keeper = start_keeper(socket_dir)
    cache = wc.Cache(socket_dir)
    fp = wc.Fingerprint.create(checkpoint)
    kept = cache.put(fp, {"w": torch.arange(64.0)})
    dropped = cache.put(wc.Fingerprint.create(checkpoint, extra={"x": 1}), {"w": torch.ones(8)})
    kill(keeper)
    assert wait_until(lambda: not kept.leased and not dropped.leased)
    dropped.close()
    keeper = start_keeper(socket_dir)
    try:
        assert wait_until(lambda: kept.leased, REPUBLISH_S)
        assert [e.digest for e in cache.entries()] == [fp.digest]
        assert torch.equal(kept.tensors["w"], torch.arange(64.0))
        kept.close()
        assert wait_until(lambda: cache.entries()[0].leases == 0)
    finally:
        terminate_keeper(keeper)


# --- item 3: clients killed in the middle of things ----------------------------------------------------------

#: A client that takes a lease on an entry, then starts a publish and stops half-way: its frame header and the
#: segment fds are sent, half the manifest is not. Prints "sent" and waits to be killed.
HALF_PUBLISH = r"""
import fcntl, json, os, struct, sys, time
from weightcache.client import KeeperConnection
from weightcache import protocol
socket_dir, digest, manifest = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
conn = KeeperConnection.connect(socket_dir)
reply, fds = conn.request({"op": "get", "digest": digest, "placement": "cpu"})
assert reply["found"]
fd = os.memfd_create("weightcache", os.MFD_ALLOW_SEALING)
os.ftruncate(fd, 4096)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
payload = json.dumps({"op": "publish", "manifest": manifest}).encode()
header = protocol.HEADER.pack(protocol.MAGIC, protocol.WIRE_VERSION, 1, len(payload))
import socket, array
fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
conn._sock.sendmsg([header + payload[: len(payload) // 2]], fds)
print("sent", flush=True)
time.sleep(600)
"""

#: A client that asks for an entry and reads only the reply's header (its fds arrive with it), then waits.
HALF_ATTACH = r"""
import json, sys, time, socket
from weightcache.client import KeeperConnection
from weightcache import protocol
socket_dir, digest = sys.argv[1], sys.argv[2]
conn = KeeperConnection.connect(socket_dir)
protocol.send_frame(conn._sock, {"op": "get", "digest": digest, "placement": "cpu"})
data, anc, _, _ = conn._sock.recvmsg(protocol.HEADER.size, socket.CMSG_SPACE(64 * 4))
print("sent" if anc else "no fds", flush=True)
time.sleep(600)
"""


def _victim(code: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "sent":
        proc.kill()
        raise AssertionError(f"victim did not get going: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc


@pytest.mark.parametrize("moment", ["publish", "attach"])
def test_client_killed_mid_publish_or_attach(checkpoint: Path, socket_dir: Path, moment: str) -> None:
    keeper = start_keeper(socket_dir)
    try:
        cache = wc.Cache(socket_dir)
        fp = wc.Fingerprint.create(checkpoint)
        cache.put(fp, {"w": torch.arange(256.0)}).close()
        assert wait_until(lambda: cache.entries()[0].leases == 0)
        baseline = open_fds(keeper.pid)
        other = wc.Fingerprint.create(checkpoint, extra={"half": True})
        manifest = {
            "version": 1,
            "fingerprint": other.to_json(),
            "segments": [{"kind": "memfd", "size": 4096, "placement": "cpu"}],
            "tensors": {
                "name": ["w"], "segment": [0], "offset": [0], "dtype": ["float32"], "shape": [[4]],
                "stride": [[1]], "kind": ["tensor"], "requires_grad": [False], "digest": [None],
            },
        }  # fmt: skip
        if moment == "publish":
            victim = _victim(HALF_PUBLISH, str(socket_dir), fp.digest, json.dumps(manifest))
        else:
            victim = _victim(HALF_ATTACH, str(socket_dir), fp.digest)
        [entry] = cache.entries()
        assert [pid for pid, _ in entry.holders] == [victim.pid], "the victim holds a lease"
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        assert wait_until(lambda: cache.entries()[0].leases == 0), "its lease is released"
        assert [e.digest for e in cache.entries()] == [fp.digest], "a half-published entry never becomes visible"
        # <=: connections of this test that the keeper was still closing may count in the baseline
        assert wait_until(lambda: open_fds(keeper.pid) <= baseline), "the keeper closed every fd the victim sent"
        with cache.get(fp) as handle:  # type: ignore[union-attr]  # and serves everyone else
            assert torch.equal(handle.tensors["w"], torch.arange(256.0))
        assert keeper.poll() is None
    finally:
        terminate_keeper(keeper)


#: Attaches the entry from 8 threads at once (8 leases), reports the tensors' digests, waits for stdin to close.
ATTACH_8 = r"""
import hashlib, json, sys, threading
import weightcache as wc
from weightcache.client import KeeperConnection
socket_dir, fp = sys.argv[1], wc.Fingerprint.from_json(json.loads(sys.argv[2]))
cache = wc.Cache(socket_dir)
handles = [None] * 8
def one(i):
    handles[i] = cache.get(fp)
threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
digests = {hashlib.sha256(h.tensors["w"].numpy().tobytes()).hexdigest() for h in handles}
print(json.dumps({"digests": sorted(digests), "leased": sum(h.leased for h in handles)}), flush=True)
sys.stdin.read()
"""


def test_32_concurrent_attaches(checkpoint: Path, socket_dir: Path) -> None:
    """Four processes attach with eight threads each, all at once: 32 leases held together, identical data."""
    keeper = start_keeper(socket_dir)
    procs: list[subprocess.Popen[str]] = []
    try:
        fp = wc.Fingerprint.create(checkpoint)
        weights = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
        wc.Cache(socket_dir).put(fp, {"w": weights}).close()
        for _ in range(4):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", ATTACH_8, str(socket_dir), json.dumps(fp.to_json())],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        expected = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
        for p in procs:
            assert p.stdout is not None
            report = json.loads(p.stdout.readline())
            assert report == {"digests": [expected], "leased": 8}
        [entry] = wc.Cache(socket_dir).entries()
        assert entry.leases == 32 and {pid for pid, _ in entry.holders} == {p.pid for p in procs}
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            p.wait(30)
        terminate_keeper(keeper)


# --- item 3: the environment fails --------------------------------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to mount a tmpfs")
def test_full_socket_directory_is_a_clear_error(tmp_path: Path, checkpoint: Path) -> None:
    full = Path(tempfile.mkdtemp(prefix="wc-full-", dir="/tmp"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(full)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        fd = os.open(full / "fill", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError, match="No space left"):
            while True:  # fill it up
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        with pytest.raises(wc.KeeperUnavailable, match="cannot write in the socket directory .*No space left"):
            wc.Cache(full / "s", spawn=True)
        # mode daemon starts an engine anyway (from disk, saying why); strict raises
        with pytest.warns(wc.FallbackWarning, match=r"\(KeeperUnavailable: .*No space left"):
            assert wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=full / "s").source == "disk"
        with pytest.raises(wc.KeeperUnavailable, match="No space left"):
            wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=full / "s", strict=True)
        with pytest.warns(wc.FallbackWarning, match="no keeper"):
            assert wc.attach(meta_model(), checkpoint, mode="client", socket_dir=full / "s").source == "disk"
    finally:
        subprocess.run(["umount", str(full)])
        shutil.rmtree(full, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_unwritable_socket_directory_is_a_clear_error(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="wc-ro-", dir="/tmp"))
    os.chmod(base, 0o755)  # root's, not writable by uid 65534
    code = (  # import first: this Python's own files may not be readable by uid 65534
        "import os, sys, weightcache as wc, weightcache.client as client\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n    client.ensure_keeper(sys.argv[1])\n"
        "except wc.SocketDirError as exc:\n    print(exc)\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code, str(base / "s")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "cannot create socket directory" in out.stdout and "Permission denied" in out.stdout
        assert "Pick a writable socket_dir or set $WEIGHTCACHE_DIR" in out.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("damage", ["truncated data", "truncated header", "corrupt header", "absurd header length"])
def test_damaged_checkpoint_is_a_clear_error_and_publishes_nothing(
    tmp_path: Path, socket_dir: Path, damage: str
) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    file = ckpt / "model.safetensors"
    data = bytearray(file.read_bytes())
    if damage == "truncated data":
        data = data[: len(data) - 1000]
    elif damage == "truncated header":
        data = data[:100]
    elif damage == "corrupt header":
        data[8:20] = b"\xff" * 12
    else:
        data[:8] = (1 << 40).to_bytes(8, "little")
    file.write_bytes(bytes(data))
    keeper = start_keeper(socket_dir)
    try:
        with pytest.raises(wc.CheckpointError, match=r"model\.safetensors") as info:
            wc.attach(meta_model(), ckpt, mode="daemon", socket_dir=socket_dir)
        assert "corrupt" in str(info.value) or "truncated" in str(info.value)
        assert entries(socket_dir) == [], "nothing is published from a damaged checkpoint"
    finally:
        terminate_keeper(keeper)


def test_1000_attach_detach_cycles_leak_nothing(checkpoint: Path, socket_dir: Path) -> None:
    """Neither this process nor the keeper grows in fds, mappings or memory over 1,000 attach/detach cycles."""
    keeper = start_keeper(socket_dir)
    try:
        cache = wc.Cache(socket_dir)
        fp = wc.Fingerprint.create(checkpoint)
        cache.put(fp, {f"t{i}": torch.randn(256) for i in range(20)}).close()

        def maps() -> int:
            return Path("/proc/self/maps").read_text().count("memfd:weightcache")

        def rss_kb(pid: int) -> int:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
            raise AssertionError("no VmRSS")

        for _ in range(20):  # warm up: caches, threads, allocator pools
            cache.get(fp).close()  # type: ignore[union-attr]
        import gc

        gc.collect()
        before = (open_fds(os.getpid()), maps(), open_fds(keeper.pid), rss_kb(keeper.pid), rss_kb(os.getpid()))
        for _ in range(1000):
            handle = cache.get(fp)
            assert handle is not None
            float(handle.tensors["t3"].sum())
            handle.close()
            del handle
        gc.collect()
        assert wait_until(lambda: cache.entries()[0].leases == 0)
        # the keeper closes its side of each connection asynchronously (the entries() call's too)
        assert wait_until(lambda: open_fds(keeper.pid) == before[2])
        after = (open_fds(os.getpid()), maps(), open_fds(keeper.pid), rss_kb(keeper.pid), rss_kb(os.getpid()))
        assert after[0] == before[0] and after[1] <= before[1] and after[2] == before[2], (before, after)
        assert after[3] < before[3] + 4096 and after[4] < before[4] + 16384, (before, after)  # KiB
    finally:
        terminate_keeper(keeper)


def test_socket_directory_appearing_mid_connect_means_no_keeper(tmp_path: Path) -> None:
    """A directory created by a racing engine while we connect is "no keeper yet", never a SocketDirError.

    Racing engines in mode daemon each find no keeper; one creates the directory while another is between
    checking it and connecting. That other engine must spawn or wait, not fall back to disk (CI saw it do so).
    """
    directory = tmp_path / "s"
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(directory)

    thread = threading.Thread(target=churn)
    thread.start()
    errors: list[str] = []
    try:
        for _ in range(20000):
            try:
                KeeperConnection.connect(directory).close()
            except wc.KeeperUnavailable:
                pass
            except wc.WeightCacheError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        stop.set()
        thread.join()
    assert errors == []


# --- a keeper that stops answering (SIGSTOP, a debugger, a wedged host) ---------------------------------------


def _in_thread(call: Callable[[], object], timeout: float) -> tuple[object, float]:
    """``(what call returned or raised, seconds it took)``; AssertionError if it is still blocked after
    ``timeout`` (the thread is left behind, stuck: that is the failure)."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:
            box.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert box, f"still blocked after {timeout} s"
    return box[0], time.monotonic() - start


def test_a_stopped_keeper_is_a_deadline_not_a_hang(checkpoint: Path, socket_dir: Path) -> None:
    keeper = start_keeper(socket_dir)
    try:
        with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir) as handle:
            fingerprint = handle.fingerprint
        conn = KeeperConnection.connect(socket_dir)
        keeper.send_signal(signal.SIGSTOP)
        # SIGSTOP takes effect on each thread when the kernel next gets to it: on a loaded machine the keeper's
        # server thread once answered the get before it stopped. Wait until every thread is stopped.
        assert wait_until(lambda: all_threads_stopped(keeper.pid), 10)
        # Stopped between hello and get: the get has a deadline and says which op went unanswered.
        error, took = _in_thread(lambda: conn.get(fingerprint.digest, fingerprint.placement), 60)
        assert isinstance(error, wc.KeeperUnavailable), error
        assert "did not answer 'get'" in str(error) and "SIGSTOP" in str(error), error
        assert took < REPLY_TIMEOUT_S + 3  # its deadline, not that plus a wait for the silent keeper to close
        # Stopped before the attach: mode client falls back within the deadline and says the keeper is silent.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result, took = _in_thread(
                lambda: wc.attach(meta_model(), checkpoint, mode="client", socket_dir=socket_dir), 60
            )
        assert isinstance(result, wc.Handle) and result.source == "disk", result
        assert took < 20
        [warning] = [w for w in caught if issubclass(w.category, wc.FallbackWarning)]
        assert "did not answer 'hello'" in str(warning.message) and "partial frame" not in str(warning.message)
        # mode daemon does not try to spawn a second keeper beside the silent one: one deadline, then disk
        with pytest.warns(wc.FallbackWarning, match="did not answer"):
            result, took = _in_thread(
                lambda: wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir), 60
            )
        assert isinstance(result, wc.Handle) and result.source == "disk", result
        assert took < 20
    finally:
        keeper.send_signal(signal.SIGCONT)
        terminate_keeper(keeper)


def test_200_engines_connect_while_the_keeper_pauses(socket_dir: Path) -> None:
    """A full listen backlog is retried within the connect timeout: all 200 connect after a 2 s pause."""
    keeper = start_keeper(socket_dir)
    try:
        keeper.send_signal(signal.SIGSTOP)
        barrier = threading.Barrier(201)

        def connect() -> str:
            barrier.wait()
            try:
                KeeperConnection.connect(socket_dir).close()
                return "ok"
            except wc.WeightCacheError as exc:
                return f"{type(exc).__name__}: {exc}"

        with ThreadPoolExecutor(200) as pool:
            futures = [pool.submit(connect) for _ in range(200)]
            barrier.wait()
            time.sleep(2)
            keeper.send_signal(signal.SIGCONT)
            results = [f.result(timeout=60) for f in futures]
        failed = [r for r in results if r != "ok"]
        assert failed == [], f"{len(failed)} of 200 failed, e.g. {failed[0]}"
    finally:
        keeper.send_signal(signal.SIGCONT)
        terminate_keeper(keeper)


# --- engines always start ------------------------------------------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_a_squatted_default_socket_directory_does_not_stop_an_engine(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    squatted = runtime / "weightcache"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 65534, 65534)  # another local user got there first
    monkeypatch.delenv("WEIGHTCACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with pytest.warns(wc.FallbackWarning, match="owned by uid 65534"):
        assert wc.attach(meta_model(), checkpoint, mode="daemon").source == "disk"
    with pytest.raises(wc.SocketDirError, match="owned by uid 65534"):
        wc.attach(meta_model(), checkpoint, mode="daemon", strict=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to mount a tmpfs")
def test_a_read_only_socket_directory_says_so(checkpoint: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="wc-ro-", dir="/tmp"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(base)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        os.mkdir(base / "made", 0o700)
        subprocess.run(["mount", "-o", "remount,ro", str(base)], check=True)
        for missing_or_not in ("new", "made"):
            with pytest.raises(wc.SocketDirError, match="read-only file system") as info:
                wc.Cache(base / missing_or_not, spawn=True)
            assert "permission" not in str(info.value).lower()
            with pytest.warns(wc.FallbackWarning, match="read-only file system"):
                handle = wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=base / missing_or_not)
            assert handle.source == "disk"
    finally:
        subprocess.run(["umount", str(base)])
        shutil.rmtree(base, ignore_errors=True)
