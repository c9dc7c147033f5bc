"""Fingerprint: identity fields, canonical JSON, digest, diff, and change detection without reading data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import pytest
import torch
from models import make_checkpoint

import weightcache as wc
from weightcache.errors import ManifestError
from weightcache.fingerprint import Fingerprint, canonical_json, format_differences


def test_create_fills_identity_fields(checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(
        checkpoint,
        dtype=torch.bfloat16,
        quant="fp8_block",
        quant_config={"weight_block_size": [128, 128]},
        parallel={"tp": (1, 2), "pp": (0, 1)},
        transform="my.shard",
        device="cpu",
        extra={"engine_config": {"max_len": 4096}},
    )
    assert fp.model_path == str(checkpoint.resolve())
    assert fp.architecture == "TinyLM"
    assert fp.dtype == "bfloat16" and fp.quant == "fp8_block" and fp.quant_config_hash
    assert fp.parallel == (("pp", 0, 1), ("tp", 1, 2))
    assert fp.transform == "my.shard"
    assert fp.device_kind == "cpu" and fp.placement == "cpu" and fp.compute_capability is None
    assert fp.torch_version == torch.__version__ and fp.format_version >= 1
    [f] = fp.checkpoint
    assert f.name == "model.safetensors" and f.size == (checkpoint / "model.safetensors").stat().st_size
    assert len(f.header_sha256) == 64
    assert json.loads(fp.extra) == {"engine_config": {"max_len": 4096}}


def test_digest_is_stable_and_canonical(checkpoint: Path) -> None:
    a = wc.Fingerprint.create(checkpoint, quant_config={"b": 1, "a": 2})
    b = wc.Fingerprint.create(checkpoint, quant_config={"a": 2, "b": 1})
    assert a == b and a.digest == b.digest and len(a.digest) == 64
    assert a.canonical_json() == canonical_json(json.loads(a.canonical_json()))
    assert " " not in a.canonical_json()


def test_json_round_trip(checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint, dtype="float16", parallel={"tp": (0, 4)})
    back = wc.Fingerprint.from_json(json.loads(json.dumps(fp.to_json())))
    assert back == fp and back.digest == fp.digest and back.placement == fp.placement


@pytest.mark.parametrize(
    "change, field",
    [
        ({"dtype": torch.float16}, "dtype"),
        ({"quant": "fp8_block"}, "quant"),
        ({"quant_config": {"x": 1}}, "quant_config_hash"),
        ({"parallel": {"tp": (0, 2)}}, "parallel"),
        ({"transform": "other"}, "transform"),
    ],
)
def test_diff_names_each_differing_field(checkpoint: Path, change: dict, field: str) -> None:
    base = wc.Fingerprint.create(checkpoint)
    other = wc.Fingerprint.create(checkpoint, **change)
    diffs = base.diff(other)
    assert [d[0] for d in diffs] == [field]
    assert diffs[0][1] == getattr(base, field) and diffs[0][2] == getattr(other, field)
    assert base.digest != other.digest


def test_diff_names_each_differing_key_of_extra(checkpoint: Path) -> None:
    """A model loader's identity (a whole model configuration) differs in one leaf: the diff names that leaf."""
    config = {"rope": {"theta": 10000.0, "type": "default"}, "layers": 2}
    base = wc.Fingerprint.create(checkpoint, extra={"transformers": config, "structure": "a"})
    other = wc.Fingerprint.create(
        checkpoint, extra={"transformers": {**config, "rope": {"theta": 5e5, "type": "default"}}, "structure": "b"}
    )
    assert base.diff(other) == [("extra.structure", "a", "b"), ("extra.transformers.rope.theta", 10000.0, 5e5)]
    assert wc.Fingerprint.create(checkpoint).diff(wc.Fingerprint.create(checkpoint, extra={"k": "v"})) == [
        ("extra.k", None, "v")
    ]


@pytest.mark.parametrize(
    ("mine", "theirs", "expected"),
    [
        ({}, {"a": None}, [("extra.a", "<absent>", None)]),
        ({"n": 1}, {"n": 1.0}, [("extra.n", 1, 1.0)]),
        ({"n": True}, {"n": 1}, [("extra.n", True, 1)]),
    ],
)
def test_every_extra_difference_that_changes_the_digest_is_named(
    checkpoint: Path, mine: dict, theirs: dict, expected: list
) -> None:
    """Values the digest tells apart are told apart by the diff too (it compared with Python's ==, for which a
    missing key was null and 1, 1.0 and True were one value: a miss listed no difference at all)."""
    a, b = wc.Fingerprint.create(checkpoint, extra=mine), wc.Fingerprint.create(checkpoint, extra=theirs)
    assert a.digest != b.digest and a.diff(b) == expected
    if mine:
        with pytest.raises(wc.InvalidArgument, match="already holds"):
            a.with_extra(**theirs)  # an identity is extended, never rewritten


def test_every_argument_is_checked_before_the_checkpoint_is_read(tmp_path: Path) -> None:
    """An argument that cannot work is the first error, whatever the checkpoint (here: none at all)."""
    missing = tmp_path / "not-there"
    with pytest.raises(wc.InvalidArgument, match="device"):
        wc.Fingerprint.create(missing, device="gpu")
    with pytest.raises(wc.InvalidArgument, match="rank < size"):
        wc.Fingerprint.create(missing, parallel={"tp": (3, 2)})
    with pytest.raises(wc.InvalidArgument, match="lambda"):
        wc.Fingerprint.create(missing, transform=lambda sd: sd)
    with pytest.raises(wc.UnsupportedQuantError):
        wc.Fingerprint.create(missing, quant="int3-magic")
    with pytest.raises(wc.InvalidArgument):
        wc.Fingerprint.create(missing, dtype="nonsense")
    with pytest.raises(wc.CheckpointError):
        wc.Fingerprint.create(missing)


@pytest.mark.parametrize(
    "parallel",
    [{"tp": (0.9, 2)}, {"tp": (0, 2.5)}, {"tp": "01"}, {"tp": (True, 2)}, {"tp": ("1", "2")}, {"x" * 65: (0, 1)}],
)
def test_a_parallel_layout_of_anything_but_integer_ranks_and_sizes_is_refused(checkpoint: Path, parallel: dict) -> None:
    """``(rank, size)`` of integers under a name the keeper accepts (it was truncated with int(): (0.9, 2) was
    rank 0, and "01" rank 0 of 1)."""
    with pytest.raises(wc.InvalidArgument, match="parallel"):
        wc.Fingerprint.create(checkpoint, parallel=parallel)
    with pytest.raises(wc.InvalidArgument, match="at most 16"):
        wc.Fingerprint.create(checkpoint, parallel={f"a{i}": (0, 1) for i in range(17)})


def test_integral_ranks_of_any_type_are_one_layout(checkpoint: Path) -> None:
    """Ranks from numpy or torch (``np.int64``, a 0-d integer tensor's item) are integers like Python's."""
    import numpy as np
    import torch

    plain = wc.Fingerprint.create(checkpoint, parallel={"tp": (1, 2)})
    assert wc.Fingerprint.create(checkpoint, parallel={"tp": (np.int64(1), np.int32(2))}) == plain
    assert wc.Fingerprint.create(checkpoint, parallel={"tp": (torch.tensor(1), torch.tensor(2))}) == plain
    assert plain.parallel == (("tp", 1, 2),)


def test_rewrite_with_same_shapes_changes_identity(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "c", seed=0)
    file = ckpt / "model.safetensors"
    before = wc.Fingerprint.create(ckpt)
    st = os.stat(file)
    make_checkpoint(tmp_path / "c", seed=1)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))  # an rsync -t / cp -p style restore
    after = wc.Fingerprint.create(ckpt)
    assert before.checkpoint[0].header_sha256 == after.checkpoint[0].header_sha256  # headers alone can't tell
    assert before.checkpoint[0].mtime_ns == after.checkpoint[0].mtime_ns
    assert before.digest != after.digest
    fields = [d[0] for d in before.diff(after)]
    assert any(f.startswith("checkpoint[model.safetensors].") for f in fields)


def test_in_place_overwrite_of_data_bytes_changes_identity(tmp_path: Path) -> None:
    """Overwrite tensor bytes inside the file (same inode, same size, same header, mtime restored)."""
    ckpt = make_checkpoint(tmp_path / "c")
    file = ckpt / "model.safetensors"
    before = wc.Fingerprint.create(ckpt)
    st = os.stat(file)
    with open(file, "r+b") as f:
        f.seek(st.st_size - 16)
        f.write(b"\x01" * 16)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = wc.Fingerprint.create(ckpt)
    assert after.checkpoint[0].inode == before.checkpoint[0].inode
    assert before.digest != after.digest  # ctime moved; nothing the writer can set back


def test_placement_is_not_identity(checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint)
    moved = attrs.evolve(fp, placement="GPU-00000000-0000-0000-0000-000000000000")
    assert moved == fp and moved.digest == fp.digest
    assert moved.diff(fp) == []


def test_missing_and_corrupt_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(wc.CheckpointError, match="does not exist"):
        wc.Fingerprint.create(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(wc.CheckpointError, match="no .safetensors"):
        wc.Fingerprint.create(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(wc.CheckpointError, match="header"):
        wc.Fingerprint.create(bad)


def test_from_json_rejects_malformed_input(checkpoint: Path) -> None:
    good = wc.Fingerprint.create(checkpoint).to_json()
    for broken in (
        None,
        [],
        {**good, "dtype": 3},
        {**good, "format_version": "1"},
        {**good, "format_version": True},
        {**good, "checkpoint": [{"name": "x"}]},
        {**good, "parallel": [["tp", 0]]},
        {k: v for k, v in good.items() if k != "quant"},
    ):
        with pytest.raises(wc.ManifestError):
            wc.Fingerprint.from_json(broken)


def test_bad_arguments(checkpoint: Path) -> None:
    with pytest.raises(wc.UnsupportedQuantError, match="unknown quantization method"):
        wc.Fingerprint.create(checkpoint, quant="int3-magic")
    with pytest.raises(wc.InvalidArgument, match="rank < size"):
        wc.Fingerprint.create(checkpoint, parallel={"tp": (2, 2)})
    with pytest.raises(wc.InvalidArgument, match="device"):
        wc.Fingerprint.create(checkpoint, device="tpu")
    with pytest.raises(wc.InvalidArgumentType, match="JSON"):
        wc.Fingerprint.create(checkpoint, extra={"f": object()})
    with pytest.raises(wc.InvalidArgumentType, match="JSON"):
        wc.Fingerprint.create(checkpoint, quant_config={"bits": object()})
    fp = wc.Fingerprint.create(checkpoint, extra={"a": 1})
    with pytest.raises(wc.InvalidArgument, match="already holds a"):
        fp.with_extra(a=2)
    # every argument error is a WeightCacheError, and still the ValueError or TypeError Python code expects
    assert issubclass(wc.InvalidArgumentType, wc.WeightCacheError) and issubclass(wc.InvalidArgumentType, TypeError)
    assert issubclass(wc.InvalidArgumentType, ValueError)


def _scale(state: dict, k: float = 1.0) -> dict:
    return state


def _shard(state: dict, rank: int = 0) -> dict:
    return state


def test_transform_identity(checkpoint: Path) -> None:
    import functools

    from weightcache.fingerprint import transform_identity

    a = transform_identity(functools.partial(_scale, k=2.0))
    b = transform_identity(functools.partial(_shard, rank=1))
    c = transform_identity(functools.partial(_scale, k=3.0))
    assert len({a, b, c}) == 3 and "_scale" in a and '"k":2.0' in a
    with pytest.raises(wc.InvalidArgument, match="lambda"):
        transform_identity(lambda s: s)
    x = 2

    def closure(s: dict) -> dict:
        return {k: v * x for k, v in s.items()}

    with pytest.raises(wc.InvalidArgument, match="closure"):
        transform_identity(closure)
    closure.weightcache_id = "times-two-v1"  # type: ignore[attr-defined]
    assert transform_identity(closure) == "times-two-v1"
    with pytest.raises(wc.InvalidArgument, match="JSON"):
        transform_identity(functools.partial(_scale, k=object()))

    def v1(s: dict) -> dict:
        return s

    first = transform_identity(v1)

    def v1(s: dict) -> dict:
        return dict(s)

    assert transform_identity(v1) != first and transform_identity(v1).split("#")[0] == first.split("#")[0]
    fp1 = wc.Fingerprint.create(checkpoint, transform=functools.partial(_scale, k=2.0))
    fp2 = wc.Fingerprint.create(checkpoint, transform=functools.partial(_scale, k=3.0))
    assert fp1.digest != fp2.digest


def test_dtype_names_are_validated(checkpoint: Path) -> None:
    assert wc.Fingerprint.create(checkpoint, dtype="torch.bfloat16").dtype == "bfloat16"
    assert wc.Fingerprint.create(checkpoint, dtype=torch.bfloat16).dtype == "bfloat16"
    assert wc.Fingerprint.create(checkpoint, dtype="bf16").dtype == "bfloat16"  # a short name, the same dtype
    with pytest.raises(wc.InvalidArgument, match="bf17"):
        wc.Fingerprint.create(checkpoint, dtype="bf17")


def test_the_owner_explains_any_miss_without_raising() -> None:
    """Whatever a fingerprint from the keeper holds (an older keeper did not bound them), comparing it and
    explaining the difference neither raises nor copies it whole into a warning."""
    mine = Fingerprint.from_json(
        {
            "model_path": "/m",
            "architecture": None,
            "revision": None,
            "checkpoint": [],
            "parallel": [],
            "quant": "none",
            "quant_config_hash": None,
            "dtype": None,
            "transform": None,
            "engine": "torch",
            "engine_version": "2",
            "device_kind": "cpu",
            "compute_capability": None,
            "torch_version": "2",
            "format_version": 1,
            "extra": '{"a":1}',
            "placement": "cpu",
        }
    )
    for extra in ("[" * 100_000 + "]" * 100_000, json.dumps({"a": "x" * (8 << 20)}), '"\\ud800"'):
        theirs = attrs.evolve(mine, extra=extra)
        diffs = mine.diff(theirs)
        assert diffs
        assert len(format_differences(diffs)) < 2000
    with pytest.raises(ManifestError, match="nested 100000 levels deep"):
        attrs.evolve(mine, extra="[" * 100_000 + "]" * 100_000).check_bounds()
    with pytest.raises(ManifestError, match="'extra' holds"):
        Fingerprint.from_json({**mine.to_json(), "extra": "x" * (8 << 20)})
    with pytest.raises(ManifestError, match="'model_path' holds"):
        Fingerprint.from_json({**mine.to_json(), "model_path": "/" * 5000})
