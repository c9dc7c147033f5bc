"""CPU segments (sealed memfds), packing, the keeper-side fd checks, and what the CUDA transport decides without a
GPU (its ctypes declarations, whether segments are created RDMA-capable)."""

from __future__ import annotations

import enum
import os
import types

import pytest
import torch

import weightcache as wc
from weightcache import segments
from weightcache.manifest import SegmentInfo
from weightcache.segments.memfd import MemfdTransport


def test_pack_aligns_and_splits() -> None:
    placements, sizes = segments.pack([10, 600, 5000, 1], alignment=512, max_segment_bytes=4096)
    assert [(p.segment, p.offset) for p in placements] == [(0, 0), (0, 512), (1, 0), (2, 0)]
    assert sizes == [1536, 5120, 512]
    assert all(p.offset % 512 == 0 for p in placements)


def test_pack_keeps_zero_sized_tensors() -> None:
    placements, sizes = segments.pack([0, 0], alignment=512, max_segment_bytes=4096)
    assert len(placements) == 2 and sizes == [512]


def test_write_seal_map_round_trip() -> None:
    t = MemfdTransport()
    a = torch.randn(7, 3)
    b = torch.arange(10, dtype=torch.int64)
    seg = t.create(4096, "cpu")
    seg.write(0, a)
    seg.write(512, b)
    seg.seal()
    base = t.map(seg.fd, SegmentInfo("memfd", 4096, "cpu"))
    seg.close()  # the mapping outlives the fd
    assert torch.equal(base[: a.numel() * 4].view(torch.float32).view(7, 3), a)
    assert torch.equal(base[512 : 512 + 80].view(torch.int64), b)


def test_sealed_segment_cannot_change() -> None:
    seg = MemfdTransport().create(4096, "cpu")
    seg.write(0, torch.ones(4))
    seg.seal()
    with pytest.raises(wc.SegmentError, match="sealed"):
        seg.write(0, torch.zeros(4))
    with pytest.raises(PermissionError):
        os.pwrite(seg.fd, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, 10)  # shrinking would SIGBUS every client
    import mmap

    with pytest.raises(PermissionError):
        mmap.mmap(seg.fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
    seg.close()


def test_private_mapping_isolates_writes() -> None:
    t = MemfdTransport()
    seg = t.create(4096, "cpu")
    seg.write(0, torch.zeros(16))
    seg.seal()
    info = SegmentInfo("memfd", 4096, "cpu")
    mine, theirs = t.map(seg.fd, info), t.map(seg.fd, info)
    mine[:64].view(torch.float32).fill_(3.0)
    assert theirs[:64].view(torch.float32).sum().item() == 0
    assert torch.equal(t.map(seg.fd, info)[:64], torch.zeros(64, dtype=torch.uint8))
    seg.close()


def test_write_out_of_bounds() -> None:
    seg = MemfdTransport().create(512, "cpu")
    with pytest.raises(wc.SegmentError, match="overflows"):
        seg.write(256, torch.zeros(100))
    seg.close()
    with pytest.raises(wc.SegmentError, match="cpu"):
        MemfdTransport().create(512, "GPU-x")


def test_unknown_transport_kind() -> None:
    with pytest.raises(wc.SegmentError, match="unknown segment kind"):
        segments.transport("floppy")


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 6),
        lambda: torch.randn(6, 4).t(),  # transposed: strides kept
        lambda: torch.randn(2, 3, 4).permute(2, 0, 1),
        lambda: torch.randn(8, 8)[:, :3],  # not dense: stored contiguous
        lambda: torch.randn(3).expand(4, 3),  # overlapping: stored contiguous
        lambda: torch.zeros(0, 5),
    ],
)
def test_dense_bytes_and_strides(make) -> None:  # type: ignore[no-untyped-def]
    t = make()
    data = segments.dense_bytes(t)
    stride = segments.stored_stride(t)
    assert data.numel() == t.numel() * t.element_size()
    if t.numel():
        rebuilt = data.view(t.dtype).as_strided(t.shape, stride)
        assert torch.equal(rebuilt, t)
    if segments.is_dense(t):
        assert stride == t.stride()


def test_the_ctypes_mapping_calls_match_cuda_h() -> None:
    """The structs a client passes to cuMemSetAccess have cuda.h's layout, and without libcuda the ctypes driver
    is absent (mapping then goes through cuda-bindings) rather than broken."""
    import ctypes

    from weightcache.segments import cuda_import

    assert ctypes.sizeof(cuda_import.MemLocation) == 8 and ctypes.sizeof(cuda_import.MemAccessDesc) == 12
    assert cuda_import.MemAccessDesc.flags.offset == 8
    assert (cuda_import.PROT_READ, cuda_import.PROT_READWRITE, cuda_import.HANDLE_TYPE_POSIX_FD) == (1, 3, 1)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert cuda_import.driver() is None


class FakeDriver:
    """The few names of cuda-bindings' driver module that ``rdma_capable`` uses. ``known=False`` plays bindings
    without the attribute; ``answer`` is what cuDeviceGetAttribute returns (an error code, or success and 0/1)."""

    class CUresult(enum.Enum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_NO_DEVICE = 100

    def __init__(self, *, known: bool = True, answer: tuple[int, int] = (0, 1), init: int = 0) -> None:
        names = {"CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED": 110} if known else {}
        self.CUdevice_attribute = types.SimpleNamespace(**names)
        self.answer = answer
        self.init = init
        self.queries: list[tuple[int, int]] = []

    def cuInit(self, flags: int) -> tuple[FakeDriver.CUresult]:
        return (self.CUresult(self.init),)

    def cuDeviceGet(self, ordinal: int) -> tuple[FakeDriver.CUresult, int]:
        return self.CUresult.CUDA_SUCCESS, ordinal

    def cuDeviceGetAttribute(self, attribute: int, device: int) -> tuple[FakeDriver.CUresult, int]:
        self.queries.append((attribute, device))
        return self.CUresult(self.answer[0]), self.answer[1]


@pytest.mark.parametrize(
    ("driver", "expected", "asked"),
    [
        (FakeDriver(answer=(0, 1)), True, [1, 0]),
        (FakeDriver(answer=(0, 0)), False, [1, 0]),
        (FakeDriver(answer=(1, 0)), False, [1, 0]),  # a driver that does not know the attribute refuses it
        (FakeDriver(known=False), False, []),  # cuda-bindings without the attribute: nothing to ask
    ],
    ids=["supported", "not-supported", "driver-refuses", "bindings-lack-it"],
)
def test_rdma_capable_asks_once_per_device_and_a_failed_query_means_no(
    driver: FakeDriver, expected: bool, asked: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether GPU segments are created RDMA-capable: the device's answer, asked once per device and remembered;
    when the query fails, no flag (segments as before) rather than an error. The driver is played by a fake: no
    GPU here, and no real driver lacks the attribute."""
    from weightcache.segments import cuda_vmm

    monkeypatch.setattr(cuda_vmm, "_driver", lambda: driver)
    monkeypatch.setattr(cuda_vmm, "_rdma", {})
    assert [cuda_vmm.rdma_capable(1), cuda_vmm.rdma_capable(1)] == [expected, expected]
    assert cuda_vmm.rdma_capable(0) is expected
    assert driver.queries == [(110, device) for device in asked]  # once per device


def test_rdma_capable_is_not_remembered_when_the_driver_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cuInit that fails says nothing about the device: the answer is no for now, and asked again next time."""
    from weightcache.segments import cuda_vmm

    driver = FakeDriver(init=100)
    monkeypatch.setattr(cuda_vmm, "_driver", lambda: driver)
    monkeypatch.setattr(cuda_vmm, "_rdma", {})
    assert cuda_vmm.rdma_capable(0) is False and not driver.queries
    driver.init = 0
    assert cuda_vmm.rdma_capable(0) is True and len(driver.queries) == 1
