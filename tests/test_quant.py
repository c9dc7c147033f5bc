"""Quantization strategies and their registry."""

from __future__ import annotations

from typing import ClassVar

import pytest

import weightcache as wc
from weightcache.quant import QuantStrategy


def test_builtin_methods() -> None:
    assert wc.quant.safe_methods() == ["fp8_block", "none"]
    for name in ("fp8_per_tensor", "marlin", "awq", "gptq"):
        strategy = wc.quant.get(name)
        assert strategy.ipc_safe is False and strategy.reason
        with pytest.raises(wc.UnsupportedQuantError) as info:
            strategy.check()
        assert name in str(info.value) and strategy.reason in str(info.value)
    wc.quant.get("none").check()
    wc.quant.get("fp8_block").check({"weight_block_size": [128, 128]})


def test_fp8_block_config_is_checked() -> None:
    for bad in ({}, {"weight_block_size": [128]}, {"weight_block_size": [0, 128]}, {"weight_block_size": "128x128"}):
        with pytest.raises(wc.UnsupportedQuantError, match="weight_block_size"):
            wc.quant.get("fp8_block").check(bad)


def test_unknown_method() -> None:
    with pytest.raises(wc.UnsupportedQuantError, match="unknown quantization method 'nf4'.*known methods"):
        wc.quant.get("nf4")


def test_register_new_methods() -> None:
    class MyInt8(QuantStrategy):
        name: ClassVar[str] = "test_int8_rowwise"
        ipc_safe: ClassVar[bool] = True

    class Bad(QuantStrategy):
        name: ClassVar[str] = "test_bad"
        ipc_safe: ClassVar[bool] = False

    assert wc.quant.register(MyInt8) is MyInt8
    assert wc.quant.get("test_int8_rowwise").ipc_safe
    assert "test_int8_rowwise" in wc.quant.safe_methods()
    with pytest.raises(wc.InvalidArgument, match="already registered"):
        wc.quant.register(MyInt8)
    wc.quant.register(MyInt8, replace=True)
    with pytest.raises(wc.InvalidArgument, match="reason"):
        wc.quant.register(Bad)
    with pytest.raises(wc.InvalidArgumentType):
        wc.quant.register(int)  # type: ignore[type-var]


def test_cache_refuses_to_publish_or_get_refused_methods(checkpoint, socket_dir) -> None:  # type: ignore[no-untyped-def]
    import torch

    fp = wc.Fingerprint.create(checkpoint, quant="gptq")
    cache = wc.Cache(socket_dir, spawn=True)
    with pytest.raises(wc.UnsupportedQuantError, match="gptq"):
        cache.put(fp, {"w": torch.zeros(4)})
    with pytest.raises(wc.UnsupportedQuantError, match="gptq"):
        cache.get(fp)
    assert cache.entries() == []
