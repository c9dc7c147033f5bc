"""FP8 methods: block-wise scaling is shareable, per-tensor scaling is not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..errors import UnsupportedQuantError
from .base import QuantStrategy


class FP8Block(QuantStrategy):
    """Block-wise FP8 (e.g. DeepSeek-V3 style, 128x128 blocks): FP8 weights plus a tensor of per-block scales.

    Post-processing keeps both as plain tensors, so binding them reproduces the layer exactly. A config, when
    given, must describe block scaling: ``weight_block_size`` as two positive integers.
    """

    name: ClassVar[str] = "fp8_block"
    ipc_safe: ClassVar[bool] = True

    def check(self, config: Mapping[str, Any] | None = None) -> None:
        super().check(config)
        if config is None:
            return
        block = config.get("weight_block_size")
        if not (
            isinstance(block, (list, tuple))
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise UnsupportedQuantError(
                f"quantization method 'fp8_block' needs weight_block_size = [rows, cols] in its config; found "
                f"{block!r}. Without block scales the weights are per-tensor FP8, which cannot be shared: "
                "use mode='off'."
            )


class FP8PerTensor(QuantStrategy):
    """Per-tensor (or per-channel) FP8 as engines post-process it."""

    name: ClassVar[str] = "fp8_per_tensor"
    ipc_safe: ClassVar[bool] = False
    reason: ClassVar[str | None] = (
        "post-processing transposes the weights and collapses per-shard scales into one, and the layer "
        "records the chosen kernel layout in Python attributes that binding tensors cannot restore"
    )
