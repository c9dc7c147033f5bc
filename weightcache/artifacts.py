"""Compiled artifacts over the keeper, client side: a blob goes in as a sealed memfd and comes out as bytes whose
SHA-256 was checked.

:func:`put` writes a blob into a memfd, seals it and hands it to the keeper; :func:`get` reads the memfd the keeper
answers with and checks its SHA-256 against what the publisher recorded. A miss of any kind (no keeper, a keeper
too old for artifacts, no artifact for this key, a blob whose bytes do not match its SHA-256) is ``None`` plus a
reason, never an exception: whoever asked compiles as it would have. An :class:`Artifact` that is kept open holds
its memfd and a lease, and is re-published to a restarted keeper like weights are (:mod:`weightcache.republish`).

Layer L2: no torch; what a blob means is its producer's business (:mod:`weightcache.torch_compile` for
torch.compile).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from . import republish
from .artifact_key import MAX_ARTIFACT_BYTES, ArtifactKey
from .client import KeeperConnection
from .errors import InvalidArgument, KeeperUnavailable, SegmentError, WeightCacheError
from .fdcheck import REQUIRED_SEALS
from .lease import BaseLease
from .messages import ArtifactInfo
from .protocol import close_fds

log = logging.getLogger("weightcache.artifacts")

#: Bytes read from a memfd per ``pread``.
_CHUNK = 1 << 24


def sealed_memfd(data: bytes | bytearray | memoryview, name: str = "weightcache-artifact") -> tuple[int, str]:
    """A memfd holding ``data``, sealed against write, shrink and grow, and the SHA-256 of ``data``.

    Raises InvalidArgument for a blob over :data:`~weightcache.artifact_key.MAX_ARTIFACT_BYTES` and SegmentError
    when the memory cannot be had."""
    view = memoryview(data).cast("B")
    if view.nbytes > MAX_ARTIFACT_BYTES:
        raise InvalidArgument(f"an artifact holds at most {MAX_ARTIFACT_BYTES} bytes; this one has {view.nbytes}")
    sha256 = hashlib.sha256(view).hexdigest()
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise SegmentError(f"memfd_create failed: {exc}; this needs Linux >= 3.17") from exc
    try:
        if view.nbytes:
            os.ftruncate(fd, view.nbytes)
            os.posix_fallocate(fd, 0, view.nbytes)
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], done)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
    except OSError as exc:
        os.close(fd)
        raise SegmentError(
            f"cannot put a {view.nbytes}-byte artifact into shared memory: {exc} (out of memory, or /dev/shm limits?)"
        ) from exc
    return fd, sha256


def read_blob(fd: int, size: int) -> bytes:
    """The ``size`` bytes of memfd ``fd`` (SegmentError if it holds fewer)."""
    out = bytearray(size)
    view = memoryview(out)
    done = 0
    while done < size:
        n = os.preadv(fd, [view[done : done + _CHUNK]], done)
        if n <= 0:
            raise SegmentError(f"the artifact's memfd holds {done} bytes; its record says {size}")
        done += n
    return bytes(out)


def map_blob(fd: int, size: int) -> memoryview:
    """The ``size`` bytes of memfd ``fd`` mapped into this process read-only, not copied (SegmentError if it holds
    fewer). The mapping, and a duplicate of ``fd`` that Python's mmap keeps, live as long as the view and any slice
    of it; the caller may close ``fd`` at once."""
    held = os.fstat(fd).st_size
    if held < size:
        raise SegmentError(f"the artifact's memfd holds {held} bytes; its record says {size}")
    if size == 0:
        return memoryview(bytearray())
    return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))


def umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``; 0o022 where that is not there)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def write_whole(target: Path, data: bytes, mode: int = 0o644, *, within: Path | None = None) -> bool:
    """Write ``data`` at ``target`` with ``mode`` (less the umask) unless a file is there (a local file is never
    overwritten), so that a reader sees the whole file or none: written aside in the same directory, then renamed.
    Whether it was written. What restores an artifact's files (inductor's kernels, vLLM's compile cache) writes
    through this.

    With ``within``, ``target`` must lie under that directory through real directories only: a symbolic link on
    the way (one another user planted in a group-shared cache directory, say) raises ValueError before anything is
    written, and the directories it creates are this user's."""
    if within is not None:
        relative = target.parent.relative_to(within)  # ValueError for a target outside it
        within.mkdir(parents=True, exist_ok=True)
        directory = within
        for part in relative.parts:
            directory = directory / part
            if directory.is_symlink():
                raise ValueError(f"{directory} is a symbolic link; a restore writes through real directories only")
            directory.mkdir(exist_ok=True)
    if target.is_symlink() or target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=".wc-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(temporary, mode & ~umask())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return True


class ArtifactLease(BaseLease):
    """The lease of a held artifact: its connection, its memfd, and what a re-publication sends."""

    def __init__(self, connection: KeeperConnection, fd: int, info: ArtifactInfo, *, respawn: bool) -> None:
        super().__init__(connection, [fd], respawn=respawn, publisher=info.publisher)
        self.info = info

    @property
    def digest(self) -> str:
        return self.info.key

    def publish_to(self, connection: KeeperConnection, fds: list[int], *, timeout: float | None = None) -> bool:
        info = self.info
        reply = connection.put_artifact(
            info.weights, info.artifact_key, fds[0], info.bytes, info.sha256, timeout=timeout
        )
        return reply.created


class Artifact:
    """An artifact this process published or got, held open: its memfd and its lease in the keeper.

    While it is open the keeper counts it as leased (never evicted for the budget), and if the keeper restarts
    this process re-publishes it from the memfd it holds. :meth:`close` (or the end of a ``with`` block) lets go.
    An artifact another uid published is never held (the keeper leases an artifact to its publisher only): its
    :attr:`held` is False and :meth:`read` gives its bytes once.

    Attributes:
        info: what the keeper reports of it (its entry key, weights digest, key, size, SHA-256, publisher).
        created: for a publish, whether the keeper took this blob (False: it held one of this key already, and this
            process leases that one); True for a get.
        replaced: whether this publish replaced the artifact named by ``replace``.
        evicted: the keys the keeper evicted to make room for it.
    """

    def __init__(
        self,
        info: ArtifactInfo,
        lease: ArtifactLease | None,
        *,
        created: bool = True,
        replaced: bool = False,
        evicted: tuple[str, ...] = (),
        data: bytes | memoryview | None = None,
    ) -> None:
        self.info = info
        # What it was fetched with: its bytes, checked (the first read() returns them without reading again), or
        # its mapping, unchecked (fetched with check=False: the first view() returns it).
        self._data = data
        self.created = created
        self.replaced = replaced
        self.evicted = evicted
        self._lease = lease
        if lease is not None:
            republish.watch(lease)

    @property
    def key(self) -> ArtifactKey:
        return self.info.artifact_key

    @property
    def held(self) -> bool:
        """Whether this process holds the artifact and the keeper its lease now (False once closed, for one
        published without ``hold``, and while its keeper is gone)."""
        return self._lease is not None and self._lease.held

    def read(self) -> bytes | None:
        """The blob; None once closed (or never held). SegmentError if its bytes do not match its SHA-256."""
        data, self._data = self._data, None
        if isinstance(data, memoryview):  # fetched mapped and unchecked
            data = self._checked(data.tobytes())
        if data is not None and (self.held or self._lease is None):  # fetched, or another uid's: read, not held
            return data
        fds = self._lease.dup_fds() if self._lease is not None else None
        if fds is None:
            return None
        try:
            return self._checked(read_blob(fds[0], self.info.bytes))
        finally:
            close_fds(fds)

    def _checked(self, data: bytes) -> bytes:
        """``data``, once its SHA-256 is the artifact's (SegmentError otherwise)."""
        if hashlib.sha256(data).hexdigest() != self.info.sha256:
            raise SegmentError(f"artifact {self.info.key[:24]}...'s bytes do not match its SHA-256")
        return data

    def view(self) -> memoryview | None:
        """The blob mapped into this process, not copied and **not checked** against its SHA-256 (the caller checks
        what it uses, e.g. against hashes the blob carries itself); None once closed (or never held). The view
        stays valid after :meth:`close`."""
        data, self._data = self._data, None
        if data is not None and (self.held or self._lease is None):
            return data if isinstance(data, memoryview) else memoryview(data)
        fds = self._lease.dup_fds() if self._lease is not None else None
        if fds is None:
            return None
        try:
            return map_blob(fds[0], self.info.bytes)
        finally:
            close_fds(fds)

    def close(self, *, wait: bool = True) -> None:
        """Release the lease; returns once the keeper has released it (``wait``; at most
        :data:`~weightcache.client.connection.CLOSE_TIMEOUT_S`)."""
        if self._lease is not None:
            republish.forget(self._lease)
            self._lease.close(wait=wait)

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close(wait=False)  # collected anywhere: never wait on the keeper here

    def __repr__(self) -> str:
        state = "" if self.held else " (released)"
        return f"<Artifact {self.info.key[:24]} {self.info.kind} {self.info.bytes} bytes{state}>"


@attrs.frozen
class Fetched:
    """What :func:`get` found: the blob and the artifact's record (and, held, the open :class:`Artifact`)."""

    data: bytes | memoryview
    info: ArtifactInfo
    artifact: Artifact | None = None


@attrs.frozen
class Miss:
    """Why :func:`get` found nothing: ``reason`` is a sentence for a log line; ``corrupt`` the SHA-256 of a blob
    whose bytes did not match it (a publish with ``replace=corrupt`` takes its place)."""

    reason: str
    corrupt: str | None = None


def put(
    conn: KeeperConnection,
    weights: str,
    key: ArtifactKey,
    data: bytes | bytearray | memoryview,
    *,
    replace: str | None = None,
    hold: bool = False,
    respawn: bool = False,
) -> Artifact:
    """Publish ``data`` as the artifact of ``weights`` for ``key`` over ``conn``; the returned :class:`Artifact`
    says whether the keeper took it (``created``) and what it evicted for it.

    With ``hold``, the Artifact owns ``conn`` and the memfd (the caller closes the Artifact); without, it holds
    nothing, ``conn`` is left as it was and the memfd closed (the caller closes ``conn``, which ends the lease).
    Raises what the keeper refuses with (BudgetExceeded, KeeperError) and SegmentError.
    """
    size = memoryview(data).nbytes
    fd, sha256 = sealed_memfd(data)
    try:
        reply = conn.put_artifact(weights, key, fd, size, sha256, replace=replace)
    except BaseException:
        os.close(fd)
        raise
    now = time.time()
    info = ArtifactInfo(
        key=reply.key,
        weights=weights,
        artifact_key=key,
        bytes=size,
        sha256=sha256,
        publisher=os.getuid(),
        leases=1 if hold else 0,
        holders=((os.getpid(), now),) if hold else (),
        created=now,
        last_used=now,
        age_s=0.0,
    )
    lease = None
    if hold:
        lease = ArtifactLease(conn, fd, info, respawn=respawn)
    else:
        os.close(fd)
    return Artifact(info, lease, created=reply.created, replaced=reply.replaced, evicted=reply.evicted)


def get(
    conn: KeeperConnection,
    weights: str,
    key: ArtifactKey,
    *,
    trust: Sequence[int] = (),
    hold: bool = False,
    respawn: bool = False,
    check: bool = True,
) -> Fetched | Miss:
    """The artifact of ``weights`` for ``key`` over ``conn``, its bytes checked against its SHA-256, or a
    :class:`Miss` saying why not. Without ``check``, the Fetched's data is the memfd mapped (:func:`map_blob`),
    neither copied nor checked: the caller checks what it uses. Errors of the keeper or the connection propagate
    (the caller decides); a corrupt blob is a Miss (when checked). With ``hold`` (and a hit on an artifact this
    uid published), the Fetched's :class:`Artifact` owns ``conn`` and the memfd; another publisher's artifact
    comes as an :class:`Artifact` that is not held (the keeper leases artifacts to their publishers only), and
    ``conn`` stays the caller's."""
    if not conn.serves_artifacts:
        return Miss(f"the keeper speaks protocol {conn.protocol}, which holds no artifacts (restart it to upgrade)")
    reply, fd = conn.get_artifact(weights, key, trust=trust)
    if reply.artifact is None or fd is None:
        return Miss(_miss_reason(weights, key, reply.others, reply.near))
    info = reply.artifact
    data: bytes | memoryview
    try:
        data = read_blob(fd, info.bytes) if check else map_blob(fd, info.bytes)
    except BaseException:
        os.close(fd)
        raise
    actual = hashlib.sha256(data).hexdigest() if check else info.sha256
    if actual != info.sha256:
        os.close(fd)
        return Miss(
            f"artifact {info.key[:24]}... is corrupt: its {info.bytes} bytes hash to {actual[:12]}, its publisher "
            f"(uid {info.publisher}) recorded {info.sha256[:12]}; compiling instead",
            corrupt=info.sha256,
        )
    if not hold:
        os.close(fd)
        return Fetched(data, info)
    if info.publisher != os.getuid():
        # The keeper leases an artifact only to its publisher (no other uid loads its compiled code): this one is
        # read, not held, and never re-published under this uid.
        os.close(fd)
        return Fetched(data, info, Artifact(info, None, data=data))
    lease = ArtifactLease(conn, fd, info, respawn=respawn)
    return Fetched(data, info, Artifact(info, lease, data=data))


def _miss_reason(weights: str, key: ArtifactKey, others: Sequence[int], near: Sequence[ArtifactKey]) -> str:
    what = f"no {key.kind} artifact for weights {weights[:12]} and this key"
    if others:
        what += f" from a trusted publisher (uid {', '.join(map(str, others))} holds one; see trusted_publishers)"
    if near:
        differences = "; ".join(
            ", ".join(f"{name}: wanted {ours!r}, cached {theirs!r}" for name, ours, theirs in key.diff(other)[:4])
            for other in near[:3]
        )
        what += f"; {len(near)} of other keys differ ({differences})"
    return what


def connect_or_miss(socket_dir: str | os.PathLike[str] | None) -> KeeperConnection | Miss:
    """A connection to the keeper, or a Miss that says why there is none (no keeper, or it does not answer)."""
    try:
        return KeeperConnection.connect(socket_dir)
    except KeeperUnavailable as exc:
        return Miss(f"no keeper: {exc}")
    except WeightCacheError as exc:
        return Miss(f"the keeper refused the connection: {exc}")


__all__ = [
    "Artifact",
    "ArtifactLease",
    "Fetched",
    "Miss",
    "connect_or_miss",
    "get",
    "put",
    "read_blob",
    "sealed_memfd",
    "umask",
    "write_whole",
]
