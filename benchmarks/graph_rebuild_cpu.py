"""The Python cost of rebuilding CUDA graphs from their descriptions (issue 31), on a CPU, tree against tree.

A restore adds every node of every graph through ``CudaGraphDriver``'s ctypes calls; on an H200 a graph of ~240
kernel nodes took 3-5 ms to rebuild, and vLLM captures thousands of graphs. Here the same Python and ctypes code
runs against a stand-in for ``libcuda`` whose every function is a C call that returns 0 and does nothing of note
(libc's ``sched_yield``), so what is timed is the rebuild's own cost: the description walked, the ctypes
structures made, the calls made. The graphs are ``graph_artifact_cpu.synthetic_bundle``'s (8 graphs of 240 kernel
nodes, 30 % with a 1 KiB argument buffer). Each tree runs in ``--processes`` fresh processes, alternating; each
process rebuilds the 8 graphs 5 times and reports the median per node, and how many garbage collections of each
generation the rebuilds set off.

    python benchmarks/graph_rebuild_cpu.py --tree /tmp/wt-before --tree . --processes 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tree_runs import alternate

CHILD = r"""
import ctypes, gc, json, statistics, sys, time
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from graph_artifact_cpu import synthetic_bundle
from weightcache.graphs import CudaGraphDriver, rebuild
from weightcache.graphs.bundle import GraphBundle


class NoOpLibcuda:
    def __getattr__(self, name):
        fn = ctypes.CDLL(None)["sched_yield"]  # a new function pointer per name: the driver sets argtypes on each
        setattr(self, name, fn)
        return fn


bundle = GraphBundle.from_bytes(synthetic_bundle(8, 240, 18, 4, 0.3, 1024).to_bytes(), check_images=False)
driver = CudaGraphDriver(NoOpLibcuda())
functions = [{name: 1 for name in r.description.kernels()} for r in bundle.graphs]
nodes = sum(len(r.description.nodes) for r in bundle.graphs)
counts = [0, 0, 0]


def count(phase, info):
    if phase == "start":
        counts[info["generation"]] += 1


gc.callbacks.append(count)
per_node = []
for _ in range(5):
    t = time.perf_counter()
    for record, fns in zip(bundle.graphs, functions):
        driver.destroy_graph(rebuild(driver, record.description, fns))
    per_node.append((time.perf_counter() - t) / nodes * 1e6)
print(json.dumps({"us_per_node": statistics.median(per_node), "collections": counts, "nodes": nodes}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", required=True, help="a checkout of weightcache")
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    runs = alternate(CHILD, [t.resolve() for t in args.tree], args.processes)
    report = {"date": time.strftime("%F %H:%M UTC", time.gmtime()), "python": sys.version.split()[0], "trees": {}}
    for tree, results in runs.items():
        values = [float(r["us_per_node"]) for r in results]  # type: ignore[arg-type]
        report["trees"][tree] = {  # type: ignore[index]
            "us_per_node_median": round(statistics.median(values), 2),
            "us_per_node": [round(v, 2) for v in values],
            "collections_per_process": [r["collections"] for r in results],
        }
        print(f"{tree}: {statistics.median(values):.2f} us per node (median of {len(values)} processes)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
