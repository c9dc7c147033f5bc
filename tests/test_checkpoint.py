"""Checkpoint discovery, header checks and loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import stop_keeper
from models import make_checkpoint
from safetensors.torch import save_file

import weightcache as wc
from weightcache.checkpoint import safetensors_files
from weightcache.loader import load_state_dict


def test_single_file_directory_and_file(checkpoint: Path) -> None:
    assert safetensors_files(checkpoint) == [checkpoint / "model.safetensors"]
    assert safetensors_files(checkpoint / "model.safetensors") == [checkpoint / "model.safetensors"]


def test_index_selects_files(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "s", shards=2)
    (ckpt / "stray.safetensors").write_bytes(b"not listed in the index")
    files = safetensors_files(ckpt)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    state = load_state_dict(ckpt)
    assert "embed.weight" in state and "blocks.1.down.bias" in state


def test_index_naming_a_missing_file(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "s", shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(wc.CheckpointError, match="does not exist"):
        safetensors_files(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(wc.CheckpointError, match="weight_map"):
        safetensors_files(ckpt)
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {}}')  # an index of nothing: no checkpoint
    with pytest.raises(wc.CheckpointError, match="maps no tensor"):
        safetensors_files(ckpt)
    with pytest.raises(wc.CheckpointError, match="maps no tensor"):
        wc.Fingerprint.create(ckpt)


def test_truncated_file_is_a_clear_error(checkpoint: Path) -> None:
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(wc.CheckpointError, match="truncated"):
        load_state_dict(checkpoint)
    file.write_bytes(data[:4])
    with pytest.raises(wc.CheckpointError, match="too short"):
        load_state_dict(checkpoint)


def test_duplicate_tensor_across_files(tmp_path: Path) -> None:
    d = tmp_path / "dup"
    d.mkdir()
    save_file({"w": torch.zeros(2)}, str(d / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(d / "b.safetensors"))
    with pytest.raises(wc.CheckpointError, match="in both"):
        load_state_dict(d)


def test_dtype_converts_floats_only(tmp_path: Path) -> None:
    d = tmp_path / "mixed"
    d.mkdir()
    save_file({"f": torch.randn(3), "i": torch.arange(3), "b": torch.tensor([True, False])}, str(d / "m.safetensors"))
    state = load_state_dict(d, dtype=torch.float16)
    assert state["f"].dtype == torch.float16 and state["i"].dtype == torch.int64 and state["b"].dtype == torch.bool


def test_transform_must_return_a_dict(checkpoint: Path) -> None:
    with pytest.raises(wc.CheckpointError, match="expected a dict"):
        load_state_dict(checkpoint, transform=lambda s: list(s))  # type: ignore[arg-type,return-value]


def test_huge_declared_header_is_refused_before_allocating(tmp_path: Path) -> None:
    d = tmp_path / "huge"
    d.mkdir()
    (d / "m.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(wc.CheckpointError, match="header"):
        safetensors_files(d) and load_state_dict(d)


def test_offsets_outside_the_file(tmp_path: Path) -> None:
    d = tmp_path / "lie"
    d.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    (d / "m.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(wc.CheckpointError, match="data_offsets"):
        load_state_dict(d)


def test_dtype_leaves_fp8_alone(tmp_path: Path) -> None:
    d = tmp_path / "fp8"
    d.mkdir()
    save_file({"w": torch.randn(4).to(torch.float8_e4m3fn), "s": torch.ones(1)}, str(d / "m.safetensors"))
    state = load_state_dict(d, dtype=torch.bfloat16)
    assert state["w"].dtype == torch.float8_e4m3fn and state["s"].dtype == torch.bfloat16


def test_a_pytorch_bin_checkpoint_is_named_with_how_to_convert_it(tmp_path: Path) -> None:
    """A directory of .bin weights: the error says what it found there and how to convert it."""
    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    torch.save({"w": torch.ones(2)}, ckpt / "pytorch_model.bin")
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(wc.CheckpointError) as info:
        safetensors_files(ckpt)
    text = str(info.value)
    assert "holds no .safetensors files (found config.json, pytorch_model.bin)" in text, text
    assert "save_file(torch.load(" in text and "save_pretrained" in text
    with pytest.raises(wc.CheckpointError, match=r"pytorch_model.bin is not a .safetensors file.*save_file"):
        safetensors_files(ckpt / "pytorch_model.bin")
    (ckpt / "pytorch_model.bin").unlink()
    (ckpt / "config.json").unlink()
    with pytest.raises(wc.CheckpointError, match=r"holds no .safetensors files \(it is empty\)"):
        safetensors_files(ckpt)


@pytest.mark.parametrize("part", ["header", "config", "index"])
def test_deeply_nested_json_is_a_clear_error(tmp_path: Path, part: str) -> None:
    """Issue 22, finding 5: a header, config.json or index nested 100,000 deep ends `weightcache load` with an
    error naming the file, not a RecursionError traceback."""
    import struct
    import subprocess
    import sys

    ckpt = make_checkpoint(tmp_path / "ckpt", shards=2 if part == "index" else 1)
    deep = "[" * 100_000 + "]" * 100_000
    if part == "header":
        header = json.dumps({"__metadata__": {"x": "y"}}).encode()[:-1] + b',"deep":' + deep.encode() + b"}"
        bad = ckpt / "model.safetensors"
        bad.write_bytes(struct.pack("<Q", len(header)) + header)
    elif part == "config":
        bad = ckpt / "config.json"
        bad.write_text(deep)
    else:
        bad = ckpt / "model.safetensors.index.json"
        bad.write_text('{"weight_map": ' + deep + "}")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "weightcache", "load", str(ckpt), "--socket-dir", str(tmp_path / "s")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stop_keeper(tmp_path / "s")  # the one `load` started
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert str(bad) in out.stderr and "not a valid" in out.stderr, out.stderr
    with pytest.raises(wc.CheckpointError, match=bad.name):
        if part == "header":
            from weightcache.checkpoint import read_header

            read_header(bad)
        else:
            wc.Fingerprint.create(ckpt)
