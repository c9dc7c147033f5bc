"""Memory budgets of the keeper: how many bytes of segments it may hold per placement.

Parsed from ``weightcache serve --max-bytes [PLACEMENT=]SIZE`` and ``--max-fraction F``; applied by the keeper
when an entry is published (see :meth:`weightcache.keeper.store.Store.publish`). Torch-free: the keeper uses it.
"""

from __future__ import annotations

from typing import Any

import attrs

from .units import parse_size


@attrs.frozen
class Budget:
    """How many bytes of segments the keeper may hold per placement.

    ``per_placement`` maps a placement (``"cpu"``, ``"GPU-<uuid>"``) to its limit; ``default`` applies to every
    other placement (None: unlimited). Built by :func:`parse_budget` from ``weightcache serve`` options.
    """

    default: int | None = None
    per_placement: dict[str, int] = attrs.field(factory=dict)

    def limit(self, placement: str) -> int | None:
        return self.per_placement.get(placement, self.default)

    def to_json(self) -> dict[str, Any]:
        return {"default": self.default, "per_placement": dict(self.per_placement)}


def host_memory_bytes() -> int:
    """MemTotal from /proc/meminfo, in bytes (what ``--max-fraction`` applies to on CPU)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemTotal line")


def parse_budget(max_bytes: list[str] | None = None, max_fraction: float | None = None) -> Budget:
    """A :class:`Budget` from ``--max-bytes [PLACEMENT=]SIZE`` (repeatable) and ``--max-fraction F``.

    A bare size applies to every placement; ``PLACEMENT=SIZE`` to one (``cpu`` or ``GPU-<uuid>``) and wins over
    the bare one. ``max_fraction`` caps the CPU placement at that fraction of the host's memory (MemTotal); the
    keeper never initialises CUDA, so it cannot read a GPU's memory size: give GPUs a size.
    """
    default: int | None = None
    per: dict[str, int] = {}
    for item in max_bytes or []:
        placement, sep, size = item.rpartition("=")
        if sep and not (placement == "cpu" or placement.startswith("GPU-")):
            raise ValueError(f"--max-bytes {item!r}: expected SIZE or PLACEMENT=SIZE with PLACEMENT cpu or GPU-<uuid>")
        if sep:
            per[placement] = parse_size(size)
        else:
            default = parse_size(size)
    if max_fraction is not None:
        if not 0 < max_fraction <= 1:
            raise ValueError(f"--max-fraction {max_fraction}: expected a fraction of host memory in (0, 1]")
        by_fraction = int(host_memory_bytes() * max_fraction)
        cpu = per.get("cpu", default)  # what --max-bytes gave the CPU, if anything: the fraction only lowers it
        per["cpu"] = by_fraction if cpu is None else min(cpu, by_fraction)
    return Budget(default, per)
