"""No quantization: the weights are what the loader produced. Always safe to share."""

from __future__ import annotations

from typing import ClassVar

from .base import QuantStrategy


class Unquantized(QuantStrategy):
    """Unquantized weights (any dtype)."""

    name: ClassVar[str] = "none"
    ipc_safe: ClassVar[bool] = True
