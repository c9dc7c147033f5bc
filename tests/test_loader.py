"""The loader's CPU-side parts: the checkpoint layout and the head prefetch (the GPU streaming is in test_cuda)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from safetensors.torch import save_file

from weightcache.checkpoint import drop_page_cache
from weightcache.errors import CheckpointError
from weightcache.loader import checkpoint_layout, prefetch_head


def _cached(path: Path, offset: int, nbytes: int) -> bool:
    """Whether these bytes are in the page cache: a RWF_NOWAIT read fails rather than wait for the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(nbytes)], offset, os.RWF_NOWAIT) == nbytes
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_prefetch_head_reads_the_beginning_of_the_checkpoint(tmp_path: Path) -> None:
    save_file(
        {"a": torch.ones(8 << 20, dtype=torch.uint8), "b": torch.ones(24 << 20, dtype=torch.uint8)},
        str(tmp_path / "model.safetensors"),
    )
    file = tmp_path / "model.safetensors"
    drop_page_cache(tmp_path)
    if _cached(file, 0, 1 << 20):
        pytest.skip("this filesystem keeps the file in memory whatever the advice (e.g. tmpfs)")
    prefetch_head([file], nbytes=4 << 20).join(timeout=30)
    # the advice starts the reads; they complete asynchronously
    assert wait_until(lambda: _cached(file, 0, 4 << 20), timeout=20)


def test_prefetch_head_ignores_missing_files(tmp_path: Path) -> None:
    prefetch_head([tmp_path / "gone.safetensors"]).join(timeout=30)  # advice only: no exception, thread ends


def test_layout_lists_tensors_in_file_order_with_absolute_offsets(tmp_path: Path) -> None:
    tensors = {"z": torch.arange(10, dtype=torch.int32), "a": torch.ones(3, 4, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layout = checkpoint_layout(tmp_path)
    assert sorted(t.name for t in layout) == ["a", "z"]
    assert [t.begin for t in layout] == sorted(t.begin for t in layout)
    data = (tmp_path / "model.safetensors").read_bytes()
    for t in layout:
        expected = tensors[t.name]
        assert t.dtype == expected.dtype and t.shape == tuple(expected.shape)
        raw = torch.frombuffer(bytearray(data[t.begin : t.end]), dtype=torch.uint8)
        assert torch.equal(raw.view(t.dtype).view(t.shape), expected)


def test_layout_of_a_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    save_file({"w": torch.ones(1000)}, str(tmp_path / "model.safetensors"))
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        checkpoint_layout(tmp_path)
