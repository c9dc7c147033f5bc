"""Every error weightcache raises, in one place.

Catch :class:`WeightCacheError` for all of them, or exactly one case. Each message says what was expected,
what was found, and what to do. This module imports nothing heavy: the keeper and the CLI use it too.
"""

from __future__ import annotations


class WeightCacheError(Exception):
    """Base class of every error raised by weightcache."""


class InvalidArgument(WeightCacheError, ValueError):
    """An argument has a value weightcache cannot use here: an unknown mode, a device that is no device or that
    this process lacks (a CUDA device with a CPU build of torch), an unknown dtype, a bad parallel layout, a
    transform without a stable identity. The message names what is accepted."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of a type weightcache cannot use: a config or ``extra`` that is not JSON, a state dict value
    that is not a tensor, a class registered as an engine adapter or quantization strategy that is not one. Also
    a ``TypeError`` (and, as every :class:`InvalidArgument`, a ``ValueError``)."""


# --- the keeper and the wire ------------------------------------------------------------------------------


class KeeperUnavailable(WeightCacheError):
    """No keeper answers on the socket (none running, stale socket, or it could not be started)."""


class KeeperNotResponding(KeeperUnavailable):
    """The keeper accepted the connection but did not answer a request within its deadline: it is stopped
    (SIGSTOP, a debugger), wedged, or its host is overloaded. The connection is closed; nothing was changed."""


class KeeperAlreadyRunning(WeightCacheError):
    """`weightcache serve` found another keeper already serving the same socket directory."""


class KeeperError(WeightCacheError):
    """The keeper answered a request with an error (entry too big, bad manifest, evicting a leased entry...)."""

    def __init__(self, message: str, code: str = "error") -> None:
        super().__init__(message)
        #: Machine-readable reason sent by the keeper, e.g. ``"leased"``, ``"not_found"``, ``"bad_request"``.
        self.code = code


class BudgetExceeded(KeeperError):
    """The keeper refused a publish: it does not fit the placement's memory budget even after evicting every
    unleased entry there (code ``"over_budget"``)."""


class ProtocolError(WeightCacheError):
    """A peer sent something that is not a valid weightcache message (bad frame, bad JSON, bad fds)."""


class ProtocolVersionError(ProtocolError):
    """Client and keeper speak protocol versions that do not overlap."""


class SocketDirError(WeightCacheError):
    """The socket directory is missing, not private, not owned by this user, or a symlink."""


class PeerRejected(WeightCacheError):
    """The peer on the socket runs as a user that is not allowed (SO_PEERCRED check)."""


class KeeperForbidden(PeerRejected, KeeperError):
    """The keeper refused this peer (not its uid, not in its ``--allow-group``), or a member of its group asked
    for what only its owner may do (code ``"forbidden"``): both a PeerRejected and a KeeperError."""


class EntryNotFound(KeeperError):
    """The keeper holds no entry with the requested fingerprint or digest: its reply to a request naming one (an
    evict, an inspect) with code ``"not_found"``, and a strict client's ``attach`` that found none. A
    :class:`KeeperError` whose :attr:`~KeeperError.code` is ``"not_found"``."""

    def __init__(self, message: str, code: str = "not_found") -> None:
        super().__init__(message, code)


#: What a keeper's error code means to a caller: the one table (see :func:`keeper_error`); codes not named here
#: raise :class:`KeeperError` carrying the code. The codes are :mod:`weightcache.messages`'s constants.
KEEPER_ERRORS: dict[str, type[WeightCacheError]] = {
    "over_budget": BudgetExceeded,
    "version": ProtocolVersionError,
    "forbidden": KeeperForbidden,
    "not_found": EntryNotFound,
}


def keeper_error(code: str, message: str) -> WeightCacheError:
    """The exception for a keeper's error reply ``code`` with ``message``: the only place that reads codes."""
    cls = KEEPER_ERRORS.get(code, KeeperError)
    return cls(message, code) if issubclass(cls, KeeperError) else cls(message)


# --- what is cached -----------------------------------------------------------------------------------------


class FingerprintMismatch(WeightCacheError):
    """The keeper holds weights for this checkpoint, but not with this fingerprint (dtype, layout, ...)."""

    def __init__(self, message: str, differences: tuple[tuple[str, object, object], ...] = ()) -> None:
        super().__init__(message)
        #: ``(field, requested, cached)`` for each field that differs.
        self.differences = differences


class ManifestError(WeightCacheError):
    """A manifest is malformed or does not fit its segments."""


class SegmentError(WeightCacheError):
    """A shared memory segment could not be created, exported, imported or mapped."""


class UnsupportedQuantError(WeightCacheError):
    """The quantization method is unknown, or its output cannot be shared safely between processes."""


# --- loading and binding ------------------------------------------------------------------------------------


class CheckpointError(WeightCacheError):
    """The checkpoint is missing, empty, or not valid safetensors; for a transformers model, also: it has no
    config.json that transformers can read."""


class BindError(WeightCacheError):
    """Tensors could not be bound into the model: a name is missing, a shape or dtype differs, or a tensor
    was left on the meta device."""


# --- CUDA graphs ------------------------------------------------------------------------------------------


class GraphDescriptionError(WeightCacheError, ValueError):
    """A CUDA graph's description (:mod:`weightcache.graphs`) is malformed: a field of the wrong type or out of
    range, argument bytes that are not hex, an edge naming a node the description lacks. Nothing is rebuilt."""


class GraphRestoreError(WeightCacheError):
    """A CUDA graph cannot be rebuilt from its description in this process: a kernel it names has no function
    handle here, a node type it cannot rebuild, or a driver call failed. The caller captures the graph as usual."""


# --- engine adapters ----------------------------------------------------------------------------------------


class BackendError(WeightCacheError):
    """An engine adapter (see :mod:`weightcache.backends`) cannot be used as configured."""


class EngineNotInstalled(BackendError, ImportError):
    """The adapter's engine (vLLM, SGLang, ...) is not importable in this environment."""


class BackendConfigError(BackendError, ValueError):
    """An adapter option is unknown or has a wrong value (e.g. in vLLM's --model-loader-extra-config)."""


# --- warnings -----------------------------------------------------------------------------------------------


class FallbackWarning(UserWarning):
    """weightcache served weights from disk instead of the cache: mode ``client``'s fallback (no keeper, a miss,
    a mismatch), or mode ``daemon`` where no keeper can be used or publishing failed (it serves what it loaded);
    the message says why."""


__all__ = [
    "BackendConfigError",
    "BackendError",
    "BindError",
    "BudgetExceeded",
    "CheckpointError",
    "EngineNotInstalled",
    "EntryNotFound",
    "FallbackWarning",
    "FingerprintMismatch",
    "GraphDescriptionError",
    "GraphRestoreError",
    "InvalidArgument",
    "InvalidArgumentType",
    "KEEPER_ERRORS",
    "KeeperAlreadyRunning",
    "KeeperError",
    "KeeperForbidden",
    "KeeperNotResponding",
    "KeeperUnavailable",
    "ManifestError",
    "PeerRejected",
    "ProtocolError",
    "ProtocolVersionError",
    "SegmentError",
    "SocketDirError",
    "UnsupportedQuantError",
    "WeightCacheError",
    "keeper_error",
]
