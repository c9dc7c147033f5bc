"""The kept kernel images of graphs loaded into this process: :class:`KernelLoader`.

A graph rebuilt in a new process needs a handle of each kernel it launches, and handles cannot be found by name
(:mod:`~weightcache.graphs.cubins`), so the process loads the images the artifact carries itself and asks each
module for its kernels. The loader does that once per image, and for an artifact's images ahead of time
(:meth:`KernelLoader.preload`): on worker threads, each image is checked against its SHA-256, loaded
(``cuModuleLoadData``) and asked for every kernel the graphs use (``cuModuleGetFunction``, where the driver's lazy
loading loads each function), while the caller parses, checks and rebuilds; hashing and the driver's work run
without the GIL. No byte of an image that does not match its SHA-256 reaches the driver.

Layer L3; imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from ..errors import GraphRestoreError
from .bundle import GraphRecord, image_matches
from .cubins import loading_kept_images
from .description import kernel_name

log = logging.getLogger("weightcache.graphs")

#: Worker threads that check and load an artifact's images.
MAX_THREADS = 8


class ModuleDriver(Protocol):
    """The driver calls a :class:`KernelLoader` makes (:class:`~weightcache.graphs.driver.CudaGraphDriver` has
    them)."""

    def load_module(self, image: bytes | memoryview) -> int: ...

    def module_function(self, module: int, name: str) -> int | None: ...

    def unload_module(self, module: int) -> None: ...

    def current_context(self) -> int: ...

    def make_current(self, context: int) -> None: ...


class KernelLoader:
    """Modules loaded from kept kernel images, each image once, and the kernels' function handles."""

    def __init__(self, driver: ModuleDriver) -> None:
        self._driver = driver
        self._modules: dict[str, int] = {}
        self._functions: dict[tuple[str, str], int | None] = {}
        self._loading: dict[str, Future[tuple[int, dict[str, int | None]]]] = {}
        self._lock = threading.Lock()  # functions() from several threads (graphs built ahead, the caller)
        #: Images loaded (each once), their bytes, and the seconds callers of :meth:`functions` waited for them.
        self.images_loaded = 0
        self.image_bytes = 0
        self.image_seconds = 0.0
        #: Seconds spent in each step of loading images, summed over images (loaded side by side, so the sum can
        #: exceed the wall time): ``check`` (SHA-256), ``load`` (``cuModuleLoadData``), ``functions``
        #: (``cuModuleGetFunction`` of the kernels asked for, where lazy loading loads each); and ``span``, from
        #: the first :meth:`preload` to its last image loaded.
        self.image_steps: dict[str, float] = {}
        self._steps_lock = threading.Lock()
        self._preload_began: float | None = None

    def preload(self, images: Mapping[str, bytes | memoryview], graphs: Iterable[GraphRecord]) -> None:
        """Start checking and loading every image of ``images`` (an artifact's, taken unchecked) on worker
        threads, each module asked for the kernels ``graphs`` use from it; :meth:`functions` waits for the ones
        it needs. A preload that failed is not remembered (a module it had loaded is unloaded): :meth:`functions`
        loads the caller's copy of that image instead (a recorder's own image, after the artifact's did not
        match) and raises what that load raises."""
        todo = {d: image for d, image in images.items() if d not in self._modules and d not in self._loading}
        if not todo:
            return
        wanted: dict[str, set[str]] = {}
        for record in graphs:
            for name, digest in record.kernels.items():
                wanted.setdefault(digest, set()).add(name)
        driver, context = self._driver, self._driver.current_context()

        if self._preload_began is None:
            self._preload_began = time.perf_counter()

        def load(digest: str, image: bytes | memoryview) -> tuple[int, dict[str, int | None]]:
            driver.make_current(context)
            module = self._load(digest, image, check=True)
            try:
                began = time.perf_counter()
                names = sorted(wanted.get(digest, ()))
                found = {name: driver.module_function(module, kernel_name(name)) for name in names}
                self._count("functions", began)
                return module, found
            except BaseException:  # the failed preload is not remembered (functions()): nothing else unloads it
                driver.unload_module(module)
                raise

        pool = ThreadPoolExecutor(max_workers=min(MAX_THREADS, len(todo)), thread_name_prefix="weightcache-images")
        self._loading.update({digest: pool.submit(load, digest, image) for digest, image in todo.items()})
        pool.shutdown(wait=False)

    def functions(
        self, kernels: Mapping[str, str], images: Mapping[str, bytes | memoryview], *, check: bool
    ) -> dict[str, int]:
        """Each kernel of ``kernels`` (its name or qualified name -> SHA-256 of its image) -> its function handle
        (the image's function of that name, :func:`~weightcache.graphs.description.kernel_name`), from this process's
        own load of its image in ``images``: preloaded, loaded earlier, or loaded now (``check``: the image
        checked against its SHA-256 first; an artifact's images are taken unchecked, a recorder's are this
        process's own). :class:`GraphRestoreError` if an image does not match or has no kernel of that name.
        Thread-safe."""
        with self._lock:
            return self._functions_of(kernels, images, check=check)

    def _functions_of(
        self, kernels: Mapping[str, str], images: Mapping[str, bytes | memoryview], *, check: bool
    ) -> dict[str, int]:
        found = {}
        for name, digest in kernels.items():
            module = self._modules.get(digest)
            if module is None:
                began = time.perf_counter()
                loading = self._loading.pop(digest, None)
                if loading is not None:
                    try:
                        module, resolved = loading.result()
                    except Exception:
                        pass  # the preloaded copy failed: the caller's own copy below (a recorder's loads)
                    else:
                        self._functions.update({(digest, n): f for n, f in resolved.items()})
                if module is None:  # checked as the caller says; the artifact's failing copy fails again
                    module = self._load(digest, images[digest], check=check)
                self._modules[digest] = module
                self.images_loaded += 1
                self.image_bytes += len(images[digest])
                self.image_seconds += time.perf_counter() - began
            if (digest, name) not in self._functions:
                began = time.perf_counter()
                self._functions[(digest, name)] = self._driver.module_function(module, kernel_name(name))
                self._count("functions", began)
            function = self._functions[(digest, name)]
            if function is None:
                raise GraphRestoreError(f"the kept image {digest[:12]} has no kernel named {kernel_name(name)[:120]}")
            found[name] = function
        return found

    def settle(self) -> None:
        """Wait for every preload still running (their results are kept for :meth:`functions`): after it, no worker
        thread of this loader calls the driver, so the process may capture in CUDA's global mode."""
        for loading in list(self._loading.values()):
            try:
                loading.result()
            except Exception:  # a failed preload is not remembered; functions() reports it where it matters
                pass

    def close(self) -> None:
        """Unload every module loaded here, preloaded ones too (waiting for loads still running); a graph that uses
        their functions must be destroyed first. Errors of the driver are logged, not raised."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        modules = list(self._modules.values())
        for loading in self._loading.values():
            try:
                modules.append(loading.result()[0])
            except Exception:  # an image that did not match, or a load that failed: no module
                pass
        self._modules.clear()
        self._loading.clear()
        self._functions.clear()
        for module in modules:
            try:
                self._driver.unload_module(module)
            except Exception as exc:
                log.warning("weightcache: a kernel module could not be unloaded: %s", exc)

    def _count(self, step: str, began: float) -> None:
        """Add the seconds since ``began`` to ``step`` of :attr:`image_steps`, and move the preload's span on."""
        now = time.perf_counter()
        with self._steps_lock:
            self.image_steps[step] = self.image_steps.get(step, 0.0) + now - began
            if self._preload_began is not None:
                self.image_steps["span"] = now - self._preload_began

    def _load(self, digest: str, image: bytes | memoryview, *, check: bool) -> int:
        began = time.perf_counter()
        if check and not image_matches(digest, image):
            raise GraphRestoreError(f"the artifact's kernel image {digest[:12]} does not match its SHA-256")
        if check:
            self._count("check", began)
        began = time.perf_counter()
        with loading_kept_images():  # a recorder in this process does not keep what we load ourselves
            module = self._driver.load_module(image)
        self._count("load", began)
        return module


__all__ = ["MAX_THREADS", "KernelLoader", "ModuleDriver"]
