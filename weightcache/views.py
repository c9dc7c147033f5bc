"""Cutting an entry's tensors out of its mapped segments: one mapping per segment, one view per tensor.

This is the attach's per-tensor hot loop, so it makes as few Python objects per tensor as it can: consecutive
tensors mostly share a segment and a dtype, and the typed base is looked up only when either changes.
"""

from __future__ import annotations

import torch

from . import segments
from .errors import ManifestError
from .manifest import Manifest
from .torch_dtypes import TORCH_DTYPES


def map_entry(manifest: Manifest, fds: list[int]) -> dict[str, torch.Tensor]:
    """Map every segment of ``manifest`` (its fd in ``fds``, in order) once and return its tensors by name.

    Each tensor keeps its segment mapped for as long as it (or a view of it) lives. Raises ManifestError when
    the manifest describes tensors that do not fit its segments, and SegmentError when a segment cannot be
    mapped.
    """
    if len(fds) != len(manifest.segments):
        raise ManifestError(f"manifest lists {len(manifest.segments)} segments but {len(fds)} fds arrived")
    bases = [segments.transport(info.kind).map(fd, info) for fd, info in zip(fds, manifest.segments)]
    try:
        return _cut(manifest, bases)
    except (RuntimeError, TypeError, ValueError) as exc:  # torch refused a view: the manifest is wrong
        raise ManifestError(f"cannot build the tensors this manifest describes: {exc}") from exc


def _torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ManifestError(f"dtype {name!r} is not supported by torch {torch.__version__}") from None


def _cut(manifest: Manifest, bases: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    typed: dict[tuple[int, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    last_seg: object = None
    last_dt: object = None
    base = torch.empty(0)
    itemsize = 1
    for name, seg, off, dt, shape, stride in zip(
        manifest.names, manifest.segment, manifest.offset, manifest.dtype, manifest.shape, manifest.stride
    ):
        if seg != last_seg or dt != last_dt:  # consecutive tensors mostly share both: look the base up only then
            last_seg, last_dt = seg, dt
            cached = typed.get((seg, dt))
            if cached is None:
                if not (isinstance(seg, int) and 0 <= seg < len(bases)):
                    raise ManifestError(f"tensor {name!r} names segment {seg!r}; the entry has {len(bases)}")
                cached = typed[(seg, dt)] = bases[seg].view(_torch_dtype(dt))
            base = cached
            itemsize = base.element_size()
        index, misaligned = divmod(off, itemsize)
        if misaligned:
            raise ManifestError(f"tensor {name!r} has offset {off}, not a multiple of its {dt} element size")
        out[name] = base.as_strided(shape, stride, index)  # torch checks the view lies inside the segment
    return out


__all__ = ["map_entry"]
