"""``attach()``: give a model its weights from the host cache, or from disk, by mode.

- ``off``: load the safetensors checkpoint, no keeper involved.
- ``daemon``: ensure a keeper; attach if the fingerprint is cached, else load from disk, publish, and bind the
  published copy (so this process, too, runs on the shared memory).
- ``client``: attach what the keeper holds; if no keeper runs, it holds no such entry, or its entry for this
  checkpoint differs, fall back to disk with a :class:`FallbackWarning` saying why (or raise with
  ``strict=True``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
from torch import nn

from . import quant as quant_registry
from .binding import bind
from .cache import Cache, Handle
from .checkpoint import apply_transform, load_state_dict
from .client import ensure_keeper
from .errors import (
    BindError,
    BudgetExceeded,
    EntryNotFound,
    FallbackWarning,
    FingerprintMismatch,
    KeeperUnavailable,
    UnsupportedQuantError,
    WeightCacheError,
)
from .fingerprint import Fingerprint, format_differences, resolve_dtype
from .loader import StoredTensor, checkpoint_layout

Mode = Literal["off", "daemon", "client"]
MODES = ("off", "daemon", "client")


def attach(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    mode: Mode = "off",
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    quant: str = "none",
    quant_config: Mapping[str, Any] | None = None,
    parallel: Mapping[str, tuple[int, int]] | None = None,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    strict: bool = False,
    socket_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
) -> Handle:
    """Bind the weights of ``checkpoint`` into ``model`` and return a :class:`Handle` (a context manager).

    Args:
        model: the model, typically built under ``torch.device("meta")``; its parameters and buffers are
            replaced by the loaded or attached tensors.
        checkpoint: a directory of ``.safetensors`` files (with or without an index), or one such file.
        mode: ``"off"``, ``"daemon"`` or ``"client"`` (see the module docstring).
        device: where the weights live (``"cpu"``; ``"cuda:N"`` with the CUDA transport). Default ``"cpu"``.
        dtype: convert floating point weights to this dtype on load (part of the fingerprint).
        quant: quantization method of the weights; refused methods raise UnsupportedQuantError in modes
            daemon and client, before anything is loaded.
        quant_config: the method's configuration (its hash is part of the fingerprint).
        parallel: ``{"tp": (rank, size), ...}`` of these weights (part of the fingerprint).
        transform: applied to the loaded state dict (on ``device``) before binding or publishing (sharding,
            quantization, renaming);
            its name and a hash of its code are part of the fingerprint (see
            :func:`weightcache.fingerprint.transform_identity`; functions it calls are not covered).
        strict: in mode client, raise KeeperUnavailable, EntryNotFound or FingerprintMismatch instead of
            falling back to disk; in mode daemon, raise BudgetExceeded when the keeper's memory budget refuses
            the weights (without it, the engine warns and loads them again into its own memory).
        socket_dir: the keeper's socket directory (default: see :mod:`weightcache.rundir`).
        progress: show a bar of the bytes read on stderr while loading from disk. None (default): only when
            stderr is a terminal and the checkpoint is at least 1 GiB; True/False: always/never.

    Returns:
        A Handle with ``source`` ("cache" or "disk"), ``fingerprint`` and ``tensors``. Close it (or leave the
        ``with`` block) to release the lease; the model keeps working either way.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; found {mode!r}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    torch_dtype = resolve_dtype(dtype)
    fingerprint = Fingerprint.create(
        checkpoint,
        dtype=torch_dtype,
        quant=quant,
        quant_config=quant_config,
        parallel=parallel,
        transform=transform,
        device=dev,
    )

    def from_disk(reason: str | None = None) -> Handle:
        state = load_weights(checkpoint, dev, torch_dtype, transform, progress)
        bind(model, state, device=dev)
        return Handle(source="disk", fingerprint=fingerprint, tensors=state, fallback_reason=reason)

    if mode == "off":
        return from_disk()

    quant_registry.get(quant).check(quant_config)

    if mode == "daemon":
        with ThreadPoolExecutor(max_workers=1) as pool:
            spawning = None
            cache = Cache(socket_dir)
            cache.respawn = True  # mode daemon keeps a keeper running: also after a crash, to re-publish to
            try:
                handle = cache.get(fingerprint)
            except KeeperUnavailable:
                # No keeper, so nothing is cached: start one while the weights load instead of before.
                spawning = pool.submit(ensure_keeper, socket_dir)
                handle = None

            def keeper_ready() -> None:
                if spawning is not None:
                    spawning.result()

            layout = checkpoint_layout(checkpoint) if handle is None and dev.type == "cuda" and not transform else None
            if handle is None:
                try:
                    if layout is not None and _stored_as_is(layout, torch_dtype):
                        # Straight from the files into the segments: no second copy on the device at any time.
                        handle = cache.put_checkpoint(
                            fingerprint, layout, before_publish=keeper_ready, progress=progress
                        )
                    else:
                        state = load_weights(checkpoint, dev, torch_dtype, transform, progress)
                        keeper_ready()
                        # consume: each tensor is freed once copied into its segment, so publishing needs one
                        # segment of extra memory, not a second copy of the model.
                        handle = cache.put(fingerprint, state, consume=True)
                except BudgetExceeded as exc:
                    if strict:
                        raise
                    # The refused segments are freed with what they held: the engine loads again, privately.
                    return _fallback(from_disk, f"the keeper refused to publish the weights: {exc}")
        return _bound(model, handle, dev)

    # mode == "client"
    try:
        cache = Cache(socket_dir)
        handle = cache.get(fingerprint)
        if handle is None:
            reason, diffs = why_missing(cache, fingerprint)
    except KeeperUnavailable as exc:
        if strict:
            raise
        return _fallback(from_disk, f"no keeper is available ({exc})")
    except (UnsupportedQuantError, BindError):
        raise
    except WeightCacheError as exc:  # a broken entry, an insecure socket dir, a keeper error...
        if strict:
            raise
        return _fallback(from_disk, f"the cache could not serve this request ({type(exc).__name__}: {exc})")
    if handle is not None:
        return _bound(model, handle, dev)
    if strict:
        if diffs:
            raise FingerprintMismatch(reason, tuple(diffs))
        raise EntryNotFound(reason)
    return _fallback(from_disk, reason)


def _stored_as_is(layout: list[StoredTensor], dtype: torch.dtype | None) -> bool:
    """Whether loading with ``dtype`` keeps every tensor exactly as the files store it."""
    from .checkpoint import CONVERTIBLE

    return dtype is None or all(t.dtype == dtype or str(t.dtype) not in CONVERTIBLE for t in layout)


def load_weights(
    checkpoint: str | os.PathLike[str],
    device: torch.device,
    dtype: torch.dtype | None,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
    progress: bool | None = False,
) -> dict[str, torch.Tensor]:
    """The checkpoint as a state dict on ``device``, converted to ``dtype``, with ``transform`` applied there.

    CPU: the files are memory-mapped (pages are read when first touched). CUDA: they are streamed with large
    sequential reads through pinned buffers (:mod:`weightcache.loader`). ``progress``: see :func:`attach`.
    """
    if device.type == "cuda":
        from .checkpoint import safetensors_files
        from .loader import load_to_device
        from .progress import byte_bar, wanted

        total = sum(f.stat().st_size for f in safetensors_files(checkpoint)) if progress is not False else 0
        with byte_bar(total, "loading checkpoint", wanted(progress, total)) as update:
            state = load_to_device(checkpoint, device, dtype=dtype, progress=update)
        return apply_transform(state, transform)
    return load_state_dict(checkpoint, dtype=dtype, transform=transform, progress=progress)


def _bound(model: nn.Module, handle: Handle, device: torch.device) -> Handle:
    try:
        bind(model, handle.tensors, device=device)
    except BaseException:
        handle.close()
        raise
    return handle


def _fallback(from_disk: Callable[[str], Handle], reason: str) -> Handle:
    warnings.warn(f"weightcache: loading from disk: {reason}", FallbackWarning, stacklevel=3)
    return from_disk(reason)


def why_missing(cache: Cache, fingerprint: Fingerprint) -> tuple[str, list[tuple[str, object, object]]]:
    """Explain a miss: the closest cached entry of the same checkpoint and placement, and how it differs."""
    same_model = [
        e
        for e in cache.entries()
        if e.fingerprint.model_path == fingerprint.model_path and e.placement == fingerprint.placement
    ]
    if not same_model:
        return (
            f"the keeper holds no entry for {fingerprint.model_path} on {fingerprint.placement} "
            f"(digest {fingerprint.digest[:12]}); publish it first with mode='daemon' or `weightcache load`",
            [],
        )
    best = min(same_model, key=lambda e: len(fingerprint.diff(e.fingerprint)))
    diffs = fingerprint.diff(best.fingerprint)
    return (
        f"the cached entry {best.digest[:12]} for {fingerprint.model_path} does not match: {format_differences(diffs)}",
        diffs,
    )
