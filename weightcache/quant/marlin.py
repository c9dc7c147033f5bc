"""Marlin kernels (used for GPTQ/AWQ/FP8 on older GPUs): repacked tiles plus a mutable workspace."""

from __future__ import annotations

from typing import ClassVar

from .base import QuantStrategy


class Marlin(QuantStrategy):
    """Marlin repacking."""

    name: ClassVar[str] = "marlin"
    ipc_safe: ClassVar[bool] = False
    reason: ClassVar[str | None] = (
        "Marlin repacks weights into a tile layout and allocates a per-layer workspace that its kernels "
        "write to at run time; a shared, read-only copy would be corrupted or rejected"
    )
