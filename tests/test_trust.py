"""Trust between the users of one keeper (``serve --allow-group``): an engine attaches only weights published by
its own uid or by the keeper's owner, unless it names other publishers it trusts; a member's publish never
replaces, shadows or evicts another uid's entry. Real keeper processes, a real second uid (needs root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import hostile
import pytest
import torch
from conftest import serve_detached, start_keeper, terminate_keeper, wait_until
from models import meta_model
from safetensors.torch import load_file

import weightcache as wc
from weightcache import protocol
from weightcache.client import KeeperConnection
from weightcache.fingerprint import Fingerprint

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second uid")

MEMBER_UID, GROUP = 65534, 4242

#: Run as a member of GROUP: ``MEMBER socket_dir fingerprint-json action``. Imports come first: this Python's own
#: files may not be readable by that user.
MEMBER = r"""
import json, os, sys, secrets
import attrs
import torch
import weightcache as wc
import weightcache.cache, weightcache.publish, weightcache.digests, weightcache.views, weightcache.segments.memfd
from weightcache import protocol
from weightcache.client import KeeperConnection
from weightcache.fingerprint import Fingerprint
socket_dir, fingerprint, action = sys.argv[1], Fingerprint.from_json(json.loads(sys.argv[2])), sys.argv[3]
shapes = json.loads(sys.argv[4])
os.setgroups([4242]); os.setgid(65534); os.setuid(65534)
cache = wc.Cache(socket_dir)
try:
    if action == "publish-forged":  # tensors of the member's choosing, under the owner's fingerprint
        state = {name: torch.full(shape, 7.0) for name, shape in shapes.items()}
        handle = cache.put(fingerprint, state)
        print(json.dumps({"key": [e.key for e in cache.entries() if e.publisher == 65534][0]}))
        handle.close()
    elif action in ("publish-deep", "publish-big-extra"):  # the owner's model, with an extra of the member's making
        extra = "[" * 100_000 + "]" * 100_000 if action == "publish-deep" else json.dumps({"x": "a" * (8 << 20)})
        forged = attrs.evolve(fingerprint, extra=extra)  # past the client's own checks: the keeper must refuse it
        cache.put(forged, {name: torch.full(shape, 7.0) for name, shape in shapes.items()}).close()
        print(json.dumps({"published": True}))
    elif action == "hold":  # attach the owner's entry and publish one of its own; keep both across a restart
        cache.respawn = True
        handle = cache.get(fingerprint)
        own = Fingerprint.from_json({**fingerprint.to_json(), "dtype": "float16"})
        mine = cache.put(own, {name: torch.full(shape, 7.0) for name, shape in shapes.items()})
        print(json.dumps({"publisher": handle.publisher, "own": mine.publisher}), flush=True)
        sys.stdin.read()
    elif action == "get":
        handle = cache.get(fingerprint)
        print(json.dumps({"found": handle is not None,
                          "publisher": None if handle is None else handle.publisher}))
except wc.WeightCacheError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


HOSTILE = str(Path(__file__).parent / "hostile.py")


def shapes(checkpoint: Path) -> str:
    """The checkpoint's tensor names and shapes (JSON): what the member forges tensors for."""
    return json.dumps({k: list(v.shape) for k, v in load_file(checkpoint / "model.safetensors").items()})


def as_member(socket_dir: Path, fingerprint: Fingerprint, action: str, checkpoint: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEMBER, str(socket_dir), json.dumps(fingerprint.to_json()), action, shapes(checkpoint)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def start_member(*argv: str) -> tuple[subprocess.Popen[str], dict]:
    """A member process (``python argv...``) that reports one JSON line and then holds what it took until its
    stdin closes; the process and that report (the process's stderr in the failure if it printed none)."""
    process = subprocess.Popen(
        [sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, process.stderr.read() if process.stderr else ""
    report: dict = json.loads(line)
    return process, report


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    os.chmod(base, 0o711)
    yield base / "s"
    shutil.rmtree(base, ignore_errors=True)


def owner_fingerprint(checkpoint: Path, socket_dir: Path) -> Fingerprint:
    """The fingerprint the owner's engines use (what a member reads off `weightcache ls`)."""
    with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir) as handle:
        fingerprint = handle.fingerprint
    cache = wc.Cache(socket_dir)
    assert cache.entries()[0].leases == 0  # closing the handle returned once the keeper released the lease
    cache.evict(fingerprint)
    return fingerprint


def test_a_members_forged_entry_is_never_served_to_the_owner(checkpoint: Path, shared_dir: Path) -> None:
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
    try:
        fingerprint = owner_fingerprint(checkpoint, shared_dir)
        forged = as_member(shared_dir, fingerprint, "publish-forged", checkpoint)
        assert "key" in forged, forged
        cache = wc.Cache(shared_dir)
        [entry] = cache.entries()
        assert entry.publisher == MEMBER_UID and entry.key == forged["key"]

        # The owner's client does not attach it: a miss that says whose entry is there.
        assert cache.get(fingerprint) is None
        model = meta_model()
        with pytest.warns(wc.FallbackWarning, match=f"published by uid {MEMBER_UID}.*trusted_publishers"):
            handle = wc.attach(model, checkpoint, mode="client", socket_dir=shared_dir)
        assert handle.source == "disk" and not bool((model.embed.weight == 7.0).all())
        with pytest.raises(wc.EntryNotFound, match=f"uid {MEMBER_UID}"):
            wc.attach(meta_model(), checkpoint, mode="client", socket_dir=shared_dir, strict=True)

        # Mode daemon publishes the owner's own entry beside it (nothing replaced or shadowed).
        model = meta_model()
        with warnings.catch_warnings():
            warnings.simplefilter("error", wc.FallbackWarning)
            with wc.attach(model, checkpoint, mode="daemon", socket_dir=shared_dir) as handle:
                assert handle.source == "cache" and handle.read_disk and handle.publisher == 0
        assert sorted(e.publisher for e in cache.entries()) == [0, MEMBER_UID]
        with wc.attach(meta_model(), checkpoint, mode="client", socket_dir=shared_dir, strict=True) as handle:
            assert handle.source == "cache" and handle.publisher == 0
            assert not bool((handle.tensors["embed.weight"] == 7.0).all())

        # The member's own engines attach the member's entry first; a named publisher is trusted.
        assert as_member(shared_dir, fingerprint, "get", checkpoint) == {"found": True, "publisher": MEMBER_UID}
        trusting = wc.Cache(shared_dir, trusted_publishers=[MEMBER_UID])
        cache.evict(f"{fingerprint.digest}@cpu")  # the owner's own entry: a bare key is the owner's
        with trusting.get(fingerprint) as handle:  # type: ignore[union-attr]
            assert handle.publisher == MEMBER_UID
            assert bool((handle.tensors["embed.weight"] == 7.0).all())
        with pytest.raises(wc.InvalidArgument, match="no user named"):
            wc.Cache(shared_dir, trusted_publishers=["no-such-user-here"])
    finally:
        terminate_keeper(keeper)


def test_a_members_publish_never_evicts_the_owners_entries(checkpoint: Path, shared_dir: Path) -> None:
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP), "--max-bytes", "400KiB")
    try:
        with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=shared_dir) as handle:
            fingerprint = handle.fingerprint
        cache = wc.Cache(shared_dir)
        assert cache.entries()[0].leases == 0  # closing the handle returned once the keeper released the lease
        [owners] = cache.entries()
        assert owners.leases == 0 and owners.publisher == 0  # unleased: the owner's own publish could evict it
        other = Fingerprint.from_json({**fingerprint.to_json(), "dtype": "float16"})
        refused = as_member(shared_dir, other, "publish-forged", checkpoint)
        assert refused["error"] == "BudgetExceeded" and "uid 65534" in refused["message"], refused
        assert [e.key for e in cache.entries()] == [owners.key]
    finally:
        terminate_keeper(keeper)


def test_republication_after_a_restart_follows_the_same_rules(checkpoint: Path, shared_dir: Path) -> None:
    """A member that held the owner's entry does not re-publish it to a restarted keeper (only what it published
    itself, recorded as its own): the owner's engines then load from disk and publish their own."""
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
    holder = None
    try:
        with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=shared_dir) as handle:
            fingerprint = handle.fingerprint
            arguments = [str(shared_dir), json.dumps(fingerprint.to_json()), "hold", shapes(checkpoint)]
            holder, report = start_member("-c", MEMBER, *arguments)
            assert report == {"publisher": 0, "own": MEMBER_UID}
        keeper.kill()
        keeper.wait(10)
        keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
        cache = wc.Cache(shared_dir)
        # The member's own entry comes back (its holder re-publishes it); the owner's, which it also held, does not.
        assert wait_until(lambda: len(cache.entries()) == 1, timeout=20)
        [entry] = cache.entries()
        assert entry.publisher == MEMBER_UID and entry.fingerprint.dtype == "float16"
        assert cache.get(fingerprint) is None
        with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=shared_dir) as handle:
            assert handle.read_disk and handle.publisher == 0
        assert sorted(e.publisher for e in cache.entries()) == [0, MEMBER_UID]
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(10)
        terminate_keeper(keeper)


def test_republication_never_changes_who_published(checkpoint: Path, shared_dir: Path) -> None:
    """Finding 1 of issue 22 (trust laundering): an owner engine that trusts a member attaches the member's forged
    entry; after a keeper restart it must not re-publish those bytes under the owner's uid, so a default-trust
    owner engine loads from disk instead of attaching them."""
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
    trusted = own = None
    try:
        fingerprint = owner_fingerprint(checkpoint, shared_dir)
        assert "key" in as_member(shared_dir, fingerprint, "publish-forged", checkpoint)
        trusting = wc.Cache(shared_dir, trusted_publishers=[MEMBER_UID])
        trusted = trusting.get(fingerprint)
        assert trusted is not None and trusted.publisher == MEMBER_UID
        # An entry the owner published itself, held as well: it must come back, and shows when re-publication ran.
        other = Fingerprint.from_json({**fingerprint.to_json(), "dtype": "float16"})
        own = wc.Cache(shared_dir).put(other, {"w": torch.ones(4)})
        keeper.kill()
        keeper.wait(10)
        keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
        cache = wc.Cache(shared_dir)
        assert wait_until(lambda: any(e.digest == other.digest for e in cache.entries()), timeout=20)
        assert [e.publisher for e in cache.entries()] == [0]  # only the owner's own entry is back
        assert not trusted.leased  # mapped still, but not re-published
        assert bool((trusted.tensors["embed.weight"] == 7.0).all())
        model = meta_model()
        with pytest.warns(wc.FallbackWarning, match="loading from disk"):
            handle = wc.attach(model, checkpoint, mode="client", socket_dir=shared_dir)
        assert handle.source == "disk" and not bool((model.embed.weight == 7.0).all())
    finally:
        for h in (trusted, own):
            if h is not None:
                h.close()
        terminate_keeper(keeper)


def test_a_members_entry_cannot_crash_or_flood_the_owners_engine(checkpoint: Path, shared_dir: Path) -> None:
    """Finding 2 of issue 22: a fingerprint ``extra`` nested 100,000 deep, or of 8 MiB, is refused at publish
    with a clear error; the owner's engine falls back to disk with a short warning instead of raising."""
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
    try:
        fingerprint = owner_fingerprint(checkpoint, shared_dir)
        deep = as_member(shared_dir, fingerprint, "publish-deep", checkpoint)
        assert deep.get("error") == "KeeperError" and "nested" in deep["message"], deep
        big = as_member(shared_dir, fingerprint, "publish-big-extra", checkpoint)
        assert big.get("error") == "KeeperError" and "extra" in big["message"], big
        assert len(deep["message"]) < 2000 and len(big["message"]) < 2000
        assert wc.Cache(shared_dir).entries() == []
        model = meta_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = wc.attach(model, checkpoint, mode="client", socket_dir=shared_dir)
        assert handle.source == "disk"
        [warning] = [w for w in caught if issubclass(w.category, wc.FallbackWarning)]
        assert len(str(warning.message)) < 2000
    finally:
        terminate_keeper(keeper)


def test_one_member_cannot_starve_the_owner(checkpoint: Path, shared_dir: Path) -> None:
    """Finding 3 of issue 22: a member takes all it can of every keeper-wide resource (connections, segment fds,
    bytes of publish frames in flight, fds and bytes of replies it never reads); the owner's CLI and engines keep
    working, and the member got only its share of each."""
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP), "--max-connections", "64", nofile=4096)
    member = None
    try:
        fingerprint = wc.Fingerprint.create(checkpoint).to_json()
        owner = KeeperConnection.connect(shared_dir)
        # An entry whose get reply (100 fds, a manifest of 1 MB) does not fit a socket buffer: unread, it blocks.
        big = hostile.publish(owner, {**fingerprint, "extra": "big"}, 100, tensors=1000, name_chars=1000)
        digest = big.partition("@")[0]
        member, got = start_member(HOSTILE, "starve", str(shared_dir), digest, json.dumps(fingerprint))

        start = time.monotonic()
        ls = subprocess.run(
            [sys.executable, "-m", "weightcache", "ls", "--socket-dir", str(shared_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ls.returncode == 0, ls.stderr
        assert len(wc.Cache(shared_dir).entries()) >= 2
        with KeeperConnection.connect(shared_dir) as conn:
            reply, fds = conn.get(digest, "cpu")
            assert reply.found and len(fds) == 100
            protocol.close_fds(fds)
            # A publish frame over 64 KiB, while the member's frames stall; and 100 more segment fds.
            assert hostile.publish(conn, {**fingerprint, "extra": "wide"}, 1, tensors=200, name_chars=500)
            assert hostile.publish(conn, {**fingerprint, "extra": "many"}, 100)
        assert time.monotonic() - start < 30  # no stall behind the member's frames (the client waits 40 s)

        # The member got its share of each (a quarter), no more: entries of 200 segments (512 of 2048 fds),
        # connections (16 of 64), replies' fds (250 of 448, so two gets of 100 fds each).
        assert got["entries"] == 2 and got["entries_refused"] == 8, got
        assert got["stalled"] == 2 and got["gets"] + got["idle"] == 13 and got["idle_refused"] > 0, got
        owner.close()
    finally:
        if member is not None:
            member.kill()
            member.wait(10)
        terminate_keeper(keeper)


def test_the_cli_escapes_what_a_member_published(checkpoint: Path, shared_dir: Path) -> None:
    """Finding 4 of issue 22: ``ls`` and ``inspect --tensors`` print a member's architecture, parallel axis and
    tensor names with ESC, BEL, CR, C1, bidi controls and a lone surrogate escaped, and do not crash."""
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
    try:
        fingerprint = wc.Fingerprint.create(checkpoint).to_json()
        out = subprocess.run(
            [sys.executable, HOSTILE, "evil", str(shared_dir), json.dumps(fingerprint)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        key = json.loads(out.stdout)["key"]
        for command in (["ls"], ["inspect", key, "--tensors"]):
            shown = subprocess.run(
                [sys.executable, "-m", "weightcache", *command, "--socket-dir", str(shared_dir)],
                capture_output=True,
                timeout=60,
            )
            assert shown.returncode == 0, shown.stderr.decode()
            text = shown.stdout.decode()  # valid UTF-8: no lone surrogate got through
            assert "Evil" in text and "\\x1b]0;owned\\x07\\x0d\\x9b2J\\u202e\\ud800" in text, text
            assert not any(c in text for c in "\x1b\x07\r\x9b\u202e"), text
    finally:
        terminate_keeper(keeper)


#: As a member of GROUP: open (hold) the owner's artifact ``argv[2]`` of key {"n": 1}, report what it read and
#: whether it holds it, then keep the artifact open until stdin closes.
HOLDER = r"""
import json, os, sys
import torch
import weightcache as wc
import weightcache.cache, weightcache.artifacts, weightcache.republish
socket_dir, weights = sys.argv[1], sys.argv[2]
wc.Cache  # the lazy name resolved while this Python's files are readable
os.setgroups([4242]); os.setgid(65534); os.setuid(65534)
found = wc.Cache(socket_dir).open_artifact(weights, wc.ArtifactKey("test.kind", {"n": 1}))
print(json.dumps({"data": found.read().decode() if found else None, "held": bool(found and found.held),
                  "publisher": found.info.publisher if found else None}), flush=True)
sys.stdin.read()
"""


def test_a_member_takes_no_lease_on_an_artifact_it_did_not_publish(shared_dir: Path) -> None:
    """Issue 33, item 4: a member's lease on the owner's artifact pinned it (no member process ever loads another
    uid's compiled code), and the owner could not evict it to publish its own. The member still reads the blob;
    the keeper takes no lease for it, so the owner evicts it while the member's process keeps it open."""
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
    member = None
    try:
        cache = wc.Cache(shared_dir)
        weights, key = "ef" * 32, wc.ArtifactKey("test.kind", {"n": 1})
        cache.put_artifact(weights, key, b"the owner's blob")
        member, got = start_member("-c", HOLDER, str(shared_dir), weights)
        assert got == {"data": "the owner's blob", "held": False, "publisher": os.getuid()}, got
        [artifact] = cache.artifacts()
        assert artifact.leases == 0, artifact
        assert cache.evict(artifact.key) == [artifact.key]  # not pinned by the member
        assert cache.artifacts() == []
    finally:
        if member is not None:
            member.communicate("", timeout=30)
        terminate_keeper(keeper)


def test_unread_artifact_lists_count_against_the_members_reply_share(shared_dir: Path) -> None:
    """Issue 33, finding 1: a member with ~1,000 artifacts of ~15 KiB keys sent ``list_artifacts`` on 12
    connections and read nothing; the keeper held every ~15 MiB reply (40 -> 637 MiB) and refused nothing. Those
    replies now count against the member's share of reply bytes: once it is full, the member is answered busy,
    and the owner's own list still works."""
    serve_detached(shared_dir, "--allow-group", str(GROUP), "--max-connections", "64")
    member = None
    try:
        member, got = start_member(HOSTILE, "list-flood", str(shared_dir), "12")
        assert got["published"] == 1000 and got["unread"] == 12, got
        assert got["busy"] and got["code"] == "busy" and "replies not read yet" in got["message"], got
        with KeeperConnection.connect(shared_dir) as owner:
            assert len(owner.list_artifacts().artifacts) == 1000  # the owner is not the member's victim
    finally:
        if member is not None:
            member.kill()
            member.wait(10)
        wc.Cache(shared_dir).stop(wait=30)


#: As a member of GROUP: publish a small artifact of key {"n": 2} for weights ``argv[2]``.
PUBLISHER = r"""
import os, sys
import torch
import weightcache as wc
import weightcache.cache, weightcache.artifacts, weightcache.republish
socket_dir, weights = sys.argv[1], sys.argv[2]
wc.Cache
os.setgroups([4242]); os.setgid(65534); os.setuid(65534)
wc.Cache(socket_dir).put_artifact(weights, wc.ArtifactKey("test.kind", {"n": 2}), b"a member's blob")
"""


def test_inspect_and_evict_take_the_name_ls_prints_for_a_members_artifact(shared_dir: Path) -> None:
    """Issue 33, item 7: ``ls`` names another uid's artifact ``<weights>/<key digest>~<uid>``, and ``inspect``
    and ``evict`` refused that very name."""
    keeper = start_keeper(shared_dir, "--allow-group", str(GROUP))
    try:
        weights = "fe" * 32
        subprocess.run([sys.executable, "-c", PUBLISHER, str(shared_dir), weights], check=True, timeout=60)

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "weightcache", *args, "--socket-dir", str(shared_dir)]
            return subprocess.run(command, capture_output=True, text=True, timeout=60)

        listed = cli("ls")
        [name] = [word for word in listed.stdout.split() if word.startswith(weights[:12] + "/")]
        assert name.endswith(f"~{MEMBER_UID}"), listed.stdout
        shown = cli("inspect", name)
        assert shown.returncode == 0 and f"(uid {MEMBER_UID})" in shown.stdout, shown.stdout + shown.stderr
        evicted = cli("evict", name)
        assert evicted.returncode == 0, evicted.stdout + evicted.stderr
        assert wc.Cache(shared_dir).artifacts() == []
    finally:
        terminate_keeper(keeper)


#: As a member of GROUP: publish an artifact of ``argv[2]`` MiB named ``argv[3]``; print what the keeper said.
SIZED = r"""
import json, os, sys
import torch
import weightcache as wc
import weightcache.cache, weightcache.artifacts, weightcache.republish
socket_dir, mib, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
uid = int(sys.argv[4]) if len(sys.argv) > 4 else 65534
wc.Cache
os.setgroups([4242]); os.setgid(65534); os.setuid(uid)
try:
    key = wc.ArtifactKey("test.sized", {"mib": mib, "name": name})
    wc.Cache(socket_dir).put_artifact("cd" * 32, key, os.urandom(mib << 20))
    print(json.dumps({"published": True}))
except wc.WeightCacheError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def test_a_member_holds_at_most_its_share_of_the_budget(shared_dir: Path) -> None:
    """Issue 33, finding 2: one member could fill the whole budget, so the owner's and the other members'
    publishes failed. A member holds at most ``--member-share`` of a placement's budget (its own least recently
    used unleased ones go first); the owner's publish fits beside it."""
    serve_detached(shared_dir, "--allow-group", str(GROUP), "--max-bytes", "cpu=16M")
    try:

        def member(mib: int, name: str) -> dict:
            command = [sys.executable, "-c", SIZED, str(shared_dir), str(mib), name]
            out = subprocess.run(command, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            result: dict = json.loads(out.stdout.strip().splitlines()[-1])
            return result

        too_big = member(5, "a")  # over a quarter of 16 MiB
        assert too_big.get("error") == "BudgetExceeded" and "share of the keeper's budget" in too_big["message"]
        assert member(3, "b") == {"published": True}
        assert member(3, "c") == {"published": True}  # "b", unleased, makes room within the member's share
        mine = [a for a in wc.Cache(shared_dir).artifacts() if a.publisher == MEMBER_UID]
        assert [a.artifact_key.fields["name"] for a in mine] == ["c"]
        owner = wc.Cache(shared_dir).put_artifact("cd" * 32, wc.ArtifactKey("test.owner"), os.urandom(12 << 20))
        assert owner.created and not owner.evicted  # 12 MiB beside the member's 3
    finally:
        wc.Cache(shared_dir).stop(wait=30)


def test_members_are_bounded_against_each_other(shared_dir: Path) -> None:
    """Issue 33, item 8: members were bounded against the owner but not against each other (four members at their
    quarter filled the whole budget: a fifth, and the owner, were refused). Members together hold at most three
    quarters; while five hold artifacts each may hold a fifth of that, and a member whose publish fits its part
    makes room by evicting the least recently used unleased artifact of a member over its part."""
    serve_detached(shared_dir, "--allow-group", str(GROUP), "--max-bytes", "cpu=16M")
    try:

        def member(uid: int, mib: int, name: str) -> dict:
            command = [sys.executable, "-c", SIZED, str(shared_dir), str(mib), name, str(uid)]
            out = subprocess.run(command, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            result: dict = json.loads(out.stdout.strip().splitlines()[-1])
            return result

        for uid in (65531, 65532, 65533, 65534):
            assert member(uid, 3, f"u{uid}") == {"published": True}  # 12 MiB: the members' three quarters
        refused = member(65530, 3, "whole")
        assert refused.get("error") == "BudgetExceeded", refused
        assert "5 members hold entries there, so each may hold 2.4 MiB" in refused["message"], refused
        assert member(65530, 2, "part") == {"published": True}
        held = {a.publisher for a in wc.Cache(shared_dir).artifacts()}
        assert held == {65530, 65532, 65533, 65534}  # the least recently used member over its part gave way
        owner = wc.Cache(shared_dir).put_artifact("cd" * 32, wc.ArtifactKey("test.owner"), os.urandom(4 << 20))
        assert owner.created and not owner.evicted  # the owner's quarter stayed free
    finally:
        wc.Cache(shared_dir).stop(wait=30)
