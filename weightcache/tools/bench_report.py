"""``weightcache bench``'s results: the columns of a configuration, the line printed for it, and the JSON report.

:func:`stats` is a column's median, min and max over the fresh processes; :func:`columns_of` the columns and
ratios of one mechanism's processes (attach / floor, import / torch import, whether every process saw the
published bits); :func:`report_lines` the table's lines of a configuration (synthetic, then
:data:`REAL_VARIANTS`); :func:`make_report` the ``--json`` report with the machine, the command and the flatness
in size; :func:`report_path` makes ``--json``'s directory before the work starts.

Layer L5 (a tool). Computes and formats only: it measures nothing and starts no process. Its names are
re-exported by :mod:`weightcache.tools.bench`.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import weightcache as wc


def report_path(json_out: str | os.PathLike[str] | None) -> Path | None:
    """Where ``--json`` writes, with its directory created now: before the work, not after it (a fresh clone
    has no ``bench-results/``). WeightCacheError when the directory cannot be created."""
    if json_out is None:
        return None
    path = Path(json_out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise wc.WeightCacheError(
            f"--json {json_out}: cannot create its directory ({exc}); give a path in a writable directory"
        ) from exc
    return path


def stats(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Median, min and max of column ``key`` over ``runs`` (one dict per process or round)."""
    values = [float(r[key]) for r in runs]
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def columns_of(runs: list[dict[str, Any]], expected: str) -> dict[str, Any]:
    """The reported columns of one mechanism's fresh processes: medians, ratios and whether all saw ``expected``."""
    row: dict[str, Any] = {"runs": runs}
    for key in ("attach_ms", "import_ms", "floor_ms", "gc_ms", "gc_import_ms", "gc_after_ms", "identity_ms"):
        row[key] = stats(runs, key)
    for key in ("python_ms", "cuda_init_ms", "gc_full", "gc_import_full"):
        row[key] = stats(runs, key)
    row["attach_over_floor"] = round(row["attach_ms"]["median"] / row["floor_ms"]["median"], 3)
    # per process (attach and floor of the same process share its moment of the machine's load): the median
    row["attach_over_floor_paired"] = round(statistics.median(r["attach_ms"] / r["floor_ms"] for r in runs), 3)
    row["import_over_torch"] = round(row["import_ms"]["median"] / row["python_ms"]["median"], 4)
    row["identical"] = all(r["checksum"] == expected and r["source"] == "cache" for r in runs)
    return row


#: The real-checkpoint rows of a configuration, as :func:`report_lines` labels them.
REAL_VARIANTS = {"real": "real checkpoint"}


def report_lines(r: dict[str, Any]) -> list[str]:
    """The synthetic row of a configuration, then its real-checkpoint rows (``--real-checkpoint``)."""
    lines = [report_line(r)]
    for name, label in REAL_VARIANTS.items():
        if name in r:
            lines.append(
                report_line({**r[name], "gib": r["gib"], "tensors": r["tensors"], "segments": r["segments"]}, label)
            )
    return lines


def report_line(r: dict[str, Any], label: str = "synthetic") -> str:
    a, imp, fl, g = r["attach_ms"], r["import_ms"], r["floor_ms"], r["gc_ms"]
    text = (
        f"{r['gib']:>6g} GiB {r['tensors']:>5} tensors, {label} | attach median {a['median']:7.2f} ms "
        f"({a['min']:.2f}-{a['max']:.2f}) | import {imp['median']:6.2f} ms ({imp['min']:.1f}-{imp['max']:.1f}; "
        f"gc in it {r['gc_import_ms']['median']:.1f}; torch {r['python_ms']['median']:.0f} ms) | "
        f"floor {fl['median']:.2f} ms, attach/floor {r['attach_over_floor']:.2f}x "
        f"(per process {r['attach_over_floor_paired']:.2f}x) | "
        f"gc in attach {g['median']:.2f} ms (max {g['max']:.1f}; full collections in it: "
        f"{r['gc_full']['max']:g} at most); "
        f"a full collection after it {r['gc_after_ms']['median']:.0f} ms | "
        f"identity again {r['identity_ms']['median']:.2f} ms"
    )
    if "peer" in r:
        p = r["peer"]["attach_ms"]
        text += f" | peer {p['median']:.2f} ms ({p['min']:.1f}-{p['max']:.1f}), {r['peer_over_attach']:.1f}x"
    return text + f" | {r['segments']} segments | identical {r['identical']}"


def make_report(device: str, results: list[dict[str, Any]], counts: Sequence[int]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "bytecode_cached": not sys.flags.dont_write_bytecode,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("WEIGHTCACHE_")},
        "command": "weightcache bench " + " ".join(sys.argv[2:]),
        "results": results,
    }
    for n in counts:
        series = [r for r in results if r["tensors"] == n]
        if len(series) > 1:
            small, large = series[0], series[-1]
            ratio = large["attach_ms"]["median"] / small["attach_ms"]["median"]
            report.setdefault("flatness", []).append(
                {"tensors": n, "from_gib": small["gib"], "to_gib": large["gib"], "ratio": round(ratio, 3)}
            )
    return report


__all__ = ["REAL_VARIANTS", "columns_of", "make_report", "report_line", "report_lines", "report_path", "stats"]
