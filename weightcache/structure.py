"""The structure of a model: a digest of every parameter and buffer it registers (name, kind, dtype, shape, and
which names share one tensor), taken on the model as built, before anything is bound into it.

A framework loader fills a model according to the model: ``from_pretrained`` of another configuration fuses,
converts or computes other tensors from the same files. So where a framework loader makes the weights
(:mod:`weightcache.loaders`), this digest joins the fingerprint, and a model built differently is a miss that
names the difference, never an entry bound into a model it was not made for.

It never reads tensor data (a model on the meta device has none), and costs a few microseconds per tensor.
"""

from __future__ import annotations

import hashlib

from torch import nn


def structure_digest(model: nn.Module) -> str:
    """SHA-256 (hex) of the model's class and of each parameter and buffer registration, in module order:
    full name, kind (``p`` parameter, ``b`` persistent buffer, ``n`` non-persistent buffer), dtype, shape, and
    for a tensor registered under several names (tied weights) the first of them.

    Equal for two builds of the same class and configuration, in any process; independent of the device and of
    the data."""
    cls = type(model)
    lines = [f"{cls.__module__}.{cls.__qualname__}"]
    first: dict[int, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, p in module._parameters.items():
            if p is not None:
                name = dot + attr
                alias = first.setdefault(id(p), name)
                lines.append(f"{name} p {p.dtype} {tuple(p.shape)} {alias if alias != name else ''}")
        non_persistent = module._non_persistent_buffers_set
        for attr, b in module._buffers.items():
            if b is not None:
                name = dot + attr
                alias = first.setdefault(id(b), name)
                kind = "n" if attr in non_persistent else "b"
                lines.append(f"{name} {kind} {b.dtype} {tuple(b.shape)} {alias if alias != name else ''}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


__all__ = ["structure_digest"]
