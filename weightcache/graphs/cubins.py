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
- :class:`CubinRecorder`: CUPTI's module-loaded callback on ``libcupti`` (the callback itself is C,
  :mod:`~weightcache.graphs.cupti_shim`: one in Python deadlocked vLLM's threads that load modules); every image
  loaded while it is subscribed, by SHA-256, which images define each kernel name, and which image each module handle
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
from .cupti_shim import EVENT_CONTEXT, EVENT_IMAGE, EVENT_MODULE, EVENT_UNLOAD, load_shim, loaded_shim

log = logging.getLogger("weightcache.graphs")

_ELF_MAGIC = b"\x7fELF"
_SHT_SYMTAB = 2
_STT_FUNC = 2
_STB_GLOBAL, _STB_WEAK = 1, 2
#: ``st_other``'s flag for a kernel's entry point in a CUDA ELF file: nvcc marks local kernels with it (those of
#: internal linkage: anonymous namespaces, and template instances made internal, as every FlashAttention 3 kernel of
#: vLLM 0.26); the driver finds them by name all the same.
_STO_CUDA_ENTRY = 0x10


def kernel_names(image: bytes) -> set[str]:
    """The kernels an ELF cubin defines (each in its own ``.text.<name>`` section): its global and weak functions,
    and its local ones flagged as entry points (kernels of internal linkage; a local function without the flag is a
    device function). Empty for anything that is not a 64-bit little-endian ELF file or whose tables do not fit in
    it."""
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
                st_name, st_info, other, st_shndx = struct.unpack_from("<IBBH", image, at)
                if st_info & 0xF != _STT_FUNC or st_shndx == 0:
                    continue
                if st_info >> 4 not in (_STB_GLOBAL, _STB_WEAK) and not other & _STO_CUDA_ENTRY:
                    continue
                end = strings.find(b"\0", st_name)
                if 0 <= st_name < end:
                    names.add(strings[st_name:end].decode("utf-8", "replace"))
        return names
    except struct.error:
        return set()


# The layouts of CUPTI's callback data, as the C callback reads them (tests build them to play CUPTI's part).


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
#: The largest image read off a ``cuModuleLoadData`` pointer whose load CUPTI's module callback did not report.
_MAX_ELF = 1 << 30


@contextlib.contextmanager
def loading_kept_images() -> Iterator[None]:
    """Within it, modules this thread loads are not kept by the :class:`CubinRecorder` (a restore loads tens of MB
    of images it got from an artifact; the graphs a process captures use its libraries' own modules)."""
    shim = loaded_shim()
    if shim is None:  # no recorder in this process: nothing keeps images
        yield
        return
    shim.wc_own_add(1)  # (a depth: blocks nest)
    try:
        yield
    finally:
        shim.wc_own_add(-1)


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
        self._shim = load_shim()  # the callback, in C: it never waits for the GIL (cupti_shim's text says why)
        self._images: dict[str, bytes] = {}
        self._names: dict[str, frozenset[str]] = {}  # image -> the kernels it defines
        self._kernels: dict[str, list[str]] = {}  # kernel name -> the images that define it, in load order
        self._modules: dict[int, str] = {}  # module handle -> the image it was loaded from
        self._sequence: dict[int, str] = {}  # the shim's image number -> its digest, until its load's end is seen
        self._dropped = 0  # events the callback could not queue (out of memory), as last seen
        self._stopped = False  # stop(): nothing kept any more
        self.follows_modules = False  # (below, once CUPTI follows them)
        self._lock = threading.Lock()
        loads, from_memory = (
            (ctypes.c_uint32 * len(_MODULE_LOADS))(*_MODULE_LOADS),
            (ctypes.c_uint32 * len(_LOADS_FROM_MEMORY))(*_LOADS_FROM_MEMORY),
        )
        self._state = self._shim.wc_new(
            _DOMAIN_DRIVER, _DOMAIN_RESOURCE, _MODULE_LOADED, _CONTEXT_DESTROY, _MODULE_UNLOAD,
            loads, len(_MODULE_LOADS), from_memory, len(_LOADS_FROM_MEMORY), _MAX_ELF,
        )  # fmt: skip
        if not self._state:
            raise GraphRestoreError("weightcache's CUPTI callback could not allocate its state (out of memory)")
        self._subscriber = ctypes.c_void_p()
        subscribe, enable = self._lib.cuptiSubscribe, self._lib.cuptiEnableCallback
        subscribe.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p]
        enable.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32]
        self._lib.cuptiUnsubscribe.argtypes = [ctypes.c_void_p]
        callback = ctypes.cast(self._shim.wc_callback, ctypes.c_void_p)
        code = subscribe(ctypes.byref(self._subscriber), callback, self._state)
        if code != 0:
            raise GraphRestoreError(
                f"cuptiSubscribe failed with CUptiResult {code} (another CUPTI subscriber, e.g. a profiler, may be "
                "active): the machine code of this process's kernels is not kept, so its graphs are not recorded"
            )
        code = enable(1, self._subscriber, _DOMAIN_RESOURCE, _MODULE_LOADED)
        if code != 0:
            self.close()
            raise GraphRestoreError(f"cuptiEnableCallback(module loaded) failed with CUptiResult {code}")
        follow = [
            *((_DOMAIN_DRIVER, c) for c in (*_MODULE_LOADS, _MODULE_UNLOAD)),
            (_DOMAIN_RESOURCE, _CONTEXT_DESTROY),
        ]
        for at, (domain, cbid) in enumerate(follow):
            code = enable(1, self._subscriber, domain, cbid)
            if code != 0:  # all or nothing: loads followed without their unloads would map handles given again
                log.info("weightcache: CUPTI does not follow the driver's module loads (CUptiResult %s)", code)
                for undo in follow[:at]:
                    enable(0, self._subscriber, *undo)
                break
        else:
            #: Whether the driver's module loads, unloads and context teardowns are followed (which module holds
            #: which image); without, a function's image is known only by its name (:meth:`image_for`), and two
            #: functions of one name in one graph make it not describable.
            self.follows_modules = True
            self._shim.wc_follow(self._state, 1)

    def _drain(self) -> None:
        """Take what the callback queued, in its order (called with ``_lock`` held): images are hashed and parsed
        here, outside the driver's locks."""
        kind, seq, module, size = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
        data = ctypes.c_void_p()
        take = self._shim.wc_take
        while take(self._state, ctypes.byref(kind), ctypes.byref(seq), ctypes.byref(module), ctypes.byref(data),
                   ctypes.byref(size)):  # fmt: skip
            try:
                payload = ctypes.string_at(data.value, size.value) if data.value else b""
            finally:
                if data.value:
                    self._shim.wc_release(data)
            if kind.value == EVENT_IMAGE:
                digest = self._keep(payload)
                if module.value:  # reported during a followed load: its end names it
                    self._sequence[seq.value] = digest
            elif kind.value == EVENT_MODULE:  # a load's end: the images CUPTI reported during it
                numbers = struct.unpack(f"<{len(payload) // 8}Q", payload[: len(payload) // 8 * 8])
                digests = {self._sequence.pop(n) for n in numbers if n in self._sequence}
                if len(digests) == 1 and module.value:  # (0: the load failed, or reported too many to tell)
                    self._modules[module.value] = digests.pop()
            elif kind.value == EVENT_UNLOAD:
                self._modules.pop(module.value, None)
            elif kind.value == EVENT_CONTEXT:  # every module of that context goes (one context a process)
                self._modules.clear()
        dropped = self._shim.wc_dropped(self._state)
        if dropped != self._dropped:  # memory ran out inside a callback: an image or a load's end is missing
            self._dropped = dropped
            self._sequence.clear()  # (a lost end would leave its images' numbers here for good)
            log.warning(
                "weightcache: CUPTI's callback lost %d event(s) for want of memory; a kernel of a module whose "
                "load was lost is known by its name only",
                dropped,
            )

    def _keep(self, image: bytes) -> str:
        digest = hashlib.sha256(image).hexdigest()
        if digest not in self._images:
            names = frozenset(kernel_names(image))
            self._images[digest] = image
            self._names[digest] = names
            for name in names:
                self._kernels.setdefault(name, []).append(digest)
        return digest

    def add(self, image: bytes) -> str:
        """Keep ``image`` (also for images obtained otherwise); its SHA-256."""
        with self._lock:
            self._drain()
            return self._keep(image)

    def counts(self) -> tuple[int, int]:
        """How many images were kept, and how many kernel names they define."""
        with self._lock:
            self._drain()
            return len(self._images), len(self._kernels)

    def image_of(self, kernel: str) -> str | None:
        """The SHA-256 of the one kept image that defines ``kernel``; None where none does or several do (then
        :meth:`image_for` tells by the function's module)."""
        with self._lock:
            self._drain()
            found = self._kernels.get(kernel, ())
            return found[0] if len(found) == 1 else None

    def images_defining(self, kernel: str) -> int:
        """How many kept images define ``kernel``."""
        with self._lock:
            self._drain()
            return len(self._kernels.get(kernel, ()))

    def image_for(self, kernel: str, module: int | None, *, by_name: bool = True) -> str | None:
        """The SHA-256 of the kept image that defines ``kernel`` for a function of ``module`` (its handle,
        ``cuFuncGetModule``). Where that module's load was seen: the image it was loaded from, None if that image
        does not define the name. Where it was not (loaded before this recorder, or through the runtime's library
        API): with ``by_name``, :meth:`image_of`, which cannot know an image that was never kept (a module of the
        same name loaded before the recorder; the recorder's verifying replay is what catches that); without,
        None."""
        with self._lock:
            self._drain()
            digest = self._modules.get(module) if module else None
            if digest is not None:
                return digest if kernel in self._names[digest] else None
        return self.image_of(kernel) if by_name else None

    def why_unknown(self, kernel: str, module: int | None) -> str:
        """Why :meth:`image_for` knows no image for ``kernel``, a function of ``module``: that module's load was
        seen and the kernel names read from its image do not include ``kernel`` (weightcache did not read that
        image's symbols as a kernel's), several kept images define the name and the module's load was not seen,
        or no kept image defines it (its module was loaded before this recorder subscribed, or while this process
        kept none after :func:`stop_keeping_kernel_images`); or this recorder was stopped."""
        with self._lock:
            self._drain()
            digest = self._modules.get(module) if module else None
            defining = len(self._kernels.get(kernel, ()))
            if self._stopped:
                return (
                    f"kernel images are no longer kept in this process (stop_keeping_kernel_images), so the image "
                    f"of kernel {kernel[:120]} is not known (stop keeping them only once nothing more is recorded)"
                )
            if digest is not None:
                return (
                    f"the load of the module of kernel {kernel[:120]} was seen (image {digest[:16]}, "
                    f"{len(self._names[digest])} kernel name(s) read from it), and that image does not name it as "
                    "a kernel: its symbols are not understood here (report it, with the engine and GPU)"
                )
            if defining > 0:
                return (
                    f"{defining} kept kernel image(s) define {kernel[:120]}, and the load of this function's module "
                    "was not seen, so which one it runs is not known"
                )
            if _let_go:
                return (
                    f"the module of kernel {kernel[:120]} was loaded while this process kept no kernel images: they "
                    "were let go earlier (stop_keeping_kernel_images), and the module was loaded before they were "
                    "kept again"
                )
            unfollowed = (
                ", or its image's symbols are not understood here (CUPTI here does not follow which module holds "
                "which image)"
                if not self.follows_modules
                else ""
            )
            return (
                f"the module of kernel {kernel[:120]} was loaded before this GraphCache kept modules{unfollowed} "
                "(make the GraphCache before the model's first kernel runs)"
            )

    def image(self, digest: str) -> bytes:
        with self._lock:
            self._drain()
            return self._images[digest]

    def queued_bytes(self) -> int:
        """Bytes of module images the callback queued that no question has taken yet (a process that only
        restores graphs asks none)."""
        return int(self._shim.wc_queued(self._state))

    def close(self) -> None:
        """Unsubscribe (idempotent); the images kept so far stay."""
        if self._subscriber.value:
            self._lib.cuptiUnsubscribe(self._subscriber)
            self._subscriber = ctypes.c_void_p()

    def stop(self) -> int:
        """Unsubscribe, queue nothing more, and let go of every image: those queued and those kept (idempotent).
        From then on no image is known (:meth:`image_for` None, :meth:`why_unknown` says why); the bytes let go."""
        self.close()
        with self._lock:
            freed = int(self._shim.wc_stop(self._state))
            freed += sum(len(image) for image in self._images.values())
            self._stopped = True
            self._images.clear()
            self._names.clear()
            self._kernels.clear()
            self._modules.clear()
            self._sequence.clear()
        return freed


_lock = threading.Lock()
_recorder: CubinRecorder | None = None
_failed: GraphRestoreError | None = None
_let_go = False  # stop_keeping_kernel_images was called in this process


def keep_kernel_images() -> CubinRecorder:
    """This process's :class:`CubinRecorder`, subscribed on the first call and kept until
    :func:`stop_keeping_kernel_images` (CUPTI allows one subscriber). Call it before the model's first kernel
    runs (before ``attach`` too: a load runs kernels), so that every module the graphs need is seen loading.
    Raises the same :class:`~weightcache.errors.GraphRestoreError` on every call where CUPTI cannot be used."""
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


def stop_keeping_kernel_images() -> int:
    """Stop keeping this process's kernel images (:func:`keep_kernel_images`) once no graph will be recorded in
    it any more: unsubscribe from CUPTI and let go of every image kept or queued; how many bytes that freed (0
    where none was kept). A process that restores every graph records none, and the callback's queue otherwise
    grows with each module loaded for its life. A later :func:`keep_kernel_images` (or a new ``GraphCache``)
    subscribes again; modules loaded in between are not known, so graphs that use them are captured, not
    recorded. A GraphCache made before keeps the stopped recorder: what it records from then on is refused the
    same way."""
    global _recorder, _let_go
    with _lock:
        recorder, _recorder = _recorder, None
        _let_go = _let_go or recorder is not None
    return recorder.stop() if recorder is not None else 0


__all__ = [
    "CubinRecorder",
    "keep_kernel_images",
    "kernel_names",
    "load_cupti",
    "loading_kept_images",
    "stop_keeping_kernel_images",
]
