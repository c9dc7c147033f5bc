"""The keeper as a real process: readiness, exclusivity, privacy, and surviving bad input."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import (
    keeper_pid,
    one_tensor_manifest,
    sealed_memfd,
    serve_detached,
    start_keeper,
    terminate_keeper,
    wait_until,
)

import weightcache as wc
from weightcache import protocol
from weightcache.client import KeeperConnection, ensure_keeper


def alive(socket_dir: Path) -> bool:
    with KeeperConnection.connect(socket_dir) as conn:
        reply, _ = conn.request({"op": "list"})
    return bool(reply["ok"])


def test_socket_dir_and_socket_are_private(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(socket_dir / "keeper.sock").st_mode) == 0o600
    assert keeper_pid(socket_dir) == keeper.pid


def test_second_keeper_refuses_to_start(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "serve", "--socket-dir", str(socket_dir)], capture_output=True, text=True
    )
    assert out.returncode == 1
    assert f"a keeper (pid {keeper.pid}) already serves" in out.stderr
    assert alive(socket_dir)


def test_stale_socket_is_detected_and_replaced(socket_dir: Path) -> None:
    socket_dir.mkdir(mode=0o700)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(socket_dir / "keeper.sock"))  # a socket file nobody listens on, as a crashed keeper leaves
    dead.close()
    with pytest.raises(wc.KeeperUnavailable, match="stale socket"):
        KeeperConnection.connect(socket_dir)
    proc = start_keeper(socket_dir)
    try:
        assert alive(socket_dir)
    finally:
        proc.terminate()
        proc.wait(10)
    assert not (socket_dir / "keeper.sock").exists(), "a stopped keeper removes its socket"


def test_unsafe_socket_dirs_are_refused() -> None:
    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    (base / "real").mkdir(mode=0o700)
    (base / "link").symlink_to(base / "real")
    with pytest.raises(wc.SocketDirError, match="symlink"):
        ensure_keeper(base / "link")
    (base / "open").mkdir(mode=0o755)
    os.chmod(base / "open", 0o755)
    with pytest.raises(wc.SocketDirError, match="chmod 700"):
        ensure_keeper(base / "open")
    if os.getuid() == 0:
        (base / "theirs").mkdir(mode=0o700)
        os.chown(base / "theirs", 65534, 65534)
        with pytest.raises(wc.SocketDirError, match="owned by uid 65534"):
            ensure_keeper(base / "theirs")
    with pytest.raises(wc.SocketDirError, match="too long|Pick a shorter"):
        ensure_keeper(base / ("x" * 120))
    shutil.rmtree(base)


def test_the_longest_socket_dir_that_passes_the_length_check_works() -> None:
    """The keeper binds a temporary name before renaming it to keeper.sock: that name must fit wherever the
    final one does (a socket path of exactly 107 bytes)."""
    from weightcache.rundir import MAX_SOCKET_PATH, SOCKET_NAME

    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    longest = base / ("d" * (MAX_SOCKET_PATH - len(f"{base}/") - len(f"/{SOCKET_NAME}")))
    assert len(str(longest / SOCKET_NAME)) == MAX_SOCKET_PATH
    try:
        ensure_keeper(longest)
        with KeeperConnection.connect(longest) as conn:
            assert conn.hello["ok"]
    finally:
        subprocess.run([sys.executable, "-m", "weightcache", "stop", "--socket-dir", str(longest)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def test_protocol_version_mismatch_is_a_clear_error(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    with pytest.raises(wc.ProtocolVersionError, match="speaks protocol 1..2, the client speaks 7..9"):
        KeeperConnection.connect(socket_dir, protocol_version=9, min_protocol_version=7)
    with pytest.raises(wc.ProtocolVersionError, match="the client speaks 0..0"):
        KeeperConnection.connect(socket_dir, protocol_version=0, min_protocol_version=0)
    assert alive(socket_dir)


def raw_exchange(socket_dir: Path, data: bytes, fds: list[int] | None = None) -> bytes:
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(socket_dir / "keeper.sock"))
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, __import__("array").array("i", fds))] if fds else []
    s.sendmsg([data], anc)
    s.shutdown(socket.SHUT_WR)
    s.settimeout(10)
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass  # the keeper closed on us with our junk still unread: a reset, not a hang
    s.close()
    return b"".join(chunks)


def frame(obj: object, nfds: int = 0) -> bytes:
    payload = json.dumps(obj).encode()
    return b"WC" + bytes([1, nfds]) + struct.pack("!I", len(payload)) + payload


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"GET / HTTP/1.1\r\n\r\n",
        b"WC\x01\x00\xff\xff\xff\xff",
        b"WC\x01\x00\x00\x00\x00\x05[1,2",
        frame({"op": "get"}),
        frame([1, 2, 3]),
        frame({"op": "hello", "protocol": "one"}),
        frame({"op": "hello", "protocol": 1}) + frame({"op": "publish", "manifest": "nope"}),
        frame({"op": "hello", "protocol": 1}) + frame({"op": "get", "digest": 5, "placement": "cpu"}),
        frame({"op": "hello", "protocol": 1}) + frame({"op": "explode"}),
        frame({"op": "hello", "protocol": 1}) + frame({"op": "evict", "digest": ""}),
        frame({"op": "hello", "protocol": 1}) + frame({"op": "inspect", "digest": "zz"}),
    ],
)
def test_keeper_survives_bad_input(socket_dir: Path, keeper: subprocess.Popen[bytes], data: bytes) -> None:
    raw_exchange(socket_dir, data)
    assert keeper.poll() is None
    assert alive(socket_dir)


def test_error_replies_say_what_is_wrong(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    reply = raw_exchange(socket_dir, frame({"op": "get", "digest": "x", "placement": "cpu"}))
    assert b"the first message must be 'hello'" in reply
    with KeeperConnection.connect(socket_dir) as conn:
        with pytest.raises(wc.KeeperError, match="unknown op 'explode'") as info:
            conn.request({"op": "explode"})
        assert info.value.code == "bad_request"
        with pytest.raises(wc.KeeperError, match="lacks the field 'placement'"):
            conn.request({"op": "get", "digest": "x"})
        assert conn.request({"op": "list"})[0]["ok"]  # the connection stays usable


def _manifest(checkpoint: Path, size: int, offset: int = 0) -> dict:
    return one_tensor_manifest(wc.Fingerprint.create(checkpoint).to_json(), size=size, offset=offset)


def test_publish_checks_fds_and_manifest(socket_dir: Path, keeper: subprocess.Popen[bytes], checkpoint: Path) -> None:
    with KeeperConnection.connect(socket_dir) as conn:
        with tempfile.TemporaryFile() as f:
            os.ftruncate(f.fileno(), 512)
            with pytest.raises(wc.KeeperError, match="expected a memfd"):
                conn.request({"op": "publish", "manifest": _manifest(checkpoint, 512)}, [f.fileno()])
        unsealed = sealed_memfd(512, seal=False)
        with pytest.raises(wc.KeeperError, match="not sealed"):
            conn.request({"op": "publish", "manifest": _manifest(checkpoint, 512)}, [unsealed])
        sealed = sealed_memfd(512)
        with pytest.raises(wc.KeeperError, match="1 segments but 2 fds"):
            conn.request({"op": "publish", "manifest": _manifest(checkpoint, 512)}, [sealed, sealed])
        with pytest.raises(wc.KeeperError, match="1 segments but 0 fds"):
            conn.request({"op": "publish", "manifest": _manifest(checkpoint, 512)})
        with pytest.raises(wc.KeeperError, match="spans bytes 500..516 of segment 0"):
            conn.request({"op": "publish", "manifest": _manifest(checkpoint, 512, offset=500)}, [sealed])
        with pytest.raises(wc.KeeperError, match="memfd holds 512 bytes; the manifest says 1024"):
            conn.request({"op": "publish", "manifest": _manifest(checkpoint, 1024)}, [sealed])
        with pytest.raises(wc.KeeperError, match="carries no fds"):
            conn.request({"op": "list"}, [sealed])
        assert conn.request({"op": "list"})[0]["entries"] == []
        reply, _ = conn.request({"op": "publish", "manifest": _manifest(checkpoint, 512)}, [sealed])
        assert reply["created"] is True
        for fd in (unsealed, sealed):
            os.close(fd)
    assert keeper.poll() is None


def test_racing_spawns_start_exactly_one_keeper(socket_dir: Path) -> None:
    code = (
        "import sys, weightcache.client as c; c.ensure_keeper(sys.argv[1]); "
        "print(c.KeeperConnection.connect(sys.argv[1]).hello['pid'])"
    )
    with ThreadPoolExecutor(16) as pool:
        outs = list(
            pool.map(
                lambda _: subprocess.run([sys.executable, "-c", code, str(socket_dir)], capture_output=True, text=True),
                range(16),
            )
        )
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs if o.returncode]
    pids = {int(o.stdout.strip()) for o in outs}
    assert len(pids) == 1
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert sum(1 for line in ps.splitlines() if "weightcache serve" in line and str(socket_dir) in line) == 1


def test_keeper_never_loads_torch(socket_dir: Path) -> None:
    ensure_keeper(socket_dir)
    pid = keeper_pid(socket_dir)
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps and "libcuda" not in maps
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=" in env


#: Run as another user: ``AS_USER uid gid groups-json action target``. Imports come first: this Python's own
#: files may not be readable by that user.
AS_USER = r"""
import hashlib, json, mmap, os, socket, struct, sys
import weightcache as wc
from weightcache.client import KeeperConnection
uid, gid, groups, action, target = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
os.setgroups(groups)
os.setgid(gid)
os.setuid(uid)
if action == "raw-hello":  # no client-side checks: only the keeper's stand in the way
    s = socket.socket(socket.AF_UNIX)
    s.connect(target)
    p = json.dumps({"op": "hello", "protocol": 1}).encode()
    try:
        s.sendall(b"WC" + bytes([1, 0]) + struct.pack("!I", len(p)) + p)
    except BrokenPipeError:
        pass  # the keeper may refuse (and close) before our hello is sent
    print(s.recv(4096)[8:].decode())
else:  # attach the one entry through the library, then try what only the owner may do
    try:
        conn = KeeperConnection.connect(target)
    except wc.WeightCacheError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
        sys.exit()
    [entry] = conn.request({"op": "list"})[0]["entries"]
    reply, fds = conn.request({"op": "get", "digest": entry["digest"], "placement": "cpu"})
    size = reply["manifest"]["segments"][0]["size"]
    out = {"sha": hashlib.sha256(mmap.mmap(fds[0], size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)[:]).hexdigest()}
    for op in ("evict", "stop"):
        try:
            conn.request({"op": op, "digest": "*", "all": True, "force": True})
        except wc.KeeperError as exc:
            out[op] = exc.code
    print(json.dumps(out))
"""


def as_user(uid: int, gid: int, groups: list[int], action: str, target: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", AS_USER, str(uid), str(gid), json.dumps(groups), action, str(target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    result: dict = json.loads(out.stdout)
    return result


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_other_uid_is_refused(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    # Open the path on purpose so that only the SO_PEERCRED check stands between the other user and the keeper.
    os.chmod(socket_dir.parent, 0o755)  # mkdtemp made it 0700
    os.chmod(socket_dir, 0o755)
    os.chmod(socket_dir / "keeper.sock", 0o666)
    reply = as_user(65534, 65534, [], "raw-hello", socket_dir / "keeper.sock")
    assert reply["ok"] is False and reply["error"] == "forbidden" and "uid 65534" in reply["message"]
    os.chmod(socket_dir, 0o700)
    assert alive(socket_dir)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_allowed_group_gets_in_and_nobody_else(checkpoint: Path) -> None:
    """`serve --allow-group`: a member (by a supplementary group) attaches but may not evict or stop; a
    non-member is kept out by the directory's permissions and, with those opened, by the keeper itself."""
    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    os.chmod(base, 0o711)
    socket_dir = base / "s"
    os.mkdir(socket_dir, 0o700)
    with pytest.raises(RuntimeError, match=r"expected uid 0 gid 4242.*chmod 2750"):
        start_keeper(socket_dir, "--allow-group", "4242")  # an existing private directory is never loosened
    os.rmdir(socket_dir)
    keeper = start_keeper(socket_dir, "--allow-group", "4242")
    try:
        st, sock = os.stat(socket_dir), os.stat(socket_dir / "keeper.sock")
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (4242, 0o2750)
        assert (sock.st_gid, stat.S_IMODE(sock.st_mode)) == (4242, 0o660)
        content = os.urandom(512)
        fd = os.memfd_create("weightcache", os.MFD_ALLOW_SEALING)
        os.write(fd, content)
        import fcntl

        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with KeeperConnection.connect(socket_dir) as conn:
            conn.request({"op": "publish", "manifest": _manifest(checkpoint, 512)}, [fd])
        os.close(fd)
        import hashlib

        member = as_user(65534, 65534, [4242], "attach", socket_dir)
        assert member == {"sha": hashlib.sha256(content).hexdigest(), "evict": "forbidden", "stop": "forbidden"}
        outsider = as_user(65533, 65533, [], "attach", socket_dir)
        assert outsider["error"] == "SocketDirError" and "owned by uid 0" in outsider["message"]
        os.chmod(socket_dir, 0o2755)  # open the path: the keeper's own check must still refuse
        os.chmod(socket_dir / "keeper.sock", 0o666)
        reply = as_user(65533, 65533, [], "raw-hello", socket_dir / "keeper.sock")
        assert reply["error"] == "forbidden" and "serves uid 0 and group 4242 only" in reply["message"]
        os.chmod(socket_dir, 0o2750)
        assert keeper.poll() is None and len(wc.Cache(socket_dir).entries()) == 1
    finally:
        terminate_keeper(keeper)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown")
def test_a_shared_directory_is_trusted_only_when_named() -> None:
    from weightcache.rundir import check_socket_dir

    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    shared = base / "s"
    shared.mkdir()
    os.chown(shared, 65534, os.getgid())
    os.chmod(shared, 0o2750)
    try:
        with pytest.raises(wc.SocketDirError, match="never as a default location"):
            check_socket_dir(shared, explicit=False)  # e.g. /tmp/weightcache-<uid> squatted by another user
        assert check_socket_dir(shared, explicit=True) == (65534, os.getgid())
        os.chmod(shared, 0o2770)  # group-writable: any member could plant a socket
        with pytest.raises(wc.SocketDirError, match="expected 2750"):
            check_socket_dir(shared, explicit=True)
    finally:
        shutil.rmtree(base)


def test_stop(socket_dir: Path) -> None:
    ensure_keeper(socket_dir)
    pid = keeper_pid(socket_dir)
    wc.Cache(socket_dir).stop()
    assert wait_until(lambda: not (socket_dir / "keeper.sock").exists())
    with pytest.raises(wc.KeeperUnavailable):
        KeeperConnection.connect(socket_dir)
    assert pid


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """Send ``sig`` to thread ``tid`` of process ``pid`` (Linux's tgkill; os.kill would reach the main thread)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(234, pid, tid, sig) != 0:  # SYS_tgkill on x86-64
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {sig})")


def test_a_stop_signal_that_reaches_a_connection_thread_still_stops_the_keeper(socket_dir: Path) -> None:
    """The kernel may deliver a process's SIGTERM to any of its threads; Python runs the handler on the main thread,
    which waits in select() for connections. Whichever thread the signal reaches, the keeper stops."""
    keeper = start_keeper(socket_dir)
    try:
        with KeeperConnection.connect(socket_dir) as conn:  # a connection: a thread of its own in the keeper
            threads = sorted(int(t) for t in os.listdir(f"/proc/{keeper.pid}/task") if int(t) != keeper.pid)
            assert threads, "the keeper serves a connection on a thread of its own"
            _tgkill(keeper.pid, threads[-1], 15)
            assert keeper.wait(10) == 0
            assert conn.peer_closed()
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait(10)
    assert not (socket_dir / "keeper.sock").exists(), "a stopped keeper removes its socket"


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_keeper_serves_on(socket_dir: Path) -> None:
    keeper = start_keeper(socket_dir)
    try:
        with KeeperConnection.connect(socket_dir):
            keeper.send_signal(10)  # SIGUSR1
            assert alive(socket_dir)
        keeper.terminate()
        assert keeper.wait(10) == 0
        assert keeper.stderr is not None
        log = keeper.stderr.read().decode()
        assert log.count("hread 0x") >= 2 and "in serve_forever" in log and "in _serve" in log, log
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait(10)


_ = protocol


def test_before_hello_frames_are_small(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    reply = raw_exchange(socket_dir, b"WC\x01\x00" + struct.pack("!I", 1 << 20))
    assert b"limit here is 65536" in reply
    assert alive(socket_dir)


def test_wrongly_typed_manifest_columns(socket_dir: Path, keeper: subprocess.Popen[bytes], checkpoint: Path) -> None:
    manifest = _manifest(checkpoint, 512)
    manifest["tensors"]["dtype"] = [["x"]]
    fd = sealed_memfd(512)
    with KeeperConnection.connect(socket_dir) as conn:
        with pytest.raises(wc.KeeperError, match="dtype"):
            conn.request({"op": "publish", "manifest": manifest}, [fd])
        manifest = _manifest(checkpoint, 1000)
        with pytest.raises(wc.KeeperError, match="multiple of 512"):
            conn.request({"op": "publish", "manifest": manifest}, [fd])
        manifest = _manifest(checkpoint, 512)
        manifest["segments"][0]["kind"] = "cuda_vmm"  # a GPU segment kind on the placement cpu
        with pytest.raises(wc.KeeperError, match="has kind 'cuda_vmm'; expected 'memfd'"):
            conn.request({"op": "publish", "manifest": manifest}, [fd])
    os.close(fd)
    assert alive(socket_dir)


def test_publishing_an_existing_entry_takes_a_lease(
    socket_dir: Path, keeper: subprocess.Popen[bytes], checkpoint: Path
) -> None:
    """Two clients re-publishing the same entry (after a keeper restart): one entry, two leases, no error."""
    first_fd, second_fd = sealed_memfd(512), sealed_memfd(512)
    with KeeperConnection.connect(socket_dir) as a, KeeperConnection.connect(socket_dir) as b:
        assert a.request({"op": "publish", "manifest": _manifest(checkpoint, 512)}, [first_fd])[0]["created"]
        assert not b.request({"op": "publish", "manifest": _manifest(checkpoint, 512)}, [second_fd])[0]["created"]
        reply, _ = a.request({"op": "list"})
        [entry] = reply["entries"]
        assert entry["leases"] == 2 and [h["pid"] for h in entry["holders"]] == [os.getpid()] * 2
        held = [c for c in reply["clients"] if c["entries"]]
        assert len(held) == 2 and all(c["entries"] == [entry["key"]] and c["pid"] == os.getpid() for c in held)
        assert all(c["since"] <= entry["created"] + 1 for c in reply["clients"])
    os.close(first_fd)
    os.close(second_fd)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another group")
def test_spawning_in_own_shared_directory_keeps_it_shared(socket_dir: Path) -> None:
    first = start_keeper(socket_dir, "--allow-group", "4242")
    first.kill()  # a crash: after a deliberate stop nothing starts a keeper by itself
    first.wait(10)
    ensure_keeper(socket_dir)  # e.g. mode daemon, or a client re-publishing after a crash
    sock = os.stat(socket_dir / "keeper.sock")
    assert (sock.st_gid, stat.S_IMODE(sock.st_mode)) == (4242, 0o660)
    assert stat.S_IMODE(os.stat(socket_dir).st_mode) == 0o2750


def test_an_idle_connection_without_a_lease_is_dropped(socket_dir: Path) -> None:
    """Issue 22, finding 3: a connection that said hello and then sits holding no lease is dropped after
    --idle-timeout; one that holds a lease stays (it is an engine's lease)."""
    import hostile

    proc = start_keeper(socket_dir, "--idle-timeout", "1")
    try:
        fingerprint = _fingerprint()
        idle = KeeperConnection.connect(socket_dir)
        leasing = KeeperConnection.connect(socket_dir)
        hostile.publish(leasing, fingerprint, 1)
        assert wait_until(idle.peer_closed, timeout=5)
        assert not leasing.peer_closed()
        assert len(leasing.list().entries) == 1
        idle.close()
        leasing.close()
    finally:
        proc.terminate()
        proc.wait(10)


def _fingerprint() -> dict:
    """A real fingerprint's JSON (of a checkpoint made for it and removed again: only the JSON is used)."""
    from conftest import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="wc-ckpt-") as directory:
        return wc.Fingerprint.create(make_checkpoint(directory)).to_json()


def test_a_peer_must_read_a_reply_before_its_next_request(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    """Issue 22, finding 3: requests sent without reading the replies (which would pile up replies, and the fds
    they carry, in the keeper's socket) end the connection after the first reply."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(socket_dir / "keeper.sock"))
    hello = {"op": "hello", "protocol": 1}
    s.sendall(frame(hello))
    s.recv(65536)
    s.sendall(frame({"op": "list"}) * 20)
    time.sleep(1)  # read nothing meanwhile: the keeper finds the first reply unread when the second request comes
    s.settimeout(10)
    received = b""
    with contextlib.suppress(ConnectionResetError):  # it closed with our requests unread: a reset
        while chunk := s.recv(1 << 20):
            received += chunk
    s.close()
    assert received.count(b'"ok":true') <= 1  # at most one reply, then the keeper closed the connection
    assert alive(socket_dir)


def test_list_replies_stay_bounded_however_large_the_entries(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    """Issue 22, finding 3: ``list`` answers in pages of at most 4 MiB of entries; Cache.entries(), ``ls`` and
    ``ls --json`` still see every entry, and listing costs the keeper little memory."""
    import hostile
    from test_keeper_fuzz import keeper_status

    fingerprint = _fingerprint()
    with KeeperConnection.connect(socket_dir) as conn:
        for i in range(40):  # 40 entries of ~250 KiB of fingerprint each: ~10 MiB in all
            hostile.publish(conn, {**fingerprint, "extra": json.dumps({"i": i, "pad": "x" * 250_000})}, 1)
        before = keeper_status(keeper.pid, "VmRSS")
        sizes = []
        for _ in range(4):
            reply, _ = conn.request({"op": "list"})
            sizes.append(len(json.dumps(reply)))
            assert reply.get("next")
        grown = keeper_status(keeper.pid, "VmRSS") - before
    assert max(sizes) <= 4 * 2**20 + 64 * 1024, sizes  # messages.LIST_PAGE_BYTES and the rest
    assert grown < 32 * 1024, f"the keeper grew by {grown} KiB"
    assert len(wc.Cache(socket_dir).entries()) == 40
    for extra in ([], ["--json"]):
        out = subprocess.run(
            [sys.executable, "-m", "weightcache", "ls", "--socket-dir", str(socket_dir), *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["entries"]) == 40


def test_a_connection_over_the_share_is_told_busy_never_broken_pipe(socket_dir: Path) -> None:
    """Issue 33, finding 8: the keeper answers a connection it does not admit and closes it at once, often before
    the client's hello arrives; the client then saw ``KeeperUnavailable: ... Broken pipe`` (21 of 36 times here)
    instead of the refusal waiting in its socket. It reads the refusal: busy, saying why."""
    serve_detached(socket_dir, "--max-connections", "4")
    held = [KeeperConnection.connect(socket_dir) for _ in range(4)]
    try:
        for _ in range(30):
            with pytest.raises(wc.KeeperError) as refused:
                KeeperConnection.connect(socket_dir)
            assert refused.value.code == "busy" and "connections" in str(refused.value), refused.value
    finally:
        for conn in held:
            conn.close()


def _hundred_segments(cache: wc.Cache, checkpoint: Path) -> wc.Fingerprint:
    """An entry of 100 segments (one 512-byte tensor each), published and its lease let go."""
    import torch

    fp = wc.Fingerprint.create(checkpoint)
    state = {f"t{i:03}": torch.full((128,), float(i)) for i in range(100)}
    cache.put(fp, state, max_segment_bytes=512, digests=False).close()
    return fp


def test_a_read_reply_frees_what_it_held_though_no_request_follows(socket_dir: Path, checkpoint: Path) -> None:
    """A ``get``'s segment fds count against the uid's share of reply fds until the reply is read; an engine reads
    it and then sends nothing for as long as it holds the entry. The reservation ended only at the connection's
    next request, so a few engines holding a many-segment entry filled the share and every later ``get`` was
    refused ``busy`` (here: an open-file limit of 2048 gives the owner 250 reply fds; the third get failed)."""
    keeper = start_keeper(socket_dir, nofile=2048)
    try:
        cache = wc.Cache(socket_dir)
        fp = _hundred_segments(cache, checkpoint)
        handles = [cache.get(fp) for _ in range(5)]  # 500 segment fds handed out, each reply read at once
        assert all(h is not None and len(h.tensors) == 100 for h in handles)
        assert cache.entries()[0].leases == 5
        for h in handles:
            assert h is not None
            h.close()
    finally:
        terminate_keeper(keeper)


@pytest.mark.slow
def test_a_reply_never_read_ends_the_connection_after_the_deadline(socket_dir: Path, checkpoint: Path) -> None:
    """A peer that asks for an entry and never reads the reply (its fds held in the socket) is dropped after the
    send deadline (30 s), which releases its lease and what the reply held (it stayed forever)."""
    from weightcache.keeper.server import SEND_TIMEOUT_S

    keeper = start_keeper(socket_dir)
    try:
        cache = wc.Cache(socket_dir)
        fp = _hundred_segments(cache, checkpoint)
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(socket_dir / "keeper.sock"))
        s.sendall(frame({"op": "hello", "protocol": 1}))
        s.recv(65536)
        s.sendall(frame({"op": "get", "digest": fp.digest, "placement": fp.placement}))
        assert wait_until(lambda: cache.entries()[0].leases == 1, 10)  # the get took its lease; nothing read
        assert wait_until(lambda: cache.entries()[0].leases == 0, SEND_TIMEOUT_S + 15)
        s.close()
        assert alive(socket_dir)
    finally:
        terminate_keeper(keeper)


def test_a_keeper_ended_by_an_error_leaves_no_stopped_marker(tmp_path: Path) -> None:
    """``keeper.stopped`` tells clients the keeper was stopped on purpose (and nothing starts another by itself);
    a keeper that ends of an unexpected error is a crash to them: it leaves no marker, so mode-daemon engines
    start a keeper and re-publish (it left one, and a crash looked like a deliberate stop). The error is injected
    into the accept loop of a keeper run in a child process."""
    import textwrap

    socket_dir = Path(tempfile.mkdtemp(prefix="wc-"))
    script = textwrap.dedent(
        f"""
        import sys
        from weightcache.keeper import daemon, server

        def broken(self):
            raise RuntimeError("an unexpected error in the accept loop")

        server.Server.serve_forever = broken
        try:
            daemon.serve({str(socket_dir)!r})
        except RuntimeError:
            sys.exit(3)
        """
    )
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 3, out.stderr
        assert not (socket_dir / "keeper.stopped").exists()
        assert not (socket_dir / "keeper.sock").exists()  # its socket is still removed
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
