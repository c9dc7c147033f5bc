"""The driver calls a client makes to map a received CUDA VMM segment, through ``ctypes`` on ``libcuda``.

A restarted engine maps segments; it never creates or exports them. The seven calls that mapping needs
(``cuMemImportFromShareableHandle``, ``cuMemAddressReserve``, ``cuMemMap``, ``cuMemSetAccess``,
``cuMemRelease``, ``cuMemUnmap``, ``cuMemAddressFree``) are declared here with their C signatures, on the
``libcuda.so.1`` that torch's CUDA runtime has already loaded into the process. Importing NVIDIA's
``cuda-bindings`` instead costs a fresh process 10-15 ms, on the critical path of every restart; publishers still
use it (:mod:`weightcache.segments.cuda_vmm`) for everything else.

Declared by hand from ``cuda.h`` (CUDA 11.2 and later, unchanged since): every argument type is given, so that no
64-bit pointer or size goes through ctypes' default ``int`` conversion. When ``libcuda`` or one of the symbols is
missing, :func:`driver` returns None and the caller uses ``cuda-bindings``; so does ``WEIGHTCACHE_CUDA_DRIVER=
bindings`` (for comparing the two).
"""

from __future__ import annotations

import ctypes
import os
import threading

#: ``CUresult`` of success.
CUDA_SUCCESS = 0
#: ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``.
HANDLE_TYPE_POSIX_FD = 0x1
#: ``CU_MEM_LOCATION_TYPE_DEVICE``.
LOCATION_TYPE_DEVICE = 0x1
#: ``CU_MEM_ACCESS_FLAGS_PROT_READ`` and ``CU_MEM_ACCESS_FLAGS_PROT_READWRITE``.
PROT_READ = 0x1
PROT_READWRITE = 0x3


class MemLocation(ctypes.Structure):
    """``CUmemLocation``: ``{CUmemLocationType type; int id;}``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemAccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``: ``{CUmemLocation location; CUmemAccess_flags flags;}``."""

    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


_u64 = ctypes.c_uint64  # CUdeviceptr and CUmemGenericAllocationHandle are unsigned long long
_SIGNATURES: dict[str, list[type]] = {
    # (CUmemGenericAllocationHandle *handle, void *osHandle, CUmemAllocationHandleType shHandleType)
    "cuMemImportFromShareableHandle": [ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_int],
    # (CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags)
    "cuMemAddressReserve": [ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.c_size_t, _u64, ctypes.c_ulonglong],
    # (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags)
    "cuMemMap": [_u64, ctypes.c_size_t, ctypes.c_size_t, _u64, ctypes.c_ulonglong],
    # (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
    "cuMemSetAccess": [_u64, ctypes.c_size_t, ctypes.POINTER(MemAccessDesc), ctypes.c_size_t],
    # (CUmemGenericAllocationHandle handle)
    "cuMemRelease": [_u64],
    # (CUdeviceptr ptr, size_t size)
    "cuMemUnmap": [_u64, ctypes.c_size_t],
    "cuMemAddressFree": [_u64, ctypes.c_size_t],
    # (CUresult error, const char **pStr)
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
}


class DriverError(Exception):
    """A driver call returned an error: ``what`` failed with ``code`` (its ``CUDA_ERROR_*`` name in the text)."""

    def __init__(self, what: str, code: int, name: str) -> None:
        super().__init__(f"{what} failed: {name}")
        self.code = code


class Driver:
    """The mapping calls, bound to one ``libcuda``. Methods raise :class:`DriverError`; they need the target
    device's context current on the calling thread (torch's primary context)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)  # AttributeError: a driver too old for VMM
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self._lib = lib

    def _check(self, code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            raise DriverError(what, code, self.error_name(code))

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
            return f"CUresult {code}"
        return text.value.decode()

    def import_fd(self, fd: int) -> int:
        """``cuMemImportFromShareableHandle`` of a POSIX fd (not consumed); returns the allocation handle."""
        handle = _u64()
        # the fd travels in the pointer argument: (void *)(uintptr_t)fd
        code = self._lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), HANDLE_TYPE_POSIX_FD)
        self._check(code, "cuMemImportFromShareableHandle")
        return int(handle.value)

    def reserve(self, size: int, address: int = 0) -> int:
        """Reserve ``size`` bytes of address space, asking for ``address`` (0: anywhere). The address is a hint:
        the driver may place the range elsewhere, and a driver that refuses the hint outright is asked again
        without it; the caller compares what it got."""
        ptr = _u64()
        code = self._lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, address, 0)
        if code != CUDA_SUCCESS and address:
            code = self._lib.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0)
        self._check(code, "cuMemAddressReserve")
        return int(ptr.value)

    def map(self, ptr: int, size: int, handle: int) -> None:
        self._check(self._lib.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")

    def set_access(self, ptr: int, size: int, device: int, flags: int) -> int:
        """``cuMemSetAccess`` for one device; returns the CUresult (the caller may try other flags)."""
        desc = MemAccessDesc(MemLocation(LOCATION_TYPE_DEVICE, device), flags)
        return int(self._lib.cuMemSetAccess(ptr, size, ctypes.byref(desc), 1))

    def release(self, handle: int) -> None:
        """``cuMemRelease``; its result is ignored (a mapping of the allocation keeps the memory either way)."""
        self._lib.cuMemRelease(handle)

    def free_address(self, ptr: int, size: int) -> None:
        """``cuMemAddressFree`` of a reserved range that nothing is mapped into; errors are ignored."""
        self._lib.cuMemAddressFree(ptr, size)

    def unmap_and_free(self, ptr: int, size: int, reserved: int = 0) -> None:
        """Unmap ``size`` bytes and free the address range (``reserved`` bytes, if more were reserved than
        mapped); errors are ignored (this runs when a mapping is collected)."""
        self._lib.cuMemUnmap(ptr, size)
        self._lib.cuMemAddressFree(ptr, max(size, reserved))


def map_fd(
    drv: Driver, fd: int, size: int, device: int, read_only: bool, address: int = 0, reserve: int = 0
) -> tuple[int, bool]:
    """Import the VMM allocation behind ``fd``, reserve ``max(size, reserve)`` bytes of address space (at
    ``address`` if the driver gives it, see :meth:`Driver.reserve`), map it at its start and
    give ``device`` access: read-only when ``read_only`` and the driver allows it, else read-write. Returns
    (pointer, mapped read-only); the caller unmaps with :meth:`Driver.unmap_and_free`. Releases the imported
    handle either way (the mapping holds the memory) and frees what it took on failure. Raises
    :class:`DriverError`."""
    handle = drv.import_fd(fd)
    try:
        reserved = max(size, reserve)
        ptr = drv.reserve(reserved, address)
        try:
            drv.map(ptr, size, handle)
        except DriverError:
            drv.free_address(ptr, reserved)
            raise
        code = CUDA_SUCCESS
        for flags in (PROT_READ, PROT_READWRITE) if read_only else (PROT_READWRITE,):
            code = drv.set_access(ptr, size, device, flags)
            if code == CUDA_SUCCESS:
                return ptr, flags == PROT_READ
        drv.unmap_and_free(ptr, size, reserved)
        raise DriverError("cuMemSetAccess", code, drv.error_name(code))
    finally:
        drv.release(handle)


_lock = threading.Lock()
_driver: Driver | None = None
_loaded = False


def driver() -> Driver | None:
    """The ctypes driver, loaded once per process; None when ``libcuda.so.1`` or a symbol is missing, or
    ``WEIGHTCACHE_CUDA_DRIVER=bindings`` asks for ``cuda-bindings``."""
    global _driver, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            if os.environ.get("WEIGHTCACHE_CUDA_DRIVER", "") != "bindings":
                try:
                    _driver = Driver(ctypes.CDLL("libcuda.so.1"))
                except (OSError, AttributeError):
                    _driver = None
        return _driver


__all__ = ["Driver", "DriverError", "MemAccessDesc", "MemLocation", "driver", "map_fd"]
