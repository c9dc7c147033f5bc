"""Running one benchmark's child script in fresh processes of several checkouts, alternating (tree against tree):
what ``graph_rebuild_cpu.py``, ``graph_relocate_cpu.py`` and ``graph_restore_cpu.py`` share, with the last two's
options and report."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
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


#: The options :func:`graph_report` writes as they are (or leaves out); any other option is written too.
_REPORTED = {"tree", "json", "processes", "graphs", "nodes", "externals"}


def graph_options(
    description: str,
    nodes: int,
    externals: int,
    externals_help: str,
    more: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The options of a graph benchmark run tree against tree: ``--tree`` (repeated), ``--processes``, ``--graphs``,
    ``--nodes``, ``--externals``, ``--json``, and those ``more`` adds; parsed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tree", type=Path, action="append", required=True, help="a checkout of weightcache")
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--graphs", type=int, default=51)
    parser.add_argument("--nodes", type=int, default=nodes)
    parser.add_argument("--externals", type=int, default=externals, help=externals_help)
    parser.add_argument("--json", type=Path)
    if more is not None:
        more(parser)
    args = parser.parse_args()
    args.tree = [t.resolve() for t in args.tree]
    return args


def graph_report(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, Any]]],
    each: Callable[[list[dict[str, Any]]], dict[str, Any]],
    line: Callable[[str, dict[str, Any]], str],
) -> dict[str, Any]:
    """The report of :func:`graph_options`' run: date, Python, the options, and for each tree the median and every
    process's ``seconds`` with what ``each`` makes of that tree's results; each tree's ``line`` (from its name and
    entry) printed, and the report written to ``--json`` where given."""
    report: dict[str, Any] = {
        "date": time.strftime("%F %H:%M UTC", time.gmtime()),
        "python": sys.version.split()[0],
        "graphs": args.graphs,
        "nodes": args.nodes,
        "externals": args.externals,
        **{k: v for k, v in vars(args).items() if k not in _REPORTED},
        "trees": {},
    }
    for tree, results in runs.items():
        values = [r["seconds"] for r in results]
        report["trees"][tree] = {
            "seconds_median": round(statistics.median(values), 4),
            "seconds": [round(v, 4) for v in values],
            **each(results),
        }
        print(line(tree, report["trees"][tree]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report
