"""AWQ (activation-aware weight quantization)."""

from __future__ import annotations

from typing import ClassVar

from .base import QuantStrategy


class AWQ(QuantStrategy):
    """AWQ int4 weights."""

    name: ClassVar[str] = "awq"
    ipc_safe: ClassVar[bool] = False
    reason: ClassVar[str | None] = (
        "AWQ layers keep Python-side state after loading (packing order, group size and the kernel chosen "
        "for the device) that binding tensors cannot restore"
    )
