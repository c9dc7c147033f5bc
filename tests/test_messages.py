"""One vocabulary: docs/protocol.md, weightcache.messages and the keeper's dispatch table name the same ops and
error codes, each code raises the class the one table in weightcache.errors says, and every shape survives a
trip through JSON while a wrong field is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from weightcache import errors, messages
from weightcache.artifact_key import ArtifactKey
from weightcache.budget import Budget
from weightcache.errors import ProtocolError
from weightcache.fingerprint import Fingerprint
from weightcache.keeper import HANDLERS
from weightcache.messages import (
    ArtifactInfo,
    ClientInfo,
    EntryInfo,
    ErrorReply,
    EvictReply,
    EvictRequest,
    GetArtifactReply,
    GetArtifactRequest,
    GetReply,
    GetRequest,
    HelloReply,
    HelloRequest,
    InspectReply,
    InspectRequest,
    KeeperInfo,
    ListArtifactsReply,
    ListArtifactsRequest,
    ListReply,
    ListRequest,
    PublishReply,
    PublishRequest,
    PutArtifactReply,
    PutArtifactRequest,
    StopReply,
    StopRequest,
)

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()
TROUBLESHOOTING = (ROOT / "docs" / "troubleshooting.md").read_text()


def documented_ops() -> set[str]:
    section = PROTOCOL.split("## Messages", 1)[1].split("\n\n")
    table = next(block for block in section if block.startswith("| op |"))
    return set(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE))


def documented_codes() -> set[str]:
    paragraph = next(block for block in PROTOCOL.split("\n\n") if block.startswith("Error codes:"))
    return set(re.findall(r"`([a-z_]+)`", paragraph))


def test_ops_are_the_same_in_the_docs_the_messages_and_the_dispatch_table() -> None:
    assert documented_ops() == set(messages.OPS) == set(HANDLERS) == set(messages.SHAPES)
    assert len(messages.OPS) == len(set(messages.OPS))
    assert set(messages.OPS) >= messages.OWNER_OPS
    assert "release" not in messages.OPS  # no client sends it


def test_error_codes_are_the_same_in_the_docs_and_the_messages() -> None:
    assert documented_codes() == set(messages.ERROR_CODES)
    assert set(errors.KEEPER_ERRORS) <= set(messages.ERROR_CODES)


def test_troubleshooting_names_the_class_the_table_raises_for_each_code() -> None:
    section = TROUBLESHOOTING.split("## Keeper error codes", 1)[1]
    rows = dict(re.findall(r"^\| `(\w+)` \|[^|]*\| `(\w+)`", section, re.MULTILINE))
    for code in messages.ERROR_CODES:
        assert rows[code] == errors.KEEPER_ERRORS.get(code, errors.KeeperError).__name__, code


@pytest.mark.parametrize("code", messages.ERROR_CODES)
def test_each_code_maps_to_its_exception(code: str) -> None:
    expected = {
        messages.OVER_BUDGET: errors.BudgetExceeded,
        messages.VERSION: errors.ProtocolVersionError,
        messages.FORBIDDEN: errors.PeerRejected,
    }.get(code, errors.KeeperError)
    exc = errors.keeper_error(code, f"about {code}")
    assert isinstance(exc, expected) and str(exc) == f"about {code}"
    assert type(exc) is errors.KEEPER_ERRORS.get(code, errors.KeeperError)
    if isinstance(exc, errors.KeeperError):
        assert exc.code == code
    # a group member refused an owner-only op: also catchable as the KeeperError it always was
    assert isinstance(errors.keeper_error(messages.FORBIDDEN, "x"), errors.KeeperError)


def test_unknown_codes_are_keeper_errors_carrying_the_code() -> None:
    exc = errors.keeper_error("timeout", "waited")
    assert type(exc) is errors.KeeperError and exc.code == "timeout"


def fingerprint(checkpoint: Path) -> Fingerprint:
    return Fingerprint.create(checkpoint)


def test_every_shape_round_trips(checkpoint: Path) -> None:
    fp = fingerprint(checkpoint)
    entry = EntryInfo(
        digest=fp.digest,
        placement="cpu",
        device="cpu",
        model="TinyLM",
        bytes=512,
        tensors=1,
        segments=1,
        leases=1,
        holders=((42, 1.5),),
        created=1.0,
        last_used=2.0,
        age_s=3.0,
        fingerprint=fp,
        tensor_bytes=16,
        publisher=1000,
        key=f"{fp.digest}@cpu~1000",
    )
    keeper = KeeperInfo(1, "0.1.0", 1, "/tmp/x", 1.0, 2.0, 3, Budget(None, {"cpu": 1024}), {"cpu": 512})
    key = ArtifactKey("torch.compile", {"torch": "2.13.0", "shapes": [[1, 8]]})
    sha = "0" * 64
    artifact = ArtifactInfo(f"{fp.digest}/{key.digest}~7", fp.digest, key, 10, sha, 7, 1, ((42, 1.5),), 1.0, 2.0, 3.0)
    values = [
        HelloRequest(1, 1, "0.1.0", 7),
        HelloRequest(1),
        HelloReply(1, "0.1.0", 7, 0),
        PublishRequest({"version": 1}),
        PublishReply("d", "d@cpu", True, ("e@cpu",)),
        PublishReply("d", "d@cpu", False),
        GetRequest("d", "cpu"),
        GetRequest("d", "cpu", (1000, 0)),
        GetReply(False),
        GetReply(False, others=(1000,)),
        GetReply(True, "d@cpu", {"version": 1}, 0),
        ListRequest(),
        ListRequest(entry.key),
        ListReply(keeper, (entry,), (ClientInfo(42, 1.5, (entry.key,), 1),)),
        ListReply(keeper, (entry,), (), entry.key),
        InspectRequest("ab"),
        InspectReply(entry, {"version": 1}),
        EvictRequest("*", force=True, every=True),
        EvictReply(("d@cpu",)),
        StopRequest(),
        StopReply(7),
        ErrorReply(messages.LEASED, "held"),
        PutArtifactRequest(fp.digest, key, 10, sha),
        PutArtifactRequest(fp.digest, key, 10, sha, replace="1" * 64),
        PutArtifactReply(artifact.key, True, True, ("e@cpu",)),
        PutArtifactReply(artifact.key, False),
        GetArtifactRequest(fp.digest, key),
        GetArtifactRequest(fp.digest, key, (7, 0)),
        GetArtifactReply(True, artifact),
        GetArtifactReply(False, others=(7,), near=(key.with_fields(dtype="x"),)),
        ListArtifactsRequest(),
        ListArtifactsRequest("ab"),
        ListArtifactsReply((artifact,), truncated=True),
    ]
    op_of = {request: op for op, (request, _) in messages.SHAPES.items()}
    for value in values:
        again = type(value).from_json(value.to_json())
        assert again == value and type(again) is type(value)
        if type(value) in op_of:
            assert value.to_json()["op"] == op_of[type(value)]
    assert {type(v) for v in values} >= {shape for pair in messages.SHAPES.values() for shape in pair}
    assert entry.key == f"{fp.digest}@cpu~1000" == messages.entry_key(fp.digest, "cpu", 1000)
    assert messages.entry_key(fp.digest, "cpu") == f"{fp.digest}@cpu"
    assert entry.to_json()["model_path"] == fp.model_path
    found = GetReply.encode_found("d@cpu", '{"version":1}', 0)
    assert GetReply.from_json(json.loads(found)) == GetReply(True, "d@cpu", {"version": 1}, 0)


def test_a_wrong_field_is_named() -> None:
    with pytest.raises(ProtocolError, match="lacks the field 'placement'"):
        GetRequest.from_json({"op": "get", "digest": "x"})
    with pytest.raises(ProtocolError, match="field 'force' must be bool"):
        EvictRequest.from_json({"op": "evict", "digest": "x", "force": "yes"})
    with pytest.raises(ProtocolError, match="field 'protocol' must be int; found a boolean"):
        HelloRequest.from_json({"op": "hello", "protocol": True})
    with pytest.raises(ProtocolError, match="field 'evicted' must be a list of strings"):
        EvictReply.from_json({"ok": True, "evicted": [1]})
    with pytest.raises(ProtocolError, match="lacks the field 'pid'"):
        StopReply.from_json({"ok": True})
    with pytest.raises(ProtocolError, match="expected a successful reply"):
        StopReply.from_json({"ok": False, "error": "forbidden"})
    key = {"kind": "torch.compile", "fields": {}}
    with pytest.raises(ProtocolError, match="field 'weights' must be the weights' fingerprint digest"):
        GetArtifactRequest.from_json({"op": "get_artifact", "weights": "../x", "key": key})
    with pytest.raises(ProtocolError, match="field 'sha256' must be 64 lower-case hex digits"):
        PutArtifactRequest.from_json({"op": "put_artifact", "weights": "ab" * 32, "key": key, "size": 1, "sha256": "x"})
