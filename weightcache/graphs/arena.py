"""A range of GPU virtual addresses at a fixed base, from which a graph's memory comes at the same addresses in every
process (issue 31).

A restored graph's arguments point at its inputs, activations and pool. On an H200 a fresh process could not have
torch's own segments at their old addresses again (docs/architecture.md): the driver placed most of them elsewhere.
An :class:`Arena` instead reserves one range at a base the caller names (``cuMemAddressReserve`` with that address:
a hint, so what the driver returned is checked and anything else refused), maps physical memory into it on demand in
granularity-sized chunks (``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``; or, :meth:`Arena.map_ahead`, as far as
a restore will reach, before it), and hands out allocations with a bump pointer: the same sequence of requests
gets the same addresses in every process that got the base. Memory is never reused (a graph's memory lives as long
as its graphs); :meth:`Arena.free` only counts. The range it covers is :meth:`Arena.range`, what
:mod:`~weightcache.graphs.check` compares between the recording and the restoring process.

The driver calls are :class:`ArenaDriver`'s; :class:`CudaArenaDriver` makes them through cuda-bindings, on the
calling thread's current context. :class:`~weightcache.torch_graphs.GraphCache` serves torch's graph pool from one.
On an H200 (driver 580.159.04) the driver gave a fresh process :data:`DEFAULT_BASE` for a 64 GiB arena, and placed
ranges of 2 and 64 MiB elsewhere whatever base they asked for (512 MiB and more got theirs): give an arena at least
512 MiB of address space.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import GraphRestoreError
from .check import AddressRange

#: Where an arena is asked for when the caller names no base: high in the 47-bit user address space, away from
#: where the driver placed torch's segments on the H200 (0x7f..), the host's mappings and the weights' homes
#: (:data:`weightcache.segments.cuda_vmm.HOME_BASE`, 16 TiB below it). A fresh process got it on the H200.
DEFAULT_BASE = 0x6000_0000_0000
#: Every allocation starts at a multiple of this (torch's caching allocator asks for 512-byte aligned blocks).
ALIGNMENT = 512


class ArenaDriver(Protocol):
    """The VMM calls an :class:`Arena` makes. Errors raise :class:`~weightcache.errors.GraphRestoreError`."""

    def granularity(self, device: int) -> int:
        """The allocation granularity on ``device``: chunk sizes and the base are multiples of it."""
        ...

    def reserve(self, size: int, base: int) -> int:
        """Reserve ``size`` bytes of address space asking for ``base``; returns where the driver put them."""
        ...

    def create(self, size: int, device: int) -> int:
        """``size`` bytes of physical memory on ``device``; returns its handle."""
        ...

    def map(self, address: int, size: int, handle: int, device: int) -> None:
        """Map ``handle`` at ``address`` and give ``device`` read-write access."""
        ...

    def unmap(self, address: int, size: int) -> None:
        """Undo a :meth:`map` (errors ignored)."""
        ...

    def release(self, handle: int) -> None:
        """Release physical memory (errors ignored)."""
        ...

    def free_address(self, address: int, size: int) -> None:
        """Free a reservation (errors ignored)."""
        ...


class Arena:
    """``size`` bytes of address space at ``base`` on ``device``, named ``name`` (see the module's text).

    Raises :class:`~weightcache.errors.GraphRestoreError` when the driver does not give exactly ``base`` (the
    reservation it gave is freed), or when ``base`` or ``size`` is not a multiple of the device's granularity."""

    def __init__(self, driver: ArenaDriver, name: str, size: int, device: int = 0, base: int = DEFAULT_BASE) -> None:
        self._driver = driver
        self.name = name
        self.device = device
        self.chunk = driver.granularity(device)
        if size <= 0 or size % self.chunk or base % self.chunk:
            raise GraphRestoreError(
                f"arena {name!r}: base {base:#x} and size {size} must be positive multiples of the granularity "
                f"({self.chunk} bytes on cuda:{device})"
            )
        got = driver.reserve(size, base)
        if got != base:
            driver.free_address(got, size)
            raise GraphRestoreError(
                f"arena {name!r}: asked the driver for {size} bytes of address space at {base:#x} and got "
                f"{got:#x}; graph memory cannot be had at its recorded addresses here, so graphs are captured"
            )
        self.base = base
        self.size = size
        self.used = 0  # the bump pointer: bytes handed out, alignment included
        self.mapped = 0  # bytes of the range backed by physical memory
        self.freed = 0  # bytes given back (never reused)
        self._chunks: list[tuple[int, int, int]] = []  # (address, size, handle)

    def range(self) -> AddressRange:
        """The addresses this arena covers, for :func:`~weightcache.graphs.check.restore_problems`."""
        return AddressRange(self.name, self.base, self.size)

    def allocate(self, size: int) -> int:
        """``size`` bytes at the next :data:`ALIGNMENT`-aligned offset, mapped; their address. Raises
        :class:`~weightcache.errors.GraphRestoreError` when the range is full (nothing changes then)."""
        if size <= 0:
            raise GraphRestoreError(f"arena {self.name!r}: an allocation must be at least one byte, not {size}")
        start = -(-self.used // ALIGNMENT) * ALIGNMENT
        end = start + size
        if end > self.size:
            raise GraphRestoreError(
                f"arena {self.name!r} is full: {size} bytes asked, {self.size - start} of {self.size} left; give "
                "it a larger size"
            )
        self._map_to(end)
        self.used = end
        return self.base + start

    def skip_to(self, used: int) -> None:
        """Move the bump pointer to ``used`` bytes from the base, mapping everything before it: what a restore does
        in place of a capture whose allocations ended there in the recording process. Raises
        :class:`~weightcache.errors.GraphRestoreError` if ``used`` lies behind the pointer or past the range."""
        if not self.used <= used <= self.size:
            raise GraphRestoreError(
                f"arena {self.name!r}: cannot move its pointer from {self.used} to {used} (size {self.size}); the "
                "recorded layout does not fit this arena"
            )
        self._map_to(used)
        self.used = used

    def rewind_to(self, used: int) -> None:
        """Move the bump pointer back to ``used`` bytes from the base, keeping the memory mapped: what a refused
        restore does after :meth:`skip_to`, so that the capture in its place gets the addresses the recording
        process's capture got. Only for bytes nothing was handed out from since the pointer stood there (the caller
        knows: a restore allocates nothing). Raises :class:`~weightcache.errors.GraphRestoreError` if ``used`` lies
        past the pointer or below zero."""
        if not 0 <= used <= self.used:
            raise GraphRestoreError(f"arena {self.name!r}: cannot move its pointer back from {self.used} to {used}")
        self.used = used

    def map_ahead(self, ends: Sequence[int]) -> bool:
        """Map the range now as far as each of ``ends`` (bytes from the base, ascending; at most the arena's size),
        one piece to each, leaving the bump pointer where it is: a restore's graphs' memory mapped before them
        instead of a piece at each (behind the driver calls of the threads building graphs ahead), in pieces that
        :meth:`unmap_unused` can give back where the graphs are not restored after all. Returns whether it
        mapped them all; a driver call that fails leaves what was mapped before it (later requests map as they
        go, and fail where they must)."""
        try:
            for end in ends:
                self._map_to(min(end, self.size))
        except GraphRestoreError:
            return False
        return True

    def unmap_unused(self) -> int:
        """Unmap and release every piece that lies wholly past the bump pointer (mapped ahead for allocations that
        did not come); the bytes given back. Later requests map again as they go."""
        given = 0
        while self._chunks and self._chunks[-1][0] >= self.base + self.used:
            address, length, handle = self._chunks.pop()
            self._driver.unmap(address, length)
            self._driver.release(handle)
            self.mapped -= length
            given += length
        return given

    def _map_to(self, end: int) -> None:
        while self.mapped < end:
            length = min(max(self.chunk, -(-(end - self.mapped) // self.chunk) * self.chunk), self.size - self.mapped)
            handle = self._driver.create(length, self.device)
            try:
                self._driver.map(self.base + self.mapped, length, handle, self.device)
            except BaseException:
                self._driver.release(handle)
                raise
            self._chunks.append((self.base + self.mapped, length, handle))
            self.mapped += length

    def free(self, address: int, size: int) -> None:
        """Note that ``size`` bytes at ``address`` are no longer used; the memory stays mapped and is not reused
        (allocations keep their addresses in every process)."""
        if not self.base <= address < self.base + self.used:
            raise GraphRestoreError(f"arena {self.name!r}: {address:#x} was not allocated from it")
        self.freed += size

    def close(self) -> None:
        """Unmap and release everything, and free the range (idempotent)."""
        for address, length, handle in reversed(self._chunks):
            self._driver.unmap(address, length)
            self._driver.release(handle)
        self._chunks.clear()
        if self.size:
            self._driver.free_address(self.base, self.size)
            self.size = self.mapped = self.used = 0


class CudaArenaDriver:
    """:class:`ArenaDriver` through cuda-bindings (``cuda.bindings.driver``)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError:
            raise GraphRestoreError(
                "an arena needs NVIDIA's cuda-bindings: pip install 'cuda-bindings>=12.8' (matching your driver)"
            ) from None
        self._cu: Any = driver

    def _check(self, result: tuple[Any, ...], what: str) -> Any:
        if result[0] != self._cu.CUresult.CUDA_SUCCESS:
            raise GraphRestoreError(f"{what} failed: {getattr(result[0], 'name', result[0])}")
        return result[1] if len(result) > 1 else None

    def _prop(self, device: int) -> Any:
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        return prop

    def granularity(self, device: int) -> int:
        flag = self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(self._check(self._cu.cuMemGetAllocationGranularity(self._prop(device), flag), "granularity"))

    def reserve(self, size: int, base: int) -> int:
        return int(self._check(self._cu.cuMemAddressReserve(size, 0, base, 0), "cuMemAddressReserve"))

    def create(self, size: int, device: int) -> int:
        return self._check(self._cu.cuMemCreate(size, self._prop(device), 0), "cuMemCreate")  # type: ignore[no-any-return]

    def map(self, address: int, size: int, handle: int, device: int) -> None:
        cu = self._cu
        self._check(cu.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        try:
            self._check(cu.cuMemSetAccess(address, size, [desc], 1), "cuMemSetAccess")
        except GraphRestoreError:
            cu.cuMemUnmap(address, size)
            raise

    def unmap(self, address: int, size: int) -> None:
        self._cu.cuMemUnmap(address, size)

    def release(self, handle: int) -> None:
        self._cu.cuMemRelease(handle)

    def free_address(self, address: int, size: int) -> None:
        self._cu.cuMemAddressFree(address, size)


__all__ = ["ALIGNMENT", "DEFAULT_BASE", "Arena", "ArenaDriver", "CudaArenaDriver"]
