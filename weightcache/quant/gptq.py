"""GPTQ."""

from __future__ import annotations

from typing import ClassVar

from .base import QuantStrategy


class GPTQ(QuantStrategy):
    """GPTQ int4/int8 weights."""

    name: ClassVar[str] = "gptq"
    ipc_safe: ClassVar[bool] = False
    reason: ClassVar[str | None] = (
        "GPTQ post-processing shuffles weights by act-order index tables (g_idx) and records the exllama/"
        "marlin state in Python attributes, which binding tensors cannot restore"
    )
