"""Progress bars for long loads: a tqdm bar of bytes on stderr.

``progress=None`` (the default of :func:`weightcache.attach`) shows a bar only when it helps: stderr is a
terminal and the load is at least :data:`AUTO_MIN_BYTES`. ``True`` and ``False`` force it on or off.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from .units import format_bytes

#: Loads smaller than this finish in about a second from a fast disk: no bar unless asked for.
AUTO_MIN_BYTES = 1 << 30
#: ``loading checkpoint:  40%|####      | 2.0 GiB/5.0 GiB [00:02<00:03, 1.0 GiB/s]``
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {size}/{total_size} [{elapsed}<{remaining}, {speed}]"


def wanted(progress: bool | None, total_bytes: int) -> bool:
    """Whether to show a bar for a load of ``total_bytes`` (see the module docstring)."""
    if progress is None:
        stream = sys.stderr  # None when the process was started with stderr closed
        return total_bytes >= AUTO_MIN_BYTES and stream is not None and stream.isatty()
    return bool(progress)


@contextlib.contextmanager
def byte_bar(total_bytes: int, desc: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A bar counting bytes up to ``total_bytes``; yields its update function, or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm  # lazy: only a bar needs it (~40 ms to import alone)

    class ByteBar(tqdm):  # type: ignore[misc]  # tqdm is untyped
        """tqdm's bar with sizes as the rest of weightcache prints them (``2.0 GiB``, not tqdm's ``2.00G``)."""

        @property
        def format_dict(self) -> dict[str, object]:
            found: dict[str, object] = super().format_dict
            rate = found.get("rate")
            found["size"] = format_bytes(self.n)
            found["total_size"] = format_bytes(self.total or 0)
            found["speed"] = f"{format_bytes(rate)}/s" if isinstance(rate, (int, float)) else "? B/s"
            return found

    with ByteBar(total=total_bytes, desc=desc, leave=False, file=sys.stderr, bar_format=BAR_FORMAT) as bar:
        yield bar.update
