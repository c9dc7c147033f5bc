"""What every group of the CLI's commands shares: :func:`printable` (what the CLI prints of anything it did not
write itself) and :func:`connect` (a connection to the keeper that ``--socket-dir`` names).

Layer L5 (tools). Imports the keeper client only when a command connects (``serve`` has no use for it), and never
torch.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightcache.client import KeeperConnection


#: What a terminal would act on instead of showing: C0 and C1 controls, DEL, bidi overrides and isolates, and
#: lone surrogates (which no encoding can write).
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNPRINTABLE_BUT_NEWLINES = re.compile(
    r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def printable(text: object, *, newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on escaped (``\x1b``, ``\u202e``, ``\udc80``): what
    the CLI prints of anything it did not write itself (entries are published by other users of a shared keeper).
    ``newlines``: keep line breaks (for messages of several lines)."""
    pattern = _UNPRINTABLE_BUT_NEWLINES if newlines else _UNPRINTABLE
    return pattern.sub(_escape, str(text))


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def connect(args: argparse.Namespace) -> KeeperConnection:
    """A connection to the keeper of ``args.socket_dir`` (``--socket-dir``; None: the default directory)."""
    from weightcache.client import KeeperConnection  # filelock, which it imports: serve does without

    return KeeperConnection.connect(args.socket_dir)
