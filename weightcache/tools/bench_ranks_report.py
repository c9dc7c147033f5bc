"""``weightcache bench --ranks``'s results: a configuration's lines of text and the JSON report.

:func:`lines` is the report of one configuration as text (the headline against :data:`GOAL_RATIO`, one line per
rank, the keeper kill), :func:`row_ok` whether it passed (every rank saw its publisher's bits, every shard came
back after the keeper kill), :func:`make_report` the ``--json`` report with the machine and the command.

Layer L5 (a tool). Formats only: it measures nothing and starts no process. Its names are re-exported by
:mod:`weightcache.tools.bench_ranks`.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import weightcache as wc

from .bench_ranks_processes import REPUBLISH_TIMEOUT_S

#: The goal: the slowest of n ranks attaching together within this factor of one rank alone (medians).
GOAL_RATIO = 1.5


def lines(row: dict[str, Any]) -> list[str]:
    """The report of one configuration as text: the headline, one line per rank, the keeper kill."""
    a, t = row["alone"]["attach_ms"], row["together"]
    where = f"{row['ranks']} ranks"
    if row["gpus"]:
        where += f" on {min(row['ranks'], row['gpus'])} GPU(s)"
        if row["shared_gpu"]:
            where += f" (shared: up to {row['ranks_per_device']} ranks per GPU: the keeper's concurrency, not the"
            where += f" {row['ranks']}-GPU case)"
    else:
        where += " on the CPU"
    k = row["keeper"]
    out = [
        f"{where} | {row['gib']:g} GiB and {row['tensors']} tensors per rank, {row['segments']} segments | "
        f"alone {a['median']:.2f} ms ({a['min']:.2f}-{a['max']:.2f}) | together: slowest "
        f"{t['slowest_ms']['median']:.2f} ms ({t['slowest_ms']['min']:.2f}-{t['slowest_ms']['max']:.2f}), "
        f"{row['slowest_over_alone']:.2f}x alone "
        f"(goal {GOAL_RATIO}x: {'met' if row['goal_met'] else 'missed'}), every rank {t['attach_ms']['median']:.2f} "
        f"ms (CPU {t['attach_cpu_ms']['median']:.2f}, alone {row['alone']['attach_cpu_ms']['median']:.2f}), started "
        f"within {t['skew_ms']['median']:.2f} ms | keeper CPU {k['cpu_ms_per_attach']:.2f} ms per attach "
        f"(alone {k['alone_cpu_ms_per_attach']:.2f}; ticks of {k['tick_ms']:g} ms) | identical {row['identical']}"
    ]
    for r in row["per_rank"]:
        ra, ri = r["attach_ms"], r["import_ms"]
        out.append(
            f"    rank {r['rank']}: attach {ra['median']:.2f} ms ({ra['min']:.2f}-{ra['max']:.2f}; CPU "
            f"{r['attach_cpu_ms']['median']:.2f}), import {ri['median']:.1f} ms"
        )
    kk = row.get("keeper_kill")
    if kk is not None:
        tail = f"{kk['attach_ms']['median']:.2f} ms median" if kk["attach_ms"] else "not run"
        back = (
            f"all {kk['holders']} shards re-published {kk['republish_s']:.2f} s after the restart began"
            if kk["republished"]
            else f"NOT every shard re-published within {REPUBLISH_TIMEOUT_S:g} s"
        )
        out.append(
            f"    keeper SIGKILLed under {kk['holders']} holding ranks, a new one serving in "
            f"{kk['keeper_start_s']:.2f} s, {back}; {kk['holders']} new ranks attached from the cache ({tail}) | "
            f"identical {kk['identical']}"
        )
    return out


def row_ok(row: dict[str, Any]) -> bool:
    kk = row.get("keeper_kill")
    return bool(row["identical"] and (kk is None or (kk["identical"] and kk["holders_leased"])))


def make_report(device: str, gpus: Sequence[str], results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "gpus": list(gpus),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "weightcache": wc.__version__,
        "command": "weightcache bench " + " ".join(sys.argv[2:]),
        "goal_ratio": GOAL_RATIO,
        "results": results,
    }


__all__ = ["GOAL_RATIO", "lines", "make_report", "row_ok"]
