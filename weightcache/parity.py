"""Parity: does a cache-attached model hold exactly what a disk-loaded one holds, tensor by tensor?

A model's *tensor table* lists every parameter and buffer by name (tied names included) with its shape, dtype,
stride, kind (parameter or buffer) and the SHA-256 of its bytes. Where a tensor lives (device address, offset
in its storage) is not compared: attached tensors are views into shared segments by design.

Record one table for the model an engine loaded from disk and one for the model it attached from the cache,
then diff them: any difference means the attached model is not the model the engine would have run. A
quantization method joins the whitelist (``ipc_safe = True``) only after its tables are identical on the
devices it is meant for, and the engine's outputs are too: tables cannot show Python-side state that
post-processing leaves on the layers, which is why both are needed.

>>> from weightcache import parity
>>> parity.write_table(disk_model, "disk.json"); parity.write_table(attached_model, "cache.json")
$ weightcache parity disk.json cache.json       # exit 0: identical; 1: the differences are listed

This module imports torch only inside :func:`record`: the CLI diffs tables without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .errors import KeeperUnavailable, WeightCacheError

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
    kind: str  # "parameter" or "buffer"
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
    """The tensor table of a model (every parameter and buffer, tied names included) or of a state dict."""
    from torch import nn

    if isinstance(model, nn.Module):
        items: list[tuple[str, torch.Tensor, str]] = [
            (name, p, "parameter") for name, p in model.named_parameters(remove_duplicate=False)
        ]
        items += [(name, b, "buffer") for name, b in model.named_buffers(remove_duplicate=False)]
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


# --- driving an engine: disk load, publish, attach in a new process -------------------------------------------

#: Token ids fed to the engine when none are given (any ids below the vocabulary size do).
DEFAULT_PROMPT = [1, 5, 9, 200, 31, 7]


@attrs.frozen
class EngineParity:
    """What :func:`engine_parity` found: per run (``disk``, ``daemon``, ``client``) its greedy tokens, and the
    differences of the daemon's and the client's tensor tables from the disk-loaded model's."""

    tokens: dict[str, list[int]]
    differences: dict[str, list[str]]
    tensors: int

    @property
    def identical(self) -> bool:
        same_tokens = len({tuple(t) for t in self.tokens.values()}) == 1
        return same_tokens and not any(self.differences.values())


def engine_parity(
    engine: str,
    model: str,
    workdir: str | os.PathLike[str],
    *,
    engine_args: Mapping[str, Any] | None = None,
    prompt: list[int] | None = None,
    max_tokens: int = 16,
    timeout: float = 1800,
) -> EngineParity:
    """Run ``engine`` three times on ``model``, each in a new process: its own disk load, weightcache mode
    daemon (publishing into a keeper of a private socket directory under ``workdir``), and mode client (strict,
    attaching what the daemon published). Compare their tensor tables and greedy tokens. The keeper is
    stopped at the end. Engines: ``vllm``.
    """
    import subprocess
    import sys

    from .cache import Cache

    if engine != "vllm":
        raise WeightCacheError(
            f"weightcache parity --engine drives vllm; found {engine!r}. For another engine, record the tables "
            "with weightcache.parity.write_table() in its process and diff them with `weightcache parity A B`."
        )
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    socket_dir = work / "keeper"
    options = {"socket_dir": str(socket_dir)}
    runs = {
        "disk": ("auto", None),
        "daemon": ("weightcache", {**options, "mode": "daemon"}),
        "client": ("weightcache", {**options, "mode": "client", "strict": True}),
    }
    # apply_model hands a function to vLLM's workers, which vLLM only pickles when told it may.
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    tokens: dict[str, list[int]] = {}
    try:
        for name, (load_format, extra) in runs.items():
            spec = {
                "model": model,
                "table": str(work / f"{name}.json"),
                "load_format": load_format,
                "extra": extra,
                "engine_args": dict(engine_args or {}),
                "prompt": prompt or DEFAULT_PROMPT,
                "max_tokens": max_tokens,
            }
            out = subprocess.run(
                [sys.executable, "-m", "weightcache.backends.vllm", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith("WEIGHTCACHE-TOKENS ")]
            if out.returncode != 0 or not lines:
                raise WeightCacheError(
                    f"the {name} run of {engine} failed (exit {out.returncode}); its last output:\n{out.stderr[-3000:]}"
                )
            tokens[name] = json.loads(lines[-1].removeprefix("WEIGHTCACHE-TOKENS "))
    finally:
        with contextlib.suppress(KeeperUnavailable):  # the daemon run spawned it; nothing else uses it
            Cache(socket_dir).stop()
    disk = read_table(work / "disk.json")
    return EngineParity(
        tokens=tokens,
        differences={name: compare(disk, read_table(work / f"{name}.json")) for name in ("daemon", "client")},
        tensors=len(disk),
    )


__all__ = [
    "DEFAULT_PROMPT",
    "TABLE_VERSION",
    "EngineParity",
    "TensorRecord",
    "compare",
    "engine_parity",
    "read_table",
    "record",
    "tensor_sha256",
    "write_table",
]
