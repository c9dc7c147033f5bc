"""MkDocs hook: docstrings use Sphinx roles (:func:`name`), which mkdocstrings renders as ":func:" followed by
code; keep the code and drop the role name."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub("", html)
