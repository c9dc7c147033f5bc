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
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML comes with the docs tools (the dev extra)

import weightcache
from weightcache.budget import parse_budget
from weightcache.tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


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
    # restarted until it can start, however often (deployment.md): systemd's default stops after 5 starts in 10 s
    assert service["Restart"] == "on-failure" and unit["Unit"]["StartLimitIntervalSec"] == "0"


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


# --- the images: deploy/docker builds the images the manifests name ----------------------------------------------


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in (DEPLOY / "docker" / name).read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        pending += raw.rstrip().removesuffix("\\") + " " if raw.rstrip().endswith("\\") else raw
        if not raw.rstrip().endswith("\\"):
            lines.append(pending)
            pending = ""
    assert not pending, f"{name}: a continuation line at the end"
    out = []
    for line in lines:
        instruction, _, args = line.strip().partition(" ")
        assert instruction.isupper(), f"{name}: {line!r} does not start with an instruction"
        out.append((instruction, args.strip()))
    return out


def built_by(image: str) -> str:
    """The Dockerfile under deploy/docker whose documented build command tags ``image``."""
    found = [p.name for p in (DEPLOY / "docker").glob("*.Dockerfile") if f" -t {image} ." in p.read_text()]
    assert len(found) == 1, f"no Dockerfile in deploy/docker builds {image} (docker build ... -t {image} .)"
    return found[0]


def pip_installs(steps: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments of each `pip install` in the RUN steps."""
    found = []
    for instruction, args in steps:
        if instruction == "RUN":
            for command in args.split("&&"):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    found.append(words[2:])
    return found


def test_the_keeper_image_is_built_here_and_runs_a_real_serve_command() -> None:
    _, keeper = keeper_pod()
    assert keeper["image"].endswith(f":{weightcache.__version__}")
    steps = dockerfile(built_by(keeper["image"]))
    assert steps[0][0] == "FROM"
    for instruction, args in steps:
        if instruction == "COPY":
            *sources, _ = shlex.split(args)
            assert all((ROOT / s).exists() for s in sources), f"COPY {args}: not in the repository"
    installs = pip_installs(steps)
    assert ["--no-cache-dir", "--no-deps", "/src"] in installs, "weightcache itself, without torch"
    wanted = {w.split(">")[0].split("=")[0] for args in installs for w in args if not w.startswith(("-", "/"))}
    assert "torch" not in wanted, "the keeper never imports torch: its image has none"
    # Every distribution the keeper commands import is installed (asked of a process that imports them).
    code = (
        "import sys, importlib.metadata as md, weightcache.tools.cli, weightcache.keeper, weightcache.client; "
        "owners = md.packages_distributions(); "
        "tops = {m.split('.')[0] for m in list(sys.modules) if m[0] != '_'}; "
        "print(' '.join(sorted({d for m in tops for d in owners.get(m, [])})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    needed = {name.lower().replace("_", "-") for name in out.stdout.split()} - {"weightcache"}
    assert needed <= {w.lower() for w in wanted}, f"the keeper image lacks {sorted(needed - wanted)}"
    entrypoint = json.loads(dict(steps)["ENTRYPOINT"])
    command = json.loads(dict(steps)["CMD"])
    args = parse_weightcache(entrypoint + command)
    assert args.command == "serve" and args.socket_dir == parse_weightcache(keeper["command"]).socket_dir
    user = dict(steps)["USER"].split(":")
    pod, _ = keeper_pod()
    assert int(user[0]) == pod["securityContext"]["runAsUser"] and int(user[1]) == pod["securityContext"]["runAsGroup"]


def test_the_engine_image_adds_the_plugin_to_vllm_without_replacing_its_torch() -> None:
    deployment = load_yaml("engine-deployment.yaml")
    [engine] = deployment["spec"]["template"]["spec"]["containers"]
    assert engine["image"].endswith(f":{weightcache.__version__}")
    steps = dockerfile(built_by(engine["image"]))
    [base] = [args for instruction, args in steps if instruction == "FROM"]
    assert base.startswith("vllm/vllm-openai:") and engine["command"][0] == "vllm"
    installs = pip_installs(steps)
    assert ["--no-cache-dir", "--no-deps", "/src"] in installs, "--no-deps: vLLM's pinned torch stays"
    assert not any(w.startswith("torch") for args in installs for w in args)
    assert any("vllm.general_plugins" in args for instruction, args in steps if instruction == "RUN")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "weightcache" in project["entry-points"]["vllm.general_plugins"]  # what that RUN checks


def test_deployment_docs_show_how_to_build_the_images() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    for name in ("keeper.Dockerfile", "vllm.Dockerfile"):
        assert f"deploy/docker/{name}" in text, f"docs/deployment.md does not show deploy/docker/{name}"


def test_the_systemd_units_header_names_every_line_to_edit() -> None:
    """Issue 32: the unit as shipped does not verify (``/usr/local/bin/weightcache is not executable`` where
    weightcache lives in a virtual environment), and its header only said to set ``User=``."""
    header = [line for line in (DEPLOY / "systemd" / "weightcache-keeper.service").read_text().splitlines()]
    header = header[: next(i for i, line in enumerate(header) if not line.startswith("#"))]
    text = "\n".join(header)
    for needed in ("User=", "Group=", "ExecStart=", "command -v weightcache", "systemd-analyze verify", "--max-"):
        assert needed in text, f"the unit's header does not say to edit or check {needed}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_systemd_unit_verifies_once_execstart_names_this_weightcache(tmp_path: Path) -> None:
    """What the header says to do is enough: with ExecStart= pointing at this environment's weightcache command,
    ``systemd-analyze verify`` passes silently (as shipped it names /usr/local/bin/weightcache, which may not be)."""
    command = Path(sys.executable).parent / "weightcache"
    if not command.exists():
        pytest.skip("weightcache is not installed as a command beside this interpreter")
    unit = (DEPLOY / "systemd" / "weightcache-keeper.service").read_text()
    assert "ExecStart=/usr/local/bin/weightcache " in unit
    edited = tmp_path / "weightcache-keeper.service"
    edited.write_text(unit.replace("ExecStart=/usr/local/bin/weightcache ", f"ExecStart={command} "))
    out = subprocess.run(["systemd-analyze", "verify", str(edited)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
