"""CUDA graphs restored from the keeper instead of captured (issue 31): :class:`GraphCache`.

A captured CUDA graph is a list of kernel launches whose arguments hold device addresses. It can be rebuilt in a
new process, node by node, when everything it points at is at the same addresses there and the kernels' machine
code can be had. A :class:`GraphCache` arranges both, for the graphs of one model::

    graphs = wc.GraphCache(handle, {"model": "llama-8b", "sizes": [1, 8]}, device="cuda:0")
    x = graphs.empty((8, 4096), dtype=torch.bfloat16)     # a static input, at a reproducible address
    g = graphs.graph("batch-8", lambda: model(x))         # restored from the keeper, or captured
    x.copy_(batch); g.replay(); g.outputs[0]              # the output, at a reproducible address too
    graphs.publish()                                      # after the last graph: what was captured, for next time

- **Addresses.** Static inputs (:meth:`GraphCache.empty`) and the graphs' memory pool come from an
  :class:`~weightcache.graphs.arena.Arena` at a fixed base (torch's caching allocator serves the pool through
  a pluggable allocator that bump-allocates in the arena), so the same calls in the same order get the same
  addresses in every process. Weights are reproducible where the keeper's segments are mapped at their home
  addresses (:func:`weightcache.segments.cuda_vmm.home_ranges`) or where :meth:`GraphCache.adopt` copied a
  module's parameters into the arena. A tensor made elsewhere (torch's own allocator, an engine's buffers) can be
  declared by name with :meth:`GraphCache.external`: a restoring process declares the same name, and where the
  tensor lies elsewhere there (at least as large, one device allocation) every pointer into it is moved with it
  (relocated, :attr:`GraphCache.relocated`).
- **Kernels.** From the first :func:`keep_kernel_images` (a GraphCache calls it too), CUPTI hands this process
  the image of every CUDA module loaded (:class:`~weightcache.graphs.cubins.CubinRecorder`); the artifact keeps
  the images that define the graphs' kernels, and a restore loads them itself. Call :func:`keep_kernel_images`
  before the model's first kernel runs (before ``attach``): a module loaded earlier is not seen, and a graph
  using one of its kernels is not recorded.
- **Checks.** Recording refuses a graph with any device address outside the reproduced ranges, a kernel whose
  image was not seen, or a graph rebuilt from the kept images that does not replay bitwise equal to the captured
  one (``verify``). A restore refuses, and captures instead, on another name or order of graphs, an arena pointer
  elsewhere than recorded, a range that is missing, elsewhere (the arena, a weights home) or smaller, an external
  tensor that cannot be relocated (:func:`~weightcache.graphs.check.relocation_problems`), or a pointer that is not
  mapped device memory in its range (:func:`~weightcache.graphs.check.extent_problems`). From the first refusal
  on, every later graph of that GraphCache is captured (the arena's layout is this process's own from there) and
  :meth:`GraphCache.publish` replaces the artifact.

An engine that runs its own capture loop (vLLM, SGLang) asks :meth:`GraphCache.restore` for each graph in its
order and, where that gives None, captures it itself into :attr:`GraphCache.pool` inside
:meth:`GraphCache.capturing`, then records it with :meth:`EngineCapture.record`.

The artifact (kind ``cuda.graphs``) is keyed by the weights and the caller's key plus torch, CUDA, the driver, the
GPU and the arena; it is code, so only this uid's own artifacts are loaded. ``WEIGHTCACHE_MODE=off``: every graph
is captured with torch's own pool and nothing is published (no arena reserved, no kernel images kept, nothing asked of
the keeper). Layer L3.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import attrs
import torch

from .artifact_key import ArtifactKey
from .cache import Cache, weights_digest
from .dtypes import DTYPES
from .errors import GraphDescriptionError, GraphRestoreError, WeightCacheError
from .fingerprint import Fingerprint
from .graphs.arena import ALIGNMENT, DEFAULT_BASE, Arena, CudaArenaDriver
from .graphs.bundle import FORMAT, GraphBundle, GraphRecord, Output
from .graphs.check import (
    AddressRange,
    extent_problems,
    extents,
    moved_ranges,
    moves,
    pointers,
    relocate,
    relocation_problems,
)
from .graphs.cubins import CubinRecorder, keep_kernel_images, stop_keeping_kernel_images
from .graphs.description import GraphDescription, kernel_image
from .graphs.driver import CudaGraphDriver
from .graphs.loading import KernelLoader
from .graphs.prebuild import Prebuilder, Prebuilt, build
from .graphs.record import describe, prepare, rebuild, shared_needs
from .handle import Handle
from .manifest import extent_bytes
from .pipeline import SWITCH_ENV, switched_off
from .segments import cuda_vmm
from .torch_dtypes import TORCH_DTYPES
from .views import contiguous_stride

log = logging.getLogger("weightcache.graphs")

#: The artifact kind.
KIND = "cuda.graphs"
#: Address space an arena reserves by default (memory is mapped only as it is used).
DEFAULT_ARENA_BYTES = 64 << 30

# why nothing more is restored or recorded once the graph pool served an allocation outside a capture of its own
_FOREIGN = (
    "the graph pool served allocations outside GraphCache.graph and GraphCache.capturing (a capture with "
    "GraphCache.pool): the arena's layout is this process's own from there"
)

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class _Memory:
    """Device memory at a raw address, for ``torch.as_tensor``; keeps what owns the memory alive."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "stream": None,
        }


class CudaGraph:
    """A graph of a :class:`GraphCache`: :meth:`replay` launches it on the current stream.

    Attributes:
        name: the name it was asked for by.
        restored: True when it was rebuilt from the keeper's artifact, False when it was captured here.
        reason: why a captured graph was not restored (no artifact, a check that failed, ...); None when restored.
        recorded: whether it is among what :meth:`GraphCache.publish` publishes (a restored graph always is).
        record_problem: why a captured graph was not recorded (an address outside the reproduced ranges, a
            kernel image not seen, a rebuilt replay that differs); None otherwise.
        outputs: the tensors the graph writes its results to, as the captured function returned them (flattened).
        seconds: how long restoring or capturing it took (warm-up included).
    """

    def __init__(
        self,
        name: str,
        outputs: tuple[torch.Tensor, ...],
        *,
        restored: bool,
        reason: str | None,
        seconds: float,
        recorded: bool = True,
        record_problem: str | None = None,
        torch_graph: torch.cuda.CUDAGraph | None = None,
        executable: int = 0,
        driver: CudaGraphDriver | None = None,
        keep: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.name = name
        self.outputs = outputs
        self.restored = restored
        self.reason = reason
        self.recorded = recorded
        self.record_problem = record_problem
        self.seconds = seconds
        #: Seconds of each step of a restore: ``map`` (the arena's memory for it mapped), ``checks`` (its ranges,
        #: how far they moved, its outputs), ``relocate`` (its relocation worked out, or waited for where the build
        #: thread works it out), ``extents`` (the driver's queries of the ranges it reaches), then ``wait`` and the
        #: build's ``ahead_kernels``, ``ahead_rebuild``, ``ahead_instantiate`` where it was built ahead, or
        #: ``kernels`` (its kernels' functions), ``rebuild``, ``instantiate`` where it was built here.
        self.phases: dict[str, float] = {}
        self._graph = torch_graph
        self._executable = executable
        self._driver = driver
        self._keep = keep  # the external tensors it may read and write: alive while it can replay

    def replay(self) -> None:
        """Launch the graph on torch's current stream."""
        if self._graph is not None:
            self._graph.replay()
        elif self._driver is not None and self._executable:
            self._driver.launch(self._executable, torch.cuda.current_stream().cuda_stream)
        else:
            raise GraphRestoreError(f"graph {self.name!r} was closed")

    def close(self) -> None:
        """Free the executable graph (outputs in the arena stay valid while the GraphCache is open; outputs in an
        external tensor, as long as that tensor)."""
        if self._driver is not None and self._executable:
            self._driver.destroy_executable(self._executable)
            self._executable = 0
        self._graph = None
        self._keep = ()

    def __repr__(self) -> str:
        how = "restored" if self.restored else "captured"
        return f"<CudaGraph {self.name!r} {how} in {self.seconds * 1e3:.1f} ms, {len(self.outputs)} outputs>"


def _device_index(device: int | str | torch.device | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise WeightCacheError(f"CUDA graphs need a CUDA device; found {d}")
    return d.index if d.index is not None else torch.cuda.current_device()


def _flatten(value: object) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, list | tuple):
        out: list[torch.Tensor] = []
        for item in value:
            out.extend(_flatten(item))
        return tuple(out)
    raise GraphRestoreError(
        f"a graph's function must return a tensor or a (nested) tuple or list of tensors, found {type(value).__name__}"
    )


def _driver_version() -> int:
    version = ctypes.c_int(0)
    try:
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
    except (OSError, AttributeError):
        pass
    return int(version.value)


def graphs_key(key: Mapping[str, Any], device: int, arena: tuple[int, int]) -> ArtifactKey:
    """The ``cuda.graphs`` artifact key: the caller's ``key`` plus what decides whether recorded graphs can be
    rebuilt here (torch, CUDA, the driver, the GPU and its compute capability, the arena's base and size, the
    artifact's format)."""
    props = torch.cuda.get_device_properties(device)
    return ArtifactKey(
        KIND,
        {
            "key": dict(key),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "driver": _driver_version(),
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "arena": list(arena),
            "format": FORMAT,
        },
    )


@attrs.frozen
class FetchedBundle:
    """A ``cuda.graphs`` artifact as :func:`fetch_bundle` got it: the bundle, the artifact's SHA-256 and size, and
    the seconds of each step (``artifact``: asked for and mapped; ``parse``: the header and descriptions checked
    against their SHA-256 and parsed)."""

    bundle: GraphBundle
    sha256: str
    bytes: int
    phases: dict[str, float]


@attrs.frozen
class BundleMiss:
    """Why :func:`fetch_bundle` has no bundle to use; ``sha256``: the SHA-256 of this uid's artifact that was there
    but could not be used (unreadable, malformed), which the next publish replaces; None where there was none."""

    reason: str
    sha256: str | None = None


def fetch_bundle(cache: Cache, weights: str, key: ArtifactKey) -> FetchedBundle | BundleMiss:
    """This uid's ``cuda.graphs`` artifact of ``weights`` for ``key`` from the keeper, mapped and parsed with every
    field checked; or why there is none to use (no artifact, another uid's, unreadable, malformed; the last two
    are logged at WARNING). Never raises for the keeper's or the artifact's sake: the caller captures instead."""
    began = time.perf_counter()
    try:
        found = cache.open_artifact(weights, key, check=False)  # mapped: no copy, no hash of the whole blob
    except WeightCacheError as exc:
        return BundleMiss(f"no {KIND} artifact: {exc}")
    if found is None:
        return BundleMiss(cache.miss_reason(weights, key) or f"no {KIND} artifact for this key")
    if found.info.publisher != os.getuid():
        found.close()
        return BundleMiss(f"the keeper's {KIND} artifact was published by uid {found.info.publisher}, not this uid")
    ours = found.info.sha256
    try:
        blob = found.view()
    except (WeightCacheError, OSError) as exc:  # its memfd is shorter than its record; the mapping failed
        log.warning("weightcache: the %s artifact could not be mapped: %s", KIND, exc)
        return BundleMiss(f"the {KIND} artifact could not be used: {exc}", ours)
    finally:
        found.close()
    if blob is None:
        return BundleMiss(f"the {KIND} artifact could not be read", ours)
    read = time.perf_counter()
    try:
        # The header and descriptions are checked against their SHA-256 here; each image by the thread that loads it.
        bundle = GraphBundle.from_bytes(blob, check_images=False)
    except GraphDescriptionError as exc:
        log.warning("weightcache: %s", exc)
        return BundleMiss(str(exc), ours)
    phases = {"artifact": read - began, "parse": time.perf_counter() - read}
    return FetchedBundle(bundle, ours, len(blob), phases)


def adoption_spans(pieces: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int]]:
    """The memory :meth:`GraphCache.adopt` copies for tensors spanning ``pieces`` (first byte, bytes), given in
    the module's order: pieces that overlap (views of one storage) form one span, ``(first byte, end)``, and the
    spans come in the order of their first piece in ``pieces`` (not by address: the arena's layout must not
    depend on where torch's allocator put them); with, for each piece, the index of its span."""
    ordered = sorted((first, first + size, order) for order, (first, size) in enumerate(pieces))
    merged: list[list[int]] = []  # [first byte, end, first piece's order]
    member: dict[int, int] = {}  # piece -> index into merged
    for first, end, order in ordered:
        if merged and first < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
            merged[-1][2] = min(merged[-1][2], order)
        else:
            merged.append([first, end, order])
        member[order] = len(merged) - 1
    rank = {old: new for new, old in enumerate(sorted(range(len(merged)), key=lambda i: merged[i][2]))}
    spans = [(first, end) for first, end, _ in sorted(merged, key=lambda m: m[2])]
    return spans, [rank[member[order]] for order in range(len(pieces))]


class EngineCapture:
    """One graph an engine captures itself, inside :meth:`GraphCache.capturing`: :meth:`record` it after the
    capture."""

    def __init__(self, cache: GraphCache, name: str, start: int) -> None:
        self._cache = cache
        self.name = name
        self._start = start
        #: Whether :meth:`record` recorded the graph for :meth:`GraphCache.publish`, and why not where it did not.
        self.recorded = False
        self.problem: str | None = "record() was not called"
        self._done = False

    def record(self, graph: torch.cuda.CUDAGraph, outputs: object) -> bool:
        """Record ``graph`` (captured into :attr:`GraphCache.pool` with ``keep_graph=True``), whose results are
        ``outputs`` (a tensor, or tuples and lists of them), for :meth:`GraphCache.publish`; whether it was
        (:attr:`problem` says why not: a graph captured without ``keep_graph``, a pointer outside the reproduced
        ranges, a kernel whose image was not kept, an earlier graph not recorded). Never raises for the cache's
        sake; once per capture (:class:`~weightcache.errors.WeightCacheError` for a second call)."""
        cache = self._cache
        if self._done:
            raise WeightCacheError(f"graph {self.name!r} was recorded once already: one record() per capture")
        self._done = True
        recording = cache._recordable and cache._arena is not None and cache._driver is not None
        with torch.cuda.device(cache.device):
            problem: str | None = None
            if recording:
                try:
                    graph.instantiate()  # kept (keep_graph=True): instantiated here, as capture_end does for others
                except Exception as exc:  # e.g. captured without keep_graph=True: it runs, it is not recorded
                    problem = f"it cannot be recorded ({type(exc).__name__}: {exc}); capture it with keep_graph=True"
            self.problem = cache._after_capture(self.name, graph, _flatten(outputs), self._start, recording, problem)
        self.recorded = self.problem is None
        return self.recorded

    def _abandoned(self) -> None:
        """The capturing block ended without :meth:`record`: the artifact would lack this graph, so nothing later
        is recorded either."""
        if not self._done:
            self._done = True
            self.problem = "record() was not called in its capturing block"
            self._cache._after_capture(self.name, None, (), self._start, True, self.problem)


class GraphCache:
    """The CUDA graphs of one model, restored from the keeper when an earlier process recorded them (see the
    module's text).

    Args:
        weights: the weights the graphs run on (a :class:`~weightcache.Handle`, a
            :class:`~weightcache.Fingerprint` or a weights digest): the artifact is kept beside them.
        key: JSON values that decide which graphs these are (model, shapes, options); torch, CUDA, driver, GPU
            and arena are added.
        device: the CUDA device (default: the current one).
        cache: the keeper to use (default: ``Cache(socket_dir)``).
        arena_bytes: the address space of static inputs and graph memory (at least 512 MiB: the driver places
            smaller reservations elsewhere than asked); the same in the recording and the restoring process.
        base: where that range starts (one GraphCache per base in a process; the same in both processes).
        verify: replay each graph rebuilt from the kept kernel images beside the captured one before recording
            it, and record it only if both give the same bytes (the graphs' functions must not depend on what
            a replay leaves behind).
        build_ahead: build every graph of a loaded artifact on a worker thread as soon as it is loaded
            (:class:`~weightcache.graphs.prebuild.Prebuilder`), each taken only once its checks passed; False:
            each graph is built when asked for, after its checks. Either way the artifact's kernel images load on
            worker threads: a capture of the process's own in CUDA's global mode while they run may fail (see
            docs/architecture.md, "Graphs built ahead").

    Never raises for the cache's sake: where something cannot work (no cuda-bindings, the arena's base taken,
    CUPTI missing, no keeper), graphs are captured as usual and :attr:`reason` says why.
    """

    def __init__(
        self,
        weights: Handle | Fingerprint | str,
        key: Mapping[str, Any] | None = None,
        *,
        device: int | str | torch.device | None = None,
        cache: Cache | None = None,
        socket_dir: str | os.PathLike[str] | None = None,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        base: int = DEFAULT_BASE,
        verify: bool = True,
        build_ahead: bool = True,
    ) -> None:
        fingerprint = weights.fingerprint if isinstance(weights, Handle) else weights
        self.weights = weights_digest(fingerprint)
        self.device = _device_index(device)
        self.verify = verify
        self.build_ahead = build_ahead
        self.key: ArtifactKey | None = None
        #: Why graphs are captured rather than restored, or not recorded (None while restoring and recording
        #: work): before the first graph, why none can be restored (no artifact, no arena, ...) or recorded (no
        #: CUPTI); from the first graph captured instead of restored on, the last such graph's ``graph '<name>' is
        #: captured: <why>``.
        self.reason: str | None = None
        #: How many pointers of the graphs restored so far were moved with their external tensors (declared at
        #: another address than recorded, :meth:`external`).
        self.relocated = 0
        self._cause: str | None = None  # why no (more) graph can be restored: the reason every later graph gives
        self._unrecordable: str | None = None  # why nothing (more) can be recorded, where no graph's record failed
        self._no_images: str | None = None  # why kernel images cannot be kept here (no CUPTI)
        self._cache = cache if cache is not None else Cache(socket_dir)
        self._arena: Arena | None = None
        self._pool: Any = None
        self._recorder: CubinRecorder | None = None
        self._bundle: GraphBundle | None = None
        self._replace: str | None = None
        self._next = 0  # index into the loaded bundle's graphs
        self._diverged = False  # the arena's layout is this process's own from here on: no more restores
        self._recordable = True  # every graph so far recorded: later ones can be too
        self._record_problem: str | None = None  # why the first graph not recorded was not
        self._records: list[GraphRecord] = []
        self._external: dict[str, tuple[AddressRange, torch.Tensor]] = {}  # name -> its range, the tensor kept
        self._also_kept: list[torch.Tensor] = []  # tensors declared again under a name, for the same memory
        # names declared again for other memory: the first declaration is kept, so no graph that reads the name is
        # restored (it would be relocated onto the first tensor while the engine uses the other)
        self._redeclared: dict[str, str] = {}
        self._capturing = False  # inside graph()'s capture or a capturing() block: the pool's allocations are its own
        self._foreign = False  # the pool served an allocation outside those: the arena's layout is not recorded
        self._images: dict[str, bytes | memoryview] = {}
        self._kernels: KernelLoader | None = None  # once there is a driver
        self._prebuilt: Prebuilder | None = None  # the artifact's graphs, built ahead on a worker thread
        self._prebuilt_from = 0  # the index of the first graph it builds
        self._prebuilt_moves: list[dict[str, int]] = []  # how far it moved external ranges, graph by graph
        # the artifact has ranges that may lie elsewhere here (external tensors): building ahead waits for the
        # first restore, when they are declared, instead of building what would have to be built again
        self._build_ahead_waits = False
        # each graph's relocation by how far its ranges moved, worked out once (_relocation)
        self._relocations: dict[tuple[int, tuple[tuple[str, int], ...]], Future[_Relocation]] = {}
        self._relocations_lock = threading.Lock()
        self._relocating: tuple[threading.Event, threading.Thread] | None = None  # _relocate_ahead's thread
        # the external ranges whose allocation the driver confirmed (extent_problems): their tensors are kept
        self._extents_passed: set[tuple[AddressRange, int]] = set()
        self._shared: dict[str, int] = {}  # each kernel's largest dynamic shared memory over the artifact's graphs
        #: Seconds of the start-up steps: ``arena`` (range, pool, driver), ``artifact`` (asked of the keeper and
        #: mapped), ``parse`` (checked).
        self.phases: dict[str, float] = {}
        self._captured = 0
        self.graphs: list[CudaGraph] = []
        self._driver: CudaGraphDriver | None = None
        if switched_off():  # before anything is reserved, served from it, subscribed to or asked of the keeper
            self._off(f"{SWITCH_ENV}=off: graphs are captured and nothing is published")
            return
        began = time.perf_counter()
        with torch.cuda.device(self.device):
            torch.cuda.init()  # type: ignore[no-untyped-call]
            torch.cuda.current_stream(self.device)  # the primary context is current on this thread from here on
            try:
                self._driver = CudaGraphDriver()
                self._kernels = KernelLoader(self._driver)
                self._arena = Arena(CudaArenaDriver(), "graphs", arena_bytes, self.device, base)
                self._alloc = _ALLOC(self._allocate)  # kept alive: torch holds the raw pointers
                self._free = _FREE(self._release)
                address = ctypes.cast(self._alloc, ctypes.c_void_p).value or 0
                release = ctypes.cast(self._free, ctypes.c_void_p).value or 0
                allocator = torch._C._cuda_customAllocator(address, release)
                self._pool = torch.cuda.MemPool(allocator)
            except (GraphRestoreError, AttributeError, RuntimeError, TypeError) as exc:
                self._driver = self._kernels = None
                if self._arena is not None:  # the range was had, torch's pool was not: give the range back
                    self._arena.close()
                    self._arena = None
                self._off(f"graph memory cannot be had at fixed addresses here ({exc}); graphs are captured")
                return
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            try:
                self._recorder = keep_kernel_images()
            except (GraphRestoreError, AttributeError) as exc:
                self.reason = self._no_images = (
                    f"kernel images cannot be kept ({exc}); graphs are restored but not recorded"
                )
                log.warning("weightcache: %s", self.reason)
            self.key = graphs_key(key or {}, self.device, (self._arena.base, self._arena.size))
            self.phases["arena"] = time.perf_counter() - began
            self._load()

    def _off(self, reason: str) -> None:
        self.reason = self._cause = self._unrecordable = reason
        self._diverged = True
        self._recordable = False
        log.warning("weightcache: %s", reason)

    # -- the pool's allocator: called by torch's caching allocator, must not raise -------------------------------

    def _allocate(self, size: int, _device: int, _stream: int | None) -> int:
        try:
            assert self._arena is not None
            if not self._capturing:  # someone else's capture with `pool`: no later graph can be restored here
                self._foreign = True
                self._recordable = False  # a later process could not restore past it: record nothing after
                self._unrecordable = self._unrecordable or _FOREIGN
            return self._arena.allocate(size)
        except Exception as exc:
            log.error("weightcache: the graph arena could not serve %d bytes: %s", size, exc)
            return 0

    def _release(self, address: int | None, size: int, _device: int, _stream: int | None) -> None:
        try:
            if self._arena is not None and address:
                self._arena.free(address, size)
        except Exception:
            log.debug("weightcache: arena free failed", exc_info=True)

    # -- the artifact ------------------------------------------------------------------------------------------

    def _load(self) -> None:
        assert self.key is not None
        fetched = fetch_bundle(self._cache, self.weights, self.key)
        if isinstance(fetched, BundleMiss):
            self.reason = self._cause = fetched.reason
            self._replace = fetched.sha256  # one of ours that is unusable: replace it
            return
        self._bundle, self._replace = fetched.bundle, fetched.sha256
        self.phases.update(fetched.phases)
        # each kernel's largest shared memory over the artifact's graphs: prepared side by side (built ahead, and
        # a graph built in this thread meanwhile), none may lower another's
        self._shared = shared_needs(r.description for r in self._bundle.graphs)
        if self._arena is not None and self._bundle.graphs:
            # every recorded graph's memory mapped now, before any thread builds graphs ahead (settle() gives back
            # what no restore reached)
            began = time.perf_counter()
            if not self._arena.map_ahead([r.end for r in self._bundle.graphs]):
                log.debug("weightcache: the arena's memory is mapped graph by graph (mapping it ahead failed)")
            self.phases["map"] = time.perf_counter() - began
        if self._kernels is not None and self._driver is not None:
            # on worker threads: the images checked, loaded and asked for their kernels; then (build_ahead) each
            # graph built and instantiated, in order, for _restore to take once its checks passed: from now on, or
            # where the artifact has ranges of other allocations (external tensors, declared before the first
            # restore), from the first restore on
            try:
                self._kernels.preload(self._bundle.images, self._bundle.graphs)
                if self.build_ahead and any(not r.own_mapping for r in self._bundle.ranges):
                    self._build_ahead_waits = True
                elif self.build_ahead:
                    self._build_ahead(0)
            except Exception as exc:  # threads that cannot start, a driver call: each graph is built when asked for
                log.warning("weightcache: the graphs are not loaded ahead (%s: %s)", type(exc).__name__, exc)

    @property
    def pool(self) -> Any:
        """The handle of the graphs' memory pool (``torch.cuda.MemPool.id``), served from the arena: what an
        engine that captures graphs itself passes as ``torch.cuda.graph(..., pool=...)`` so that their memory lies
        in the arena too; None without an arena (see :attr:`reason`) and after :meth:`close`. Inside
        :meth:`capturing` such a capture is the graph's own (recorded with :meth:`EngineCapture.record`); from the
        first allocation a capture makes here outside it (or outside :meth:`graph`) on, this GraphCache restores
        and records no more graphs (the arena's layout is this process's own)."""
        return self._pool.id if self._pool is not None and self._arena is not None else None

    @property
    def images_loaded(self) -> int:
        """Kernel images this GraphCache loaded (each once)."""
        return self._kernels.images_loaded if self._kernels is not None else 0

    @property
    def image_bytes(self) -> int:
        """The bytes of those images."""
        return self._kernels.image_bytes if self._kernels is not None else 0

    @property
    def image_seconds(self) -> float:
        """Seconds the graphs waited for those images (loads on worker threads are not counted while they run
        beside the caller)."""
        return self._kernels.image_seconds if self._kernels is not None else 0.0

    @property
    def image_steps(self) -> dict[str, float]:
        """Seconds the loads of those images spent checking (``check``), loading (``load``) and asking for their
        kernels (``functions``), summed over images that load side by side, and ``span``: from the artifact's
        load to the last image loaded."""
        return dict(self._kernels.image_steps) if self._kernels is not None else {}

    def ranges(self) -> list[AddressRange]:
        """The address ranges this process reproduces: the arena, the weights mapped at their homes, and the
        tensors declared with :meth:`external` (by name)."""
        return self._own_ranges() + [r for _, (r, _) in sorted(self._external.items())]

    def _own_ranges(self) -> list[AddressRange]:
        """The arena and the weights' homes: the ranges that are mappings of their own."""
        homes = [AddressRange(name, base, size) for name, base, size in cuda_vmm.home_ranges()]
        return ([self._arena.range()] if self._arena is not None else []) + homes

    # -- static memory -----------------------------------------------------------------------------------------

    def empty(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A contiguous tensor in the arena: at the same address in every process that makes the same calls of
        this GraphCache in the same order. Use it for a graph's static inputs. Without an arena (see
        :attr:`reason`), an ordinary tensor."""
        if self._arena is None:
            return torch.empty(tuple(shape), dtype=dtype, device=f"cuda:{self.device}")
        count = 1
        for n in shape:
            count *= n
        nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 1)
        address = self._arena.allocate(nbytes)
        return self._at(address, dtype, tuple(shape), contiguous_stride(tuple(shape)))

    def external(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Declare ``tensor``, made outside the arena (by torch's caching allocator, a library, an engine's own
        buffers), as memory the graphs may read and write, under ``name``; returns it. The recording process
        records where it lies (range ``external/<name>``); a restoring process must declare the same name, before
        the graphs that use it, for a tensor at least as large (a graph is captured otherwise, saying so), and the
        driver must know all of its recorded bytes as one device allocation. Where it lies at another address
        (torch's allocator gives a fresh process other addresses), each graph that uses it is relocated: every
        pointer the recording process found in it moves by as much (:attr:`relocated` counts them). The GraphCache
        keeps the tensor's memory alive until :meth:`close`, and each graph that may use it until that graph is
        closed. A tensor in the arena or a weights home needs no declaration (ignored); without an arena (see
        :attr:`reason`), nothing is declared.

        Raises :class:`~weightcache.errors.WeightCacheError` for a tensor on another device, of no bytes, or a
        name declared before for another address or size; after the last, no graph that reads that name is restored
        (each is captured, saying so), since the name no longer says which memory the graph is to read."""
        if not isinstance(name, str) or not name or "/" in name:
            raise WeightCacheError(f"an external tensor's name must be a non-empty string without '/', not {name!r}")
        if tensor.device.type != "cuda" or tensor.device.index != self.device:
            raise WeightCacheError(
                f"external tensor {name!r} is on {tensor.device}; this GraphCache's graphs run on cuda:{self.device}"
            )
        nbytes = extent_bytes(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size())
        if nbytes <= 0:
            raise WeightCacheError(f"external tensor {name!r} has no bytes: a graph cannot read it")
        declared = AddressRange(f"external/{name}", tensor.data_ptr(), nbytes, own_mapping=False)
        if self._arena is None or any(r.holds(declared.base) for r in self._own_ranges()):
            return tensor
        before = self._external.get(name)
        if before is not None and before[0] != declared:
            was = before[0]
            why = (
                f"external tensor {name!r} was declared at {was.base:#x} ({was.size} bytes) and now at "
                f"{declared.base:#x} ({declared.size} bytes): declare each tensor under a name of its own"
            )
            self._redeclared.setdefault(declared.name, why)
            raise WeightCacheError(why)
        if before is not None:  # the same memory again, perhaps through another tensor: keep both owners
            self._also_kept.append(tensor.detach())
        else:
            self._external[name] = (declared, tensor.detach())  # its storage, whatever the caller does to `tensor`
        return tensor

    def reads(self, name: str) -> list[str] | None:
        """The names (as given to :meth:`external`) of the tensors the artifact's graph ``name`` reads, where it is
        the next graph to restore and restoring has not stopped: what must be declared before :meth:`restore` asks
        for it (an engine that declares many tensors may declare just these). None otherwise (no artifact,
        restoring stopped, another graph next): declare every tensor the graph may read."""
        bundle = self._bundle
        if bundle is None or self._diverged or self._next >= len(bundle.graphs):
            return None
        record = bundle.graphs[self._next]
        if record.name != name:
            return None
        return sorted(n.removeprefix("external/") for n in record.reach if n.startswith("external/"))

    def start_builds(self) -> bool:
        """Say that the external tensors the graphs read are declared (:meth:`external`): the artifact's graphs, from
        the next one to restore on, are built ahead from now on, each relocated to where those tensors lie here,
        instead of from the first :meth:`restore` on. An engine that declares its tensors early (the vLLM kind
        declares the runner's right after making the GraphCache) gains the time until its first restore: the
        builds are the driver's work (nodes added, graphs instantiated) that a restore waits for. A graph whose
        tensors are declared elsewhere afterwards is not taken as built: it is built when asked for, and the graphs
        after it are built ahead again. Where the artifact has no external ranges, building started at load, and
        this changes nothing. Returns whether graphs are being built ahead (False without an artifact, with
        ``build_ahead=False``, after restoring stopped or :meth:`settle`; True also once every graph built ahead
        was taken). Never raises: where the builds cannot start, each graph is built when asked for."""
        if self._build_ahead_waits and self._bundle is not None and not self._diverged:
            self._build_ahead_waits = False
            try:
                with torch.cuda.device(self.device):  # (the build thread takes the caller's context)
                    self._check_extents_ahead()
                    self._build_ahead(self._next)
            except Exception as exc:  # e.g. a driver query that failed: each graph is built when asked for
                log.warning("weightcache: the graphs are not built ahead (%s: %s)", type(exc).__name__, exc)
        return self._prebuilt is not None

    def _check_extents_ahead(self) -> None:
        """Ask the driver now, before any graph is built ahead, for the allocation of every declared tensor the
        artifact's graphs left to restore read, as far as each reaches (what each restore's extents check asks
        first; kept in ``_extents_passed``, so those checks ask nothing more): the queries are not made behind
        the build thread's graph calls. What fails here is asked again, and refused, by the restore it concerns."""
        bundle, driver = self._bundle, self._driver
        if bundle is None or driver is None:
            return
        here = self.ranges()
        declared = {r.name for r in here if not r.own_mapping}
        reach: dict[str, int] = {}
        for record in bundle.graphs[self._next :]:
            for name, extent in record.reach.items():
                if name in declared:
                    reach[name] = max(reach.get(name, 0), extent)

        def ask(reach: Mapping[str, int]) -> list[str]:  # the driver asked about these ranges, where they can move
            moved, problems = moves(bundle.ranges, here, reach)
            ranges = moved_ranges(bundle.ranges, moved)
            return problems or extent_problems(ranges, here, reach, driver.pointer_range, self._extents_passed)

        problems = ask(reach) if reach else []
        if not problems:
            return
        # a range with a problem (smaller here, overlapping ones moved apart, not mapped) concerns only the graphs
        # that read it, which their restores refuse: the others' ranges are still asked about here, graph by graph
        log.debug("weightcache: the declared tensors are checked graph by graph: %s", "; ".join(problems))
        for record in bundle.graphs[self._next :]:
            own = {name: extent for name, extent in record.reach.items() if name in declared}
            if own:
                ask(own)

    def reproduced(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in the arena or a weights home (memory a restoring process has at the
        same address without a declaration); False without an arena."""
        if self._arena is None or not tensor.is_cuda:
            return False
        address = tensor.untyped_storage().data_ptr()
        return any(r.holds(address) for r in self._own_ranges())

    def adopt(
        self, module: torch.nn.Module, *, keep_previous: bool = False, parameters: bool = True
    ) -> torch.nn.Module:
        """Copy ``module``'s parameters and buffers that lie outside the arena and the weights' homes into the
        arena, so that a graph of it can be restored: for weights that do not come from the keeper, and for the
        buffers a model makes itself (a rotary embedding's table, which vLLM's FULL graphs read). The memory is
        laid out in ``named_parameters``, then ``named_buffers`` order (the same calls get the same addresses in
        every process); tensors whose memory overlaps (views of one storage) are copied as one span into one
        storage and keep sharing it, with their shapes, strides and offsets; each copy keeps its tensors'
        alignment modulo 512 bytes. Tensors already in the arena or at a weights home, on another device, or
        without storage of their own stay. Each tensor object stays the same (its ``.data`` is the copy, a normal
        tensor even inside ``torch.inference_mode``), so code that holds it sees the copy. Every copy is made
        before any tensor is switched, so a failure (the arena full) leaves the module and the arena's pointer as
        they were. With ``keep_previous``, the memory each tensor had is kept until :meth:`close`: graphs
        captured before (an engine's own) still read it, and a write to the tensor from then on reaches the copy
        only. With ``parameters=False``, only buffers are copied (not one that shares memory with a parameter).
        The moved tensors live in the arena: do not use them after :meth:`close`. Returns ``module``; without an
        arena (see :attr:`reason`), nothing moves."""
        if self._arena is None:
            return module
        arena = self._arena
        chosen: list[tuple[torch.Tensor, int, int]] = []  # (tensor, its first byte, bytes it spans)
        staying: list[tuple[int, int]] = []  # parameters left where they are (parameters=False): [first, end)
        for group, tensors in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for name, tensor in tensors:
                try:
                    if not tensor.is_cuda or tensor.device.index != self.device or self.reproduced(tensor):
                        continue
                    span = extent_bytes(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size())
                    first = tensor.data_ptr()
                except (RuntimeError, NotImplementedError) as exc:  # a tensor subclass without storage of its own
                    log.debug("weightcache: %s is not adopted (%s)", name, exc)
                    continue
                if span <= 0:
                    continue
                if group == "parameter" and not parameters:
                    staying.append((first, first + span))
                elif any(a < first + span and first < b for a, b in staying):
                    log.debug(
                        "weightcache: buffer %s is not adopted: it shares memory with a parameter that stays", name
                    )
                else:
                    chosen.append((tensor, first, span))
        spans, member = adoption_spans([(first, size) for _, first, size in chosen])
        used = arena.used
        with torch.inference_mode(False), torch.no_grad(), torch.cuda.device(self.device):
            bases: list[tuple[torch.Tensor, int]] = []  # each span's copy (bytes) and the address it stands for
            owners: list[list[torch.Tensor]] = [[] for _ in spans]
            for (tensor, _, _), index in zip(chosen, member):
                owners[index].append(tensor)
            try:
                for (first, end), kept in zip(spans, owners):  # every copy first: a failure switches nothing
                    pad = first % ALIGNMENT  # the copy keeps each tensor's alignment (Triton assumes 16 bytes)
                    address = arena.allocate(end - first + pad)
                    source = self._at(first, torch.uint8, (end - first,), (1,), owner=kept)
                    copy = self._at(address, torch.uint8, (end - first + pad,), (1,))
                    copy[pad:].copy_(source)
                    bases.append((copy, first - pad))
                torch.cuda.current_stream(self.device).synchronize()  # done before the old memory may go
            except BaseException:
                arena.rewind_to(used)  # nothing was switched: as if never called
                raise
            for (tensor, first, _), index in zip(chosen, member):
                copy, origin = bases[index]  # one storage a span: views of one storage stay views of one
                offset, itemsize = first - origin, tensor.element_size()
                if offset % itemsize:  # (an element not aligned to its size: a tensor at its own address)
                    moved = self._at(
                        copy.data_ptr() + offset, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())
                    )
                else:
                    moved = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
                    moved.set_(copy.untyped_storage(), offset // itemsize, tensor.shape, tensor.stride())
                if keep_previous:
                    self._also_kept.append(tensor.data)
                tensor.data = moved
        if chosen:
            log.info(
                "weightcache: %d tensor(s) of %s copied into the graph arena (%d bytes)",
                len(chosen),
                type(module).__name__,
                arena.used - used,
            )
        return module

    def _at(
        self,
        address: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        owner: object | None = None,
    ) -> torch.Tensor:
        """A tensor at ``address``, keeping ``owner`` (default: the arena) alive."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = extent_bytes(shape, stride, itemsize)
        memory = _Memory(address, max(nbytes, 1), self._arena if owner is None else owner)
        raw = torch.as_tensor(memory, device=f"cuda:{self.device}")
        return raw[:nbytes].view(dtype).as_strided(shape, stride)

    # -- graphs ------------------------------------------------------------------------------------------------

    def graph(self, name: str, fn: Callable[[], object], *, warmup: int = 1) -> CudaGraph:
        """The graph of ``fn()``: restored from the artifact when this is the next graph it recorded and every
        check passes, else captured (after ``warmup`` eager calls on a side stream, as torch recommends) and
        recorded for :meth:`publish`. ``fn`` must read only static memory (:meth:`empty`, the weights, tensors
        declared with :meth:`external`) and return its result tensor(s)."""
        started = time.perf_counter()
        with torch.cuda.device(self.device):
            restored = self._restore(name, started)
            if isinstance(restored, str):
                self.reason = f"graph {name!r} is captured: {restored}"
                restored = self._capture(name, fn, warmup, started, restored)
        self.graphs.append(restored)
        return restored

    # -- graphs an engine captures itself -----------------------------------------------------------------------

    def restore(self, name: str) -> CudaGraph | None:
        """For an engine that captures its graphs itself (vLLM's, SGLang's own loops): the next graph the
        artifact recorded, restored, where its name is ``name`` and every check of :meth:`graph` passes; None where
        it is not restored (:attr:`reason` says why; from the first refusal on no later graph is restored), and
        the engine captures it as usual, through :meth:`capturing`. The engine replays the returned graph
        (:meth:`CudaGraph.replay`) and reads its outputs (:attr:`CudaGraph.outputs`), as with :meth:`graph`."""
        started = time.perf_counter()
        with torch.cuda.device(self.device):
            restored = self._restore(name, started)
        if isinstance(restored, str):
            self.reason = f"graph {name!r} is captured: {restored}"  # the last such reason, as documented
            return None
        self.graphs.append(restored)
        return restored

    @contextlib.contextmanager
    def capturing(self, name: str) -> Iterator[EngineCapture]:
        """For an engine that captures its graphs itself: around its capture of graph ``name`` (after its warm-up
        runs, which must not allocate from :attr:`pool`), into :attr:`pool`, with a
        ``torch.cuda.CUDAGraph(keep_graph=True)``; then ``capture.record(graph, outputs)`` (inside the block)
        records it for :meth:`publish` as :meth:`graph` records its own: the pool's allocations in the block are
        this graph's memory, and its order among the graphs is the order of these blocks and :meth:`graph`
        calls. A graph not recorded (see :attr:`EngineCapture.problem`) still runs; later ones are not recorded."""
        arena = self._arena
        start = arena.used if arena is not None else 0
        capture = EngineCapture(self, name, start)
        self._capturing = True
        try:
            yield capture
        finally:
            self._capturing = False
            capture._abandoned()

    def _refuse(self, name: str, why: str, record: GraphRecord | None = None) -> str:
        """Capture ``name`` instead of restoring it: log why, restore nothing more. ``record``: the graph's record
        whose memory the arena was moved past: moved back, so that the capture gets the recorded addresses."""
        if record is not None and self._arena is not None and self._arena.used == record.end:
            self._arena.rewind_to(record.start)
        self.reason = self._cause = f"graph {name!r} is captured: {why}"
        self._diverged = True
        self.settle()
        log.warning("weightcache: %s", self.reason)
        return why

    def settle(self) -> None:
        """Let this GraphCache's worker threads finish: the graphs built ahead and not taken are destroyed (builds
        running are waited for) and the kernel images still loading are waited for. From then on no thread of this
        GraphCache calls the driver but the caller's (a graph restored later is built when asked for), so the
        process may capture graphs of its own in CUDA's global capture mode (torch's default), which fails while
        another thread calls the driver. The arena's memory mapped ahead for graphs not restored (past what was
        handed out) is given back; captures map what they use. A refusal does this itself, and so does
        :meth:`close`."""
        if self._prebuilt is not None:
            self._prebuilt.close()
            self._prebuilt = None
        self._build_ahead_waits = False
        self._stop_relocating()
        self._relocations.clear()
        if self._kernels is not None:
            self._kernels.settle()
        if self._arena is not None:
            self._arena.unmap_unused()

    def _restore(self, name: str, started: float) -> CudaGraph | str:
        """The graph rebuilt from the artifact, or why it is not."""
        bundle, arena, driver = self._bundle, self._arena, self._driver
        if bundle is None or arena is None or driver is None:
            return self._cause or "no artifact"
        if self._diverged:
            return f"restoring stopped at an earlier graph ({self._cause})"
        if self._foreign:
            return self._refuse(name, _FOREIGN)
        if self._next >= len(bundle.graphs):
            return f"the artifact holds {len(bundle.graphs)} graph(s), this is graph {self._next + 1}"
        record = bundle.graphs[self._next]
        if record.name != name:
            return self._refuse(name, f"the artifact's next graph is {record.name!r} (graphs come in recorded order)")
        if arena.used != record.start:
            return self._refuse(
                name, f"its memory started at arena offset {record.start} when recorded, {arena.used} here"
            )
        phases: dict[str, float] = {}
        executable: int | None = None
        count = 0  # pointers moved with their external tensors
        mark = started

        def step(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - mark
            mark = now

        try:
            arena.skip_to(record.end)
            step("map")
            here = self.ranges()
            moved, problems = moves(bundle.ranges, here, record.reach)
            problems += [self._redeclared[n] for n in sorted(record.reach) if n in self._redeclared]
            step("checks")
            relocation = self._relocation(self._next, moved) if moved and not problems else None
            if relocation is not None:
                problems += relocation.problems
            step("relocate")
            problems += extent_problems(
                moved_ranges(bundle.ranges, moved), here, record.reach, driver.pointer_range, self._extents_passed
            )
            step("extents")
            outputs_here = _moved_outputs(record.outputs, bundle.ranges, moved)
            problems += self._output_problems(outputs_here)
            if arena.name in record.reach and record.reach[arena.name] > record.end:
                problems.append(f"its pointers reach arena offset {record.reach[arena.name]}, past its memory")
            if problems:
                return self._refuse(name, f"{len(problems)} address check(s) failed, e.g. {problems[0]}", record)
            if relocation is not None:  # tensors declared elsewhere than recorded: every pointer into them moved
                if relocation.description is None:
                    raise GraphDescriptionError(relocation.error or "not relocated")
                record = attrs.evolve(record, description=relocation.description, outputs=outputs_here)
                count = relocation.count
            step("checks")
            if self._build_ahead_waits:  # the first restore: the external tensors are declared now
                self._build_ahead_waits = False
                self._build_ahead(self._next + 1)
            built = self._take_prebuilt(name, moved)
            if built is not None:  # built ahead (the same steps as below, on a worker thread)
                executable = built.executable
                step("wait")
                phases.update({f"ahead_{part}": seconds for part, seconds in built.phases.items()})
            else:
                assert self._kernels is not None
                built = build(driver, self._kernels, record, bundle.images, self._shared)
                executable = built.executable
                phases.update(built.phases)
            outputs = tuple(self._output(o) for o in record.outputs)
        except Exception as exc:  # never raises for the cache's sake: whatever failed, the graph is captured
            self._discard(executable)
            if isinstance(exc, GraphRestoreError | GraphDescriptionError):
                return self._refuse(name, str(exc), record)
            log.debug("weightcache: graph %r: the restore failed", name, exc_info=True)
            return self._refuse(name, f"its restore failed ({type(exc).__name__}: {exc})", record)
        with self._relocations_lock:  # (the relocating thread skips a graph whose index is below _next)
            self._relocations.pop((self._next, _frozen(moved)), None)
            self._next += 1
        self.relocated += count
        self._records.append(record)
        self._images.update({d: bundle.images[d] for d in record.kernels.values()})
        seconds = time.perf_counter() - started
        keep = tuple(t for r, t in self._external.values() if r.name in record.reach)
        restored = CudaGraph(
            name, outputs, restored=True, reason=None, seconds=seconds, executable=executable, driver=driver, keep=keep
        )
        restored.phases = phases
        return restored

    def _take_prebuilt(self, name: str, moved: Mapping[str, int]) -> Prebuilt | None:
        """The next graph as built ahead; None where there is none, or its build failed: then it is built again
        here, now that its memory is mapped (a memset or copy node may need that), and fails here if it must.
        One built ahead with external ranges moved otherwise than ``moved`` (built before they were declared
        where they are) is not taken: the graphs after it are built ahead again, each relocated to the ranges
        declared now, and this one is built here."""
        if self._prebuilt is None:
            return None
        index = self._next - self._prebuilt_from
        if not 0 <= index < len(self._prebuilt_moves):  # (never: each graph not restored stops the restoring)
            return None
        if self._prebuilt_moves[index] != moved:
            self._build_ahead(self._next + 1)
            return None
        try:
            return self._prebuilt.take(index)
        except Exception as exc:
            log.debug("weightcache: graph %r was not built ahead (%s: %s); built now", name, type(exc).__name__, exc)
            return None

    def _build_ahead(self, first: int) -> None:
        """Build the artifact's graphs from ``first`` on ahead, each relocated to the external ranges declared now
        (on the worker thread, :meth:`_relocation`; those built so far are destroyed, one being built is waited
        for)."""
        assert self._bundle is not None and self._driver is not None and self._kernels is not None
        if self._prebuilt is not None:
            self._prebuilt.close()
            self._prebuilt = None
        here = self.ranges()
        used = []
        for record in self._bundle.graphs[first:]:
            moved, problems = moves(self._bundle.ranges, here, record.reach)
            used.append(moved if not problems else {})
        self._stop_relocating()
        jobs = [(first + i, moved) for i, moved in enumerate(used) if moved]
        wanted = {(index, _frozen(moved)) for index, moved in jobs}
        with self._relocations_lock:  # relocations for moves no build or restore will ask for again
            for key in [k for k in self._relocations if k[0] >= first and k not in wanted]:
                del self._relocations[key]
        self._relocate_ahead(jobs)

        def relocated(index: int, record: GraphRecord) -> GraphRecord:
            moved = used[index]
            relocation = self._relocation(first + index, moved) if moved else None
            if relocation is None or relocation.description is None:  # refused (or failed) when asked for
                return record
            return attrs.evolve(record, description=relocation.description)

        try:
            self._prebuilt = Prebuilder(
                self._driver,
                self._kernels,
                self._bundle.graphs[first:],
                self._bundle.images,
                shared=self._shared,
                before_build=relocated,
            )
        except Exception as exc:  # threads that cannot start: each graph is built when asked for
            log.warning("weightcache: the graphs are not built ahead (%s: %s)", type(exc).__name__, exc)
            self._stop_relocating()  # (each restore works out its own relocation then)
            return
        self._prebuilt_from, self._prebuilt_moves = first, used

    def _relocate_ahead(self, jobs: list[tuple[int, dict[str, int]]]) -> None:
        """Work out the relocations of ``jobs`` (graph index, moves) in order on a thread of their own, ahead of the
        build thread, which then finds each ready (:meth:`_relocation`: whichever thread asks first works one out,
        the other waits): the relocations' Python overlaps the build thread's driver calls, which let go of the GIL,
        instead of coming before each build. A graph restored already is skipped; one such thread at a time (the
        caller has stopped the last, :meth:`_stop_relocating`)."""
        if not jobs:
            return
        stop = threading.Event()

        def work() -> None:
            for index, moved in jobs:
                if stop.is_set():
                    return
                try:
                    self._work_out(index, moved, ahead=True)
                except Exception as exc:  # the thread that needs it works it out again and raises there
                    log.debug("weightcache: graph %d was not relocated ahead: %s", index, exc)
                    return

        thread = threading.Thread(target=work, name="weightcache-relocate", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had: the build thread relocates each graph, as before
            log.debug("weightcache: relocations are not worked out ahead: %s", exc)
            return
        self._relocating = (stop, thread)

    def _stop_relocating(self) -> None:
        """Stop :meth:`_relocate_ahead`'s thread (after the relocation it is working out, if any)."""
        if self._relocating is not None:
            stop, thread = self._relocating
            self._relocating = None
            stop.set()
            thread.join()

    def _relocation(self, index: int, moved: Mapping[str, int]) -> _Relocation:
        """Graph ``index`` of the artifact relocated by ``moved`` (:func:`~weightcache.graphs.check.moves`), and
        why it may not be (:func:`~weightcache.graphs.check.relocation_problems`): worked out once for each graph
        and moves, by whichever thread asks first (the relocating thread, the build ahead, or the restore), since
        each scans every argument word of the graph; one that asks while another works it out waits for it."""
        relocation = self._work_out(index, moved, ahead=False)
        assert relocation is not None
        return relocation

    def _work_out(self, index: int, moved: Mapping[str, int], *, ahead: bool) -> _Relocation | None:
        """:meth:`_relocation`; with ``ahead`` (the relocating thread), None and nothing worked out for a graph
        restored already (``index`` below the next one, asked under the lock the restore advances it under), whose
        relocation nobody would take out of the memo again."""
        assert self._bundle is not None
        key = (index, _frozen(moved))
        with self._relocations_lock:
            if ahead and index < self._next:
                return None
            found = self._relocations.get(key)
            mine = found is None
            if found is None:
                found = self._relocations[key] = Future()
        if mine:
            try:
                found.set_result(_relocated(self._bundle.graphs[index], self._bundle.ranges, moved))
            except BaseException as exc:  # (relocated's own errors are in its result: this is the unexpected)
                found.set_exception(exc)
        return found.result()

    def _discard(self, executable: int | None) -> None:
        """Destroy an executable graph a failed restore or check made (no error of its own escapes)."""
        if executable is not None and self._driver is not None:
            try:
                self._driver.destroy_executable(executable)
            except Exception:
                log.debug("weightcache: destroying an executable graph failed", exc_info=True)

    def _output_problems(self, outputs: Iterable[Output]) -> list[str]:
        arena = self._arena
        assert arena is not None
        problems = []
        for i, o in enumerate(outputs):
            extent = extent_bytes(o.shape, o.stride, DTYPES[o.dtype].itemsize)
            in_arena = arena.base <= o.address and o.address + extent <= arena.base + arena.used
            if not in_arena and self._external_holding(o.address, extent) is None:
                problems.append(f"output {i} at {o.address:#x} lies outside the arena's memory and external tensors")
        return problems

    def _external_holding(self, address: int, nbytes: int) -> torch.Tensor | None:
        """The external tensor whose bytes hold ``nbytes`` from ``address``, if one does."""
        for declared, tensor in self._external.values():
            if declared.base <= address and address + nbytes <= declared.base + declared.size:
                return tensor
        return None

    def _output(self, o: Output) -> torch.Tensor:
        """A restored graph's output: arena memory, or a view of the external tensor that holds it."""
        extent = extent_bytes(o.shape, o.stride, DTYPES[o.dtype].itemsize)
        owner = self._external_holding(o.address, extent)  # None: the arena (_output_problems checked it)
        return self._at(o.address, TORCH_DTYPES[o.dtype], o.shape, o.stride, owner)

    def _kernel_functions(
        self, kernels: Mapping[str, str], images: Mapping[str, bytes | memoryview], *, check: bool
    ) -> dict[str, int]:
        """Each kernel's function handle from this process's own load of its image (``check``: the image checked
        against its SHA-256 first: an artifact's, which is mapped unchecked)."""
        assert self._kernels is not None
        return self._kernels.functions(kernels, images, check=check)

    def _capture(self, name: str, fn: Callable[[], object], warmup: int, started: float, why: str) -> CudaGraph:
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        current.wait_stream(side)
        recording = self._recordable and self._arena is not None and self._driver is not None
        graph = torch.cuda.CUDAGraph(keep_graph=True) if recording else torch.cuda.CUDAGraph()
        start = self._arena.used if self._arena is not None else 0
        pool = self._pool.id if self._pool is not None else None
        stream = getattr(self, "_stream", None)
        self._capturing = True
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs = _flatten(fn())
        finally:
            self._capturing = False
        if recording:
            graph.instantiate()
        problem = self._after_capture(name, graph, outputs, start, recording)
        return CudaGraph(
            name,
            outputs,
            restored=False,
            reason=why,
            seconds=time.perf_counter() - started,
            recorded=problem is None,
            record_problem=problem,
            torch_graph=graph,
            keep=tuple(t for _, t in self._external.values()),
        )

    def _after_capture(
        self,
        name: str,
        graph: torch.cuda.CUDAGraph | None,
        outputs: tuple[torch.Tensor, ...],
        start: int,
        recording: bool,
        problem: str | None = None,
    ) -> str | None:
        """After a capture (this GraphCache's own, instantiated; or an engine's in :meth:`capturing`): count it,
        record it if ``recording`` and there is no ``problem`` already; None, or why it is not recorded (from the
        first such graph on, no later one is)."""
        self._captured += 1
        if not recording:
            return self._record_problem or self._unrecordable or "an earlier graph was not recorded"
        if problem is None:
            try:
                assert graph is not None
                problem = self._record(name, graph, outputs, start)
            except Exception as exc:  # never raises for the cache's sake: the graph is captured, not recorded
                log.debug("weightcache: graph %r: recording failed", name, exc_info=True)
                problem = f"recording it failed ({type(exc).__name__}: {exc})"
        if problem is not None:
            self._recordable = False
            self._record_problem = self._record_problem or f"graph {name!r}: {problem}"
            log.warning("weightcache: graph %r is captured but not recorded: %s", name, problem)
        return problem

    def _record(
        self, name: str, graph: torch.cuda.CUDAGraph, outputs: tuple[torch.Tensor, ...], start: int
    ) -> str | None:
        """Record a captured graph for :meth:`publish`; None, or why it cannot be recorded."""
        arena, driver, recorder = self._arena, self._driver, self._recorder
        assert arena is not None and driver is not None
        if recorder is None:
            return self._no_images or "kernel images cannot be kept here"

        def module_of(function: int) -> int | None:
            try:
                return driver.function_module(function)
            except GraphRestoreError:
                return None

        def image_of(name: str, function: int, by_name: bool = False) -> str | None:
            """``function``'s image: its module's where that load was seen, else (``by_name``) the one kept image
            of that name (a name several functions of the graph share is told apart by seen modules only)."""
            return recorder.image_for(name, module_of(function), by_name=by_name)

        try:
            description, functions = describe(driver, graph.raw_cuda_graph(), image_of)
        except GraphRestoreError as exc:
            return str(exc)
        ranges = self.ranges()
        tally: dict[tuple[int, int], list[int]] = {}
        found, problems = pointers(description, ranges, driver.pointer_range, tally)
        if problems:
            largest = sorted(tally.items(), key=lambda item: -len(item[1]))[:4]
            where = "; ".join(
                f"{len(at)} address(es) in allocation {base:#x} ({size} bytes): "
                f"{', '.join(f'{a:#x}' for a in at[:3])}{', ...' if len(at) > 3 else ''}"
                for (base, size), at in largest
            )
            more = f" and {len(tally) - len(largest)} more allocation(s)" if len(tally) > len(largest) else ""
            return (
                f"{len(problems)} address(es) outside the reproduced ranges"
                f"{f' ({where}{more})' if where else ''}, e.g. {problems[0]}"
            )
        kernels: dict[str, str] = {}
        for kernel in sorted(description.kernels()):
            digest = kernel_image(kernel) or image_of(kernel, functions[kernel], by_name=True)
            if digest is None:
                return recorder.why_unknown(kernel, module_of(functions[kernel]))
            kernels[kernel] = digest
        recorded = tuple(Output(o.data_ptr(), _NAMES[o.dtype], tuple(o.shape), tuple(o.stride())) for o in outputs)
        record = GraphRecord(name, start, arena.used, description, recorded, kernels, extents(found, ranges))
        problems = self._output_problems(recorded)
        if problems:
            return problems[0]
        images = {d: recorder.image(d) for d in kernels.values()}
        if self.verify:
            why = self._verify(graph, description, kernels, images, outputs)
            if why is not None:
                return why
        self._records.append(record)
        self._images.update(images)
        return None

    def _verify(
        self,
        graph: torch.cuda.CUDAGraph,
        description: GraphDescription,
        kernels: Mapping[str, str],
        images: Mapping[str, bytes],
        outputs: tuple[torch.Tensor, ...],
    ) -> str | None:
        """Replay the captured graph and one rebuilt from the kept images; None when their outputs are the same
        bytes."""
        driver = self._driver
        assert driver is not None
        executable: int | None = None
        try:
            functions = self._kernel_functions(kernels, images, check=False)
            prepare(driver, description, functions, self._shared)
            rebuilt = rebuild(driver, description, functions)
            try:
                executable = driver.instantiate(rebuilt)
            finally:
                driver.destroy_graph(rebuilt)
        except Exception as exc:  # GraphRestoreError, or anything else a driver call raised
            self._discard(executable)
            return f"the graph cannot be rebuilt from the kept kernel images: {exc}"
        try:
            graph.replay()
            expected = [o.detach().clone() for o in outputs]
            driver.launch(executable, torch.cuda.current_stream().cuda_stream)
            torch.cuda.current_stream().synchronize()
            for i, (want, got) in enumerate(zip(expected, outputs)):
                if not torch.equal(_bytes(want), _bytes(got)):
                    return f"output {i} of the graph rebuilt from the kept kernel images differs from the captured one"
        finally:
            driver.destroy_executable(executable)
        return None

    def publish(self) -> bool:
        """Publish the recorded graphs (those restored and those captured and recorded, in order) if this process
        captured any, replacing the artifact loaded; whether it did. Call it after the last graph. Logs and returns
        False where the keeper refuses it, and where this process recorded fewer graphs than the artifact it
        loaded holds (a graph it could not record: the artifact is kept rather than replaced by a shorter one)."""
        if switched_off() or not self._captured or not self._records or self._arena is None or self.key is None:
            return False
        loaded = len(self._bundle.graphs) if self._bundle is not None else 0
        if len(self._records) < loaded:  # never replace the artifact loaded with one that holds fewer graphs
            log.warning(
                "weightcache: the %s artifact for %s is kept as it is: this process recorded %d of its %d graphs (%s)",
                KIND,
                self.weights[:12],
                len(self._records),
                loaded,
                self._record_problem or self.reason,
            )
            return False
        images = {d: self._images[d] for r in self._records for d in r.kernels.values()}
        bundle = GraphBundle(tuple(self.ranges()), tuple(self._records), images)
        blob = bundle.to_bytes()
        try:
            made = self._cache.put_artifact(self.weights, self.key, blob, replace=self._replace)
        except WeightCacheError as exc:
            log.warning("weightcache: could not publish the %s artifact for %s: %s", KIND, self.weights[:12], exc)
            return False
        if not made.created:
            log.warning(
                "weightcache: the keeper kept the %s artifact it holds for %s (another process published one "
                "meanwhile, or it is not the one this process loaded); this one was not published",
                KIND,
                self.weights[:12],
            )
            made.close()
            return False
        made.close()
        self._replace = hashlib.sha256(blob).hexdigest()
        log.info(
            "weightcache: published %s artifact for %s: %d graphs, %d kernel images, %d bytes",
            KIND,
            self.weights[:12],
            len(self._records),
            len(images),
            len(blob),
        )
        return True

    def close(self) -> None:
        """Free the graphs, the modules this GraphCache loaded and the arena. Tensors of the arena (static inputs,
        outputs, adopted parameters) must not be used after this."""
        for g in self.graphs:
            g.close()
        self.settle()  # before the modules their functions come from are unloaded
        self._recorder = None  # the process's recorder stays subscribed (CUPTI allows one subscriber)
        if self._kernels is not None or self._arena is not None:
            torch.cuda.synchronize(self.device)
        if self._kernels is not None:
            self._kernels.close()
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self._external.clear()
        self._also_kept.clear()

    def __enter__(self) -> GraphCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@attrs.frozen
class _Relocation:
    """A graph relocated by how far its external ranges moved: why it may not be (``problems``), else its
    ``description`` relocated (None where relocating failed: ``error``) and how many pointers moved (``count``)."""

    problems: list[str]
    description: GraphDescription | None = None
    count: int = 0
    error: str | None = None


def _relocated(record: GraphRecord, recorded: Sequence[AddressRange], moved: Mapping[str, int]) -> _Relocation:
    """``record``'s graph relocated by ``moved``, or the problems of
    :func:`~weightcache.graphs.check.relocation_problems` that stop it."""
    problems = relocation_problems(record.description, recorded, moved)
    if problems:
        return _Relocation(problems)
    try:
        description, count = relocate(record.description, recorded, moved)
    except GraphDescriptionError as exc:
        return _Relocation([], error=str(exc))
    return _Relocation([], description, count)


def _frozen(moved: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(moved.items()))


def _moved_outputs(
    outputs: tuple[Output, ...], ranges: Sequence[AddressRange], moved: Mapping[str, int]
) -> tuple[Output, ...]:
    """``outputs`` with each that lies in a range of ``moved`` (an external tensor declared elsewhere than
    recorded) moved with it."""
    if not moved:
        return outputs

    def here(o: Output) -> Output:
        inside = next((r for r in ranges if r.name in moved and r.holds(o.address)), None)
        return o if inside is None else attrs.evolve(o, address=o.address + moved[inside.name])

    return tuple(here(o) for o in outputs)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


__all__ = [
    "DEFAULT_ARENA_BYTES",
    "KIND",
    "BundleMiss",
    "CudaGraph",
    "EngineCapture",
    "FetchedBundle",
    "GraphCache",
    "adoption_spans",
    "fetch_bundle",
    "graphs_key",
    "keep_kernel_images",
    "stop_keeping_kernel_images",
]
