"""Cutting tensors out of mapped segments (weightcache/views.py): every layout comes back with its values, shape
and stride, whether it was cut alone (``as_strided``) or as part of a run of back-to-back tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import weightcache as wc
from weightcache import views
from weightcache.publish import pack_state


def mixed_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    state: dict[str, torch.Tensor] = {}
    for i in range(6):  # a run of 1-D tensors (norms), then of matrices sharing their trailing dimension
        state[f"norm{i}"] = rnd(256)
    for i in range(5):
        state[f"proj{i}"] = rnd(8 + i, 64)
    state["odd"] = rnd(7)  # 14 bytes: the next tensor starts after an alignment gap, so the run breaks
    for i in range(4):
        state[f"after_gap{i}"] = rnd(256)
    state["transposed"] = rnd(16, 32).t()  # not contiguous: cut alone
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.empty(0, 4)
    state["ones"] = rnd(1, 1, 32)  # size-1 dimensions
    for i in range(4):  # a run of 3-D tensors, in another dtype
        state[f"cube{i}"] = rnd(2, 3, 4, dtype=torch.float32)
    state["ints"] = torch.arange(100, dtype=torch.int32)
    for i in range(3):  # a run too short for a split
        state[f"short{i}"] = rnd(128)
    return state


def test_every_layout_comes_back_with_its_values_shape_and_stride(checkpoint_fp: wc.Fingerprint) -> None:
    state = mixed_state()
    packed = pack_state(checkpoint_fp, state, digests=False)
    try:
        tensors = packed.local_tensors()
        manifest = packed.manifest
    finally:
        packed.close()
    assert list(tensors) == list(state)
    for name, stride in zip(manifest.names, manifest.stride):
        got, want = tensors[name], state[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert got.stride() == stride, name
        assert torch.equal(got, want), name


def test_views_of_one_run_are_independent_and_writable(checkpoint_fp: wc.Fingerprint) -> None:
    """CPU mappings are private copies on write: an engine may change its weights in place, one tensor at a
    time, also when its views came from one split."""
    state = {f"n{i}": torch.full((64,), float(i)) for i in range(8)}
    packed = pack_state(checkpoint_fp, state, digests=False)
    try:
        tensors = packed.local_tensors()
    finally:
        packed.close()
    tensors["n3"].add_(100)
    assert torch.equal(tensors["n3"], torch.full((64,), 103.0))
    assert all(torch.equal(tensors[f"n{i}"], state[f"n{i}"]) for i in range(8) if i != 3)
    param = torch.nn.Parameter(tensors["n4"])
    (param * 2).sum().backward()  # a view from a split works as a trainable parameter's data
    assert param.grad is not None


def test_a_run_that_leaves_its_segment_is_a_manifest_error(checkpoint_fp: wc.Fingerprint) -> None:
    state = {f"n{i}": torch.ones(64) for i in range(8)}
    packed = pack_state(checkpoint_fp, state, digests=False)
    try:
        manifest = packed.manifest
        bad = type(manifest)(
            fingerprint=manifest.fingerprint,
            segments=manifest.segments,
            names=manifest.names,
            segment=manifest.segment,
            offset=manifest.offset,
            dtype=manifest.dtype,
            shape=(*manifest.shape[:-1], (manifest.segments[0].size,)),  # the last tensor overflows
            stride=manifest.stride,
            kind=manifest.kind,
            requires_grad=manifest.requires_grad,
            digest=manifest.digest,
        )
        with pytest.raises(wc.ManifestError, match="cannot build the tensors"):
            views.map_entry(bad, packed.fds())
    finally:
        packed.close()


@pytest.fixture
def checkpoint_fp(checkpoint: Path) -> wc.Fingerprint:
    return wc.Fingerprint.create(checkpoint)
