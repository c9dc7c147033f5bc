"""Reading JSON values back with every field checked: what a graph description and the graph artifact share.

A :class:`FieldReader` raises :class:`~weightcache.errors.GraphDescriptionError` naming the field, what it must be
and what it holds, with the subject and what follows from the refusal (a description is not used; the graphs are
captured as usual). Layer L3; imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import GraphDescriptionError

U64 = 2**64


class FieldReader:
    """Checked reads of JSON values for ``subject`` (e.g. ``"graph description"``); ``consequence`` ends each error's
    message (what happens to what was being read)."""

    def __init__(self, subject: str, consequence: str) -> None:
        self.subject = subject
        self.consequence = consequence

    def fail(self, where: str, expected: str, found: object) -> GraphDescriptionError:
        return GraphDescriptionError(
            f"{self.subject}: {where} must be {expected}, found {found!r:.80}; {self.consequence}"
        )

    def int(self, value: object, where: str, limit: int = U64) -> int:
        """A non-negative integer below ``limit`` (a bool is none)."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise self.fail(where, f"an integer in [0, {limit})", value)
        return value

    def fields(self, obj: object, where: str, names: tuple[str, ...]) -> Mapping[str, Any]:
        """An object holding at least ``names``."""
        if not isinstance(obj, Mapping):
            raise self.fail(where, "an object", obj)
        missing = [n for n in names if n not in obj]
        if missing:
            raise self.fail(where, f"an object with {', '.join(names)}", f"no {', '.join(missing)}")
        return obj

    def list(self, value: object, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, "a list", value)
        return value


__all__ = ["U64", "FieldReader"]
