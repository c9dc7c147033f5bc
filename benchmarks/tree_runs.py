"""Running one benchmark's child script in fresh processes of several checkouts, alternating (tree against tree):
what ``graph_rebuild_cpu.py`` and ``graph_relocate_cpu.py`` share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def alternate(child: str, trees: list[Path], processes: int, *argv: str) -> dict[str, list[dict[str, Any]]]:
    """Run ``child`` (Python source, given the tree as its first argument, then ``argv``) ``processes`` times in
    each tree, the trees taking turns, each in a fresh process with that tree first on the path; the JSON object
    each printed last, by tree."""
    runs: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
    for _ in range(processes):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run(
                [sys.executable, "-c", child, str(tree), *argv],
                capture_output=True,
                text=True,
                env=env,
                check=True,
                cwd=tree,
            )  # run in the tree: `python -c` puts the working directory first on the path
            runs[str(tree)].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs
