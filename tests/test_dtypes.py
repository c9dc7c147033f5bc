"""The one dtype table agrees with torch, and names resolve the same with and without torch."""

from __future__ import annotations

import pytest
import torch

from weightcache.dtypes import BY_SAFETENSORS, DTYPES, dtype_name, is_convertible
from weightcache.torch_dtypes import SAFETENSORS_DTYPES, TORCH_DTYPES, convertible, resolve_dtype


def test_the_table_agrees_with_torch() -> None:
    for name, d in DTYPES.items():
        value = getattr(torch, name, None)
        if value is None:  # a type this torch lacks: the table may know more than one torch version
            continue
        assert TORCH_DTYPES[name] is value
        assert value.itemsize == d.itemsize, name
        assert value.is_floating_point == d.floating, name
        assert convertible(value) == d.convertible == is_convertible(str(value)), name


def test_safetensors_codes() -> None:
    assert BY_SAFETENSORS["BF16"] == "bfloat16" and BY_SAFETENSORS["F8_E4M3"] == "float8_e4m3fn"
    assert SAFETENSORS_DTYPES["F8_E4M3"] is torch.float8_e4m3fn
    assert SAFETENSORS_DTYPES["BOOL"] is torch.bool


@pytest.mark.parametrize("spec", [torch.bfloat16, "bfloat16", "torch.bfloat16"])
def test_names_and_dtypes_resolve_alike(spec: object) -> None:
    assert dtype_name(spec) == "bfloat16"
    assert resolve_dtype(spec) is torch.bfloat16


def test_aliases_and_refusals() -> None:
    assert dtype_name(torch.half) == "float16" and dtype_name("half") == "float16"
    assert dtype_name("bf16") == "bfloat16" and resolve_dtype("fp16") is torch.float16  # the short names people type
    assert dtype_name(None) is None and resolve_dtype(None) is None
    for bad in ("bf17", "", 16, object()):
        with pytest.raises(ValueError, match="torch.dtype or its name"):
            dtype_name(bad)
