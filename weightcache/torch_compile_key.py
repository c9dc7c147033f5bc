"""The key of a torch.compile artifact: what a compiled program is valid for besides the weights.

:func:`compile_key` is the :class:`~weightcache.artifact_key.ArtifactKey` that
:func:`weightcache.torch_compile.compile_cache` files its artifact under: torch and Python versions, the device
(:func:`device_fields`: CPU model and vector ISA, or GPU name and compute capability with CUDA and Triton's
version), the compile options the caller names, dtype, shapes and any extra JSON fields. vLLM's compile cache uses
:func:`device_fields` in its own key (:mod:`weightcache.backends.vllm_compile_key`).

Layer L3 (the torch side). Reads versions and the device only; never compiles, loads or talks to the keeper. Its
names are re-exported by :mod:`weightcache.torch_compile`.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Mapping
from typing import Any

import torch

from .artifact_key import ArtifactKey
from .dtypes import dtype_name
from .errors import InvalidArgument
from .fingerprint import Fingerprint

#: The artifact kind :mod:`weightcache.torch_compile` publishes.
KIND = "torch.compile"


def _package_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_fields(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a compiled artifact depends on about the device: CPU model and vector ISA, or GPU name and compute
    capability with the CUDA version."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "device": "cuda",
            "gpu": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "triton": _package_version("triton"),
        }
    return {"device": dev.type, "cpu": _cpu_model(), "isa": torch.backends.cpu.get_cpu_capability()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compile_key(
    fingerprint: Fingerprint | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    shapes: object = None,
    extra: Mapping[str, Any] | None = None,
) -> ArtifactKey:
    """The :class:`ArtifactKey` of a torch.compile artifact: torch and Python versions, the device
    (:func:`device_fields`; default: the fingerprint's; on a GPU with Triton's version and the CUDA version), the
    compile ``options`` (what the caller passes to ``torch.compile``: backend, mode, dynamic, fullgraph, options),
    ``dtype`` (default: the fingerprint's; by its name, however it is spelled: ``torch.bfloat16``, ``"bf16"``),
    ``shapes`` (the example shapes or the dynamic spec) and any ``extra`` JSON fields (e.g. an engine's own cache
    key; :class:`~weightcache.errors.InvalidArgument` for one named like a field above, which it would replace).
    Values that are not JSON (a backend callable) are recorded by ``str``."""
    if device is None and fingerprint is not None and fingerprint.device_kind != "cpu":
        device = fingerprint.device_kind
    fields: dict[str, Any] = {
        "torch": torch.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        **device_fields(device),
        "options": _jsonable(dict(options or {})),
        "dtype": _dtype_text(dtype) if dtype is not None else (fingerprint.dtype if fingerprint is not None else None),
        "shapes": _jsonable(shapes),
    }
    refuse_clashes(extra, set(fields) | KEY_FIELDS)
    fields.update(_jsonable(dict(extra or {})))
    return ArtifactKey(KIND, fields)


#: The fields :func:`compile_key` fills itself on any device: an ``extra`` field may not be named like one.
KEY_FIELDS = frozenset(
    {
        "torch",
        "python",
        "device",
        "cpu",
        "isa",
        "gpu",
        "compute_capability",
        "cuda",
        "triton",
        "options",
        "dtype",
        "shapes",
    }
)


def refuse_clashes(extra: Mapping[str, Any] | None, fields: set[str] | frozenset[str]) -> None:
    """InvalidArgument where ``extra`` names one of a key's own ``fields`` (which it would replace)."""
    clashes = sorted(set(extra or {}) & fields)
    if clashes:
        raise InvalidArgument(
            f"extra names {', '.join(clashes)}, which the key holds itself; name your own fields otherwise"
        )


def _dtype_text(dtype: object) -> str:
    """A dtype by its name however it is spelled (``torch.bfloat16``, ``"bf16"``); one outside weightcache's
    table (a quantized torch dtype, ``"auto"``) by its ``str``, as before."""
    try:
        return dtype_name(dtype) or str(dtype)
    except InvalidArgument:
        return str(dtype)


def _jsonable(value: object) -> Any:
    """``value`` as JSON: containers kept, anything else not JSON by ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Size):
        return list(value)
    return str(value)


__all__ = ["KEY_FIELDS", "KIND", "compile_key", "device_fields", "refuse_clashes"]
