"""The ``weightcache`` command: serve | load | ls | inspect | evict | stop | parity | doctor | bench, and the warm
process's run | warm (:mod:`weightcache.tools.cli_warm`).

Argument parsing and the commands; each command translates its arguments into calls of the library's public
API (``weightcache.attach``/``preload``/``Cache``, :class:`weightcache.client.KeeperConnection` for the keeper
commands) or of the other tools (doctor, bench, engine parity).

Keeper commands (serve, ls, inspect, evict, stop) do not import torch, so they answer in milliseconds. So a
command imports at its start what only it needs: torch (load, through ``wc.preload``; bench; doctor's GPU
checks), the keeper's server (serve), and the keeper client with filelock, which ``serve`` has no use for
(~20-60 ms of every keeper start).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pwd
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

import weightcache as wc
from weightcache.artifact_key import artifact_matches
from weightcache.budget import parse_budget
from weightcache.messages import EVERY_ENTRY, LEASED, NOT_FOUND, ArtifactInfo, EntryInfo
from weightcache.parity import compare, read_table
from weightcache.rundir import resolve_group
from weightcache.units import format_age, format_bytes

from . import cli_warm
from .engine_parity import engine_parity

if TYPE_CHECKING:
    from weightcache.client import KeeperConnection


#: What a terminal would act on instead of showing: C0 and C1 controls, DEL, bidi overrides and isolates, and
#: lone surrogates (which no encoding can write).
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNPRINTABLE_BUT_NEWLINES = re.compile(
    r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def printable(text: object, *, newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on escaped (``\x1b``, ``\u202e``, ``\udc80``): what
    the CLI prints of anything it did not write itself (entries are published by other users of a shared keeper).
    ``newlines``: keep line breaks (for messages of several lines)."""
    pattern = _UNPRINTABLE_BUT_NEWLINES if newlines else _UNPRINTABLE
    return pattern.sub(_escape, str(text))


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _connect(args: argparse.Namespace) -> KeeperConnection:
    from weightcache.client import KeeperConnection  # filelock, which it imports: serve does without

    return KeeperConnection.connect(args.socket_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    from weightcache import keeper  # the server: only this command runs it

    try:
        budget = parse_budget(args.max_bytes, args.max_fraction)
    except (ValueError, OSError) as exc:
        raise wc.WeightCacheError(f"bad budget: {exc}") from exc
    try:
        group = None if args.allow_group is None else resolve_group(args.allow_group)
    except ValueError as exc:
        raise wc.WeightCacheError(f"--allow-group: {exc}") from exc
    try:
        limits = keeper.Limits(args.max_connections, args.idle_timeout, args.member_share)
    except ValueError as exc:
        raise wc.WeightCacheError(f"bad limit: {exc}") from exc
    if args.detach:
        keeper.detach_and_serve(args.socket_dir, args.ready_fd, budget, group, limits)
        _say_detached(args.socket_dir)
        return 0
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
    )
    keeper.serve(args.socket_dir, ready_fd=args.ready_fd, budget=budget, allow_group=group, limits=limits)
    return 0


def _say_detached(socket_dir: str | None) -> None:
    """What ``serve --detach`` started: the keeper's pid (from its instance lock, which it holds while it serves),
    its socket and its log."""
    from weightcache.rundir import INSTANCE_LOCK_NAME, LOG_NAME, SOCKET_NAME, resolve_socket_dir

    directory = resolve_socket_dir(socket_dir)
    try:
        pid = (directory / INSTANCE_LOCK_NAME).read_text().strip() or "?"
    except OSError:
        pid = "?"
    print(
        f"keeper pid {pid} serving {directory / SOCKET_NAME} (log {directory / LOG_NAME}); `weightcache stop` stops it"
    )


def cmd_ls(args: argparse.Namespace) -> int:
    try:
        conn = _connect(args)
    except wc.KeeperUnavailable as exc:
        if not args.json:
            raise
        print(json.dumps({"keeper": None, "entries": [], "error": str(exc)}, indent=2))  # a script still gets JSON
        return 1
    with conn:
        reply = conn.list()
        listed = conn.list_artifacts()
    if args.json:
        out = {"keeper": reply.keeper.to_json(), "entries": [e.to_json() for e in reply.entries]}
        out["artifacts"] = [a.to_json() for a in listed.artifacts]
        print(json.dumps(out, indent=2))
        return 0
    k = reply.keeper
    print(printable(f"keeper pid {k.pid}  weightcache {k.version}  {k.socket_dir}  up {format_age(k.uptime_s)}"))
    budget = _budget_line(k.budget.default, k.budget.per_placement, k.bytes_by_placement)
    if budget:
        print(printable("budget  " + budget))
    if not reply.entries and not listed.artifacts:
        print("(no entries)")
        return 0
    if reply.entries:
        _print_entries(reply.entries)
    if listed.artifacts:
        print()
        _print_artifacts(listed.artifacts, listed.truncated)
    return 0


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    """Columns padded to their widest cell; every cell escaped (others publish what it shows)."""
    shown = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in shown) for i in range(len(shown[0]))]
    for r in shown:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def artifact_name(a: ArtifactInfo) -> str:
    """``<weights 12>/<key digest 12>`` (``~uid`` for another user's): what ``inspect`` and ``evict`` accept."""
    return f"{a.weights[:12]}/{a.key_digest[:12]}" + "".join(a.key.partition("~")[1:])


#: Fields of a torch.compile key that `ls` shows (the rest: `inspect`).
ARTIFACT_SUMMARY = ("device", "gpu", "isa", "dtype", "torch")


def _print_artifacts(artifacts: Sequence[ArtifactInfo], truncated: bool) -> None:
    now = time.time()
    rows = [("ARTIFACT", "KIND", "KEY", "PUBLISHER", "SIZE", "LEASES", "AGE", "HELD BY (PID SINCE)")]
    for a in artifacts:
        fields = a.artifact_key.fields
        summary = " ".join(f"{name}={fields[name]}" for name in ARTIFACT_SUMMARY if fields.get(name) is not None)
        rows.append(
            (
                artifact_name(a),
                a.kind,
                summary or "-",
                user_name(a.publisher),
                format_bytes(a.bytes),
                str(a.leases),
                format_age(a.age_s),
                ", ".join(f"{pid} {format_age(now - since)}" for pid, since in a.holders) or "-",
            )
        )
    _print_table(rows)
    if truncated:
        print(f"(the {len(artifacts)} most recently used artifacts; the keeper holds more)")


def _print_entries(entries: Sequence[EntryInfo]) -> None:
    now = time.time()
    rows = [("ENTRY", "MODEL", "DEVICE", "PUBLISHER", "SIZE", "TENSORS", "LEASES", "AGE", "HELD BY (PID SINCE)")]
    for e in entries:
        fp = e.fingerprint
        # which shard, along the axes that are split (an engine records every axis it knows, most of size 1)
        model = e.model + "".join(f" {axis} {rank}/{size}" for axis, rank, size in fp.parallel if size > 1)
        model += f" [{fp.dtype}]" if fp.dtype else ""
        if fp.quant not in (None, "none"):
            model += f" {fp.quant}"
        rows.append(
            (
                e.digest[:12] + "".join(e.key.partition("~")[1:]),  # "~uid": another user's publication
                model,
                e.device,
                user_name(e.publisher),
                format_bytes(e.bytes),
                str(e.tensors),
                str(e.leases),
                format_age(e.age_s),
                ", ".join(f"{pid} {format_age(now - since)}" for pid, since in e.holders) or "-",
            )
        )
    _print_table(rows)


def user_name(uid: int) -> str:
    """A uid's user name, or the number where the host has no name for it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _budget_line(default: int | None, per_placement: Mapping[str, int], used: Mapping[str, int]) -> str:
    """``cpu 4.0 KiB of 1.0 MiB, GPU-... 0 B of 60.0 GiB``: each placement with a limit or with entries, against
    its limit (its own, else the bare one), and the bare limit for placements that hold nothing yet."""
    shown = []
    for placement in dict.fromkeys([*per_placement, *used]):
        limit = per_placement.get(placement, default)
        if limit is not None:
            shown.append(f"{placement} {format_bytes(used.get(placement, 0))} of {format_bytes(limit)}")
    if default is not None:
        shown.append(f"{format_bytes(default)} for each other placement" if shown else f"{format_bytes(default)} each")
    return ", ".join(shown)


#: The fingerprint fields `inspect` shows one per line.
INSPECTED = ("dtype", "quant", "quant_config_hash", "transform", "engine", "engine_version", "torch_version")


def _field(fp: wc.Fingerprint, key: str) -> str:
    value = getattr(fp, key)
    if key == "dtype" and value is None:
        return "as-stored"  # as `load` says it: no conversion
    return str(value)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def cmd_inspect(args: argparse.Namespace) -> int:
    with _connect(args) as conn:
        try:
            reply = conn.inspect(args.digest)
        except wc.KeeperError as exc:
            if exc.code != NOT_FOUND or not conn.serves_artifacts:
                raise
            return _inspect_artifact(args, conn.list_artifacts().artifacts, exc)
    entry, manifest = reply.entry, reply.manifest
    if args.json:
        print(json.dumps({"entry": entry.to_json(), "manifest": manifest}, indent=2))
        return 0
    fp = entry.fingerprint
    now = time.time()
    holders = ", ".join(f"pid {pid} since {format_age(now - since)}" for pid, since in entry.holders)
    size = f"{format_bytes(entry.bytes)} in {_count(entry.segments, 'segment')}, {_count(entry.tensors, 'tensor')}"
    fields = [
        ("entry", entry.digest),
        ("model", f"{entry.model}  ({fp.model_path})"),
        ("placement", entry.placement),
        ("size", size),
        ("publisher", f"{user_name(entry.publisher)} (uid {entry.publisher})"),
        ("leases", f"{entry.leases}  {holders}".rstrip()),
        *((key, _field(fp, key)) for key in INSPECTED),
        ("parallel", ", ".join(f"{a} {r}/{s}" for a, r, s in fp.parallel) or "-"),
        *(("file", f"{f.name}  {format_bytes(f.size)}  header {f.header_sha256[:12]}") for f in fp.checkpoint),
    ]
    width = max(len(key) for key, _ in fields) + 2
    for key, value in fields:
        print(f"{key:<{width}}{printable(value)}")
    if args.tensors:
        t = manifest["tensors"]
        for i, name in enumerate(t["name"]):
            line = f"  {name}  {t['dtype'][i]}{t['shape'][i]}  segment {t['segment'][i]} @ {t['offset'][i]}"
            print(printable(line))
    return 0


def _inspect_artifact(args: argparse.Namespace, artifacts: Sequence[ArtifactInfo], miss: wc.KeeperError) -> int:
    """``inspect`` of an artifact: the one ``args.digest`` names (see :func:`artifact_matches`)."""
    found = [a for a in artifacts if artifact_matches(a.key, args.digest)]
    if not found:
        raise wc.KeeperError(
            f"no entry matches {args.digest!r}, nor any artifact; `weightcache ls` lists both", NOT_FOUND
        ) from miss
    if len(found) > 1:
        names = ", ".join(artifact_name(a) for a in found[:8])
        raise wc.KeeperError(f"{args.digest!r} matches {len(found)} artifacts ({names}); give more of it", "ambiguous")
    a = found[0]
    if args.json:
        print(json.dumps({"artifact": a.to_json()}, indent=2))
        return 0
    now = time.time()
    holders = ", ".join(f"pid {pid} since {format_age(now - since)}" for pid, since in a.holders)
    rows = [
        ("artifact", a.key),
        ("kind", a.kind),
        ("weights", a.weights),
        ("size", format_bytes(a.bytes)),
        ("sha256", a.sha256),
        ("publisher", f"{user_name(a.publisher)} (uid {a.publisher})"),
        ("leases", f"{a.leases}  {holders}".rstrip()),
        ("age", format_age(a.age_s)),
        *((f"key.{name}", json.dumps(value)) for name, value in sorted(a.artifact_key.fields.items())),
    ]
    shown = [(printable(key), printable(value)) for key, value in rows]  # a key's field names are the publisher's
    width = max(len(key) for key, _ in shown) + 2
    for key, value in shown:
        print(f"{key:<{width}}{value}")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    if bool(args.digest) == bool(args.all):
        found = f"both {args.digest!r} and --all" if args.all else "neither"
        print(f"weightcache evict: give a digest (prefix) or --all; found {found}", file=sys.stderr)
        return 2
    with _connect(args) as conn:
        if args.all and not args.force:
            return _evict_unleased(conn)
        try:
            reply = conn.evict(EVERY_ENTRY if args.all else args.digest, force=args.force, every=args.all)
        except wc.KeeperError as exc:
            if exc.code != LEASED:
                raise
            leased: list[EntryInfo | ArtifactInfo] = [
                a for a in conn.list_artifacts().artifacts if artifact_matches(a.key, args.digest) and a.leases
            ]
            try:
                leased.insert(0, conn.inspect(args.digest).entry)
            except wc.KeeperError:
                pass  # the prefix names artifacts only
            _print_kept(leased)
            return 1
    for key in reply.evicted:
        print(printable(f"evicted {key}"))
    if not reply.evicted:  # only --all evicts nothing without an error: every entry of none
        print("nothing to evict")
    return 0


def _evict_unleased(conn: KeeperConnection) -> int:
    """``evict --all`` without ``--force``: every entry nobody leases, one by one; the leased ones are named."""
    kept: list[EntryInfo | ArtifactInfo] = []
    evicted = 0
    for entry in conn.list().entries:
        if entry.leases:
            kept.append(entry)
            continue
        try:
            for key in conn.evict(entry.key).evicted:
                print(printable(f"evicted {key}"))
                evicted += 1
        except wc.KeeperError as exc:
            if exc.code == LEASED:  # leased since the listing
                kept.append(conn.inspect(entry.key).entry)
            elif exc.code != NOT_FOUND:  # evicted since the listing: fine
                raise
    for artifact in conn.list_artifacts().artifacts:
        if artifact.leases:
            kept.append(artifact)
            continue
        try:
            for key in conn.evict(artifact.key).evicted:
                print(f"evicted {key}")
                evicted += 1
        except wc.KeeperError as exc:
            if exc.code not in (LEASED, NOT_FOUND):
                raise
    if not evicted and not kept:
        print("nothing to evict")
    _print_kept(kept)
    return 1 if kept else 0


def _print_kept(entries: Sequence[EntryInfo | ArtifactInfo]) -> None:
    for e in entries:
        pids = ", ".join(str(pid) for pid, _ in e.holders) or "?"
        one = len(e.holders) <= 1
        print(
            f"weightcache evict: kept {printable(e.key)}: leased by pid {pids} (an engine uses it); --force evicts it "
            f"too (its memory stays mapped in {'that process' if one else 'those processes'} until "
            f"{'it lets' if one else 'they let'} go)",
            file=sys.stderr,
        )


def cmd_stop(args: argparse.Namespace) -> int:
    from weightcache.client import stop_keeper

    try:
        conn = _connect(args)
    except wc.KeeperUnavailable as exc:
        print(f"weightcache stop: no keeper to stop: {exc}", file=sys.stderr)
        return 1
    pid = stop_keeper(
        conn,
        wait=args.timeout if args.wait else None,
        stopping=lambda pid: print(f"keeper pid {pid} stopping", flush=True),
    )
    if args.wait:
        print(f"keeper pid {pid} stopped")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    try:
        quant_config = json.loads(args.quant_config) if args.quant_config else None
    except ValueError as exc:
        raise wc.WeightCacheError(f"bad argument: --quant-config is not JSON: {exc}") from exc
    t0 = time.perf_counter()
    if args.engine == "transformers":
        handle = _load_transformers(args, quant_config)
    else:
        handle = wc.preload(  # imports torch
            args.checkpoint,
            device=args.device,
            dtype=args.dtype,
            quant=args.quant,
            quant_config=quant_config,
            socket_dir=args.socket_dir,
            progress=None,
            digests=not args.no_digests,
            max_segment_bytes=args.max_segment_bytes,
        )
    seconds = time.perf_counter() - t0
    fp = handle.fingerprint
    size, count = handle.nbytes, len(handle.tensors)
    handle.close()
    if not handle.read_disk:
        print(printable(f"already cached: {fp.digest[:12]}  {fp.describe()}"))
        return 0
    print(printable(f"published {fp.digest[:12]}  {fp.describe()}"))
    print(f"  {count} tensors, {format_bytes(size)} in {seconds:.2f} s")
    for key in handle.evicted:  # the keeper's budget made room: say so here, not only in its log
        print(printable(f"  evicted {key} (unleased, least recently used) to make room under the keeper's budget"))
    return 0


def _load_transformers(args: argparse.Namespace, quant_config: object) -> wc.Handle:
    """``load --engine transformers``: the entry of a transformers model built from the checkpoint's config.json
    (:func:`weightcache.backends.transformers.preload`)."""
    if args.quant != "none" or quant_config is not None:
        raise wc.WeightCacheError(
            "--engine transformers takes the quantization from the checkpoint's config.json (quantization_config); "
            "leave out --quant and --quant-config"
        )
    try:
        import transformers  # noqa: F401 (only whether it is there)
    except ImportError as exc:
        raise wc.EngineNotInstalled(
            f"--engine transformers needs the transformers package ({exc}); install it with "
            "`pip install 'weightcache[transformers]'`, or load without --engine for a plain module"
        ) from None
    from weightcache.backends.transformers import preload

    return preload(
        args.checkpoint,
        device=args.device,
        dtype=args.dtype,
        socket_dir=args.socket_dir,
        progress=None,
        digests=not args.no_digests,
        max_segment_bytes=args.max_segment_bytes,
    )


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
    prompt = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else None
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcache", description="Keep post-processed model weights resident; attach them in milliseconds."
    )
    parser.add_argument("--version", action="version", version=f"weightcache {wc.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument(
            "--socket-dir",
            default=None,
            help="the keeper's socket directory (default: $WEIGHTCACHE_DIR, else $XDG_RUNTIME_DIR/weightcache, else "
            "/tmp/weightcache-<uid>)",
        )
        return p

    p = add("serve", "run the keeper in the foreground (or --detach)")
    p.add_argument("--detach", action="store_true", help="fork into the background, log to keeper.log")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--max-bytes",
        action="append",
        metavar="[PLACEMENT=]SIZE",
        help="memory budget, e.g. 40G (every placement) or cpu=8G, GPU-<uuid>=60G (one placement; repeatable): "
        "a publish beyond it evicts unleased entries, least recently used first, or is refused",
    )
    p.add_argument(
        "--max-fraction", type=float, default=None, metavar="F", help="CPU budget as a fraction of host memory"
    )
    p.add_argument(
        "--allow-group",
        default=None,
        metavar="GROUP",
        help="also serve members of GROUP (name or gid): the socket directory becomes group GROUP, mode 2750, the "
        "socket 0660; members may publish, get, list and inspect, not evict or stop",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="most client connections at once (default 1024, or a quarter of the open-file limit if lower)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="drop a connection that holds no lease after this long without a request (default 30)",
    )
    p.add_argument(
        "--member-share",
        type=float,
        default=0.25,
        metavar="F",
        help="with --allow-group: the fraction of each keeper-wide resource (connections, segment fds, bytes and "
        "fds in flight, unread replies) one member uid may hold; all members together hold at most 1-F, so F stays "
        "for the owner (default 0.25, at most 0.5)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=cmd_serve)

    p = add(
        "load",
        "load a checkpoint from disk and publish it into the keeper (starting one if needed): as a plain module's "
        "weights (the checkpoint's tensors, what weightcache.attach of a plain nn.Module attaches), or with "
        "--engine transformers as a Hugging Face transformers model's. vLLM and SGLang entries hold their own "
        "post-processed weights: the engine's first start in mode daemon publishes them, not this command",
    )
    p.add_argument("checkpoint", help="directory of .safetensors files (or one file)")
    p.add_argument(
        "--engine",
        choices=["torch", "transformers"],
        default="torch",
        help="whose entry to make: torch (default: a plain nn.Module's) or transformers (the model "
        "AutoModelForCausalLM.from_config builds from the checkpoint's config.json on meta, in --dtype or the "
        "config's dtype, loaded by transformers' from_pretrained)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    p.add_argument(
        "--dtype", default=None, help="convert floating point weights, e.g. bfloat16 or bf16 (default: as stored)"
    )
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
    p.add_argument("--json", action="store_true", help="the entry and its full manifest as JSON")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.set_defaults(func=cmd_inspect)

    p = add("evict", "drop entries from the keeper (leased ones only with --force)")
    p.add_argument("digest", nargs="?", help="entry digest or a unique prefix of it")
    p.add_argument("--all", action="store_true", help="every entry")
    p.add_argument("--force", action="store_true", help="also entries that clients hold leases on")
    p.set_defaults(func=cmd_evict)

    p = add("stop", "stop the keeper (attached clients keep working)")
    p.add_argument(
        "--wait",
        action="store_true",
        help="return once the keeper process has exited (it has then written everything it writes into its socket "
        "directory): exit status 1 if it still runs after --timeout",
    )
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="with --wait: how long (default 30)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser(
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

    # No --socket-dir: the benchmark always runs a private keeper in a temporary directory.
    bench_help = "measure attach time and its flatness in size on synthetic weights; --restart: a whole engine restart"
    p = sub.add_parser("bench", help=bench_help, description=bench_help + " (see docs/benchmarks.md)")
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
    cli_warm.add_commands(add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. Output closed early (``weightcache ls | head -0``): status 141, as a
    process killed by SIGPIPE, and nothing printed about it."""
    for stream in (sys.stdout, sys.stderr):  # never a UnicodeEncodeError, whatever a string holds
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    try:
        try:
            result: int = args.func(args)
        except wc.WeightCacheError as exc:
            print(f"weightcache {args.command}: {printable(exc, newlines=True)}", file=sys.stderr)
            result = 1
        except KeyboardInterrupt:
            print(f"weightcache {args.command}: interrupted", file=sys.stderr)
            result = 130
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] != "torch":
                raise
            print(
                f"weightcache {args.command}: needs torch, which is not installed here (only the keeper's commands "
                "serve, ls, inspect, evict, stop, doctor and the warm commands run without it): pip install torch",
                file=sys.stderr,
            )
            result = 1
        sys.stdout.flush()
        return result
    except BrokenPipeError:
        # Whoever read our output stopped: point stdout at /dev/null so that the flush at exit is quiet too.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 141
