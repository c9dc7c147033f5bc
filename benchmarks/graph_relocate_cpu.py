"""The Python cost of relocating CUDA graphs in a restore (issue 31), on a CPU, tree against tree.

Where a tensor a graph reads (declared with ``GraphCache.external``) lies elsewhere in the restoring process, the
restore finds every pointer into it and moves it (``check.relocate``), after looking for words it would leave
behind (``check.relocation_problems``); vLLM's runner tensors moved so in every process on an H100, for each of
its 51 FULL graphs of up to 450 nodes. Neither step touches the GPU, so both are timed here: the graphs are
``graph_artifact_cpu.synthetic_bundle``'s (``--graphs`` graphs of ``--nodes`` kernel nodes, 10 % with a 256-byte
argument buffer), read back from the artifact's bytes as a restore reads them, and the weights' range stands in
for a moved tensor (about half of the pointers move: more than an engine's graphs would have). ``--externals N``
cuts the weights' first GiB (where the pointers lie) into N external ranges instead, each moved by as much, and
every tenth one also covered by a view spanning it and the next (vLLM's runner: a hundred and more declared tensors,
views of one another among them; on an H100 its 51 graphs reached them with 40,851 pointers). Each tree runs in
``--processes`` fresh processes, alternating; each reports the seconds for all graphs (both steps).

    python benchmarks/graph_relocate_cpu.py --tree /tmp/wt-before --tree . --processes 5
    python benchmarks/graph_relocate_cpu.py --tree /tmp/wt-before --tree . --processes 5 --externals 150
"""

from __future__ import annotations

from tree_runs import alternate, graph_options, graph_report

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from graph_artifact_cpu import HOME, synthetic_bundle
from weightcache.graphs.bundle import GraphBundle
from weightcache.graphs.check import AddressRange, relocate, relocation_problems

graphs, nodes, externals = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
bundle = GraphBundle.from_bytes(synthetic_bundle(graphs, nodes, 18, 4, 0.1, 256).to_bytes(), check_images=False)
ranges, moved = list(bundle.ranges), {HOME.name: 2 << 20}
if externals:
    size = (1 << 30) // externals
    cut = [AddressRange(f"external/r{i:04}", HOME.base + i * size, size, own_mapping=False) for i in range(externals)]
    views = [
        AddressRange(f"external/v{i:04}", HOME.base + i * size, 2 * size, own_mapping=False)
        for i in range(0, externals - 1, 10)
    ]
    ranges = [r for r in ranges if r.name != HOME.name] + sorted(cut + views, key=lambda r: r.name)
    moved = {r.name: 2 << 20 for r in cut + views}
began = time.perf_counter()
count = 0
for record in bundle.graphs:
    assert relocation_problems(record.description, ranges, moved) == []
    count += relocate(record.description, ranges, moved)[1]
print(json.dumps({"seconds": time.perf_counter() - began, "moved": count}))
"""


def main() -> int:
    args = graph_options(
        __doc__.split("\n\n")[0], 480, 0, "external ranges the pointers lie in (0: the weights' range alone)"
    )
    runs = alternate(CHILD, args.tree, args.processes, str(args.graphs), str(args.nodes), str(args.externals))
    graph_report(
        args,
        runs,
        lambda results: {"pointers_moved": results[0]["moved"]},
        lambda tree, row: (
            f"{tree}: {row['seconds_median']:.3f} s for {args.graphs} graphs of {args.nodes} nodes, "
            f"{args.externals or 1} moved range(s) ({row['pointers_moved']} pointers moved; median of "
            f"{len(row['seconds'])} processes)"
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
