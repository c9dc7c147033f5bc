"""The one dtype table: every element type weightcache knows, by torch's name, in pure Python.

A manifest names dtypes (torch's names without ``torch.``), a safetensors header names them by code (``BF16``),
a fingerprint records the dtype weights were converted to, and only floating point weights are converted.
Each of those reads this table; :mod:`weightcache.torch_dtypes` maps it to ``torch.dtype`` objects.

Must import nothing but the standard library: the keeper validates manifests with it.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import InvalidArgument


class DType(NamedTuple):
    """One element type."""

    #: torch's name without the ``torch.`` prefix (what manifests and fingerprints record)
    name: str
    #: the safetensors header's code, or None when safetensors has none
    safetensors: str | None
    #: bytes per element
    itemsize: int
    #: a floating point type (float8/float4 included)
    floating: bool
    #: ``dtype=`` converts tensors of this type; FP8 and integer tensors are quantized data and stay as stored
    convertible: bool


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bool", "BOOL", 1, False, False),
        DType("uint8", "U8", 1, False, False),
        DType("int8", "I8", 1, False, False),
        DType("int16", "I16", 2, False, False),
        DType("uint16", "U16", 2, False, False),
        DType("int32", "I32", 4, False, False),
        DType("uint32", "U32", 4, False, False),
        DType("int64", "I64", 8, False, False),
        DType("uint64", "U64", 8, False, False),
        DType("float16", "F16", 2, True, True),
        DType("bfloat16", "BF16", 2, True, True),
        DType("float32", "F32", 4, True, True),
        DType("float64", "F64", 8, True, True),
        DType("complex64", None, 8, False, False),
        DType("complex128", None, 16, False, False),
        DType("float8_e4m3fn", "F8_E4M3", 1, True, False),
        DType("float8_e4m3fnuz", None, 1, True, False),
        DType("float8_e5m2", "F8_E5M2", 1, True, False),
        DType("float8_e5m2fnuz", None, 1, True, False),
        DType("float8_e8m0fnu", "F8_E8M0", 1, True, False),
        DType("float4_e2m1fn_x2", None, 1, True, False),
    )
}

#: safetensors code -> dtype name
BY_SAFETENSORS: dict[str, str] = {d.safetensors: d.name for d in DTYPES.values() if d.safetensors}

#: torch's other names for the same types (``torch.half is torch.float16``), and the short ones people type
ALIASES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp64": "float64",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "short": "int16",
    "int": "int32",
    "long": "int64",
    "cfloat": "complex64",
    "cdouble": "complex128",
}


def dtype_name(dtype: object) -> str | None:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> ``"bfloat16"`` (None stays None).

    A ``torch.dtype`` is read by its ``str()`` (``"torch.bfloat16"``), so this needs no torch. ValueError for a
    name outside :data:`DTYPES`.
    """
    if dtype is None:
        return None
    kind = type(dtype)
    if isinstance(dtype, str):
        text = dtype
    elif kind.__module__ == "torch" and kind.__name__ == "dtype":
        text = str(dtype)  # "torch.bfloat16"
    else:
        text = ""
    name = text.removeprefix("torch.")
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise InvalidArgument(f"dtype must be a torch.dtype or its name, e.g. 'bfloat16' (or 'bf16'); found {dtype!r}")
    return name


def itemsize(name: str) -> int:
    """Bytes per element of the dtype ``name`` (KeyError if the table lacks it)."""
    return DTYPES[name].itemsize


def is_convertible(name: str) -> bool:
    """Whether ``dtype=`` converts tensors of dtype ``name`` (torch's name, with or without ``torch.``)."""
    d = DTYPES.get(name.removeprefix("torch."))
    return d is not None and d.convertible


__all__ = ["ALIASES", "BY_SAFETENSORS", "DTYPES", "DType", "dtype_name", "is_convertible", "itemsize"]
