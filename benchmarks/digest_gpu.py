"""Hashing a GPU checkpoint: weightcache's content digests against the first version's way of reading the bytes.

A publish on a GPU records SHA-256 of every tensor (weightcache.digests). The first version copied each 32 MiB
chunk with ``.cpu()`` (a new pageable buffer per chunk, a synchronous copy on the default stream) from eight
threads; the current one copies into two pinned buffers per call on a side stream and hashes one chunk while the
next is copied. This times both over the tensors of a Llama-3-8B as SGLang holds them (bf16, fused qkv and
gate_up; ~15 GiB), in each of ``--processes`` fresh processes, both ways in alternating order, and checks that
both give the same digests. Prints one JSON line per process and a summary with medians.

    python benchmarks/digest_gpu.py [--processes 3] [--layers 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HIDDEN, INTERMEDIATE, VOCAB, KV = 4096, 14336, 128256, 1024


def shapes(layers: int) -> list[tuple[int, ...]]:
    qkv, gate_up = (HIDDEN + 2 * KV, HIDDEN), (2 * INTERMEDIATE, HIDDEN)
    layer: list[tuple[int, ...]] = [qkv, (HIDDEN, HIDDEN), gate_up, (HIDDEN, INTERMEDIATE), (HIDDEN,), (HIDDEN,)]
    return [(VOCAB, HIDDEN), *layer * layers, (HIDDEN,), (VOCAB, HIDDEN)]


def one_process(layers: int, first: str) -> dict[str, object]:
    import torch

    from weightcache.digests import CHUNK_BYTES, MAX_THREADS, content_digests
    from weightcache.segments import dense_bytes

    def pageable(t: torch.Tensor) -> str:  # the first version's content_digest for a device tensor
        data = dense_bytes(t)
        digest = hashlib.sha256()
        for start in range(0, data.numel(), CHUNK_BYTES):
            digest.update(data[start : start + CHUNK_BYTES].cpu().numpy().data)
        return digest.hexdigest()

    def first_version(tensors: list[torch.Tensor]) -> list[str]:
        with ThreadPoolExecutor(max_workers=min(MAX_THREADS, os.cpu_count() or 1)) as pool:
            return list(pool.map(pageable, tensors))

    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) for s in shapes(layers)]
    torch.cuda.synchronize()
    ways = {"pinned_side_stream": content_digests, "pageable_default_stream": first_version}
    order = [first, *(w for w in ways if w != first)]
    seconds: dict[str, float] = {}
    digests: dict[str, list[str]] = {}
    for way in order:
        start = time.perf_counter()
        digests[way] = ways[way](tensors)
        seconds[way] = round(time.perf_counter() - start, 3)
    gib = sum(t.numel() * t.element_size() for t in tensors) / 2**30
    return {
        "order": order,
        "gib": round(gib, 2),
        "tensors": len(tensors),
        "seconds": seconds,
        "gib_per_s": {w: round(gib / s, 2) for w, s in seconds.items()},
        "same_digests": digests["pinned_side_stream"] == digests["pageable_default_stream"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.layers, args.child)), flush=True)
        return 0
    rows = []
    for i in range(args.processes):
        first = "pinned_side_stream" if i % 2 == 0 else "pageable_default_stream"
        cmd = [sys.executable, __file__, "--layers", str(args.layers), "--child", first]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    ways = list(rows[0]["seconds"])
    summary = {
        "processes": len(rows),
        "gib": rows[0]["gib"],
        "median_seconds": {w: statistics.median(r["seconds"][w] for r in rows) for w in ways},
        "same_digests": all(r["same_digests"] for r in rows),
    }
    print(json.dumps({"summary": summary}), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0 if summary["same_digests"] else 1


if __name__ == "__main__":
    sys.exit(main())
