"""The address checks of a graph restore: a stale pointer must never reach a replay.

A description's argument bytes hold device addresses: of the weights, the inputs, the activations and
workspaces, the graph's own pool. A graph rebuilt in another process is valid only if every one of them points at
the same data there. The restore gets that by placing memory in :class:`AddressRange` s that it reproduces at the
same virtual addresses in both processes (the weights' mappings, a reserved range for the rest), or that the
caller names and finds at the same address again (a tensor of its own, :attr:`AddressRange.own_mapping` False);
these checks say whether it did:

- at record time, :func:`pointers` finds every word of the description that is an address (each aligned 8-byte
  word inside one parameter of a kernel, structures passed by value included, every aligned word of an argument
  buffer, the first and last byte a memset writes, the first and
  last byte a memcpy reads and writes) and says in which range it lies; a word that the driver knows as device
  memory outside every range is a problem (that memory is not reproduced: torch's caching allocator, a library's
  workspace, host memory mapped for the device), and such a graph is never restored;
- at restore time, :func:`restore_problems` checks that every range a pointer uses is at its recorded base with
  at least its recorded size and of the same kind, and, with a driver, that every pointer is mapped device memory
  inside it (for a part of another allocation: device memory, and :func:`extent_problems` checks that its whole
  recorded size lies in one allocation).

Any problem means the graph is captured as usual; each is a sentence naming the node, the byte and the address.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np

from .description import DESTINATION, SOURCE, GraphDescription, KernelNode, MemcpyNode, MemsetNode, node_place


@attrs.frozen
class AddressRange:
    """A range of virtual addresses a restore reproduces: :attr:`name` (e.g. ``weights/0``, ``pool``), its base
    and size. :attr:`own_mapping`: the range is a mapping of its own (the arena, a weights segment), so every
    address checked in it must lie in device memory mapped inside it; False for a part of someone else's
    allocation (a tensor of torch's caching allocator, named by its owner), where an address checked must be
    device memory, and all of the range's recorded bytes one allocation."""

    name: str
    base: int
    size: int
    own_mapping: bool = True

    def holds(self, address: int) -> bool:
        return self.base <= address < self.base + self.size


@attrs.frozen
class Pointer:
    """A word of a description that is an address: node :attr:`node`'s argument byte :attr:`offset` holds
    :attr:`value`, inside range :attr:`range`; for a memset or memcpy node, :attr:`offset` is :data:`DESTINATION`
    or :data:`SOURCE` and :attr:`value` the first or last byte it writes or reads there."""

    node: int
    offset: int
    value: int
    range: str


#: Words below this are never looked up as device addresses: CUDA places device memory above 4 GiB on 64-bit
#: Linux, and a graph's argument bytes are mostly scalars (sizes, strides, flags) below it.
LOWEST_ADDRESS = 1 << 32


def _kernel_words(description: GraphDescription) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Node index, byte offset and value of every word of every kernel node that could be a device pointer
    (:meth:`~weightcache.graphs.description.DescriptionTables.argument_words`) and lies at or above
    :data:`LOWEST_ADDRESS`: from the description's tables in one pass, since a restore checks and relocates every
    graph of a model and numpy's cost is per call, not per word."""
    nodes, offsets, values = description.tables.argument_words()
    candidate = values >= LOWEST_ADDRESS
    return nodes[candidate], offsets[candidate], values[candidate]


def _range_of(values: np.ndarray, ranges: Sequence[AddressRange]) -> np.ndarray:
    """For each of ``values`` (``uint64``), the index in ``ranges`` of the first range that holds it; -1 where none
    does. One binary search a value in :func:`_pieces` of the ranges, whatever their number (vLLM's graphs reach a
    hundred and more of the runner's tensors, and a pass over every word for each range grows with them)."""
    if not ranges or not len(values):
        return np.full(len(values), -1, dtype=np.intp)
    bounds, owner = _pieces(tuple(ranges))
    at = np.searchsorted(bounds, values, side="right") - 1
    return np.where(at >= 0, owner[np.maximum(at, 0)], -1)


@functools.lru_cache(maxsize=64)
def _pieces(ranges: tuple[AddressRange, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``ranges`` cut where any of them starts or ends: the cuts (``uint64``, sorted) and for the piece from each
    cut to the next the index of the first range that holds it (-1: none; the last cut starts no piece). Ranges
    may overlap (views of one tensor, declared apart). Kept for the ranges asked for again: a restore asks for a
    bundle's recorded ranges for every graph."""
    top = 2**64 - 1
    cuts = np.unique(np.array([min(x, top) for r in ranges for x in (r.base, r.base + r.size)], dtype=np.uint64))
    owner = np.full(len(cuts), -1, dtype=np.intp)
    for i in range(len(ranges) - 1, -1, -1):  # the first range in order written last: it wins where they overlap
        r = ranges[i]
        low, high = (
            np.searchsorted(cuts, np.uint64(min(r.base, top))),
            np.searchsorted(cuts, np.uint64(min(r.base + r.size, top))),
        )
        owner[low:high] = i
    owner.setflags(write=False)
    cuts.setflags(write=False)
    return cuts, owner


def pointers(
    description: GraphDescription,
    ranges: Sequence[AddressRange],
    pointer_range: Callable[[int], tuple[int, int] | None] | None,
    tally: dict[tuple[int, int], list[int]] | None = None,
) -> tuple[list[Pointer], list[str]]:
    """Every address of ``description`` in ``ranges``, and the problems: an address the driver knows as device
    memory (``pointer_range``, e.g. :meth:`~weightcache.graphs.driver.GraphDriver.pointer_range`; each distinct
    word at or above :data:`LOWEST_ADDRESS` is asked once) outside every range, or a memset whose destination is
    in none (its first and last byte; a memcpy's on both sides). Words that are no device address are not
    pointers (scalars; a scalar that equals an address inside a range is treated as a pointer: checked, and moved
    with its range where :func:`relocate` moves that range). Without ``pointer_range`` (a restore, which checks
    the pointers it finds with :func:`restore_problems`), words outside the ranges are not looked up. ``tally``,
    where given, gets the problems' distinct addresses by the device allocation that holds each,
    ``(base, size)``, in the order found."""
    found: list[Pointer] = []
    problems: list[str] = []
    known: dict[int, tuple[int, int] | None] = {}

    def outside(node: int, offset: int, value: int, what: str) -> None:
        if pointer_range is None and offset >= 0:
            return
        if value not in known:
            known[value] = pointer_range(value) if pointer_range is not None else None
        allocation = known[value]
        if allocation is not None or offset < 0:
            held = f" (allocation {allocation[0]:#x}, {allocation[1]} bytes)" if allocation else ""
            if tally is not None and allocation is not None:
                seen = tally.setdefault(allocation, [])
                if value not in seen:
                    seen.append(value)
            problems.append(
                f"{node_place(node, offset, what)} holds {value:#x}, device memory outside every range the restore "
                f"reproduces{held}: a rebuilt graph would read memory no later process has at that address"
            )

    for i, node in enumerate(description.nodes):
        for offset, first, last, what in _copy_ends(node):
            ends = (first, last) if last != first else (first,)
            where = [next((r for r in ranges if r.holds(a)), None) for a in ends]
            for address, inside in zip(ends, where, strict=True):
                if inside is not None:
                    found.append(Pointer(i, offset, address, inside.name))
                else:
                    outside(i, offset, address, what)
            start, end = where[0], where[-1]
            if start is not None and end is not None and start.name != end.name:
                problems.append(
                    f"{node_place(i, offset, what)} runs from {first:#x} in range {start.name!r} to {last:#x} in "
                    f"range {end.name!r}: one copy or memset spans memory no single range reproduces"
                )
    nodes, offsets, values = _kernel_words(description)
    held = _range_of(values, ranges)
    hit = held >= 0
    for node, offset, value, index in zip(
        nodes[hit].tolist(), offsets[hit].tolist(), values[hit].tolist(), held[hit].tolist(), strict=True
    ):
        found.append(Pointer(node, offset, value, ranges[index].name))
    # (without pointer_range, a restore: only the pointers inside the ranges matter)
    unmatched = ~hit if pointer_range is not None else np.zeros(len(values), dtype=bool)
    kernels = description.nodes
    for node, offset, value in zip(nodes[unmatched].tolist(), offsets[unmatched].tolist(), values[unmatched].tolist()):
        kernel = kernels[node]
        outside(node, offset, value, kernel.function if isinstance(kernel, KernelNode) else "")
    found.sort(key=lambda p: (p.node, p.offset))
    return found, problems


def _copy_ends(node: object) -> list[tuple[int, int, int, str]]:
    """(offset, first byte, last byte, kind) of each side of a memset (what it writes) or a memcpy (what it reads,
    what it writes)."""
    if isinstance(node, MemsetNode):
        if not (node.width and node.height):
            return [(DESTINATION, node.dst, node.dst, "memset")]
        last = node.dst + (node.height - 1) * node.pitch + node.width * node.element_size - 1
        return [(DESTINATION, node.dst, last, "memset")]
    if isinstance(node, MemcpyNode):
        ends = node.last_bytes()
        src_last, dst_last = ends if ends is not None else (node.src, node.dst)
        return [(SOURCE, node.src, src_last, "memcpy"), (DESTINATION, node.dst, dst_last, "memcpy")]
    return []


def restore_problems(
    recorded: Sequence[AddressRange],
    current: Sequence[AddressRange],
    found: Sequence[Pointer],
    pointer_range: Callable[[int], tuple[int, int] | None] | None = None,
) -> list[str]:
    """What stops a graph recorded with ``recorded`` ranges and ``found`` pointers from being rebuilt in this
    process, whose ranges are ``current``: a range a pointer uses that is missing here, at another base, or
    smaller; with ``pointer_range``, a pointer that is not mapped device memory inside its range here. Empty: every
    address checked."""
    was = {r.name: r for r in recorded}
    now = {r.name: r for r in current}
    problems = []
    for name in sorted({p.range for p in found}):
        before, after = was.get(name), now.get(name)
        if before is None:
            problems.append(f"range {name!r} holds pointers of the graph but is not among the recorded ranges")
        elif after is None:
            problems.append(f"range {name!r} ({before.base:#x}, {before.size} bytes) is not in this process")
        elif after.base != before.base or after.size < before.size:
            problems.append(
                f"range {name!r} was at {before.base:#x} ({before.size} bytes) when the graph was recorded and is at "
                f"{after.base:#x} ({after.size} bytes) here{': smaller' if after.size < before.size else ''}"
            )
        elif after.own_mapping != before.own_mapping:
            kind = {True: "a mapping of its own", False: "part of another allocation"}
            problems.append(
                f"range {name!r} was {kind[before.own_mapping]} when the graph was recorded and is "
                f"{kind[after.own_mapping]} here"
            )
    if problems or pointer_range is None:
        return problems
    known: dict[int, tuple[int, int] | None] = {}
    for p in found:
        if p.value not in known:
            known[p.value] = pointer_range(p.value)
        if not _mapped(known[p.value], now[p.range]):
            problems.append(
                f"{node_place(p.node, p.offset)} points at {p.value:#x}, which is not device memory mapped "
                f"inside range {p.range!r} in this process"
            )
    return problems


def _mapped(allocation: tuple[int, int] | None, inside: AddressRange) -> bool:
    """Whether the allocation the driver reports for an address of ``inside`` is what the range needs: any device
    memory for a part of someone else's allocation, a mapping within the range for a range of its own."""
    if allocation is None:
        return False
    return not inside.own_mapping or (
        inside.holds(allocation[0]) and allocation[0] + allocation[1] <= inside.base + inside.size
    )


def extents(found: Sequence[Pointer], ranges: Sequence[AddressRange]) -> dict[str, int]:
    """For each range the ``found`` pointers use, how far into it they reach: the offset of the highest pointer
    from the range's base, plus one. What :func:`extent_problems` checks in a restoring process."""
    bases = {r.name: r.base for r in ranges}
    reach: dict[str, int] = {}
    for p in found:
        reach[p.range] = max(reach.get(p.range, 0), p.value - bases[p.range] + 1)
    return reach


def extent_problems(
    recorded: Sequence[AddressRange],
    current: Sequence[AddressRange],
    reach: Mapping[str, int],
    pointer_range: Callable[[int], tuple[int, int] | None],
    passed: set[tuple[AddressRange, int]] | None = None,
) -> list[str]:
    """:func:`restore_problems` by range instead of by pointer: every range a graph's pointers use (``reach``,
    from :func:`extents`) is here, at its recorded base, at least as large, and mapped device memory inside it from
    its base to the farthest pointer. A range of its own is one mapping (a weights segment; the arena, mapped from
    its base on), and a part of someone else's allocation must lie in one allocation from its base to the end of
    its recorded size, so that covers every pointer recorded in it, at one driver query per end instead of one per
    pointer. ``passed``, where given, remembers each part of another allocation whose driver queries passed, with
    its last byte (``(range as here, last byte)``), and is not asked about again: only for a caller that keeps that
    memory alive from one call to the next (a GraphCache keeps every tensor declared with it), whose allocation
    therefore cannot change."""
    problems = restore_problems(recorded, current, [Pointer(-1, -1, 0, name) for name in reach])
    if problems:
        return problems
    now = {r.name: r for r in current}
    was = {r.name: r for r in recorded}
    for name, extent in sorted(reach.items()):
        inside = now[name]
        # a part of another allocation: all of what was recorded, not only as far as a pointer reaches (a kernel
        # is handed a tensor's first byte and reads on from there)
        last = inside.base + (extent if inside.own_mapping else max(extent, was[name].size)) - 1
        if passed is not None and (inside, last) in passed:
            continue
        ends = [(address, pointer_range(address)) for address in (inside.base, last)]
        for address, allocation in ends:
            if not _mapped(allocation, inside):
                problems.append(
                    f"range {name!r}: {address:#x}, which a pointer of the graph reaches, is not device memory "
                    "mapped inside the range in this process"
                )
                break
        else:
            if not inside.own_mapping and ends[0][1] != ends[1][1]:
                problems.append(
                    f"range {name!r}: its first byte {inside.base:#x} and its last {last:#x} lie in two "
                    "allocations in this process, not one"
                )
            elif not inside.own_mapping and passed is not None:
                passed.add((inside, last))
    return problems


def moves(
    recorded: Sequence[AddressRange], current: Sequence[AddressRange], reach: Mapping[str, int]
) -> tuple[dict[str, int], list[str]]:
    """How far each range a graph's pointers use (``reach``) moved: a part of another allocation (``own_mapping``
    False, then and now) that is here at another base and at least as large, by ``current base - recorded base``
    (what :func:`relocate` moves its pointers by). A range of its own (the arena, a weights segment) never moves:
    :func:`restore_problems` refuses it elsewhere. The problems: two recorded ranges that overlap and moved by
    different amounts (which one a pointer into both meant is not known), and a range that moved with fewer bytes
    here than recorded. Empty moves: every range is where it was."""
    now = {r.name: r for r in current}
    moved: dict[str, int] = {}
    problems: list[str] = []
    used = [r for r in recorded if r.name in reach and not r.own_mapping]
    for r in used:
        after = now.get(r.name)
        if after is None or after.own_mapping or after.base == r.base:
            continue
        if after.size < r.size:
            problems.append(
                f"range {r.name!r} was at {r.base:#x} ({r.size} bytes) when the graph was recorded and is at "
                f"{after.base:#x} with {after.size} bytes here: smaller"
            )
            continue
        moved[r.name] = after.base - r.base
    if moved:
        by_base = sorted(used, key=lambda r: r.base)
        for i, a in enumerate(by_base):
            for b in by_base[i + 1 :]:
                if b.base >= a.base + a.size:
                    break
                if moved.get(a.name, 0) != moved.get(b.name, 0):
                    problems.append(
                        f"ranges {a.name!r} and {b.name!r} overlapped when the graph was recorded and moved apart "
                        "here: which of them a pointer into both meant is not known"
                    )
    return moved, problems


#: How far around a moved range (before its first byte, past its last) :func:`relocation_problems` looks for
#: words that relocation would leave where they are.
NEAR_MOVED = 1 << 20


def relocation_problems(
    description: GraphDescription, recorded: Sequence[AddressRange], moved: Mapping[str, int]
) -> list[str]:
    """Why relocating ``description`` by ``moved`` (from :func:`moves`) could leave a stale pointer: a kernel
    argument word within :data:`NEAR_MOVED` bytes of a moved range, before its first byte or at or past its end,
    that lies in no recorded range. Such a word is likely derived from the range (a tensor's end, passed as a
    loop bound; an address before it) and passed the recording's checks only because no device memory was there
    (device memory outside every range refuses recording); relocation moves only the words inside the range, so
    it would keep the old address. Empty: nothing of the kind (each moved range, its first such word)."""
    if not moved:
        return []
    nodes, offsets, values = _kernel_words(description)
    outside = _range_of(values, recorded) < 0
    nodes, offsets, values = nodes[outside], offsets[outside], values[outside]
    if not len(values):
        return []
    # which moved ranges have any such word near them: a binary search of each range's surroundings in the words
    # sorted (scalars above 4 GiB can be many: one pass over them for each of 150 ranges was most of relocating
    # synthetic graphs on the dev VM, graph_relocate_cpu.py)
    zones = [r for r in recorded if r.name in moved]
    top = 2**64 - 1
    ordered = np.sort(values)
    low = np.array([max(r.base - NEAR_MOVED, 0) for r in zones], dtype=np.uint64)
    high = np.array([min(r.base + r.size + NEAR_MOVED, top) for r in zones], dtype=np.uint64)
    hit = np.searchsorted(ordered, high, side="left") > np.searchsorted(ordered, low, side="left")
    problems = []
    for i in np.flatnonzero(hit).tolist():  # each such range: its first word near it
        r = zones[i]
        at = int(np.argmax((values >= low[i]) & (values < high[i])))
        node, offset, value = int(nodes[at]), int(offsets[at]), int(values[at])
        kernel = description.nodes[node]  # (made only where there is a problem to name)
        what = kernel.function if isinstance(kernel, KernelNode) else None
        problems.append(
            f"{node_place(node, offset, what)} holds {value:#x}, {value - r.base:+#x} bytes from the first byte of "
            f"range {r.name!r} but outside it (and every range): relocating the range would leave this "
            "address, likely derived from it (an end, a point before it), where it is"
        )
    return problems


def moved_ranges(ranges: Sequence[AddressRange], moved: Mapping[str, int]) -> list[AddressRange]:
    """``ranges`` with each of ``moved`` at its new base (what :func:`extent_problems` checks a relocated graph
    against)."""
    return [attrs.evolve(r, base=r.base + moved[r.name]) if r.name in moved else r for r in ranges]


def relocate(
    description: GraphDescription, recorded: Sequence[AddressRange], moved: Mapping[str, int]
) -> tuple[GraphDescription, int]:
    """``description`` with every pointer into a range of ``moved`` (found as :func:`pointers` finds them: a
    kernel argument word inside the range as ``recorded``, a memset's destination or a memcpy's side whose first
    byte is in it) moved as far as its range moved, and how many were; ``description`` itself where none is. Read
    from the description's tables, without a value per node."""
    targets = [r for r in recorded if r.name in moved]
    if not targets:
        return description, 0
    nodes, offsets, values = _kernel_words(description)
    deltas = [moved[r.name] for r in targets]
    held = _range_of(values, targets)
    hit = held >= 0
    words = [
        (node, offset, deltas[index])
        for node, offset, index in zip(nodes[hit].tolist(), offsets[hit].tolist(), held[hit].tolist(), strict=True)
    ]
    copies = description.tables.copy_addresses()
    if copies:
        inside = _range_of(np.array([address for _, _, address in copies], dtype=np.uint64), targets).tolist()
        words += [(node, place, deltas[i]) for (node, place, _), i in zip(copies, inside, strict=True) if i >= 0]
    if not words:
        return description, 0
    return description.moved(words), len(words)


__all__ = [
    "DESTINATION",
    "NEAR_MOVED",
    "SOURCE",
    "AddressRange",
    "Pointer",
    "extent_problems",
    "extents",
    "moved_ranges",
    "moves",
    "pointers",
    "relocate",
    "relocation_problems",
    "restore_problems",
]
