"""Sizes and ages as people read and write them: ``format_bytes``, ``format_age``, ``parse_size``.

The one place that turns byte counts and durations into text (the CLI's tables, the keeper's budget errors, the
doctor's report) and sizes given on the command line into bytes. Standard library only: every layer uses it.
"""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``512`` -> ``"512 B"``, ``1536`` -> ``"1.5 KiB"``, ``3 << 30`` -> ``"3.0 GiB"`` (binary units, TiB at most)."""
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: the last unit always returns")


def format_age(seconds: float) -> str:
    """``42`` -> ``"42s"``, ``600`` -> ``"10m"``, ``9000`` -> ``"2.5h"``, ``259200`` -> ``"3.0d"``: ages in tables."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``"512"``, ``"64M"``, ``"40G"``, ``"1.5T"`` (binary units, optional ``iB``/``B``) -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_SUFFIXES else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"size {text!r}: expected a number with an optional K, M, G or T suffix, e.g. 40G") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"size {text!r} must be a positive number of bytes")
    return int(value * _SIZE_SUFFIXES[unit])


__all__ = ["format_age", "format_bytes", "parse_size"]
