"""The CLI's commands that look at and drop what the keeper holds: ``ls``, ``inspect`` and ``evict``, for entries
and artifacts alike, and the tables they print.

Layer L5 (tools), on the library's public API. Never imports torch, so they answer in milliseconds; everything
they print of what others published goes through :func:`~weightcache.tools.cli_common.printable`.
"""

from __future__ import annotations

import argparse
import json
import pwd
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import weightcache as wc
from weightcache.artifact_key import artifact_matches
from weightcache.messages import EVERY_ENTRY, LEASED, NOT_FOUND, ArtifactInfo, EntryInfo
from weightcache.units import format_age, format_bytes

from .cli_common import connect, printable

if TYPE_CHECKING:
    from weightcache.client import KeeperConnection


def cmd_ls(args: argparse.Namespace) -> int:
    try:
        conn = connect(args)
    except (wc.KeeperUnavailable, wc.SocketDirError) as exc:  # no keeper, or a socket directory it cannot use
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
    with connect(args) as conn:
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
        raise wc.KeeperError(
            f"ambiguous: {args.digest!r} matches {len(found)} artifacts ({names}); give more of it", "ambiguous"
        )
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
    with connect(args) as conn:
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
                print(printable(f"evicted {key}"))
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


def add_commands(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add ``ls``, ``inspect`` and ``evict`` to the CLI, through its ``add`` (which gives each ``--socket-dir``)."""
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
