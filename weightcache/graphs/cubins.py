"""The machine code of a graph's kernels, kept so that a fresh process gets their function handles without running
the model (issue 31).

A rebuilt graph node needs a function handle of the restoring process. Kernels have no public names to look up:
torch's are not in its libraries' symbol tables under their device names, and each of cuBLAS's GEMMs sits alone in
its module (docs/architecture.md, measured on an H200). What a process can do instead is keep the image of every
module the CUDA driver loads while a graph is recorded (CUPTI's module-loaded callback hands it over: the cubin, an
ELF file), and a later process loads those images itself (``cuModuleLoadData``) and asks each for its kernels by
name (``cuModuleGetFunction``). The function is the same machine code; the module is the restoring process's own
copy. A kernel that reads a module variable its library writes at run time would read the variable's initial
value there: :class:`~weightcache.torch_graphs.GraphCache` therefore replays a graph rebuilt from these copies
beside the captured graph before it records it, and records it only if the two give the same bytes.

- :func:`kernel_names`: the kernels an image defines (its ELF symbol table; no GPU needed).
- :class:`CubinRecorder`: CUPTI's module-loaded callback, through ``ctypes`` on ``libcupti``; every image loaded
  while it is subscribed, by SHA-256, which images define each kernel name, and which image each module handle
  was loaded from (CUPTI's callbacks on the driver's module loads: where two modules define a kernel of one name,
  as torch.compile's Triton modules do, a function's module says which image is its own).

Layer L3; imports no torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import logging
import os
import struct
import sys
import threading
from collections.abc import Iterator

from ..errors import GraphRestoreError

log = logging.getLogger("weightcache.graphs")

_ELF_MAGIC = b"\x7fELF"
_SHT_SYMTAB = 2
_STT_FUNC = 2
_STB_GLOBAL, _STB_WEAK = 1, 2


def kernel_names(image: bytes) -> set[str]:
    """The global functions an ELF cubin defines (each kernel is one, in its own ``.text.<name>`` section).
    Empty for anything that is not a 64-bit little-endian ELF file or whose tables do not fit in it."""
    if len(image) < 64 or image[:4] != _ELF_MAGIC or image[4] != 2 or image[5] != 1:
        return set()
    try:
        (shoff,) = struct.unpack_from("<Q", image, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
        if shentsize < 64 or shoff + shnum * shentsize > len(image):
            return set()
        sections = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)]
        names: set[str] = set()
        for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
            if kind != _SHT_SYMTAB or entsize < 24 or link >= shnum or offset + size > len(image):
                continue
            str_offset, str_size = sections[link][4], sections[link][5]
            if str_offset + str_size > len(image):
                continue
            strings = image[str_offset : str_offset + str_size]
            for at in range(offset, offset + size - entsize + 1, entsize):
                st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", image, at)
                if st_info & 0xF != _STT_FUNC or st_info >> 4 not in (_STB_GLOBAL, _STB_WEAK) or st_shndx == 0:
                    continue
                end = strings.find(b"\0", st_name)
                if 0 <= st_name < end:
                    names.add(strings[st_name:end].decode("utf-8", "replace"))
        return names
    except struct.error:
        return set()


class _ResourceData(ctypes.Structure):
    """``CUpti_ResourceData``: the context, a union holding a stream, and the resource's descriptor."""

    _fields_ = [("context", ctypes.c_void_p), ("stream", ctypes.c_void_p), ("descriptor", ctypes.c_void_p)]


class _ModuleData(ctypes.Structure):
    """The first fields of ``CUpti_ModuleResourceData`` (later CUPTI releases append more)."""

    _fields_ = [("module_id", ctypes.c_uint32), ("cubin_size", ctypes.c_size_t), ("cubin", ctypes.c_void_p)]


class _CallbackData(ctypes.Structure):
    """The first fields of ``CUpti_CallbackData`` (a driver call's callback): the site (0 on entry, 1 on exit), the
    function's name, a pointer to its parameters' structure and, on exit, to its ``CUresult``."""

    _fields_ = [
        ("site", ctypes.c_uint32),
        ("function_name", ctypes.c_void_p),
        ("params", ctypes.c_void_p),
        ("result", ctypes.c_void_p),
    ]


#: ``CUPTI_CB_DOMAIN_RESOURCE``, ``CUPTI_CBID_RESOURCE_MODULE_LOADED`` and ``_CONTEXT_DESTROY_STARTING`` (its
#: modules go with a context: their handles may be given again).
_DOMAIN_RESOURCE, _MODULE_LOADED, _CONTEXT_DESTROY = 3, 6, 2
#: ``CUPTI_CB_DOMAIN_DRIVER_API``; ``CUPTI_DRIVER_TRACE_CBID_`` of ``cuModuleLoad``, ``cuModuleLoadData``,
#: ``cuModuleLoadDataEx`` and ``cuModuleLoadFatBinary`` (each one's parameters start with ``CUmodule *module``;
#: the two ``Data`` ones' next is the image), and of ``cuModuleUnload`` (``CUmodule hmod``). cupti_driver_cbid.h.
_DOMAIN_DRIVER = 1
_MODULE_LOADS = (18, 19, 20, 21)
_LOADS_FROM_MEMORY = (19, 20)
_MODULE_UNLOAD = 22
_ENTER, _EXIT = 0, 1
#: The largest image read off a ``cuModuleLoadData`` pointer whose load CUPTI's module callback did not report.
_MAX_ELF = 1 << 30
#: Set on a thread while it loads images it got from an artifact (:func:`loading_kept_images`): those loads are
#: not kept again (a restore loads tens of MB; the graphs a process captures use its libraries' own modules).
_own = threading.local()
#: A thread's driver module loads under way: the digests of the images CUPTI reported during each.
_loads = threading.local()


def _elf_size(address: int) -> int | None:
    """The length of the 64-bit little-endian ELF file at ``address`` (a cubin handed to ``cuModuleLoadData``):
    the end of its farthest table, section or segment; None for anything else."""
    if ctypes.string_at(address, 4) != _ELF_MAGIC:  # (a PTX text may be shorter than an ELF header)
        return None
    header = ctypes.string_at(address, 64)
    if header[4] != 2 or header[5] != 1:
        return None
    phoff, shoff = struct.unpack_from("<QQ", header, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 0x36)
    end = max(64, phoff + phnum * phentsize, shoff + shnum * shentsize)
    if end > _MAX_ELF or (shnum and shentsize < 64) or (phnum and phentsize < 56):
        return None
    sections = ctypes.string_at(address + shoff, shnum * shentsize) if shnum else b""
    for i in range(shnum):
        kind, _flags, _addr, offset, size = struct.unpack_from("<IQQQQ", sections, i * shentsize + 4)
        if kind != 8:  # SHT_NOBITS takes no room in the file
            end = max(end, offset + size)
    segments = ctypes.string_at(address + phoff, phnum * phentsize) if phnum else b""
    for i in range(phnum):
        offset, _vaddr, _paddr, filesz = struct.unpack_from("<QQQQ", segments, i * phentsize + 8)
        end = max(end, offset + filesz)
    return end if end <= _MAX_ELF else None


@contextlib.contextmanager
def loading_kept_images() -> Iterator[None]:
    """Within it, modules this thread loads are not kept by the :class:`CubinRecorder`."""
    _own.active = True
    try:
        yield
    finally:
        _own.active = False


_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)


def _cupti_paths() -> list[str]:
    """Where ``libcupti`` may be: the loader's own search, then NVIDIA's wheels (``nvidia/*/lib``) on sys.path."""
    found = ["libcupti.so", "libcupti.so.13", "libcupti.so.12"]
    for entry in sys.path:
        for pattern in ("nvidia/*/lib/libcupti.so*", "nvidia/*/*/lib/libcupti.so*"):
            found.extend(sorted(glob.glob(os.path.join(entry, pattern)), reverse=True))
    return found


def load_cupti() -> ctypes.CDLL:
    """``libcupti``, wherever it is; GraphRestoreError naming where it was looked for."""
    tried = _cupti_paths()
    for path in tried:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise GraphRestoreError(
        "CUPTI (libcupti) was not found, so the machine code of a graph's kernels cannot be kept and its graphs are "
        f"captured as usual; install NVIDIA's CUPTI (pip install nvidia-cuda-cupti). Looked for: {', '.join(tried[:6])}"
    )


class CubinRecorder:
    """Keeps the image of every CUDA module loaded while it is subscribed (see the module's text).

    Only one CUPTI subscriber can exist in a process (a profiler that uses CUPTI is another): then, or where CUPTI
    is missing, construction raises :class:`~weightcache.errors.GraphRestoreError`. Call :meth:`close` to
    unsubscribe. Modules loaded before it subscribed are not seen: make it before the model's first kernel runs.
    """

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib if lib is not None else load_cupti()
        self._images: dict[str, bytes] = {}
        self._names: dict[str, frozenset[str]] = {}  # image -> the kernels it defines
        self._kernels: dict[str, list[str]] = {}  # kernel name -> the images that define it, in load order
        self._modules: dict[int, str] = {}  # module handle -> the image it was loaded from
        self.follows_modules = False  # (below, once CUPTI follows them)
        self._lock = threading.Lock()
        self._callback = _CALLBACK(self._loaded)  # kept alive: CUPTI holds the raw pointer
        self._subscriber = ctypes.c_void_p()
        subscribe, enable = self._lib.cuptiSubscribe, self._lib.cuptiEnableCallback
        subscribe.argtypes = [ctypes.POINTER(ctypes.c_void_p), _CALLBACK, ctypes.c_void_p]
        enable.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32]
        self._lib.cuptiUnsubscribe.argtypes = [ctypes.c_void_p]
        code = subscribe(ctypes.byref(self._subscriber), self._callback, None)
        if code != 0:
            raise GraphRestoreError(
                f"cuptiSubscribe failed with CUptiResult {code} (another CUPTI subscriber, e.g. a profiler, may be "
                "active): the machine code of this process's kernels is not kept, so its graphs are not recorded"
            )
        code = enable(1, self._subscriber, _DOMAIN_RESOURCE, _MODULE_LOADED)
        if code != 0:
            self.close()
            raise GraphRestoreError(f"cuptiEnableCallback(module loaded) failed with CUptiResult {code}")
        #: Whether the driver's module loads, unloads and context teardowns are followed (which module holds which
        #: image); without, a function's image is known only by its name (:meth:`image_for`), and two functions
        #: of one name in one graph make it not describable.
        self.follows_modules = True
        follow = [
            *((_DOMAIN_DRIVER, c) for c in (*_MODULE_LOADS, _MODULE_UNLOAD)),
            (_DOMAIN_RESOURCE, _CONTEXT_DESTROY),
        ]
        for at, (domain, cbid) in enumerate(follow):
            code = enable(1, self._subscriber, domain, cbid)
            if code != 0:  # all or nothing: loads followed without their unloads would map handles given again
                log.info("weightcache: CUPTI does not follow the driver's module loads (CUptiResult %s)", code)
                self.follows_modules = False
                for undo in follow[:at]:
                    enable(0, self._subscriber, *undo)
                break

    def _loaded(self, _userdata: int | None, domain: int, cbid: int, data: int | None) -> None:
        try:
            if not data or getattr(_own, "active", False):
                return
            if domain == _DOMAIN_DRIVER:
                if self.follows_modules and (cbid in _MODULE_LOADS or cbid == _MODULE_UNLOAD):
                    self._driver_call(cbid, _CallbackData.from_address(data))
                return
            if domain == _DOMAIN_RESOURCE and cbid == _CONTEXT_DESTROY:
                with self._lock:  # every module of that context goes (one context a process, as torch makes it)
                    self._modules.clear()
                return
            if domain != _DOMAIN_RESOURCE or cbid != _MODULE_LOADED:
                return
            resource = _ResourceData.from_address(data)
            if not resource.descriptor:
                return
            module = _ModuleData.from_address(resource.descriptor)
            if not module.cubin or not module.cubin_size:
                return
            digest = self.add(ctypes.string_at(module.cubin, module.cubin_size))
            pending = getattr(_loads, "stack", None)
            if pending:  # inside a driver module load on this thread: that load's module holds this image
                pending[-1].append(digest)
        except Exception:  # never raise into the driver's module load
            log.debug("weightcache: a module-loaded callback failed", exc_info=True)

    def _driver_call(self, cbid: int, call: _CallbackData) -> None:
        """A driver module load's entry and exit (its module -> the image CUPTI reported meanwhile, or, for a cubin
        loaded from memory that it did not report, the cubin itself), or a module's unload."""
        params = ctypes.cast(call.params, ctypes.POINTER(ctypes.c_void_p)) if call.params else None
        if cbid == _MODULE_UNLOAD:
            if call.site == _ENTER and params is not None and params[0]:
                with self._lock:
                    self._modules.pop(params[0], None)
            return
        stack = _loads.__dict__.setdefault("stack", [])
        if call.site == _ENTER:
            stack.append([])
            return
        if call.site != _EXIT or not stack:
            return
        reported = stack.pop()
        if params is None or not params[0] or not call.result or ctypes.c_int.from_address(call.result).value != 0:
            return  # the load failed: no module
        module = ctypes.c_void_p.from_address(params[0]).value
        if not module:
            return
        if not reported and cbid in _LOADS_FROM_MEMORY and params[1]:
            size = _elf_size(params[1])
            if size is not None:
                reported.append(self.add(ctypes.string_at(params[1], size)))
        if len(set(reported)) == 1:
            with self._lock:
                self._modules[module] = reported[0]

    def add(self, image: bytes) -> str:
        """Keep ``image`` (also for images obtained otherwise); its SHA-256."""
        digest = hashlib.sha256(image).hexdigest()
        names = frozenset(kernel_names(image))
        with self._lock:
            if digest not in self._images:
                self._images[digest] = image
                self._names[digest] = names
                for name in names:
                    self._kernels.setdefault(name, []).append(digest)
        return digest

    def counts(self) -> tuple[int, int]:
        """How many images were kept, and how many kernel names they define."""
        with self._lock:
            return len(self._images), len(self._kernels)

    def image_of(self, kernel: str) -> str | None:
        """The SHA-256 of the one kept image that defines ``kernel``; None where none does or several do (then
        :meth:`image_for` tells by the function's module)."""
        with self._lock:
            found = self._kernels.get(kernel, ())
            return found[0] if len(found) == 1 else None

    def images_defining(self, kernel: str) -> int:
        """How many kept images define ``kernel``."""
        with self._lock:
            return len(self._kernels.get(kernel, ()))

    def image_for(self, kernel: str, module: int | None, *, by_name: bool = True) -> str | None:
        """The SHA-256 of the kept image that defines ``kernel`` for a function of ``module`` (its handle,
        ``cuFuncGetModule``). Where that module's load was seen: the image it was loaded from, None if that image
        does not define the name. Where it was not (loaded before this recorder, or through the runtime's library
        API): with ``by_name``, :meth:`image_of`, which cannot know an image that was never kept (a module of the
        same name loaded before the recorder; the recorder's verifying replay is what catches that); without,
        None."""
        with self._lock:
            digest = self._modules.get(module) if module else None
            if digest is not None:
                return digest if kernel in self._names[digest] else None
        return self.image_of(kernel) if by_name else None

    def image(self, digest: str) -> bytes:
        with self._lock:
            return self._images[digest]

    def close(self) -> None:
        """Unsubscribe (idempotent); the images kept so far stay."""
        if self._subscriber.value:
            self._lib.cuptiUnsubscribe(self._subscriber)
            self._subscriber = ctypes.c_void_p()


_lock = threading.Lock()
_recorder: CubinRecorder | None = None
_failed: GraphRestoreError | None = None


def keep_kernel_images() -> CubinRecorder:
    """This process's :class:`CubinRecorder`, subscribed on the first call and kept for the life of the process
    (CUPTI allows one subscriber). Call it before the model's first kernel runs (before ``attach`` too: a load
    runs kernels), so that every module the graphs need is seen loading. Raises the same
    :class:`~weightcache.errors.GraphRestoreError` on every call where CUPTI cannot be used."""
    global _recorder, _failed
    with _lock:
        if _recorder is None:
            if _failed is not None:
                raise _failed
            try:
                _recorder = CubinRecorder()
            except GraphRestoreError as exc:
                _failed = exc
                raise
        return _recorder


__all__ = ["CubinRecorder", "keep_kernel_images", "kernel_names", "load_cupti", "loading_kept_images"]
