"""The address checks of a graph restore: a stale pointer must never reach a replay.

A description's argument bytes hold device addresses: of the weights, the inputs, the activations and
workspaces, the graph's own pool. A graph rebuilt in another process is valid only if every one of them points at
the same data there. The restore gets that by placing memory in :class:`AddressRange` s that it reproduces at the
same virtual addresses in both processes (the weights' mappings, a reserved range for the rest); these checks say
whether it did:

- at record time, :func:`pointers` finds every word of the description that is an address (each 8-byte parameter
  of a kernel, every aligned word of an argument buffer, each memset's destination) and says in which range it
  lies; a word that the driver knows as device memory outside every range is a problem (that memory is not
  reproduced: torch's caching allocator, a library's workspace, host memory mapped for the device), and such a
  graph is never restored;
- at restore time, :func:`restore_problems` checks that every range a pointer uses is at its recorded base with
  at least its recorded size, and, with a driver, that every pointer is mapped device memory inside it.

Any problem means the graph is captured as usual; each is a sentence naming the node, the byte and the address.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs

from .description import GraphDescription, KernelNode, MemsetNode


@attrs.frozen
class AddressRange:
    """A range of virtual addresses a restore reproduces: :attr:`name` (e.g. ``weights/0``, ``pool``), its base
    and size."""

    name: str
    base: int
    size: int

    def holds(self, address: int) -> bool:
        return self.base <= address < self.base + self.size


@attrs.frozen
class Pointer:
    """A word of a description that is an address: node :attr:`node`'s argument byte :attr:`offset` (-1: a memset's
    destination) holds :attr:`value`, inside range :attr:`range`."""

    node: int
    offset: int
    value: int
    range: str


def _words(description: GraphDescription) -> Iterable[tuple[int, int, int, str]]:
    for i, node in enumerate(description.nodes):
        if isinstance(node, KernelNode):
            for offset, value in node.words():
                yield i, offset, value, node.function
        elif isinstance(node, MemsetNode):
            yield i, -1, node.dst, "memset"


def _where(node: int, offset: int, what: str | None = None) -> str:
    place = "its destination" if offset < 0 else f"argument byte {offset}"
    return f"node {node}{f' ({what[:80]})' if what else ''}, {place}"


def pointers(
    description: GraphDescription,
    ranges: Sequence[AddressRange],
    pointer_range: Callable[[int], tuple[int, int] | None],
) -> tuple[list[Pointer], list[str]]:
    """Every address of ``description`` in ``ranges``, and the problems: an address the driver knows as device
    memory (``pointer_range``, e.g. :meth:`~weightcache.graphs.driver.GraphDriver.pointer_range`) outside every
    range, or a memset whose destination is in none. Zero and words that are no device address are not pointers
    (scalars; a scalar that equals an address inside a range is treated as a pointer, which can only make a
    restore refuse)."""
    found: list[Pointer] = []
    problems: list[str] = []
    for node, offset, value, what in _words(description):
        inside = next((r for r in ranges if r.holds(value)), None)
        if inside is not None:
            found.append(Pointer(node, offset, value, inside.name))
            continue
        if value == 0 and offset >= 0:
            continue
        allocation = pointer_range(value)
        if allocation is not None or offset < 0:
            held = f" (allocation {allocation[0]:#x}, {allocation[1]} bytes)" if allocation else ""
            problems.append(
                f"{_where(node, offset, what)} holds {value:#x}, device memory outside every range the restore "
                f"reproduces{held}: a rebuilt graph would read memory no later process has at that address"
            )
    return found, problems


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
                f"{after.base:#x} ({after.size} bytes) here"
            )
    if problems or pointer_range is None:
        return problems
    for p in found:
        allocation = pointer_range(p.value)
        inside = now[p.range]
        if allocation is None or not (
            inside.holds(allocation[0]) and allocation[0] + allocation[1] <= inside.base + inside.size
        ):
            problems.append(
                f"{_where(p.node, p.offset)} points at {p.value:#x}, which is not device memory mapped "
                f"inside range {p.range!r} in this process"
            )
    return problems


__all__ = ["AddressRange", "Pointer", "pointers", "restore_problems"]
