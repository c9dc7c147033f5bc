"""The CLI's ``bench``: attach time on synthetic weights (:mod:`~weightcache.tools.bench`), a whole engine restart
(``--restart``, :mod:`~weightcache.tools.bench_restart`), or many ranks at once (``--ranks``,
:mod:`~weightcache.tools.bench_ranks`).

Layer L5 (tools). Imports the benchmark it runs (and so torch) only when the command runs, never with the module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import weightcache as wc


def _numbers(text: str | None, kind: type[float] | type[int], option: str) -> list[Any] | None:
    if text is None:
        return None
    try:
        return [kind(item) for item in text.split(",")]
    except ValueError:
        raise wc.WeightCacheError(f"{option} takes comma-separated numbers, e.g. 1,2,8; found {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    sizes = _numbers(args.sizes, float, "--sizes")
    tensors = _numbers(args.tensors, int, "--tensors")
    options: dict[str, Any] = {
        "device": args.device,
        "repeat": args.repeat,
        "dtype": args.dtype,
        "json_out": args.json_out,
    }
    if args.ranks is not None:
        for flag, given in (
            ("--restart", args.restart),
            ("--profile", args.profile),
            ("--drop-caches", args.drop_caches),
            ("--no-peer", args.no_peer),
            ("--real-checkpoint", args.real_checkpoint),
        ):
            if given:
                raise wc.WeightCacheError(
                    f"{flag} does not go with --ranks (the multi-rank benchmark has no such step)"
                )
        from . import bench_ranks  # imports torch

        return bench_ranks.run(
            ranks=_numbers(args.ranks, int, "--ranks") if args.ranks else None,  # "": one per GPU, or 2 on the CPU
            sizes=sizes,
            tensors=tensors,
            segment_gib=args.segment_gib,
            **options,
        )
    if args.restart:
        if args.real_checkpoint:
            raise wc.WeightCacheError(
                "--real-checkpoint does not go with --restart (the restart benchmark attaches a real checkpoint "
                "already)"
            )
        from . import bench_restart  # imports torch

        return bench_restart.run(
            sizes=sizes,  # None: the defaults that fit this machine
            tensors=tensors or bench_restart.DEFAULT_TENSORS,
            workdir=args.workdir,
            keep=args.keep,
            progress=args.progress,
            drop_caches=args.drop_caches,
            **options,
        )
    if args.drop_caches:
        raise wc.WeightCacheError("--drop-caches goes with --restart (only the restart benchmark reads a checkpoint)")
    from . import bench  # imports torch

    return bench.run(
        sizes=sizes,
        tensors=tensors or bench.DEFAULT_TENSORS,
        peer=not args.no_peer,
        profile_dir=args.profile,
        segment_gib=args.segment_gib,
        real_checkpoint=args.real_checkpoint,
        **options,
    )


def add_commands(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``bench`` to the CLI through ``add_parser``, the subparsers' own (no ``--socket-dir``)."""
    # No --socket-dir: the benchmark always runs a private keeper in a temporary directory.
    bench_help = "measure attach time and its flatness in size on synthetic weights; --restart: a whole engine restart"
    p = add_parser("bench", help=bench_help, description=bench_help + " (see docs/benchmarks.md)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated sizes in GiB (default 1,8; with --restart 1,8,32; either: those that fit in memory)",
    )
    p.add_argument("--tensors", default=None, help="comma-separated tensor counts (default 3000)")
    p.add_argument("--repeat", type=int, default=7, help="fresh engine processes per configuration (default 7)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the synthetic weights (default bfloat16)")
    p.add_argument("--json", dest="json_out", default=None, help="write the results to this JSON file")
    p.add_argument(
        "--restart",
        action="store_true",
        help="the restart benchmark: disk and H2D bandwidth, mode off, daemon first start and client attach "
        "on a synthetic checkpoint (default sizes then 1,8,32 and tensors 300,3000)",
    )
    p.add_argument(
        "--ranks",
        nargs="?",
        const="",
        default=None,
        metavar="N,...",
        help="the multi-rank benchmark: N rank processes (each its own CUDA_VISIBLE_DEVICES, GPU rank mod visible "
        "GPUs) attach their tensor-parallel shards from one keeper at once, against one rank alone; then the keeper "
        "is killed and re-fed by the ranks. Comma-separated counts; bare --ranks: one per visible GPU (CPU: 2); "
        "--sizes is then per rank (default 1)",
    )
    p.add_argument("--workdir", default=None, help="--restart: where to write checkpoints (default a temp dir)")
    p.add_argument("--keep", action="store_true", help="--restart: keep the checkpoints")
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="--restart, as root: before each cold load drop the whole machine's page cache (libraries too, as after "
        "a reboot; slows every process on the machine), not only the checkpoint's pages",
    )
    p.add_argument("--progress", action="store_true", help="show progress bars even without a terminal")
    p.add_argument(
        "--no-peer", action="store_true", help="on CUDA, skip the legacy CUDA IPC attach measured side by side"
    )
    p.add_argument("--profile", default=None, metavar="DIR", help="each engine writes a cProfile of its attach here")
    p.add_argument(
        "--segment-gib", type=float, default=None, help="largest segment of the entries (default: GPU 16, CPU 8)"
    )
    p.add_argument(
        "--real-checkpoint",
        action="store_true",
        help="also attach a real safetensors checkpoint of the same layout, as users do, beside the synthetic entry",
    )
    p.set_defaults(func=cmd_bench)
