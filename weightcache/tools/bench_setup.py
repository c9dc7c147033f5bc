"""``weightcache bench``'s configurations: how big, how many tensors, what they hold, and how they are set up.

A configuration is a size (GiB) and a tensor count: :func:`layout` gives its tensors' sizes (LLM-like: two thirds
small, the rest large), :func:`pattern` each tensor's contents (random bits, the same on every call) and
:func:`checksum` what a process must see. :func:`plan_sizes` keeps the sizes this machine's memory holds (a size
the user gave that does not fit is refused before anything is written). :func:`publish_synthetic` fills an entry
straight into segments and publishes it; :func:`marker_checkpoint` is the tiny checkpoint that names its
fingerprint, :func:`real_checkpoint` a safetensors file of the same layout and contents.

Layer L5 (a tool). Used by :mod:`weightcache.tools.bench` and the other benchmarks (``bench_ranks``,
``bench_restart``, benchmarks/); times nothing and starts no process. Its names are re-exported by
:mod:`weightcache.tools.bench`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import weightcache as wc
from weightcache import segments
from weightcache.manifest import TensorInfo
from weightcache.publish import Packed
from weightcache.units import format_bytes

#: What ``weightcache bench`` measures without ``--sizes`` and ``--tensors``.
DEFAULT_SIZES_GIB = (1.0, 8.0)
DEFAULT_TENSORS = (3000,)
#: Fresh engine processes per configuration (and per mechanism).
DEFAULT_REPEAT = 7
#: Segments the bench fills: as large as those ``weightcache load`` streams a checkpoint into on a GPU (few
#: imports per attach); on the CPU the library's default for a memfd.
CUDA_SEGMENT_BYTES = 16 << 30
CPU_SEGMENT_BYTES = 8 << 30


def layout(total_bytes: int, n: int, itemsize: int) -> list[int]:
    """Element counts of ``n`` tensors adding up to about ``total_bytes``."""
    small = (2 * n) // 3
    big = max(1, n - small)
    sizes = [4096] * small
    rest = total_bytes // itemsize - sum(sizes)
    sizes += [max(256, (rest // big) // 256 * 256)] * big
    return sizes


#: Memory a size needs, per byte of weights: the loaded or filled copy, and the keeper's copy while it is packed
#: (CPU); on a GPU the weights once, plus room for the CUDA context and staging.
CPU_FACTOR = 2.0
GPU_HEADROOM = 1 << 30


def memory_available(device: str) -> int:
    """Bytes free for the benchmark's weights: MemAvailable on CPU, the GPU's free memory on ``cuda:N``."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise wc.WeightCacheError("/proc/meminfo has no MemAvailable line: cannot tell how big a benchmark fits")


def memory_needed(gib: float, device: str = "cpu") -> int:
    """About how much memory a benchmark of ``gib`` GiB of weights takes at its peak."""
    size = int(gib * 2**30)
    return size + GPU_HEADROOM if device.startswith("cuda") else int(size * CPU_FACTOR)


def sizes_that_fit(
    sizes: Sequence[float], available: int, *, explicit: bool, device: str = "cpu"
) -> tuple[list[float], str | None]:
    """The sizes (GiB) to run with ``available`` bytes of memory, and a note of the ones left out.

    Sizes the user gave (``explicit``) are never changed: one that does not fit is a WeightCacheError, before
    anything is written. Default sizes that do not fit are left out (the note says which); none fitting is an
    error that says what to pass.
    """
    fit = [g for g in sizes if memory_needed(g, device) <= available]
    left = [g for g in sizes if g not in fit]
    if not left:
        return fit, None
    where = f"{format_bytes(available)} available on {device}"
    if explicit:
        g = left[0]
        raise wc.WeightCacheError(
            f"--sizes {g:g} GiB needs about {format_bytes(memory_needed(g, device))} of memory; this machine has "
            f"{where}. Give smaller --sizes"
        )
    if not fit:
        g = min(sizes)
        raise wc.WeightCacheError(
            f"even the smallest default size, {g:g} GiB, needs about {format_bytes(memory_needed(g, device))} of "
            f"memory; this machine has {where}. Give smaller --sizes, e.g. --sizes 0.25"
        )
    shown = ", ".join(f"{g:g} GiB" for g in left)
    return fit, (
        f"left out {shown}: needs about {format_bytes(memory_needed(max(left), device))} of memory, {where} "
        "(pass --sizes to choose)"
    )


def plan_sizes(
    sizes: Sequence[float] | None, defaults: Sequence[float], device: str, extra_copy: bool = False
) -> list[float]:
    """:func:`sizes_that_fit` for this machine: ``sizes`` as given, or the ``defaults`` that fit (printing what
    was left out). ``extra_copy``: a second entry of each size is held beside the first (a real checkpoint's),
    so only two thirds of the memory count as available (three copies at the CPU's peak instead of two)."""
    available = memory_available(device)
    if extra_copy:
        available = available * 2 // 3
    fit, note = sizes_that_fit(sizes or defaults, available, explicit=sizes is not None, device=device)
    if note:
        print(f"weightcache bench: {note}", flush=True)
    return fit


def meta_holder(shapes: list[int], dtype: torch.dtype, prefix: str = "p") -> nn.Module:
    """A module built on the meta device with one 1-D parameter ``{prefix}{i}`` of ``shapes[i]`` elements per
    tensor: what an engine's model is to :func:`weightcache.bind`, without the engine."""
    model = nn.Module()
    with torch.device("meta"):
        for i, n in enumerate(shapes):
            model.register_parameter(f"{prefix}{i}", nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False))
    return model


def pattern(i: int, numel: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Tensor ``i``'s contents: random bits, the same on every call (a random block of at most 64 Ki elements
    from a generator seeded with ``i``, repeated). The peer's holder and our filler both use it."""
    gen = torch.Generator(device=device).manual_seed(i)
    block = torch.randint(-(2**15), 2**15, (min(numel, 1 << 16),), generator=gen, dtype=torch.int16, device=device)
    bits = block.repeat(-(-numel // block.numel()))[:numel] if numel > block.numel() else block
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if itemsize == 2:
        return bits.view(dtype)
    return bits.to(dtype)


def checksum(tensors: Sequence[torch.Tensor]) -> str:
    """Per tensor the sum of its 16-bit words (on its device), hashed: equal for identical bits, and with
    random contents a tensor read from the wrong place changes it."""
    import hashlib

    with torch.no_grad():
        sums = torch.stack([t.reshape(-1).view(torch.int16).sum(dtype=torch.int64) for t in tensors])
    return hashlib.sha256(sums.cpu().numpy().tobytes()).hexdigest()


def marker_checkpoint(directory: Path, gib: float, n: int, dtype_name: str) -> Path:
    """A tiny real checkpoint whose header names the configuration: ``attach`` fingerprints it as an engine
    would, and each configuration gets its own entry."""
    path = directory / f"marker-{gib:g}g-{n}-{dtype_name}"
    path.mkdir(exist_ok=True)
    save_file(
        {"marker": torch.zeros(1)}, str(path / "model.safetensors"), metadata={"bench": f"{gib}/{n}/{dtype_name}"}
    )
    return path


#: safetensors' names of the dtypes the bench writes into a real checkpoint.
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def real_checkpoint(directory: Path, gib: float, shapes: list[int], dtype_name: str, device: str = "cpu") -> Path:
    """A real safetensors checkpoint of the bench's layout (tensor ``p{i}`` of ``shapes[i]`` elements holding
    ``pattern(i)`` as made on ``device``, the synthetic entry's contents: a CUDA generator gives other bits than
    the CPU's), written one tensor at a time (the peak is one tensor, not the checkpoint): what a user's engine
    attaches in :func:`run`'s real-checkpoint mode, whose identity is derived from the file itself."""
    if dtype_name not in _SAFETENSORS_DTYPES:
        raise wc.WeightCacheError(
            f"--real-checkpoint writes {', '.join(_SAFETENSORS_DTYPES)} tensors; found --dtype {dtype_name}"
        )
    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    path = directory / f"real-{gib:g}g-{len(shapes)}-{dtype_name}"
    path.mkdir(exist_ok=True)
    header: dict[str, Any] = {}
    offset = 0
    for i, n in enumerate(shapes):
        header[f"p{i}"] = {
            "dtype": _SAFETENSORS_DTYPES[dtype_name],
            "shape": [n],
            "data_offsets": [offset, offset + n * itemsize],
        }
        offset += n * itemsize
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for i, n in enumerate(shapes):
            f.write(pattern(i, n, dtype, device).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return path


def publish_synthetic(
    cache: wc.Cache,
    fingerprint: wc.Fingerprint,
    shapes: list[int],
    dtype: torch.dtype,
    device: str,
    segment_bytes: int,
    seed: int = 0,
) -> tuple[int, int, str]:
    """Fill the tensors straight into segments of the fingerprint's placement (no state dict, no checkpoint:
    the peak is the entry plus one tensor) and publish them. Tensor ``i`` holds ``pattern(seed + i)`` (so that
    entries filled with other seeds, such as the shards of other ranks, differ). Returns (bytes, segments,
    checksum)."""
    transport = segments.transport_for_placement(fingerprint.placement)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    placements, sizes = segments.pack([n * itemsize for n in shapes], transport.alignment, segment_bytes)
    dtype_name = str(dtype).removeprefix("torch.")
    packed = Packed(fingerprint, transport, [], [])
    sums = []
    try:
        i = 0
        for k, size in enumerate(sizes):
            seg = transport.create(size, fingerprint.placement)
            packed.segments.append(seg)
            while i < len(shapes) and placements[i].segment == k:
                data = pattern(seed + i, shapes[i], dtype, device)
                seg.write(placements[i].offset, data)
                sums.append(data.reshape(-1).view(torch.int16).sum(dtype=torch.int64))
                packed.infos.append(
                    TensorInfo(
                        name=f"p{i}",
                        segment=k,
                        offset=placements[i].offset,
                        dtype=dtype_name,
                        shape=(shapes[i],),
                        stride=(1,),
                        kind="tensor",
                        requires_grad=False,
                        digest=None,
                    )
                )
                del data
                i += 1
            seg.seal()
        expected = hash_sums(sums)
        total = sum(seg.size for seg in packed.segments)
        handle = cache.publish(packed)
        handle.close()
    finally:
        packed.close()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return total, len(sizes), expected


def hash_sums(sums: list[Any]) -> str:
    import hashlib

    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()


__all__ = [
    "CPU_FACTOR",
    "CPU_SEGMENT_BYTES",
    "CUDA_SEGMENT_BYTES",
    "DEFAULT_REPEAT",
    "DEFAULT_SIZES_GIB",
    "DEFAULT_TENSORS",
    "GPU_HEADROOM",
    "checksum",
    "hash_sums",
    "layout",
    "marker_checkpoint",
    "memory_available",
    "memory_needed",
    "meta_holder",
    "pattern",
    "plan_sizes",
    "publish_synthetic",
    "real_checkpoint",
    "sizes_that_fit",
]
