"""Parity: does a cache-attached model hold exactly what a disk-loaded one holds, tensor by tensor?

A model's *tensor table* lists every parameter, buffer and tensor attribute (a tensor a module keeps as a plain
attribute, such as MLA's ``w_kc``) by name (tied names included) with its shape, dtype, stride, kind
(parameter, buffer or attribute) and the SHA-256 of its bytes. Where a tensor lives (device address, offset
in its storage) is not compared: attached tensors are views into shared segments by design.

Record one table for the model an engine loaded from disk and one for the model it attached from the cache,
then diff them: any difference means the attached model is not the model the engine would have run. A
quantization method joins the whitelist (``ipc_safe = True``) only after its tables are identical on the
devices it is meant for, and the engine's outputs are too: tables cannot show Python-side state that
post-processing leaves on the layers, which is why both are needed.

>>> from weightcache import parity
>>> parity.write_table(disk_model, "disk.json"); parity.write_table(attached_model, "cache.json")
$ weightcache parity disk.json cache.json       # exit 0: identical; 1: the differences are listed

This module imports torch only inside :func:`record`: the CLI diffs tables without it. Engine adapters call
it inside engine processes; the runner that drives an engine three times and diffs its tables is a tool,
:mod:`weightcache.tools.engine_parity` (``weightcache parity --engine``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .errors import WeightCacheError

if TYPE_CHECKING:
    import torch
    from torch import nn

#: Bumped when the table's fields or their meaning change.
TABLE_VERSION = 1


@attrs.frozen
class TensorRecord:
    """One tensor of a model, as parity compares it."""

    shape: tuple[int, ...]
    dtype: str
    stride: tuple[int, ...]
    kind: str  # "parameter", "buffer" or "attribute"
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "shape": list(self.shape), "stride": list(self.stride)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorRecord:
        return cls(
            shape=tuple(int(n) for n in data["shape"]),
            dtype=str(data["dtype"]),
            stride=tuple(int(n) for n in data["stride"]),
            kind=str(data["kind"]),
            sha256=str(data["sha256"]),
        )


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's elements in logical (row-major) order, so that equal values hash equal whatever
    the strides; the strides are compared separately."""
    import torch

    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    if data.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    flat = data.reshape(-1).view(dtype=torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def record(model: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, TensorRecord]:
    """The tensor table of a model (every parameter, buffer and tensor attribute, tied names included) or of a
    state dict."""
    from torch import nn

    from .binding import tensor_attributes

    if isinstance(model, nn.Module):
        items: list[tuple[str, torch.Tensor, str]] = [
            (name, p, "parameter") for name, p in model.named_parameters(remove_duplicate=False)
        ]
        items += [(name, b, "buffer") for name, b in model.named_buffers(remove_duplicate=False)]
        items += [(name, t, "attribute") for name, t in tensor_attributes(model).items()]
    else:
        items = [(name, t, "parameter" if isinstance(t, nn.Parameter) else "buffer") for name, t in model.items()]
    return {
        name: TensorRecord(
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            stride=tuple(t.stride()),
            kind=kind,
            sha256=tensor_sha256(t),
        )
        for name, t, kind in items
    }


def write_table(model: nn.Module | Mapping[str, torch.Tensor], path: str | os.PathLike[str], **meta: Any) -> None:
    """Record ``model``'s tensor table into a JSON file (``meta``: free-form notes, e.g. engine and source)."""
    table = record(model)
    data = {"version": TABLE_VERSION, "meta": meta, "tensors": {n: r.to_json() for n, r in sorted(table.items())}}
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=True))


def read_table(path: str | os.PathLike[str]) -> dict[str, TensorRecord]:
    """A table written by :func:`write_table`."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("version") != TABLE_VERSION:
            raise ValueError(f"table version {data.get('version')!r}; this weightcache reads {TABLE_VERSION}")
        return {name: TensorRecord.from_json(r) for name, r in data["tensors"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightCacheError(
            f"cannot read the tensor table {path}: {exc}. Write it with weightcache.parity.write_table()."
        ) from exc


def compare(left: Mapping[str, TensorRecord], right: Mapping[str, TensorRecord]) -> list[str]:
    """Every difference between two tables, one line each (empty: identical)."""
    out = [f"{name}: only in the left table" for name in sorted(set(left) - set(right))]
    out += [f"{name}: only in the right table" for name in sorted(set(right) - set(left))]
    for name in sorted(set(left) & set(right)):
        a, b = left[name], right[name]
        for field in attrs.fields(TensorRecord):
            va, vb = getattr(a, field.name), getattr(b, field.name)
            if va != vb:
                shown = (va[:12], vb[:12]) if field.name == "sha256" else (va, vb)
                out.append(f"{name}: {field.name} {shown[0]} vs {shown[1]}")
    return out


__all__ = [
    "TABLE_VERSION",
    "TensorRecord",
    "compare",
    "read_table",
    "record",
    "tensor_sha256",
    "write_table",
]
