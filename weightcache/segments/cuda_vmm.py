"""GPU segments: CUDA VMM allocations shared as POSIX fds, through NVIDIA's ``cuda-bindings``.

A publisher creates physical memory with ``cuMemCreate`` (requesting the POSIX-fd handle type, which cannot be
added later), maps it read-write into its own address space, copies tensors in, synchronises, unmaps, and
exports the fd. The keeper only holds that fd: it never creates a CUDA context. A client imports the fd,
reserves address space, maps it and sets *read-only* access, so an engine cannot corrupt weights others use;
a write through an attached tensor faults in the writer alone.

Memory lives while any fd, allocation handle or mapping of it lives, in any process; a mapped base tensor owns
its mapping (see :class:`_Mapping`) and unmaps it when the last view of it is collected.

Segments are placed by GPU UUID (``"GPU-<uuid>"``), never by index: ``CUDA_VISIBLE_DEVICES`` differs from
process to process, the UUID does not.

Where the GPU supports GPUDirect RDMA on VMM allocations, segments are also created RDMA-capable
(``allocFlags.gpuDirectRDMACapable``; see :func:`rdma_capable`): a NIC can register a VMM allocation only if it
was created so, and like the handle type the flag cannot be added later. Nothing uses it yet; it is there so that
a keeper can one day serve the segments it already holds to another node's keeper.

What a received VMM fd must be is :func:`weightcache.fdcheck.verify_cuda_vmm`'s (the keeper checks it without
torch or CUDA). ``cuda-bindings`` is imported on first use (a CPU-only install lacks it), by publishers only:
a client maps received segments through the few ctypes declarations of :mod:`weightcache.segments.cuda_import`,
so that a restarted engine does not pay for importing it (cuda-bindings remains the fallback).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch

from ..errors import SegmentError
from ..manifest import SegmentInfo
from . import cuda_import
from .base import Segment, Transport
from .dense import dense_bytes

#: Where a client maps an entry's segments when the driver gives it that range: every entry has a home of
#: :data:`HOME_SLOT` bytes in a window of :data:`HOME_SLOTS` slots from :data:`HOME_BASE`, picked by its digest, and
#: its segments lie there one after the other. So every process that attaches an entry gets the weights at the same
#: addresses (what a CUDA graph recorded in one process needs in the next: :mod:`weightcache.graphs`). The address
#: is a hint the driver may not honour, and two entries of one process may share a slot: such a segment is mapped
#: where the driver puts it, as before, and :func:`home_ranges` leaves it out.
HOME_BASE = 0x5000_0000_0000
HOME_SLOT = 256 << 30
HOME_SLOTS = 64
#: Address space reserved at a home for a segment of any smaller size: the driver on an H200 (580.159.04) placed
#: reservations of 2 and 64 MiB elsewhere whatever address they asked for, and gave those of 512 MiB to 64 GiB the
#: address asked (``benchmarks/graph_restore.py probe-va``).
HOME_RESERVE = 4 << 30

_lock = threading.Lock()
_homes: dict[int, tuple[str, int]] = {}  # address of a segment mapped at its home -> (range name, size)
_placements: dict[str, int] = {}
_rdma: dict[int, bool] = {}  # device index -> GPUDirect RDMA with VMM supported, queried once per device


def _driver() -> Any:
    try:
        from cuda.bindings import driver  # lazy: a CPU-only install has no cuda-bindings
    except ImportError as exc:
        raise SegmentError(
            "CUDA segments need NVIDIA's cuda-bindings: pip install 'cuda-bindings>=12.8' (matching your driver), or "
            "install weightcache with its cuda extra from a clone: pip install '.[cuda]'"
        ) from exc
    return driver


def _check(result: tuple[Any, ...], what: str) -> Any:
    cu = _driver()
    err = result[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        name = err.name if hasattr(err, "name") else str(err)
        raise SegmentError(f"{what} failed: {name}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def home_addresses(entry: str, sizes: Sequence[int]) -> list[int]:
    """The home address of each segment of the entry whose digest is ``entry`` (0 for none: an entry larger
    than :data:`HOME_SLOT`, or a digest that is no hex). Each segment takes at least :data:`HOME_RESERVE` bytes
    of the slot."""
    try:
        slot = int(entry[:16], 16) % HOME_SLOTS
    except ValueError:
        return [0] * len(sizes)
    if sum(max(size, HOME_RESERVE) for size in sizes) > HOME_SLOT:
        return [0] * len(sizes)
    at, homes = HOME_BASE + slot * HOME_SLOT, []
    for size in sizes:
        homes.append(at)
        at += max(size, HOME_RESERVE)
    return homes


def home_ranges() -> list[tuple[str, int, int]]:
    """``(name, address, size)`` of every segment this process has mapped at its home address now: the weights
    a recorded CUDA graph may point at. ``size`` is the address space reserved there (at least
    :data:`HOME_RESERVE`; ``cuPointerGetAttribute`` reports a pointer's range as its reservation). Names are
    ``weights/<digest[:16]>/<segment index>``."""
    with _lock:
        return sorted((name, address, size) for address, (name, size) in _homes.items())


def placement_of(index: int) -> str:
    """``"GPU-<uuid>"`` of the torch device ``cuda:index``."""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def device_index(placement: str) -> int:
    """The torch device index, in this process, of the GPU with that UUID; SegmentError if it is not visible."""
    with _lock:
        if placement in _placements:
            return _placements[placement]
    if not torch.cuda.is_available():
        raise SegmentError(f"segment is on {placement} but this process sees no CUDA device")
    seen = []
    for i in range(torch.cuda.device_count()):
        p = placement_of(i)
        seen.append(p)
        with _lock:
            _placements[p] = i
        if p == placement:
            return i
    raise SegmentError(
        f"segment is on {placement}, which this process cannot see (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; visible: {', '.join(seen) or 'none'}). Attach "
        "from a process that sees that GPU."
    )


def _location(index: int) -> Any:
    cu = _driver()
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = index
    return loc


@contextlib.contextmanager
def _on_device(index: int) -> Iterator[None]:
    """Make torch's primary context of ``index`` current on this thread for the driver calls inside, and
    restore the caller's current device afterwards."""
    torch.cuda.init()  # type: ignore[no-untyped-call]
    with torch.cuda.device(index):
        torch.cuda.current_stream(index)  # the primary context exists from here on
        yield


def rdma_capable(index: int) -> bool:
    """Whether the GPU ``cuda:index`` supports GPUDirect RDMA on VMM allocations
    (``CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED``), so that the segments created on it are
    RDMA-capable: a NIC can register them, which the flag given to ``cuMemCreate`` decides once and for all.

    Asked once per device and remembered. A query that fails (a driver or cuda-bindings too old to know the
    attribute) counts as not supported: segments are then created without the flag, as before, and work the same
    on this node.
    """
    with _lock:
        if index in _rdma:
            return _rdma[index]
    cu = _driver()
    if cu.cuInit(0)[0] != cu.CUresult.CUDA_SUCCESS:
        return False  # not remembered: a driver that cannot start says nothing about the device
    supported = _device_attribute(cu, index, "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED")
    with _lock:
        _rdma[index] = supported
    return supported


def _device_attribute(cu: Any, index: int, name: str) -> bool:
    """A yes/no attribute of device ``index``; False when cuda-bindings lacks it or the driver refuses it."""
    attribute = getattr(cu.CUdevice_attribute, name, None)
    if attribute is None:
        return False
    err, device = cu.cuDeviceGet(index)
    if err != cu.CUresult.CUDA_SUCCESS:
        return False
    err, value = cu.cuDeviceGetAttribute(attribute, device)
    return err == cu.CUresult.CUDA_SUCCESS and bool(value)


def granularity(index: int) -> int:
    """The recommended granularity, in bytes, of segments created on ``cuda:index`` (a segment's size is a
    multiple of it)."""
    return _granularity(_allocation_prop(index))


def _granularity(prop: Any) -> int:
    cu = _driver()
    return int(
        _check(
            cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
            "cuMemGetAllocationGranularity",
        )
    )


def _allocation_prop(index: int) -> Any:
    """What ``cuMemCreate`` is asked for on ``cuda:index`` (the granularity is asked of the same): pinned device
    memory exportable as a POSIX fd, and RDMA-capable where the device supports it."""
    cu = _driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _location(index)
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if rdma_capable(index):
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


class _Mapping:
    """Owns one virtual mapping of a VMM allocation; exposes it to torch via ``__cuda_array_interface__``.

    ``torch.as_tensor(mapping)`` keeps this object alive for as long as the tensor or any view of it lives;
    when the last one goes, this object is collected and unmaps and frees the address range.
    """

    def __init__(
        self,
        ptr: int,
        size: int,
        index: int,
        driver: cuda_import.Driver | None = None,
        home: str = "",
        reserved: int = 0,
    ) -> None:
        self.ptr = ptr
        self.size = size
        self.reserved = max(size, reserved)  # address space reserved at ptr (more than size at a home)
        self.index = index
        self._ctypes = driver  # the ctypes driver that mapped it, or None: cuda-bindings did
        self._home = home
        if home:
            with _lock:
                # the whole reservation: the driver reports a pointer's range as the reservation it lies in
                _homes[ptr] = (home, self.reserved)
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "stream": None,
        }

    def release(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            if self._home:
                with _lock:
                    _homes.pop(ptr, None)
            if self._ctypes is not None:
                self._ctypes.unmap_and_free(ptr, self.size, self.reserved)
                return
            cu = _driver()
            cu.cuMemUnmap(ptr, self.size)
            cu.cuMemAddressFree(ptr, self.reserved)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


def _map(handle: Any, size: int, index: int, read_only: bool, address: int = 0, reserve: int = 0) -> tuple[int, bool]:
    """Reserve ``max(size, reserve)`` bytes of address space (asking for ``address``, a hint), map ``handle`` at its
    start and set access. Returns (pointer, mapped read-only)."""
    cu = _driver()
    reserved = max(size, reserve)
    result = cu.cuMemAddressReserve(reserved, 0, address, 0)
    if result[0] != cu.CUresult.CUDA_SUCCESS and address:
        result = cu.cuMemAddressReserve(reserved, 0, 0, 0)
    ptr = int(_check(result, "cuMemAddressReserve"))
    try:
        _check(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    except SegmentError:
        cu.cuMemAddressFree(ptr, reserved)
        raise
    desc = cu.CUmemAccessDesc()
    desc.location = _location(index)
    flags = cu.CUmemAccess_flags
    for ro in (True, False) if read_only else (False,):
        desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if ro else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        err = cu.cuMemSetAccess(ptr, size, [desc], 1)[0]
        if err == cu.CUresult.CUDA_SUCCESS:
            return ptr, ro
    cu.cuMemUnmap(ptr, size)
    cu.cuMemAddressFree(ptr, reserved)
    raise SegmentError(f"cuMemSetAccess failed: {err}")


class CudaVmmSegment(Segment):
    """A VMM allocation being filled by the publisher (mapped read-write in this process until sealed).

    :attr:`rdma_capable` says whether it was created with the GPUDirect RDMA flag (see :func:`rdma_capable`).
    """

    kind: ClassVar[str] = "cuda_vmm"
    #: Whether the allocation was created RDMA-capable (``allocFlags.gpuDirectRDMACapable``).
    rdma_capable: bool

    def __init__(self, size: int, placement: str) -> None:
        self.index = device_index(placement)
        with _on_device(self.index):
            self._create(size, placement)

    def _create(self, size: int, placement: str) -> None:
        cu = _driver()
        prop = _allocation_prop(self.index)
        gran = _granularity(prop)  # asked of the very properties cuMemCreate gets below, RDMA flag included
        size = -(-size // gran) * gran
        super().__init__(size, placement)
        self.rdma_capable = bool(prop.allocFlags.gpuDirectRDMACapable)
        self._fd = -1
        self._mapping: _Mapping | None = None
        self._base: torch.Tensor | None = None
        try:
            self._handle = _check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
        except SegmentError as exc:
            free, total = torch.cuda.mem_get_info(self.index)
            raise SegmentError(
                f"cannot allocate a {size / 2**30:.2f} GiB segment on {placement}: {exc} ({free / 2**30:.2f} of "
                f"{total / 2**30:.2f} GiB free). Free GPU memory or evict entries (`weightcache evict`)."
            ) from exc
        try:
            ptr, _ = _map(self._handle, size, self.index, read_only=False)
            self._mapping = _Mapping(ptr, size, self.index)
            self._base = torch.as_tensor(self._mapping, device=f"cuda:{self.index}")
            self._fd = int(
                _check(
                    cu.cuMemExportToShareableHandle(
                        self._handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                    ),
                    "cuMemExportToShareableHandle",
                )
            )
        except BaseException:
            self.close()
            raise
        self._sealed = False

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        if self._sealed or self._base is None:
            raise SegmentError("segment is sealed; it cannot be written any more")
        data = dense_bytes(tensor)
        n = data.numel()
        if offset < 0 or offset + n > self.size:
            raise SegmentError(f"write of {n} bytes at {offset} overflows a {self.size}-byte segment")
        if n:
            self._base[offset : offset + n].copy_(data, non_blocking=data.is_pinned())

    def destination(self, offset: int, nbytes: int) -> torch.Tensor:
        """A writable ``uint8`` view of ``nbytes`` at ``offset``, for loaders that stream straight in."""
        if self._sealed or self._base is None:
            raise SegmentError("segment is sealed; it cannot be written any more")
        if offset < 0 or offset + nbytes > self.size:
            raise SegmentError(f"{nbytes} bytes at {offset} overflow a {self.size}-byte segment")
        return self._base[offset : offset + nbytes]

    def seal(self) -> None:
        if self._sealed:
            return
        torch.cuda.synchronize(self.index)
        # Drop our read-write mapping: from here on nobody can write the segment (clients map it read-only).
        self._base = None
        if self._mapping is not None:
            self._mapping.release()
            self._mapping = None
        self._sealed = True

    def close(self) -> None:
        self._base = None
        if self._mapping is not None:
            self._mapping.release()
            self._mapping = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        handle = getattr(self, "_handle", None)
        if handle is not None:
            self._handle = None
            _driver().cuMemRelease(handle)


class CudaVmmTransport(Transport):
    kind: ClassVar[str] = "cuda_vmm"
    alignment: ClassVar[int] = 512

    def create(self, size: int, placement: str) -> CudaVmmSegment:
        return CudaVmmSegment(size, placement)

    def map(self, fd: int, info: SegmentInfo) -> torch.Tensor:
        return self.map_checked(fd, info)[0]

    def map_all(self, fds: Sequence[int], infos: Sequence[SegmentInfo], entry: str = "") -> list[torch.Tensor]:
        """Each segment at its home address (:func:`home_addresses`) where the driver gives it, else anywhere."""
        homes = home_addresses(entry, [info.size for info in infos]) if entry else [0] * len(infos)
        names = [f"weights/{entry[:16]}/{i}" for i in range(len(infos))]

        def one(args: tuple[int, SegmentInfo, int, str]) -> torch.Tensor:
            return self.map_checked(args[0], args[1], args[2], args[3])[0]

        jobs = list(zip(fds, infos, homes, names))
        threads = min(len(fds), map_threads())
        if threads <= 1:
            return [one(job) for job in jobs]
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weightcache-map") as pool:
            return list(pool.map(one, jobs))

    def map_checked(self, fd: int, info: SegmentInfo, address: int = 0, name: str = "") -> tuple[torch.Tensor, bool]:
        """:meth:`map`, also saying whether the mapping is read-only (False when ``WEIGHTCACHE_CUDA_WRITABLE``
        asked for writable mappings, or the driver refused read-only access and the segment was mapped
        read-write instead). With ``address``, the mapping is asked for there; if it lands there, it counts among
        :func:`home_ranges` as ``name``."""
        index = device_index(info.placement)
        drv = cuda_import.driver()  # ctypes: importing cuda-bindings would cost a restarted engine 10-15 ms
        reserve = HOME_RESERVE if address else 0
        with _on_device(index):
            if drv is not None:
                try:
                    ptr, read_only = cuda_import.map_fd(
                        drv, fd, info.size, index, read_only_mappings(), address, reserve
                    )
                except cuda_import.DriverError as exc:
                    raise SegmentError(f"cannot map a segment of {info.placement}: {exc}") from exc
                home = name if address and ptr == address and name else ""
                mapping = _Mapping(ptr, info.size, index, drv, home, reserve)
                return torch.as_tensor(mapping, device=f"cuda:{index}"), read_only
            cu = _driver()
            handle = _check(
                cu.cuMemImportFromShareableHandle(
                    fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                ),
                "cuMemImportFromShareableHandle",
            )
            try:
                ptr, read_only = _map(handle, info.size, index, read_only_mappings(), address, reserve)
            finally:
                cu.cuMemRelease(handle)  # the mapping holds the memory from here on
            home = name if address and ptr == address and name else ""
            mapping = _Mapping(ptr, info.size, index, home=home, reserved=reserve)
            return torch.as_tensor(mapping, device=f"cuda:{index}"), read_only


def map_threads() -> int:
    """Threads that map one entry's segments (``WEIGHTCACHE_CUDA_MAP_THREADS``, default 1: one after the other).
    The driver calls run without the GIL; whether the driver maps in parallel is for the benchmark to show."""
    try:
        return max(1, int(os.environ.get("WEIGHTCACHE_CUDA_MAP_THREADS", "1")))
    except ValueError:
        return 1


def read_only_mappings() -> bool:
    """Clients map segments read-only unless ``WEIGHTCACHE_CUDA_WRITABLE=1`` (for engines that must patch
    weights in place; they then also change what every other client sees)."""
    return os.environ.get("WEIGHTCACHE_CUDA_WRITABLE", "") not in ("1", "true", "yes")
