"""The dtype table (:mod:`weightcache.dtypes`) as ``torch.dtype`` objects: the torch side of one table."""

from __future__ import annotations

import torch

from .dtypes import BY_SAFETENSORS, DTYPES, dtype_name
from .errors import InvalidArgument

#: dtype name -> torch.dtype, for every name of the table that this torch has (newer types come and go)
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: value for name in DTYPES if isinstance(value := getattr(torch, name, None), torch.dtype)
}
#: safetensors code -> torch.dtype
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: TORCH_DTYPES[name] for code, name in BY_SAFETENSORS.items() if name in TORCH_DTYPES
}
_CONVERTIBLE = frozenset(TORCH_DTYPES[d.name] for d in DTYPES.values() if d.convertible)


def resolve_dtype(dtype: object) -> torch.dtype | None:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> the torch dtype (None stays None)."""
    name = dtype_name(dtype)
    if name is None:
        return None
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise InvalidArgument(f"dtype {name!r} is not supported by torch {torch.__version__}") from None


def convertible(dtype: torch.dtype) -> bool:
    """Whether ``dtype=`` converts tensors of this dtype (floating point, not FP8: see the table)."""
    return dtype in _CONVERTIBLE


__all__ = ["SAFETENSORS_DTYPES", "TORCH_DTYPES", "convertible", "resolve_dtype"]
