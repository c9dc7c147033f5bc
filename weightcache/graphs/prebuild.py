"""Executable graphs built ahead from an artifact's records: :class:`Prebuilder`.

A restore checks a graph's addresses when the graph is asked for, and only then may the graph run. Building it
(its kernels' functions, ``prepare``, ``rebuild``, ``cuGraphInstantiate``) does not depend on those checks: a
graph rebuilt from its record is the same executable graph whether it is built before or after them, since the
checks decide only whether it may be used. So a :class:`Prebuilder` builds every graph of an artifact on a worker
thread as soon as the artifact is loaded, in recorded order, while the caller sets up its memory and asks for
graph after graph; the caller takes a graph's executable only once that graph's checks passed
(:meth:`Prebuilder.take`), and every executable not taken is destroyed (:meth:`Prebuilder.close`). A build that
fails is raised by :meth:`Prebuilder.take`, as the same steps would raise in the caller's thread. One thread
(:data:`BUILD_THREADS`): builds side by side do not overlap, they wait on each other (H100, 2026-12-05: with four
threads a 240-node graph's nodes took 31-127 ms to add instead of 3 ms in one thread, and the graphs were ready
later than built one after another; docs/benchmarks.md).

Layer L3; imports no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from .bundle import GraphRecord
from .driver import RestoreDriver
from .loading import KernelLoader
from .record import prepare, rebuild, shared_needs

log = logging.getLogger("weightcache.graphs")

#: Worker threads that build an artifact's graphs: one, since the driver's graph calls on several threads wait on
#: each other (measured on an H100: four threads built 8 and 51 graphs later than the caller alone did).
BUILD_THREADS = 1
#: ``CU_MEMORYTYPE_UNIFIED``: a memcpy side whose memory type the driver reads off the address.
UNIFIED = 4


def unified_copy(record: GraphRecord) -> bool:
    """Whether ``record``'s graph has a memcpy node with a side of :data:`UNIFIED` memory type."""
    return UNIFIED in record.description.tables.copy_memory_types()


class BuildDriver(RestoreDriver, Protocol):
    """A :class:`~weightcache.graphs.driver.RestoreDriver` that can make a context current on a worker thread
    (:class:`~weightcache.graphs.driver.CudaGraphDriver` can)."""

    def current_context(self) -> int: ...

    def make_current(self, context: int) -> None: ...


class Prebuilt:
    """One graph built ahead: its executable graph (the taker owns it) and the seconds of each step on the
    worker thread (``kernels``, ``rebuild``, ``instantiate``)."""

    __slots__ = ("executable", "phases")

    def __init__(self, executable: int, phases: dict[str, float]) -> None:
        self.executable = executable
        self.phases = phases


def build(
    driver: RestoreDriver,
    kernels: KernelLoader,
    record: GraphRecord,
    images: Mapping[str, bytes | memoryview],
    shared: Mapping[str, int],
) -> Prebuilt:
    """``record``'s graph built and instantiated in this thread: its kernels' functions from ``kernels`` (images
    checked against their SHA-256), ``prepare`` (with ``shared``, :func:`~weightcache.graphs.record.shared_needs`
    of every graph that may be built meanwhile), rebuild, ``cuGraphInstantiate``; the seconds of each step."""
    began = time.perf_counter()
    functions = kernels.functions(record.kernels, images, check=True)
    prepare(driver, record.description, functions, shared)
    phases = {"kernels": time.perf_counter() - began}
    graph = rebuild(driver, record.description, functions)
    phases["rebuild"] = time.perf_counter() - began - phases["kernels"]
    try:
        executable = driver.instantiate(graph)
    finally:
        driver.destroy_graph(graph)
    phases["instantiate"] = time.perf_counter() - began - phases["kernels"] - phases["rebuild"]
    return Prebuilt(executable, phases)


class Prebuilder:
    """Every graph of ``records`` built on ``threads`` worker threads, in order, each kernel's function from ``kernels``
    (which loads ``images``, checked against their SHA-256); started at construction. Each function's limits are
    set for the largest need of any of the records (:attr:`shared`: graphs prepared side by side must not lower
    each other's), and a graph with a copy through a unified address (:data:`UNIFIED`) is not built ahead: the
    driver tells such an address's memory type by what is mapped there when the node is added, which may not be
    yet; :meth:`take` says so and the caller builds it once its memory is mapped. ``before_build``, where given, turns
    each record into the one built (its index in ``records`` and the record; e.g. relocated), on the worker thread,
    so that work does not hold up the caller."""

    def __init__(
        self,
        driver: BuildDriver,
        kernels: KernelLoader,
        records: Sequence[GraphRecord],
        images: Mapping[str, bytes | memoryview],
        threads: int = BUILD_THREADS,
        shared: Mapping[str, int] | None = None,
        before_build: Callable[[int, GraphRecord], GraphRecord] | None = None,
    ) -> None:
        self._driver = driver
        #: Each kernel's largest dynamic shared memory over the records (``shared``, else computed here).
        self.shared = shared if shared is not None else shared_needs(r.description for r in records)
        self._lock = threading.Lock()
        self._closed = False
        context = driver.current_context()

        def ahead(index: int, record: GraphRecord) -> Prebuilt:
            driver.make_current(context)
            if before_build is not None:
                record = before_build(index, record)
            built = build(driver, kernels, record, images, self.shared)
            with self._lock:
                if self._closed:  # closed while this one was building: nobody will take it
                    driver.destroy_executable(built.executable)
                    raise RuntimeError("the prebuilder was closed")
            return built

        self._futures: list[Future[Prebuilt] | None] = []
        self._skipped = [unified_copy(record) for record in records]
        if records:
            pool = ThreadPoolExecutor(
                max_workers=max(1, min(threads, len(records))), thread_name_prefix="weightcache-graphs"
            )
            self._futures = [
                None if skipped else pool.submit(ahead, index, record)
                for index, (record, skipped) in enumerate(zip(records, self._skipped, strict=True))
            ]
            pool.shutdown(wait=False)

    def take(self, index: int) -> Prebuilt:
        """The graph of record ``index``, waiting for its build; the caller owns its executable from here. Raises
        what its build raised (a :class:`~weightcache.errors.GraphRestoreError` for a kernel image that does not
        match or a driver call that failed), :class:`LookupError` for a graph not built ahead (:data:`UNIFIED`),
        :class:`IndexError` for an index taken before or out of range, and :class:`RuntimeError` after
        :meth:`close`."""
        if self._closed:
            raise RuntimeError("the prebuilder was closed")
        if 0 <= index < len(self._skipped) and self._skipped[index]:
            raise LookupError(f"graph {index} copies through a unified address: it is not built ahead")
        future = self._futures[index] if 0 <= index < len(self._futures) else None
        if future is None:
            raise IndexError(f"no graph {index} to take (taken before, or the artifact has {len(self._futures)})")
        self._futures[index] = None
        return future.result()

    def close(self) -> None:
        """Destroy every executable built and not taken; builds not started are cancelled, running ones are waited
        for. Errors of the builds and of the driver are logged, not raised."""
        with self._lock:
            self._closed = True
        running = [f for f in self._futures if f is not None and not f.cancel()]  # all cancelled before any wait
        for future in running:
            try:
                built = future.result()
            except Exception as exc:  # a build that failed (or saw the close) holds nothing
                log.debug("weightcache: a graph built ahead was not used: %s", exc)
                continue
            try:
                self._driver.destroy_executable(built.executable)
            except Exception as exc:
                log.warning("weightcache: an executable graph built ahead could not be destroyed: %s", exc)
        self._futures = []


__all__ = ["BUILD_THREADS", "UNIFIED", "BuildDriver", "Prebuilder", "Prebuilt", "build", "unified_copy"]
