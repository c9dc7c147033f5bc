"""The deployment files under deploy/ (shown in docs/deployment.md) use real options and agree with each other.

Nobody runs them on a cluster here; these checks catch what can be caught without one: a `weightcache serve`
option that does not exist, a keeper and an engine that look for the socket in different host directories or
run as different users, an engine option the adapter would refuse.
"""

from __future__ import annotations

import configparser
import json
import posixpath
import shlex
from pathlib import Path
from typing import Any

import yaml  # PyYAML comes with the docs tools (the dev extra)

from weightcache.budget import parse_budget
from weightcache.tools.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def parse_weightcache(argv: list[str]) -> Any:
    """Parse a `weightcache ...` command line as the CLI would; argparse exits on anything unknown."""
    assert Path(argv[0]).name == "weightcache", argv
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:  # pragma: no cover - the failure message is the point
        raise AssertionError(f"not a valid weightcache command line: {shlex.join(argv)}") from exc


def load_yaml(name: str) -> dict[str, Any]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()))
    assert len(docs) == 1, f"{name}: expected one object"
    doc: dict[str, Any] = docs[0]
    return doc


def host_path(pod: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The host directory that ``path`` inside ``container`` is, through a hostPath volume."""
    mounts = sorted(container.get("volumeMounts", []), key=lambda m: len(m["mountPath"]), reverse=True)
    for mount in mounts:
        rel = posixpath.relpath(path, mount["mountPath"])
        if rel == "." or not rel.startswith(".."):
            [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert "hostPath" in volume, f"{volume['name']} must be a hostPath volume to reach the node's keeper"
            return posixpath.normpath(posixpath.join(volume["hostPath"]["path"], rel))
    raise AssertionError(f"{path} is not on any volume of container {container['name']}")


def keeper_pod() -> tuple[dict[str, Any], dict[str, Any]]:
    daemonset = load_yaml("keeper-daemonset.yaml")
    assert daemonset["kind"] == "DaemonSet"  # one keeper per node
    pod = daemonset["spec"]["template"]["spec"]
    [keeper] = [c for c in pod["containers"] if c["name"] == "keeper"]
    return pod, keeper


def test_systemd_unit_runs_a_real_serve_command() -> None:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read(DEPLOY / "systemd" / "weightcache-keeper.service")
    service = unit["Service"]
    args = parse_weightcache(shlex.split(service["ExecStart"]))
    assert args.command == "serve"
    assert not args.detach, "Type=simple: systemd supervises the foreground process"
    assert service["Type"] == "simple"
    # The socket directory is the one systemd creates for the service's user, private as the keeper requires.
    assert args.socket_dir == "/run/" + service["RuntimeDirectory"]
    assert service["RuntimeDirectoryMode"] == "0700"
    parse_budget(args.max_bytes, args.max_fraction)  # raises on a malformed budget


def test_daemonset_runs_a_real_serve_command_on_a_host_directory() -> None:
    pod, keeper = keeper_pod()
    args = parse_weightcache(keeper["command"] + keeper.get("args", []))
    assert args.command == "serve" and not args.detach
    assert args.socket_dir, "name the socket directory explicitly: engines must find the same one"
    parse_budget(args.max_bytes, args.max_fraction)
    probe = parse_weightcache(keeper["readinessProbe"]["exec"]["command"])
    assert probe.command == "ls" and probe.socket_dir == args.socket_dir
    assert "resources" not in keeper or "nvidia.com/gpu" not in str(keeper["resources"]), "the keeper needs no GPU"
    # The init container makes the socket directory the keeper's, mode 0700, on the same host directory.
    [init] = pod["initContainers"]
    script = init["command"][-1]
    uid = pod["securityContext"]["runAsUser"]
    assert f"chmod 0700 {args.socket_dir}" in script and f"chown {uid}:" in script
    assert host_path(pod, init, args.socket_dir) == host_path(pod, keeper, args.socket_dir)


def test_engine_pods_use_their_node_keeper() -> None:
    keeper_spec, keeper = keeper_pod()
    keeper_args = parse_weightcache(keeper["command"] + keeper.get("args", []))
    deployment = load_yaml("engine-deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    [engine] = pod["containers"]
    env = {e["name"]: e["value"] for e in engine["env"]}
    socket_dir = env["WEIGHTCACHE_DIR"]
    assert host_path(pod, engine, socket_dir) == host_path(keeper_spec, keeper, keeper_args.socket_dir)
    # SO_PEERCRED: the keeper serves its own uid (or a group given with --allow-group).
    same_uid = pod["securityContext"]["runAsUser"] == keeper_spec["securityContext"]["runAsUser"]
    assert same_uid or keeper_args.allow_group is not None
    # The adapter accepts the engine's weightcache options.
    from weightcache.backends.base import LoaderOptions

    command = engine["command"]
    assert command[command.index("--load-format") + 1] == "weightcache"
    raw = json.loads(command[command.index("--model-loader-extra-config") + 1])
    LoaderOptions.parse(raw, where="--model-loader-extra-config")
