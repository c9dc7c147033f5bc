"""The ``weightcache`` command: serve | load | ls | inspect | evict | stop | parity | bench.

Keeper commands (serve, ls, inspect, evict, stop) do not import torch, so they answer in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._version import __version__
from .errors import KeeperError, WeightCacheError


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def _human_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _connect(args: argparse.Namespace) -> Any:
    from .client import KeeperConnection

    return KeeperConnection.connect(args.socket_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    from . import keeper

    if args.detach:
        keeper.detach_and_serve(args.socket_dir, args.ready_fd)
        return 0
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
    )
    keeper.serve(args.socket_dir, ready_fd=args.ready_fd)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _connect(args) as conn:
        reply, _ = conn.request({"op": "list"})
    if args.json:
        print(json.dumps({"keeper": reply["keeper"], "entries": reply["entries"]}, indent=2))
        return 0
    k = reply["keeper"]
    print(f"keeper pid {k['pid']}  weightcache {k['version']}  {k['socket_dir']}  up {_human_age(k['uptime_s'])}")
    entries = reply["entries"]
    if not entries:
        print("(no entries)")
        return 0
    rows = [("ENTRY", "MODEL", "DEVICE", "SIZE", "TENSORS", "LEASES", "AGE")]
    for e in entries:
        fp = e["fingerprint"]
        model = e["model"] + (f" [{fp['dtype']}]" if fp.get("dtype") else "")
        if fp.get("quant") not in (None, "none"):
            model += f" {fp['quant']}"
        rows.append(
            (
                e["digest"][:12],
                model,
                e["device"],
                _human_bytes(e["bytes"]),
                str(e["tensors"]),
                str(e["leases"]),
                _human_age(e["age_s"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    with _connect(args) as conn:
        reply, _ = conn.request({"op": "inspect", "digest": args.digest})
    entry, manifest = reply["entry"], reply["manifest"]
    if args.json:
        print(json.dumps({"entry": entry, "manifest": manifest}, indent=2))
        return 0
    fp = entry["fingerprint"]
    print(f"entry      {entry['digest']}")
    print(f"model      {entry['model']}  ({fp['model_path']})")
    print(f"placement  {entry['placement']}")
    print(f"size       {_human_bytes(entry['bytes'])} in {entry['segments']} segments, {entry['tensors']} tensors")
    print(f"leases     {entry['leases']}  " + " ".join(f"pid {h['pid']}" for h in entry["holders"]))
    for key in ("dtype", "quant", "quant_config_hash", "transform", "engine", "engine_version", "torch_version"):
        print(f"{key:<10} {fp.get(key)}")
    print("parallel   " + (", ".join(f"{a} {r}/{s}" for a, r, s in fp["parallel"]) or "-"))
    for f in fp["checkpoint"]:
        print(f"file       {f['name']}  {_human_bytes(f['size'])}  header {f['header_sha256'][:12]}")
    if args.tensors:
        t = manifest["tensors"]
        for i, name in enumerate(t["name"]):
            print(f"  {name}  {t['dtype'][i]}{t['shape'][i]}  segment {t['segment'][i]} @ {t['offset'][i]}")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    if not args.digest and not args.all:
        print("weightcache evict: give a digest (prefix) or --all", file=sys.stderr)
        return 2
    with _connect(args) as conn:
        request = {"op": "evict", "digest": "*" if args.all else args.digest, "force": args.force, "all": args.all}
        try:
            reply, _ = conn.request(request)
        except KeeperError as exc:
            if exc.code == "not_found" and args.all:
                print("nothing to evict")
                return 0
            raise
    for key in reply["evicted"]:
        print(f"evicted {key}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from .errors import KeeperUnavailable

    try:
        conn = _connect(args)
    except KeeperUnavailable as exc:
        print(f"no keeper to stop: {exc}", file=sys.stderr)
        return 1
    with conn:
        reply, _ = conn.request({"op": "stop"})
    print(f"keeper pid {reply['pid']} stopping")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from .cache import Cache
    from .checkpoint import load_state_dict
    from .fingerprint import Fingerprint, resolve_dtype

    try:
        quant_config = json.loads(args.quant_config) if args.quant_config else None
        dtype = resolve_dtype(args.dtype)
    except ValueError as exc:
        raise WeightCacheError(f"bad argument: {exc}") from exc
    fp = Fingerprint.create(
        args.checkpoint, dtype=args.dtype, quant=args.quant, quant_config=quant_config, device=args.device
    )
    from . import quant

    quant.get(args.quant).check(quant_config)
    cache = Cache(args.socket_dir, spawn=True)
    handle = cache.get(fp)
    if handle is not None:
        handle.close()
        print(f"already cached: {fp.digest[:12]}  {fp.describe()}")
        return 0
    t0 = time.perf_counter()
    state = load_state_dict(args.checkpoint, dtype=dtype, progress=sys.stderr.isatty())
    t1 = time.perf_counter()
    handle = cache.put(
        fp, state, digests=False if args.no_digests else None, max_segment_bytes=args.max_segment_bytes, consume=True
    )
    t2 = time.perf_counter()
    assert handle.manifest is not None
    size = handle.manifest.total_bytes
    handle.close()
    print(
        f"published {fp.digest[:12]}  {fp.describe()}\n"
        f"  {len(handle.tensors)} tensors, {_human_bytes(size)}: read {t1 - t0:.2f} s, publish {t2 - t1:.2f} s"
    )
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    from .parity import compare, read_table

    left, right = read_table(args.left), read_table(args.right)
    differences = compare(left, right)
    if args.json:
        print(json.dumps({"tensors": len(left), "identical": not differences, "differences": differences}, indent=2))
    elif differences:
        print(f"{len(differences)} differences between {args.left} and {args.right}:")
        for line in differences[: args.limit]:
            print(f"  {line}")
        if len(differences) > args.limit:
            print(f"  ... and {len(differences) - args.limit} more (--limit)")
    else:
        print(f"identical: {len(left)} tensors (name, shape, dtype, stride, kind, bytes)")
    return 1 if differences else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcache", description="Keep post-processed model weights resident; attach them in milliseconds."
    )
    parser.add_argument("--version", action="version", version=f"weightcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--socket-dir", default=None, help="keeper socket directory (default: $WEIGHTCACHE_DIR, ...)")
        return p

    p = add("serve", "run the keeper in the foreground (or --detach)")
    p.add_argument("--detach", action="store_true", help="fork into the background, log to keeper.log")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_serve)

    p = add("load", "load a checkpoint from disk and publish it into the keeper (starting one if needed)")
    p.add_argument("checkpoint", help="directory of .safetensors files (or one file)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    p.add_argument("--dtype", default=None, help="convert floating point weights, e.g. bfloat16")
    p.add_argument("--quant", default="none", help="quantization method of the weights (default none)")
    p.add_argument("--quant-config", default=None, help="the method's config as JSON")
    p.add_argument("--no-digests", action="store_true", help="skip per-tensor content digests")
    p.add_argument("--max-segment-bytes", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_load)

    p = add("ls", "list the keeper's entries")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_ls)

    p = add("inspect", "show one entry's fingerprint and layout")
    p.add_argument("digest", help="entry digest or a unique prefix of it")
    p.add_argument("--json", action="store_true")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.set_defaults(func=cmd_inspect)

    p = add("evict", "drop entries from the keeper (leased ones only with --force)")
    p.add_argument("digest", nargs="?", help="entry digest or a unique prefix of it")
    p.add_argument("--all", action="store_true", help="every entry")
    p.add_argument("--force", action="store_true", help="also entries that clients hold leases on")
    p.set_defaults(func=cmd_evict)

    p = add("stop", "stop the keeper (attached clients keep working)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser(
        "parity",
        help="diff two tensor tables (a disk-loaded and a cache-attached model), tensor by tensor",
        description="Diff two tensor tables written by weightcache.parity.write_table(): name, shape, dtype, "
        "stride, kind and SHA-256 of the bytes. Exit status 0: identical; 1: they differ.",
    )
    p.add_argument("left", help="table of the disk-loaded model (JSON)")
    p.add_argument("right", help="table of the cache-attached model (JSON)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=40, help="differences to list (default 40)")
    p.set_defaults(func=cmd_parity)

    p = add("bench", "measure attach time (see docs/benchmarks.md)")
    from .bench import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except WeightCacheError as exc:
        print(f"weightcache {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
