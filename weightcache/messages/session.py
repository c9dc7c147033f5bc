"""The shapes of the ops about the connection and the keeper itself: ``hello`` (the first message on every
connection) and ``stop``.

Layer L1: never imports torch (the keeper and the CLI use it; tests/test_layers.py checks).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..protocol import field
from .base import HELLO, STOP, _ok

# --- hello -----------------------------------------------------------------------------------------------------


class HelloRequest(NamedTuple):
    """The first message on every connection: the protocol versions the client speaks."""

    protocol: int
    min_protocol: int | None = None
    client_version: str | None = None
    pid: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": HELLO, "protocol": self.protocol}
        for key in ("min_protocol", "client_version", "pid"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HelloRequest:
        return cls(
            protocol=field(data, "protocol", int),
            min_protocol=field(data, "min_protocol", int, optional=True),
            client_version=field(data, "client_version", str, optional=True),
            pid=field(data, "pid", int, optional=True),
        )


class HelloReply(NamedTuple):
    protocol: int
    keeper_version: str
    pid: int
    uid: int

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, **self._asdict()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HelloReply:
        _ok(data)
        return cls(
            protocol=field(data, "protocol", int),
            keeper_version=field(data, "keeper_version", str),
            pid=field(data, "pid", int),
            uid=field(data, "uid", int),
        )


# --- stop --------------------------------------------------------------------------------------------------------


class StopRequest(NamedTuple):
    def to_json(self) -> dict[str, Any]:
        return {"op": STOP}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StopRequest:
        return cls()


class StopReply(NamedTuple):
    """The keeper's pid; it exits after sending this."""

    pid: int

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "pid": self.pid}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StopReply:
        _ok(data)
        return cls(pid=field(data, "pid", int))
