"""The CPU half of a graph restore's fixed costs: getting the ``cuda.graphs`` artifact from the keeper and parsing it.

On the H200 (docs/benchmarks.md, "CUDA graphs restored instead of captured") a restore of 8 graphs spent 147-158 ms
asking for and reading a 57.2 MB artifact and 119-121 ms parsing it, against a capture of 0.28-0.39 s. Neither
step touches the GPU, so both are measured here on any machine, with an artifact of the same shape made up:
``--images`` kernel images of random bytes, ``--mib`` MiB in all; ``--graphs`` graphs of ``--nodes`` kernel nodes
each (``--buffer-share`` of them launched with one argument buffer of ``--buffer-bytes``, as cuBLAS launches its
GEMMs, the others laid out parameter by parameter, 6-90 parameters as torch's elementwise and reduction kernels
have), a chain of edges.

    python benchmarks/graph_artifact_cpu.py --processes 5 --json out.json

publishes that artifact to a keeper of its own (a temporary socket directory) and then, in each of ``--processes``
fresh processes, times the restore's own code: :func:`weightcache.torch_graphs.fetch_bundle` (the artifact asked
for and mapped; then parsed, every field checked). Medians over the processes are printed. ``--tree`` runs another
checkout's code instead, or beside it: ``--tree /path/to/old --tree .`` compares two, their processes alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import weightcache as wc
from weightcache.artifact_key import ArtifactKey
from weightcache.graphs.bundle import GraphBundle, GraphRecord, Output
from weightcache.graphs.check import AddressRange
from weightcache.graphs.description import Edge, GraphDescription, KernelNode

WEIGHTS = "ab" * 32
ARENA = AddressRange("arena", 0x7F0000000000, 64 << 30)
HOME = AddressRange("weights/0", 0x5A0000000000, 4 << 30)


def synthetic_bundle(
    graphs: int, nodes: int, images: int, mib: float, buffer_share: float, buffer_bytes: int, seed: int = 0
) -> GraphBundle:
    """A bundle of the shape the module's text says: random, but the same for the same arguments."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 100) for _ in range(images)]
    scale = mib * 2**20 / sum(sizes)
    blobs = [rng.randbytes(max(64, int(s * scale))) for s in sizes]
    import hashlib

    digests = [hashlib.sha256(b).hexdigest() for b in blobs]
    records = []
    for g in range(graphs):
        start = ARENA.base + g * (64 << 20)
        kernel_nodes = []
        kernels: dict[str, str] = {}
        for n in range(nodes):
            name = f"_ZN2at6native{rng.randint(0, 40)}kernel_{n % 37}Ev"
            kernels[name] = digests[hash(name) % images]
            pointers = [rng.choice((ARENA, HOME)) for _ in range(3)]
            words = [p.base + rng.randrange(0, 1 << 26) * 16 for p in pointers]
            if rng.random() < buffer_share:
                body = b"".join(w.to_bytes(8, "little") for w in words)
                body += rng.randbytes(buffer_bytes - len(body))
                kernel_nodes.append(
                    KernelNode(name, (rng.randint(1, 512), 1, 1), (128, 1, 1), 0, body, (), "buffer", ((4, bytes(64)),))
                )
            else:
                count = rng.randint(6, 90)
                layout, at, body = [], 0, b""
                for i in range(count):
                    if i < len(words):
                        layout.append((at, 8))
                        body += words[i].to_bytes(8, "little")
                        at += 8
                    else:
                        layout.append((at, 4))
                        body += rng.randrange(0, 1 << 20).to_bytes(4, "little")
                        at += 4
                body += bytes(-len(body) % 8)
                grid = (rng.randint(1, 4096), 1, 1)
                kernel_nodes.append(KernelNode(name, grid, (256, 1, 1), 0, body, tuple(layout), "params"))
        edges = tuple(Edge(i, i + 1) for i in range(nodes - 1))
        description = GraphDescription(tuple(kernel_nodes), edges)
        output = Output(start + 4096, "bfloat16", (8, 2048), (2048, 1))
        reach = {ARENA.name: (g + 1) * (64 << 20), HOME.name: 1 << 30}
        records.append(GraphRecord(f"batch-{2**g}", start, start + (64 << 20), description, (output,), kernels, reach))
    return GraphBundle((ARENA, HOME), tuple(records), dict(zip(digests, blobs, strict=True)))


def key(tree: int) -> ArtifactKey:
    return ArtifactKey("cuda.graphs", {"bench": "graph_artifact_cpu", "tree": tree})


def publish(socket_dir: str, tree: int, shape: dict[str, float]) -> int:
    """Publish the synthetic bundle as this tree's code writes it; its size in bytes."""
    bundle = synthetic_bundle(
        int(shape["graphs"]),
        int(shape["nodes"]),
        int(shape["images"]),
        shape["mib"],
        shape["buffer_share"],
        int(shape["buffer_bytes"]),
    )
    blob = bundle.to_bytes()
    wc.Cache(socket_dir).put_artifact(WEIGHTS, key(tree), blob).close()
    return len(blob)


def measure(socket_dir: str, tree: int) -> dict[str, float]:
    """One fresh process's restore steps, as this tree's code takes them."""
    cache = wc.Cache(socket_dir)
    try:
        from weightcache.torch_graphs import fetch_bundle
    except ImportError:  # a tree from before fetch_bundle (2026-12-04): the steps its GraphCache took to load, inline
        import time

        began = time.perf_counter()
        found = cache.open_artifact(WEIGHTS, key(tree))
        assert found is not None
        blob = found.read()
        found.close()
        assert blob is not None
        read = time.perf_counter()
        bundle = GraphBundle.from_bytes(blob, hashed=True)  # type: ignore[call-arg]
        return {"artifact": read - began, "parse": time.perf_counter() - read, "graphs": len(bundle.graphs)}
    import time
    from concurrent.futures import ThreadPoolExecutor

    from weightcache.graphs.bundle import image_matches

    fetched = fetch_bundle(cache, WEIGHTS, key(tree))
    assert not isinstance(fetched, str), fetched
    # What a restore's loading threads do before each module load (the whole blob's hash, before: in "artifact").
    images = fetched.bundle.images
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(8, len(images))) as pool:
        assert all(pool.map(lambda item: image_matches(*item), images.items()))
    checked = time.perf_counter() - began
    return {**fetched.phases, "images": checked, "graphs": len(fetched.bundle.graphs)}


def _run(tree: Path, *argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True, env=env)
    return out.stdout.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--graphs", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=240)
    parser.add_argument("--images", type=int, default=18)
    parser.add_argument("--mib", type=float, default=54.6)
    parser.add_argument("--buffer-share", type=float, default=0.3)
    parser.add_argument("--buffer-bytes", type=int, default=1024)
    parser.add_argument(
        "--tree",
        type=Path,
        action="append",
        help="a checkout of weightcache whose code publishes and restores (repeat to compare trees side by side, "
        "their processes alternating); default: the one this script belongs to",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--publish", nargs=3, help=argparse.SUPPRESS)  # socket dir, tree index, shape JSON
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # socket dir, tree index
    args = parser.parse_args()
    if args.publish:
        print(publish(args.publish[0], int(args.publish[1]), json.loads(args.publish[2])))
        return 0
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
        return 0
    trees = [t.resolve() for t in args.tree or [Path(__file__).resolve().parent.parent]]
    shape = {k: getattr(args, k) for k in ("graphs", "nodes", "images", "mib", "buffer_share", "buffer_bytes")}
    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    socket_dir = str(base / "s")
    cache = wc.Cache(socket_dir, spawn=True)
    runs: dict[int, list[dict[str, float]]] = {i: [] for i in range(len(trees))}
    try:
        sizes = [int(_run(tree, "--publish", socket_dir, str(i), json.dumps(shape))) for i, tree in enumerate(trees)]
        for _ in range(args.processes):
            for i, tree in enumerate(trees):
                runs[i].append(json.loads(_run(tree, "--measure", socket_dir, str(i))))
    finally:
        cache.stop(wait=30)
    report = []
    for i, tree in enumerate(trees):
        medians = {k: statistics.median(r.get(k, 0.0) for r in runs[i]) for k in ("artifact", "parse", "images")}
        print(
            f"{tree}: artifact {sizes[i] / 1e6:.1f} MB ({args.graphs} graphs x {args.nodes} nodes, {args.images} "
            f"images), {args.processes} fresh processes: asked for and read {medians['artifact'] * 1e3:.1f} ms, "
            f"parsed {medians['parse'] * 1e3:.1f} ms, images checked apart {medians['images'] * 1e3:.1f} ms "
            "(medians; runs "
            f"{[round(r['artifact'] * 1e3, 1) for r in runs[i]]}, {[round(r['parse'] * 1e3, 1) for r in runs[i]]} ms)"
        )
        report.append({"tree": str(tree), "bytes": sizes[i], "runs": runs[i], "medians": medians})
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "processes": args.processes, "trees": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
