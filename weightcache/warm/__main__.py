"""``python -m weightcache.warm``: one warm process (see :mod:`weightcache.warm.server`)."""

from __future__ import annotations

import sys

from .server import main

if __name__ == "__main__":
    sys.exit(main())
