"""Progress bars for long loads: a tqdm bar of bytes on stderr.

``progress=None`` (the default of :func:`weightcache.attach`) shows a bar only when it helps: stderr is a
terminal and the load is at least :data:`AUTO_MIN_BYTES`. ``True`` and ``False`` force it on or off.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

#: Loads smaller than this finish in about a second from a fast disk: no bar unless asked for.
AUTO_MIN_BYTES = 1 << 30


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

    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False, file=sys.stderr
    ) as bar:
        yield bar.update
