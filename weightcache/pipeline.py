"""The one mode engine: modes off, daemon and client, for :func:`weightcache.attach`, every engine adapter and
``weightcache load``.

Nothing else in weightcache decides modes or warns of fallbacks. A caller describes what differs for it in a
:class:`Steps` object (how to read and post-process the weights from disk, and how to serve a set of tensors:
bind them into a module, build an engine's model around them, or just return the handle) and calls :func:`run`.

- ``off``: the caller's own disk load; no keeper is involved.
- ``client``: attach what the keeper holds. If no keeper runs, it holds no such entry, or its entry differs:
  a :class:`FallbackWarning` that says why and the caller's own disk load (``strict``: the error instead).
- ``daemon``: attach if cached. Else, if another engine is loading the same entry, wait for that load and attach
  its copy (:func:`weightcache.client.first_load`). Else load from disk (a keeper is spawned meanwhile when none
  runs), pack the loaded weights into segments one segment at a time while releasing the loaded copy (the peak
  is the weights plus one segment), publish them, and serve the published copy. If publishing fails after the
  load (a budget, out of memory, no keeper), the loaded weights are served anyway, with a FallbackWarning
  (``strict``: the error instead). Reaching no keeper at all also falls back; only ``strict`` raises.

Each start logs one line on the ``weightcache`` logger: hit or miss, bytes, milliseconds, and why on a miss (on a
miss that publishes, where its time went: the load, the packing into segments with the digests, the publish); an
engine that waits for another engine's load of the same entry logs that it waits, first.

An attach of a cached entry runs with CPython's cyclic garbage collector paused, from its first allocation (the
fingerprint) to its return: it makes thousands of objects (views, parameters) that cannot form cycles, and a fresh
interpreter that just imported torch owes the collector one full pass over torch's import-time objects (tens of
milliseconds), which any allocation made while the collector runs could otherwise pay inside the attach. The pause
begins with :func:`pause_collector`, not a ``with`` block, whose entry allocates before the pause. The pass is not
skipped, only left to the engine's next allocations. A miss resumes the collector before it reads the disk.
"""

from __future__ import annotations

import abc
import contextlib
import difflib
import functools
import gc
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import attrs
import torch

from . import quant as quant_registry
from .cache import Cache
from .client import ensure_keeper, first_load, load_key
from .errors import (
    BackendError,
    BindError,
    CheckpointError,
    EntryNotFound,
    FallbackWarning,
    FingerprintMismatch,
    InvalidArgument,
    KeeperNotResponding,
    KeeperUnavailable,
    UnsupportedQuantError,
    WeightCacheError,
)
from .fingerprint import Fingerprint, format_differences
from .handle import Handle
from .rundir import resolve_socket_dir, stopped_message, stopped_on_purpose

if TYPE_CHECKING:
    from .loader import StoredTensor
    from .publish import Packed

log = logging.getLogger("weightcache")

#: The kill switch, read at every start (not at import or registration): ``off`` turns weightcache off for every
#: entry point: :func:`run` serves the caller's own disk load (``attach`` and the engine adapters, whatever mode they
#: were given; no warning, ``strict`` does not apply), ``preload`` (``weightcache load``) refuses, and
#: ``compile_cache`` neither loads nor publishes. The engine adapters also take ``daemon`` or ``client`` from it.
#: Its value is read without surrounding spaces and without case (``OFF`` is ``off``).
SWITCH_ENV = "WEIGHTCACHE_MODE"
#: What :data:`SWITCH_ENV` may say: ``off`` everywhere, ``daemon`` or ``client`` for the engine adapters.
SWITCH_VALUES = ("off", "daemon", "client")


def switch_value() -> str:
    """:data:`SWITCH_ENV` as every entry point reads it: stripped and lower-cased (empty where unset)."""
    return os.environ.get(SWITCH_ENV, "").strip().lower()


def switched_off() -> bool:
    """Whether the operator turned weightcache off (``WEIGHTCACHE_MODE=off``, in any case). Another value that is
    not one of :data:`SWITCH_VALUES` switches nothing off and is logged once as a warning (the engine adapters
    refuse it: :class:`~weightcache.errors.BackendConfigError`)."""
    value = switch_value()
    if value and value not in SWITCH_VALUES:
        _unknown_switch(value)
    return value == "off"


@functools.cache
def _unknown_switch(value: str) -> None:
    log.warning(
        "weightcache: %s=%r is none of %s: weightcache is not switched off (set it to off to switch it off, or "
        "unset it)",
        SWITCH_ENV,
        value,
        ", ".join(SWITCH_VALUES),
    )


def refuse_if_switched_off() -> None:
    """WeightCacheError where weightcache is switched off: for the entry points whose only job is to load into the
    keeper (``preload``, ``weightcache load``), which have no disk load to serve instead."""
    if switched_off():
        raise WeightCacheError(
            f"weightcache is switched off here ({SWITCH_ENV}=off in the environment): nothing was read or "
            f"published; unset {SWITCH_ENV} to load into the keeper"
        )


Mode = Literal["off", "daemon", "client"]
MODES: tuple[Mode, ...] = ("off", "daemon", "client")
T = TypeVar("T")

#: Errors of a publish after the weights were loaded: the loaded weights are served anyway (unless strict).
#: (CheckpointError and a refused quantization are not among them: they are no fault of the cache.)
PUBLISH_FAILURES: tuple[type[BaseException], ...] = (WeightCacheError, OSError, MemoryError, torch.OutOfMemoryError)


@attrs.frozen
class Request:
    """What to serve and how: the fingerprint of the weights, the mode, strictness and the keeper's directory."""

    fingerprint: Fingerprint
    mode: Mode = "off"
    strict: bool = False
    socket_dir: str | os.PathLike[str] | None = None
    #: Byte bars on stderr while a checkpoint is read and while it is packed into segments to publish (see
    #: :mod:`weightcache.progress`).
    progress: bool | None = False
    #: Record a SHA-256 per tensor when publishing (what :meth:`Handle.verify` checks).
    digests: bool = True
    #: Largest segment when publishing a state dict (None: :func:`weightcache.publish.default_segment_bytes`).
    max_segment_bytes: int | None = None
    #: The quantization method's configuration, checked by its strategy (the fingerprint holds only its hash).
    quant_config: Mapping[str, Any] | None = None
    #: uids whose entries are attached besides this process's own and the keeper owner's.
    trusted: tuple[int, ...] = ()


class Steps(abc.ABC, Generic[T]):
    """What differs between callers of :func:`run`; the sequence itself is never re-implemented."""

    @abc.abstractmethod
    def load_state(self) -> MutableMapping[str, torch.Tensor]:
        """Read and post-process the weights from disk; return the tensors to publish. The caller drops every
        other reference to them, so that publishing can release them as it goes."""

    @abc.abstractmethod
    def serve(self, handle: Handle) -> T:
        """Put ``handle``'s tensors to use (bind them, build a model around them) and return the result."""

    def serve_disk(self, reason: str | None) -> T:
        """Serve the weights from disk without the cache (mode off, or a fallback saying ``reason``)."""
        return self.serve(self.private(self.load_state(), reason))

    def check_fit(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Raise BindError now if weights like ``tensors`` cannot be served (meta stand-ins or the loaded weights;
        None: as far as can be told before loading). Mode daemon calls it before it starts a keeper or reads the
        checkpoint, and again with the loaded weights before it publishes them, so that weights no model can
        take are never published. The default checks nothing."""

    def stream_layout(self) -> list[StoredTensor] | None:
        """The checkpoint's layout when its files can be streamed as stored straight into GPU segments (no
        conversion, no post-processing), else None (the default): then :meth:`load_state` runs."""
        return None

    def complete(self, fingerprint: Fingerprint) -> Fingerprint:
        """The fingerprint to look up and publish under: ``fingerprint`` plus what only the caller can tell once
        it has built its model (an engine adapter adds the structure of its model built on meta). Called in modes
        daemon and client before a keeper is asked; never in mode off. Raise BackendError when the weights
        cannot be served from a keeper here (e.g. the model cannot be built on meta): :func:`run` then loads from
        disk with a FallbackWarning saying why (``strict``: the error). Default: ``fingerprint`` as it is."""
        return fingerprint

    #: The fingerprint of the weights, set by :func:`run` before any step runs (and again after :meth:`complete`).
    fingerprint: Fingerprint

    def private(self, tensors: MutableMapping[str, torch.Tensor], reason: str | None) -> Handle:
        """A Handle of weights this process holds privately (source ``"disk"``)."""
        return Handle(source="disk", fingerprint=self.fingerprint, tensors=dict(tensors), fallback_reason=reason)


def check_mode(mode: object) -> Mode:
    """``mode`` if it is one of :data:`MODES`; otherwise InvalidArgument naming them (and the likely one)."""
    if mode not in MODES:
        close = difflib.get_close_matches(str(mode), MODES, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidArgument(f"mode must be one of {', '.join(MODES)}; found {mode!r}{guess}")
    return mode


def run(request: Request, steps: Steps[T]) -> T:
    """Serve the weights of ``request`` through ``steps`` in the request's mode (see the module docstring).

    Raises UnsupportedQuantError for a refused quantization method in modes daemon and client, before
    anything is read; with ``strict``, the error that would otherwise have been a fallback.
    """
    mode = check_mode(request.mode)
    steps.fingerprint = request.fingerprint
    start = time.perf_counter()
    if mode == "off":
        result = steps.serve_disk(None)
        _report(request, "off", start)
        return result
    # Paused from here to the keeper's answer (and through serving a hit): nothing is allocated before (reading the
    # switch raises and catches a KeyError when it is unset).
    enabled = pause_collector()
    if switched_off():
        resume_collector(enabled)
        result = steps.serve_disk(None)
        _report(request, "off", start, reason=f"{SWITCH_ENV}=off")
        return result
    try:
        quant_registry.get(request.fingerprint.quant).check(request.quant_config)
        fingerprint = steps.complete(request.fingerprint)
        if fingerprint != request.fingerprint:
            request = attrs.evolve(request, fingerprint=fingerprint)
            steps.fingerprint = fingerprint
    except BackendError as exc:  # nothing can be served into this model: its own load may still work
        resume_collector(enabled)
        if request.strict:
            raise
        return _fallback(request, steps, str(exc), start)
    except BaseException:
        resume_collector(enabled)
        raise
    if mode == "client":
        return _client(request, steps, start, enabled)
    resume_collector(enabled)
    return _daemon(request, steps, start)


def _client(request: Request, steps: Steps[T], start: float, enabled: bool) -> T:
    """Mode client, entered with the collector paused (``enabled``: whether it ran before): resumed once the
    keeper answered, or a hit was served."""
    fingerprint = request.fingerprint
    diffs: list[tuple[str, object, object]] = []
    try:
        try:
            cache = Cache(request.socket_dir, trusted_publishers=request.trusted)
            handle = cache.get(fingerprint)
            if handle is not None:
                return _serve(request, steps, handle, "hit", start)
        finally:
            resume_collector(enabled)
        reason, diffs = why_missing(cache, fingerprint)
    except KeeperNotResponding as exc:
        if request.strict:
            raise
        reason = f"the keeper is not responding ({exc})"
    except KeeperUnavailable as exc:
        if request.strict:
            raise
        reason = f"no keeper is available ({exc})"
    except (UnsupportedQuantError, BindError, BackendError):
        raise  # not the cache's fault: loading from disk would not make these go away
    except WeightCacheError as exc:  # a broken entry, an insecure socket dir, a keeper error...
        if request.strict:
            raise
        reason = f"the cache could not serve this request ({type(exc).__name__}: {exc})"
    if request.strict:
        if diffs:
            raise FingerprintMismatch(reason, tuple(diffs))
        raise EntryNotFound(reason)
    return _fallback(request, steps, reason, start)


def _daemon(request: Request, steps: Steps[T], start: float) -> T:
    with collector_paused():
        cache = Cache(request.socket_dir, trusted_publishers=request.trusted)
    cache.respawn = True  # mode daemon keeps a keeper running: also after a crash, to re-publish to
    with ThreadPoolExecutor(max_workers=1) as pool:
        no_keeper = False
        try:
            with collector_paused():
                handle = cache.get(request.fingerprint)
        except KeeperNotResponding as exc:  # a keeper holds the socket but is silent: no second one can start
            if request.strict:
                raise
            return _fallback(request, steps, f"the keeper is not responding ({exc})", start)
        except KeeperUnavailable:
            directory = resolve_socket_dir(request.socket_dir)
            if stopped_on_purpose(directory):  # a deliberate stop stays a stop: no keeper of our own
                if request.strict:
                    raise KeeperUnavailable(stopped_message(directory)) from None
                return _fallback(request, steps, stopped_message(directory), start)
            no_keeper = True  # so nothing is cached
            handle = None
        except (UnsupportedQuantError, BindError, BackendError):
            raise
        except WeightCacheError as exc:  # a socket directory we cannot use, a keeper that misbehaves...
            if request.strict:
                raise
            return _fallback(request, steps, f"the keeper cannot be used ({type(exc).__name__}: {exc})", start)
        if handle is not None:
            with collector_paused():
                return _serve(request, steps, handle, "hit", start)
        steps.check_fit(None)  # weights the model cannot take: before a keeper starts and anything is read
        # One load per entry: engines that miss it at once wait for the first one's load, then attach its copy.
        fingerprint = request.fingerprint
        key = load_key(fingerprint.digest, fingerprint.placement)
        what = f"{fingerprint.digest[:12]} on {fingerprint.placement}"
        with first_load(resolve_socket_dir(request.socket_dir), key, what=what) as turn:
            handle = _look_again(cache, request)  # published meanwhile: by the load waited for, or just before
            if handle is not None:
                handle.resident_before = False  # its segments appeared during this start
                turn.done()
                outcome = "hit, published meanwhile" if turn.first else "hit, after another engine's load"
                with collector_paused():
                    return _serve(request, steps, handle, outcome, start)
            # No keeper: start one while the weights load instead of before (ensure_keeper returns at once if one
            # runs by now).
            spawning: Future[object] | None = pool.submit(ensure_keeper, request.socket_dir) if no_keeper else None
            return _load_and_publish(request, steps, cache, spawning, start, published=turn.done)


def _look_again(cache: Cache, request: Request) -> Handle | None:
    """The entry, if the keeper holds it now; None if not, or if no keeper can be asked (the load that follows
    spawns one, or falls back, as on a first miss)."""
    try:
        with collector_paused():
            return cache.get(request.fingerprint)
    except (UnsupportedQuantError, BindError, BackendError):
        raise
    except WeightCacheError:
        return None


def _load_and_publish(
    request: Request,
    steps: Steps[T],
    cache: Cache,
    spawning: Future[object] | None,
    start: float,
    published: Callable[[], None] = lambda: None,
) -> T:
    """Load, pack, publish and serve; ``published`` is called once the publish is done or has failed, before the
    weights are served (engines waiting for this load look in the keeper then)."""
    # Loading and packing are imported on a miss only: an attach from the cache never needs them.
    from .publish import pack_checkpoint, pack_state

    fingerprint = request.fingerprint
    layout = steps.stream_layout()
    state: MutableMapping[str, torch.Tensor] | None = None
    packed: Packed | None = None
    marks = [("", time.perf_counter())]  # where the miss's time went, for its log line
    and_digests = " and digests" if request.digests else ""
    try:
        try:
            if layout is not None:
                packed = pack_checkpoint(fingerprint, layout, digests=request.digests, progress=request.progress)
                marks.append(("read into segments" + and_digests, time.perf_counter()))
            else:
                state = steps.load_state()
                marks.append(("load", time.perf_counter()))
                steps.check_fit(state)  # what a transform made is known only now: still before publishing
                gc.collect()  # whatever held the loaded tensors besides `state` (a dropped model's cycles) goes now
                # consume: each tensor is released once copied into its sealed segment.
                packed = pack_state(
                    fingerprint,
                    state,
                    consume=True,
                    digests=request.digests,
                    max_segment_bytes=request.max_segment_bytes,
                    progress=request.progress,
                )
                marks.append(("pack" + and_digests, time.perf_counter()))
            if spawning is not None:
                spawning.result()  # the keeper started while the weights loaded
            handle = cache.publish(packed)
            marks.append(("publish", time.perf_counter()))
            published()
        except (CheckpointError, BindError, InvalidArgument):
            raise  # no fault of the cache: serving these weights without it would fail the same way
        except PUBLISH_FAILURES as exc:
            published()  # nothing to wait for: the waiters load their own
            if request.strict:
                raise
            reason = f"publishing the loaded weights failed ({type(exc).__name__}: {exc})"
            if packed is not None:
                state = {**(state or {}), **packed.local_tensors()}
            if state is None:  # nothing loaded survived (streaming into segments failed): load privately
                return _fallback(request, steps, reason, start)
            _warn(f"weightcache: serving the weights loaded from disk without the cache: {reason}")
            return _serve(request, steps, steps.private(state, reason), "miss, publish failed", start)
    finally:
        if packed is not None:
            packed.close()
    handle.read_disk = True  # (Cache.publish has marked it not resident before: this start published it)
    phases = ", ".join(f"{name} {(t - marks[i][1]) * 1e3:.0f} ms" for i, (name, t) in enumerate(marks[1:]))
    return _serve(request, steps, handle, "miss, published", start, phases=phases)


def pause_collector() -> bool:
    """Pause CPython's cyclic garbage collector (see the module docstring) and return whether it ran; give that to
    :func:`resume_collector`. Two calls and no object made: unlike entering a ``with`` block, which makes its
    context manager's bound methods before the pause begins, and so could set off the very collection the pause
    is there to keep out. Reference counting still frees everything that is not in a cycle."""
    enabled = gc.isenabled()
    gc.disable()
    return enabled


def resume_collector(enabled: bool) -> None:
    """Let the collector run again if it ran before :func:`pause_collector` returned ``enabled``."""
    if enabled:
        gc.enable()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """:func:`pause_collector` inside the block (as it was before, after it), for code whose first allocations
    do not matter."""
    enabled = pause_collector()
    try:
        yield
    finally:
        resume_collector(enabled)


def _serve(request: Request, steps: Steps[T], handle: Handle, outcome: str, start: float, phases: str = "") -> T:
    try:
        result = steps.serve(handle)
    except BackendError as exc:  # the engine cannot take these weights here: its own load may still work
        handle.close()
        if request.strict:
            raise
        return _fallback(request, steps, f"the weights could not be put to use ({exc})", start)
    except BaseException:
        handle.close()
        raise
    _report(request, outcome, start, handle, phases=phases)
    return result


def _fallback(request: Request, steps: Steps[T], reason: str, start: float) -> T:
    _warn(f"weightcache: loading from disk: {reason}")
    result = steps.serve_disk(reason)
    _report(request, "miss, loaded from disk", start, reason=reason)
    return result


def without_cache(reason: str, load: Callable[[], T], *, strict: bool, switched_off: bool = False) -> T:
    """Serve the caller's own disk load without asking a keeper, because the cache cannot be used at all here:
    ``reason`` says why (an engine release outside an adapter's range, an engine API the adapter cannot find).
    A FallbackWarning says so (``strict``: BackendError(reason) instead, and nothing loads). ``switched_off``: the
    operator turned weightcache off (``WEIGHTCACHE_MODE=off``): no warning, and strictness does not apply. Either
    way the log line of every start says what happened."""
    start = time.perf_counter()
    if not switched_off:
        if strict:
            raise BackendError(reason)
        _warn(f"weightcache: loading from disk: {reason}")
    result = load()
    outcome = "off" if switched_off else "miss, loaded from disk"
    log.info("weightcache: %s in %.1f ms: %s", outcome, (time.perf_counter() - start) * 1e3, reason)
    return result


def _warn(message: str) -> None:
    # stacklevel: the user's call of attach() or of the engine's loader, past this module's frames
    warnings.warn(message, FallbackWarning, stacklevel=6)


def _report(
    request: Request, outcome: str, start: float, handle: Handle | None = None, reason: str = "", phases: str = ""
) -> None:
    """The start's one log line; ``phases``: where a miss's time went ("load 8890 ms, pack and digests ...")."""
    fp = request.fingerprint
    size = f", {handle.nbytes / 2**20:.1f} MiB" if handle is not None else ""
    if handle is not None and handle.evicted:  # a budget made room: this process's log says so, not only the keeper's
        size += f" (the keeper evicted {', '.join(key[:12] for key in handle.evicted)} to make room)"
    why = f": {reason}" if reason else ""
    if phases:
        why = f" ({phases}){why}"
    log.info(
        "weightcache: %s (mode %s) %s on %s%s in %.1f ms%s",
        outcome,
        request.mode,
        fp.digest[:12],
        fp.placement,
        size,
        (time.perf_counter() - start) * 1e3,
        why,
    )


#: The longest explanation of a miss (a FallbackWarning's or an error's reason): one line a terminal can show.
MAX_REASON = 600


def why_missing(cache: Cache, fingerprint: Fingerprint) -> tuple[str, list[tuple[str, object, object]]]:
    """Explain a miss in one line (at most :data:`MAX_REASON` characters): entries of this fingerprint whose
    publishers are not trusted, else the nearest cached entry on the same placement (of the same checkpoint path,
    else of the same files elsewhere) and how it differs."""
    reason, diffs = _why_missing(cache, fingerprint)
    if len(reason) > MAX_REASON:
        reason = reason[: MAX_REASON - 3] + "..."
    return reason, diffs


def _why_missing(cache: Cache, fingerprint: Fingerprint) -> tuple[str, list[tuple[str, object, object]]]:
    entries = cache.entries()
    untrusted = sorted(
        {e.publisher for e in entries if e.digest == fingerprint.digest and e.placement == fingerprint.placement}
    )
    if untrusted:  # the get found none of them trusted
        uids = ", ".join(map(str, untrusted))
        return (
            f"the keeper holds entry {fingerprint.digest[:12]} only as published by uid {uids}, which this engine "
            "does not trust (by default only its own uid and the keeper's owner are); name that user in "
            "trusted_publishers to attach it, or let mode daemon publish this engine's own",
            [],
        )
    placed = [e for e in entries if e.placement == fingerprint.placement]
    same_model = [e for e in placed if e.fingerprint.model_path == fingerprint.model_path]
    if same_model:
        best = min(same_model, key=lambda e: len(fingerprint.diff(e.fingerprint)))
        diffs = fingerprint.diff(best.fingerprint)
        return (
            f"the cached entry {best.digest[:12]} for {fingerprint.model_path} does not match{_hint(diffs)}: "
            f"{format_differences(diffs)}",
            diffs,
        )
    # A copy of the checkpoint (another path, other inodes and times): the same files by their headers.
    headers = {c.header_sha256 for c in fingerprint.checkpoint}
    copies = [e for e in placed if headers & {c.header_sha256 for c in e.fingerprint.checkpoint}]
    if copies:
        best = min(copies, key=lambda e: len(fingerprint.diff(e.fingerprint)))
        diffs = fingerprint.diff(best.fingerprint)  # model_path first, then the files' inodes and times
        names = ", ".join(name for name, _, _ in diffs[:6]) + (f" and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        return (
            f"the keeper holds no entry for {fingerprint.model_path} on {fingerprint.placement} (digest "
            f"{fingerprint.digest[:12]}), but its entry {best.digest[:12]} holds files with the same headers at "
            f"{best.fingerprint.model_path}: a checkpoint's path, inodes and file times are part of its identity, so "
            "attach that path, or publish this copy with mode='daemon' or `weightcache load` (differences: "
            f"{names})",
            diffs,
        )
    return (
        f"the keeper holds no entry for {fingerprint.model_path} on {fingerprint.placement} "
        f"(digest {fingerprint.digest[:12]}); publish it first with mode='daemon' or `weightcache load`",
        [],
    )


def _hint(diffs: list[tuple[str, object, object]]) -> str:
    """What to do about a difference that has one usual cause."""
    engines = {name: (a, b) for name, a, b in diffs if name == "engine"}
    if engines.get("engine") == ("transformers", "torch"):
        return (
            " (it holds the checkpoint's plain tensors, engine torch, as `weightcache load` makes by default; a "
            "transformers model attaches the entry of `weightcache load --engine transformers`)"
        )
    return ""


__all__ = [
    "MAX_REASON",
    "MODES",
    "PUBLISH_FAILURES",
    "Mode",
    "Request",
    "Steps",
    "check_mode",
    "collector_paused",
    "pause_collector",
    "resume_collector",
    "run",
    "why_missing",
    "without_cache",
]
