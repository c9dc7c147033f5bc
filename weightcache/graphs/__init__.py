"""CUDA graphs described, checked and rebuilt from their description (issue 31: graphs restored at recorded
addresses instead of captured).

CUDA has no call that saves a graph. What a process can do is walk a captured graph through the driver's graph
API into a description (each kernel's function, launch geometry and argument bytes; memsets; the edges and their
data) and, in a later process, build a graph node by node from that description. The argument bytes hold device
pointers, so a rebuilt graph is only valid where every memory it points at sits at the recorded address again, or
(for a tensor of someone else's allocator, declared by name) where every pointer into it was moved with it: that
is what :mod:`~weightcache.graphs.check` establishes, before anything is rebuilt.

- :mod:`~weightcache.graphs.description`: the description as values (attrs), to and from JSON (no pickle); any
  malformed description is a :class:`~weightcache.errors.GraphDescriptionError`.
- :mod:`~weightcache.graphs.driver`: what the description needs of the CUDA driver (:class:`GraphDriver`, a
  protocol), and :class:`~weightcache.graphs.driver.CudaGraphDriver`, its ``libcuda`` implementation.
- :mod:`~weightcache.graphs.record`: :func:`describe` a captured graph, :func:`rebuild` one from a description,
  :func:`resolve` kernel names to this process's function handles.
- :mod:`~weightcache.graphs.check`: the address checks: every pointer a description holds lies in a range the
  restore reproduces, and every such range is at its recorded place in this process, or (a part of another
  allocation) relocated to where it is now (:func:`relocate`, refused where :func:`relocation_problems` finds a
  word it would leave behind).
- :mod:`~weightcache.graphs.arena`: a range of GPU addresses at a fixed base with a bump allocator, where graph
  memory gets the same addresses in every process.
- :mod:`~weightcache.graphs.cubins`: the machine code of the kernels, kept from CUPTI's module-loaded callback.
- :mod:`~weightcache.graphs.cupti_shim`: that callback, in C (built once per machine with its C compiler), so that
  it never waits for Python's GIL while the driver holds its lock.
- :mod:`~weightcache.graphs.bundle`: the ``cuda.graphs`` artifact's format.

:mod:`weightcache.torch_graphs` puts them together (``wc.GraphCache``): torch's graph pool served from an arena,
the weights at their home addresses, graphs recorded, published, and rebuilt in a fresh process. Layer L3; imports
no torch.
"""

from __future__ import annotations

from .arena import Arena, ArenaDriver, CudaArenaDriver
from .check import AddressRange, Pointer, moves, pointers, relocate, relocation_problems, restore_problems
from .description import Edge, EmptyNode, GraphDescription, KernelNode, MemcpyNode, MemsetNode, Node
from .driver import CudaGraphDriver, GraphDriver
from .record import describe, rebuild, resolve

__all__ = [
    "AddressRange",
    "Arena",
    "ArenaDriver",
    "CudaArenaDriver",
    "CudaGraphDriver",
    "Edge",
    "EmptyNode",
    "GraphDescription",
    "GraphDriver",
    "KernelNode",
    "MemcpyNode",
    "MemsetNode",
    "Node",
    "Pointer",
    "describe",
    "moves",
    "pointers",
    "rebuild",
    "relocate",
    "relocation_problems",
    "resolve",
    "restore_problems",
]
