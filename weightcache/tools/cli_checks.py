"""The CLI's checking commands: ``parity`` (does a cache-attached model equal the disk-loaded one?) and
``doctor`` (is the environment fit to run weightcache?).

Layer L5 (tools): they call the other tools (:mod:`~weightcache.tools.engine_parity`,
:mod:`~weightcache.tools.doctor`) and the library's public API. Import torch only when a command runs, never with
the module.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from typing import Any

import attrs

import weightcache as wc
from weightcache.parity import compare, read_table

from .engine_parity import engine_parity


def cmd_parity(args: argparse.Namespace) -> int:
    if args.engine:
        return _engine_parity(args)
    if len(args.tables) != 2:
        raise wc.WeightCacheError("parity needs two tables (LEFT RIGHT), or --engine ENGINE --model MODEL")
    left, right = read_table(args.tables[0]), read_table(args.tables[1])
    differences = compare(left, right)
    if args.json:
        print(json.dumps({"tensors": len(left), "identical": not differences, "differences": differences}, indent=2))
    elif differences:
        print(f"{len(differences)} differences between {args.tables[0]} and {args.tables[1]}:")
        _print_limited(differences, args.limit)
    else:
        print(f"identical: {len(left)} tensors (name, shape, dtype, stride, kind, bytes)")
    return 1 if differences else 0


def _print_limited(lines: list[str], limit: int) -> None:
    for line in lines[:limit]:
        print(f"  {line}")
    if len(lines) > limit:
        print(f"  ... and {len(lines) - limit} more (--limit)")


def _engine_parity(args: argparse.Namespace) -> int:
    if args.tables or not args.model:
        raise wc.WeightCacheError("with --engine, give the model with --model and no table files")
    engine_args: dict[str, Any] = {}
    for item in args.engine_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise wc.WeightCacheError(f"--engine-arg takes KEY=VALUE (JSON values, or plain strings); found {item!r}")
        try:
            engine_args[key] = json.loads(value)
        except ValueError:
            engine_args[key] = value
    try:
        prompt = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else None
    except ValueError:
        raise wc.WeightCacheError(
            f"--prompt-ids takes comma-separated token ids, e.g. 1,5,9; found {args.prompt_ids!r}"
        ) from None
    workdir = args.workdir or tempfile.mkdtemp(prefix="weightcache-parity-")
    result = engine_parity(args.engine, args.model, workdir, engine_args=engine_args, prompt=prompt)
    if args.json:
        print(json.dumps({"identical": result.identical, **attrs.asdict(result), "workdir": str(workdir)}, indent=2))
        return 0 if result.identical else 1
    for name, tokens in result.tokens.items():
        print(f"{name:7} greedy tokens {tokens}")
    for name, differences in result.differences.items():
        if differences:
            print(f"{name} vs disk: {len(differences)} differences:")
            _print_limited(differences, args.limit)
        else:
            print(f"{name} vs disk: identical, {result.tensors} tensors (name, shape, dtype, stride, kind, bytes)")
    print(f"{'identical' if result.identical else 'DIFFERENT'}; tables in {workdir}")
    return 0 if result.identical else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor  # imports the segment transports; its GPU checks import torch

    checks = doctor.run(args.socket_dir)
    if args.json:
        print(json.dumps([c.to_json() for c in checks], indent=2))
        return 1 if any(c.status == "fail" for c in checks) else 0
    print(f"weightcache doctor: weightcache {wc.__version__}")
    return doctor.report(checks)


def add_commands(
    add: Callable[[str, str], argparse.ArgumentParser], add_parser: Callable[..., argparse.ArgumentParser]
) -> None:
    """Add ``parity`` (through ``add_parser``, the subparsers' own: no ``--socket-dir``) and ``doctor`` (through
    ``add``, which gives it ``--socket-dir``) to the CLI."""
    p = add_parser(
        "parity",
        help="does a cache-attached model equal the disk-loaded one, tensor by tensor?",
        description="Diff two tensor tables written by weightcache.parity.write_table() (name, shape, dtype, "
        "stride, kind and SHA-256 of the bytes), or, with --engine vllm --model MODEL, run the engine three "
        "times (its own disk load, weightcache daemon, weightcache client in a new process) and compare their "
        "tables and greedy tokens. Exit status 0: identical; 1: they differ.",
    )
    p.add_argument("tables", nargs="*", help="LEFT RIGHT: tables of the disk-loaded and the attached model")
    p.add_argument("--engine", choices=["vllm"], help="drive this engine instead of reading tables")
    p.add_argument("--model", help="with --engine: the model (checkpoint directory or hub name)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --engine: an engine argument, e.g. dtype=bfloat16, quantization=fp8, tensor_parallel_size=2",
    )
    p.add_argument("--prompt-ids", help="with --engine: comma-separated prompt token ids for the greedy run")
    p.add_argument("--workdir", help="with --engine: where the tables and the private keeper go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=40, help="differences to list (default 40)")
    p.set_defaults(func=cmd_parity)

    p = add(
        "doctor",
        "check the environment: platform, memfd and fd passing, the socket directory, the keeper, CUDA VMM on "
        "each GPU, the engines; says what is wrong and what to do (exit status 1 when a check fails)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)
