"""Cutting an entry's tensors out of its mapped segments: one mapping per segment, one view per tensor.

This is the attach's per-tensor hot loop, so it makes as few Python objects per tensor as it can: consecutive
tensors mostly share a segment and a dtype, and the typed base is looked up only when either changes.
"""

from __future__ import annotations

import math

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
    kinds = {info.kind for info in manifest.segments}
    if len(kinds) == 1:  # every entry so far: one placement, one transport, which may map its segments together
        bases = segments.transport(kinds.pop()).map_all(fds, manifest.segments, manifest.fingerprint.digest)
    else:
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


#: Consecutive tensors that lie back to back are cut with one ``split_with_sizes`` call from this many on (fewer
#: cost more than one ``as_strided`` each: the split needs a ``narrow`` and a ``view`` first).
MIN_RUN = 4


def _cut(manifest: Manifest, bases: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One view per tensor. Runs of consecutive tensors that are contiguous, lie back to back in one segment and
    share their dtype and trailing dimensions (norms and biases; stacked projections) are cut by one torch call
    per run, the others by one ``as_strided`` each; either way torch checks that every view lies inside its
    segment."""
    names, segs, offs, dts, shapes, strides = (
        manifest.names,
        manifest.segment,
        manifest.offset,
        manifest.dtype,
        manifest.shape,
        manifest.stride,
    )
    typed: dict[tuple[int, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    run: list[int] = []  # indices of the current run
    run_key: object = None
    run_end = -1  # element index just past the run's last tensor
    base = torch.empty(0)
    itemsize = 1
    last_seg: object = None
    last_dt: object = None
    for i, (seg, off, dt, shape, stride) in enumerate(zip(segs, offs, dts, shapes, strides)):
        if seg != last_seg or dt != last_dt:  # consecutive tensors mostly share both: look the base up only then
            if run:
                _flush(run, base, out, names, shapes, strides, offs, itemsize)
                run, run_key = [], None
            last_seg, last_dt = seg, dt
            cached = typed.get((seg, dt))
            if cached is None:
                if not (isinstance(seg, int) and 0 <= seg < len(bases)):
                    raise ManifestError(f"tensor {names[i]!r} names segment {seg!r}; the entry has {len(bases)}")
                cached = typed[(seg, dt)] = bases[seg].view(_torch_dtype(dt))
            base = cached
            itemsize = base.element_size()
        index, misaligned = divmod(off, itemsize)
        if misaligned:
            raise ManifestError(f"tensor {names[i]!r} has offset {off}, not a multiple of its {dt} element size")
        trailing = _run_key(shape, stride)
        if trailing is not None:
            if trailing == run_key and index == run_end:
                run.append(i)
                run_end += shape[0] * trailing[1]
                continue
            if run:
                _flush(run, base, out, names, shapes, strides, offs, itemsize)
            run, run_key, run_end = [i], trailing, index + shape[0] * trailing[1]
            continue
        if run:
            _flush(run, base, out, names, shapes, strides, offs, itemsize)
            run, run_key = [], None
        out[names[i]] = base.as_strided(shape, stride, index)  # torch checks the view lies inside the segment
    if run:
        _flush(run, base, out, names, shapes, strides, offs, itemsize)
    return out


def _run_key(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[tuple[int, ...], int] | None:
    """(trailing dimensions, elements per row) of a contiguous tensor with elements, else None: tensors that may
    join one run."""
    if len(shape) == 1:
        return ((), 1) if stride == (1,) and shape[0] > 0 else None
    if len(shape) == 2:
        return ((shape[1],), shape[1]) if stride == (shape[1], 1) and shape[0] > 0 and shape[1] > 0 else None
    if not shape or min(shape) <= 0 or stride != contiguous_stride(shape):
        return None
    return shape[1:], math.prod(shape[1:])


def _flush(
    run: list[int],
    base: torch.Tensor,
    out: dict[str, torch.Tensor],
    names: tuple[str, ...],
    shapes: tuple[tuple[int, ...], ...],
    strides: tuple[tuple[int, ...], ...],
    offs: tuple[int, ...],
    itemsize: int,
) -> None:
    """Cut the views of one run of back-to-back tensors (indices ``run``) out of ``base``."""
    if len(run) < MIN_RUN:
        for i in run:
            out[names[i]] = base.as_strided(shapes[i], strides[i], offs[i] // itemsize)
        return
    first = shapes[run[0]]
    rows = [shapes[i][0] for i in run]
    start = offs[run[0]] // itemsize
    per_row = math.prod(first[1:])
    flat = base.narrow(0, start, sum(rows) * per_row)  # torch checks the run lies inside the segment
    block = flat.view(-1, *first[1:]) if len(first) > 1 else flat
    for i, view in zip(run, block.split_with_sizes(rows)):
        out[names[i]] = view


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (in elements) of a contiguous tensor of ``shape``."""
    stride = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


__all__ = ["contiguous_stride", "map_entry"]
