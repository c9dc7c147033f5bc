"""``attach()``: give a ``torch.nn.Module`` its weights from the host cache, or from disk, by mode.

The modes themselves (off, daemon, client, fallbacks, publishing) are :mod:`weightcache.pipeline`'s; this
module only says what attaching to a plain module means: the weights are the checkpoint's tensors (converted,
transformed), and serving them is binding them into the model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import loaders
from .binding import bind, check_fit
from .errors import InvalidArgument
from .fingerprint import Fingerprint, placement_of
from .handle import Handle
from .pipeline import (
    Mode,
    Request,
    Steps,
    check_mode,
    pause_collector,
    refuse_if_switched_off,
    resume_collector,
    run,
)
from .rundir import resolve_user
from .torch_dtypes import convertible, resolve_dtype

if TYPE_CHECKING:
    from .loader import StoredTensor

Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


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
    transform: Transform | None = None,
    strict: bool = False,
    socket_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
    trusted_publishers: Iterable[int | str] = (),
) -> Handle:
    """Bind the weights of ``checkpoint`` into ``model`` and return a :class:`Handle` (a context manager).

    Args:
        model: the model, typically built under ``torch.device("meta")``; its parameters and buffers are
            replaced by the loaded or attached tensors. A model of a framework with its own loader (a
            transformers ``PreTrainedModel``) gets what that loader makes of the checkpoint, computed buffers
            included, and ``quant`` and ``quant_config`` come from its configuration (see
            :mod:`weightcache.loaders`).
        checkpoint: a directory of ``.safetensors`` files (with or without an index), or one such file.
        mode: ``"off"`` (load from disk), ``"daemon"`` (attach if cached, else load, publish and attach) or
            ``"client"`` (attach; fall back to disk with a FallbackWarning); see :mod:`weightcache.pipeline`.
        device: where the weights live (``"cpu"``; ``"cuda:N"`` with the CUDA transport). Default ``"cpu"``.
        dtype: convert floating point weights to this dtype on load (part of the fingerprint).
        quant: quantization method of the weights; refused methods raise UnsupportedQuantError in modes
            daemon and client, before anything is loaded (an unknown name in every mode). A transformers model
            takes its method from its configuration (another ``quant`` is an InvalidArgument), and a refused one
            raises UnsupportedQuantError in every mode, mode off and ``WEIGHTCACHE_MODE=off`` included.
        quant_config: the method's configuration (its hash is part of the fingerprint).
        parallel: ``{"tp": (rank, size), ...}`` of these weights (part of the fingerprint).
        transform: applied to the loaded state dict (on ``device``) before binding or publishing (sharding,
            quantization, renaming);
            its name and a hash of its code are part of the fingerprint (see
            :func:`weightcache.fingerprint.transform_identity`; functions it calls are not covered).
        strict: raise instead of falling back to disk: in mode client KeeperUnavailable, EntryNotFound or
            FingerprintMismatch, or the cache's own error where it failed otherwise (a KeeperError, a
            SocketDirError, a ManifestError, ...); in mode daemon the error that stopped publishing
            (BudgetExceeded, SegmentError, KeeperUnavailable, ...), where without it the engine serves the weights
            it loaded, with a warning.
        socket_dir: the keeper's socket directory (default: see :mod:`weightcache.rundir`).
        progress: show a bar of the bytes read on stderr while loading from disk, and in mode daemon one of the
            bytes packed while publishing. None (default): only when stderr is a terminal and the checkpoint is at
            least 1 GiB; True/False: always/never.
        trusted_publishers: other users (names or uids) whose published entries may be attached. Entries
            published by this process's uid or the keeper's owner always may; see :class:`Cache`.

    Returns:
        A Handle with ``source`` ("cache" or "disk"), ``fingerprint``, ``tensors`` and ``read_disk``. Close it
        (or leave the ``with`` block) to release the lease; the model keeps working either way.
    """
    # Up to the keeper's answer nothing here allocates much, but a collection a fresh process owes for its imports
    # (tens of ms) would land on whatever allocates first: see weightcache.pipeline. run() pauses its own lookup.
    check_mode(mode)  # before anything is read: an unknown mode is the caller's first problem
    enabled = pause_collector()  # not a `with` block: entering one allocates before the pause
    try:
        steps, fingerprint, quant_config = _prepare(
            model, checkpoint, device, dtype, quant, quant_config, parallel, transform, progress
        )
        trusted = tuple(resolve_user(user) for user in trusted_publishers)
        request = Request(fingerprint, mode, strict, socket_dir, progress, quant_config=quant_config, trusted=trusted)
    finally:
        resume_collector(enabled)
    return run(request, steps)


def _prepare(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device: torch.device | str | None,
    dtype: torch.dtype | str | None,
    quant: str,
    quant_config: Mapping[str, Any] | None,
    parallel: Mapping[str, tuple[int, int]] | None,
    transform: Transform | None,
    progress: bool | None,
) -> tuple[Steps[Handle], Fingerprint, Mapping[str, Any] | None]:
    """:func:`attach`'s steps for ``model``, the fingerprint of its weights and the quantization config to check."""
    loader = loaders.for_model(model)
    steps: Steps[Handle]
    if loader is None:
        dev, torch_dtype, fingerprint = _identify(checkpoint, device, dtype, quant, quant_config, parallel, transform)
        steps = ModuleSteps(model, checkpoint, dev, torch_dtype, transform, progress)
    else:  # a framework's model (transformers): its own loader makes the weights (see weightcache.loaders)
        placement_of(device)  # first: InvalidArgument for a device that is none or that this process lacks
        dev = torch.device(device) if device is not None else torch.device("cpu")
        load_dtype, fingerprint, identity = loaders.identify(
            loader, model, checkpoint, device=dev, dtype=resolve_dtype(dtype), parallel=parallel, transform=transform
        )
        if quant not in ("none", identity.quant):
            raise InvalidArgument(
                f"quant={quant!r}, but {type(model).__name__}'s configuration says {identity.quant!r}: the quantization"
                " of a transformers model comes from its quantization_config; leave quant= out"
            )
        quant_config = identity.quant_config
        steps = loaders.LoaderSteps(loader, model, checkpoint, dev, load_dtype, transform)
    return steps, fingerprint, quant_config


def preload(
    checkpoint: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    quant: str = "none",
    quant_config: Mapping[str, Any] | None = None,
    parallel: Mapping[str, tuple[int, int]] | None = None,
    transform: Transform | None = None,
    socket_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
    digests: bool = True,
    max_segment_bytes: int | None = None,
) -> Handle:
    """Load ``checkpoint`` into the keeper (starting one if none runs) without a model: mode daemon's first
    start, for ``weightcache load`` and deployment scripts. The arguments mean what they mean for
    :func:`attach`, so the entry is the one ``attach`` with the same arguments finds.

    Raises WeightCacheError where ``WEIGHTCACHE_MODE=off`` switched weightcache off. Returns the attached Handle
    (``read_disk`` False when the keeper already held the entry); close it to
    leave the entry unleased in the keeper. Publishing is strict: a refused budget or a failed allocation raises
    (BudgetExceeded, SegmentError, ...), since there is no engine to serve the loaded weights to.

    Args:
        digests: record a SHA-256 per tensor (what :meth:`Handle.verify` checks); default True.
        max_segment_bytes: largest segment (default: :func:`weightcache.publish.default_segment_bytes`).
    """
    refuse_if_switched_off()
    dev, torch_dtype, fingerprint = _identify(checkpoint, device, dtype, quant, quant_config, parallel, transform)
    steps = CheckpointSteps(checkpoint, dev, torch_dtype, transform, progress)
    request = Request(fingerprint, "daemon", True, socket_dir, progress, digests, max_segment_bytes, quant_config)
    return run(request, steps)


def _identify(
    checkpoint: str | os.PathLike[str],
    device: torch.device | str | None,
    dtype: torch.dtype | str | None,
    quant: str,
    quant_config: Mapping[str, Any] | None,
    parallel: Mapping[str, tuple[int, int]] | None,
    transform: Transform | None,
) -> tuple[torch.device, torch.dtype | None, Fingerprint]:
    """The device, dtype and fingerprint that :func:`attach` and :func:`preload` derive from the same arguments,
    so that both name the same entry."""
    torch_dtype = resolve_dtype(dtype)
    fingerprint = Fingerprint.create(  # first: it checks the device (InvalidArgument), before torch.device() does
        checkpoint,
        dtype=torch_dtype,
        quant=quant,
        quant_config=quant_config,
        parallel=parallel,
        transform=transform,
        device=device,
    )
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return dev, torch_dtype, fingerprint


class CheckpointSteps(Steps[Handle]):
    """The checkpoint's tensors (converted, transformed) are the weights; serving them is returning the Handle."""

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        device: torch.device,
        dtype: torch.dtype | None,
        transform: Transform | None,
        progress: bool | None,
    ) -> None:
        self.checkpoint = checkpoint
        self.device = device
        self.dtype = dtype
        self.transform = transform
        self.progress = progress

    def load_state(self) -> MutableMapping[str, torch.Tensor]:
        # Reading checkpoints is imported on the disk path only: an attach from the cache never needs it.
        from .loader import load_weights

        return load_weights(self.checkpoint, self.device, self.dtype, self.transform, self.progress)

    def serve(self, handle: Handle) -> Handle:
        return handle

    def stream_layout(self) -> list[StoredTensor] | None:
        if self.device.type != "cuda" or self.transform is not None:
            return None
        from .loader import checkpoint_layout
        from .publish import stored_as_is

        layout = checkpoint_layout(self.checkpoint)
        return layout if stored_as_is(layout, self.dtype) else None


class ModuleSteps(CheckpointSteps):
    """:func:`attach`'s steps: serving the weights is binding them into the model."""

    def __init__(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        device: torch.device,
        dtype: torch.dtype | None,
        transform: Transform | None,
        progress: bool | None,
    ) -> None:
        super().__init__(checkpoint, device, dtype, transform, progress)
        self.model = model

    def serve(self, handle: Handle) -> Handle:
        bind(self.model, handle.tensors, device=self.device)
        return handle

    def check_fit(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        if tensors is None:
            if self.transform is not None:
                return  # what it makes is known once the weights are loaded: checked then
            from .loader import checkpoint_layout  # a miss only: the restart path never imports the loader

            tensors = {t.name: _stand_in(t, self.dtype) for t in checkpoint_layout(self.checkpoint)}
        check_fit(self.model, tensors)


def _stand_in(stored: StoredTensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A meta tensor of the shape and dtype that loading ``stored`` with ``dtype`` gives."""
    converted = dtype is not None and stored.dtype != dtype and convertible(stored.dtype)
    return torch.empty(stored.shape, dtype=dtype if converted else stored.dtype, device="meta")


__all__ = ["CheckpointSteps", "ModuleSteps", "attach", "preload"]
