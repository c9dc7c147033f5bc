"""The weightcache command, run as a user would."""

from __future__ import annotations

import argparse
import ast
import json
import os
import pwd
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import keeper_pid, one_tensor_manifest, sealed_memfd, start_keeper, terminate_keeper, wait_until
from safetensors.torch import save_file

import weightcache as wc
from weightcache import parity
from weightcache.checkpoint import drop_page_cache
from weightcache.client import KeeperConnection, ensure_keeper
from weightcache.tools.cli import build_parser
from weightcache.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent


def wc_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "weightcache", *args], capture_output=True, text=True, timeout=300)
    if check and out.returncode != 0:
        raise AssertionError(f"weightcache {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def test_load_ls_inspect_evict_stop(checkpoint: Path, socket_dir: Path) -> None:
    sd = ["--socket-dir", str(socket_dir)]
    out = wc_cli("load", str(checkpoint), "--device", "cpu", "--dtype", "bfloat16", *sd)
    assert "published" in out.stdout and "TinyLM" in out.stdout
    assert "already cached" in wc_cli("load", str(checkpoint), "--dtype", "bfloat16", *sd).stdout

    listing = json.loads(wc_cli("ls", "--json", *sd).stdout)
    assert listing["keeper"]["pid"] == keeper_pid(socket_dir)
    assert listing["keeper"]["version"]
    [entry] = listing["entries"]
    assert len(entry["digest"]) == 64 and entry["bytes"] > 0 and entry["device"] == "cpu" and entry["leases"] == 0
    assert entry["fingerprint"]["dtype"] == "bfloat16"

    table = wc_cli("ls", *sd).stdout
    assert "ENTRY" in table and entry["digest"][:12] in table and "TinyLM [bfloat16]" in table
    assert "PUBLISHER" in table and pwd.getpwuid(os.getuid()).pw_name in table
    assert entry["publisher"] == os.getuid() and entry["key"] == f"{entry['digest']}@cpu"

    shown = wc_cli("inspect", entry["digest"][:8], "--tensors", *sd).stdout
    assert "embed.weight" in shown and "bfloat16" in shown and "model.safetensors" in shown
    assert re.search(rf"^publisher +{pwd.getpwuid(os.getuid()).pw_name} \(uid {os.getuid()}\)$", shown, re.M), shown
    assert json.loads(wc_cli("inspect", entry["digest"], "--json", *sd).stdout)["manifest"]["version"] == 1

    assert "evicted" in wc_cli("evict", entry["digest"][:8], *sd).stdout
    assert json.loads(wc_cli("ls", "--json", *sd).stdout)["entries"] == []
    assert "nothing to evict" in wc_cli("evict", "--all", *sd).stdout
    both = wc_cli("evict", "--all", "abc", *sd, check=False)
    assert both.returncode == 2 and "found both 'abc' and --all" in both.stderr

    assert "stopping" in wc_cli("stop", *sd).stdout


def exited(pid: int) -> bool:
    """Whether process ``pid`` has exited: gone, or a zombie its new parent (init) has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def test_stop_wait_returns_once_the_keeper_has_exited(socket_dir: Path) -> None:
    """`stop --wait` returns after the detached keeper's last write into its socket directory, so a script may
    remove the directory at once."""
    ensure_keeper(socket_dir)
    pid = keeper_pid(socket_dir)
    assert pid is not None
    out = wc_cli("stop", "--wait", "--socket-dir", str(socket_dir))
    assert out.stdout.splitlines() == [f"keeper pid {pid} stopping", f"keeper pid {pid} stopped"]
    assert exited(pid)  # no waiting here: --wait did it
    assert (socket_dir / "keeper.stopped").read_text() == f"{pid}\n"
    assert (socket_dir / "keeper.log").read_text().rstrip().endswith(f"keeper {pid} stopped")


def test_cache_stop_waits_the_same_way(socket_dir: Path) -> None:
    """`Cache.stop(wait=...)`, the Python side of `stop --wait` (one implementation: client.stop_keeper)."""
    ensure_keeper(socket_dir)
    pid = keeper_pid(socket_dir)
    assert wc.Cache(socket_dir).stop(wait=30) == pid
    assert pid is not None and exited(pid)
    assert (socket_dir / "keeper.log").read_text().rstrip().endswith(f"keeper {pid} stopped")


def test_stop_wait_sees_an_unreaped_keeper_exit(socket_dir: Path, keeper: subprocess.Popen[bytes]) -> None:
    """A foreground keeper whose parent has not reaped it yet (a zombie) has exited: --wait does not hang on it."""
    out = wc_cli("stop", "--wait", "--timeout", "20", "--socket-dir", str(socket_dir))
    assert out.stdout.splitlines()[-1] == f"keeper pid {keeper.pid} stopped"
    assert keeper.wait(5) == 0


def test_errors_are_one_clear_line(socket_dir: Path, checkpoint: Path) -> None:
    sd = ["--socket-dir", str(socket_dir)]
    out = wc_cli("ls", *sd, check=False)
    assert out.returncode == 1 and "no keeper" in out.stderr and "Traceback" not in out.stderr
    out = wc_cli("load", str(checkpoint), "--quant", "gptq", *sd, check=False)
    assert out.returncode == 1 and "gptq" in out.stderr and "Traceback" not in out.stderr
    assert not socket_dir.exists()
    out = wc_cli("load", str(checkpoint.parent / "missing"), *sd, check=False)
    assert out.returncode == 1 and "does not exist" in out.stderr
    assert wc_cli("stop", *sd, check=False).returncode == 1
    for device in ("gpu", f"cuda:{torch.cuda.device_count()}"):
        out = wc_cli("load", str(checkpoint), "--device", device, *sd, check=False)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"weightcache load: device '{device}'") and len(out.stderr.splitlines()) == 1
    assert not socket_dir.exists()
    assert wc_cli("--version").stdout.startswith("weightcache ")


def test_inspect_unknown_digest(socket_dir: Path, keeper: object) -> None:
    out = wc_cli("inspect", "deadbeef", "--socket-dir", str(socket_dir), check=False)
    assert out.returncode == 1 and "no entry matches 'deadbeef'" in out.stderr


def test_inspect_of_an_artifact_escapes_the_publishers_field_names(socket_dir: Path, keeper: object) -> None:
    """Issue 33, item 7: ``inspect <artifact>`` printed a key's field names raw (ESC, BEL, CR, C1, RLO), which
    another member of the group publishes; ``ls`` escaped them."""
    hostile = "a\x1b[31mred\x07\r\x9b\u202eb"
    key = wc.ArtifactKey("test.kind", {hostile: "v\x1b"})
    wc.Cache(socket_dir).put_artifact("cd" * 32, key, b"blob")
    out = wc_cli("inspect", "cdcdcdcd", "--socket-dir", str(socket_dir))
    for raw in ("\x1b", "\x07", "\r", "\x9b", "\u202e"):
        assert raw not in out.stdout, repr(out.stdout)
    assert "key.a\\x1b[31mred" in out.stdout, out.stdout


def test_bench_runs_small(tmp_path: Path) -> None:
    """Fresh engine processes per configuration: attach, import, the per-tensor floor and the collector's share
    each as median, min and max; every process saw the published bits."""
    report = tmp_path / "results" / "bench.json"  # a directory that does not exist yet, as on a fresh clone
    out = wc_cli("bench", "--sizes", "0.01,0.02", "--tensors", "30", "--repeat", "2", "--json", str(report))
    assert "attach median" in out.stdout and "identical True" in out.stdout
    data = json.loads(report.read_text())
    assert [r["tensors"] for r in data["results"]] == [30, 30]
    for r in data["results"]:
        assert len(r["runs"]) == 2 and all(run["source"] == "cache" for run in r["runs"])
        for column in ("attach_ms", "import_ms", "floor_ms", "gc_ms", "python_ms"):
            assert r[column]["min"] <= r[column]["median"] <= r[column]["max"], column
        assert r["attach_ms"]["min"] > 0 and r["import_ms"]["min"] > 0 and r["floor_ms"]["min"] > 0
        assert r["attach_over_floor"] > 0 and r["identical"] is True and "peer" not in r  # the peer is CUDA's
    assert data["flatness"][0]["ratio"] > 0


def test_bench_real_checkpoint_attaches_a_safetensors_file_beside_the_synthetic_entry(tmp_path: Path) -> None:
    """--real-checkpoint: a safetensors file of the same layout, published as `weightcache load` does and
    attached by path in fresh processes, reported beside the synthetic entry with its own floor and gc columns;
    every process saw the same bits as the synthetic entry's."""
    report = tmp_path / "bench.json"
    args = ("--sizes", "0.01", "--tensors", "30", "--repeat", "2", "--real-checkpoint", "--json", str(report))
    out = wc_cli("bench", *args)
    assert "synthetic | attach median" in out.stdout and "real checkpoint | attach median" in out.stdout
    [row] = json.loads(report.read_text())["results"]
    real = row["real"]
    assert len(real["runs"]) == 2 and all(run["source"] == "cache" for run in real["runs"])
    for column in ("attach_ms", "floor_ms", "gc_ms", "gc_full"):
        assert real[column]["min"] <= real[column]["median"] <= real[column]["max"], column
    assert real["identical"] is True and row["identical"] is True and row["real_over_synthetic"] > 0
    assert {run["checksum"] for run in real["runs"]} == {run["checksum"] for run in row["runs"]}
    assert "--real-checkpoint does not go with --restart" in wc_cli("bench", "--restart", *args, check=False).stderr


def test_restart_bench_runs_small_on_cpu(tmp_path: Path) -> None:
    report = tmp_path / "results" / "restart.json"
    args = ("--sizes", "0.01", "--tensors", "40", "--repeat", "2", "--json", str(report))
    out = wc_cli("bench", "--restart", "--device", "cpu", *args)
    assert "client attach" in out.stdout and "identical True" in out.stdout
    [row] = json.loads(report.read_text())["results"]
    assert row["sources"] == ["disk", "cache", "cache"] and row["identical"] is True
    assert row["client_attaches"] == 2 and row["client_attach_ms_min"] <= row["client_attach_ms"]
    assert row["disk_read_gbps"] > 0 and row["off_s"] > 0 and row["client_attach_ms"] > 0
    # Only this checkpoint's pages were dropped: the whole machine's page cache (root) only with --drop-caches.
    assert row["page_cache_drop"] == "fadvise" and "drop_caches" not in out.stdout


def test_bench_refuses_sizes_this_machine_cannot_hold_before_writing_anything(tmp_path: Path) -> None:
    work = tmp_path / "work"
    for restart in ([], ["--restart", "--workdir", str(work)]):
        out = wc_cli("bench", *restart, "--sizes", "0.01,100000", "--tensors", "30", check=False)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert re.match(r"weightcache bench: --sizes 100000 GiB needs about .* of memory; .* available", out.stderr)
        assert not any(work.glob("*")) and "attach" not in out.stdout
        out = wc_cli("bench", *restart, "--device", "gpu", check=False)
        assert out.returncode == 1 and out.stderr.startswith("weightcache bench: device 'gpu' is not a device")


def test_default_bench_sizes_shrink_to_the_machine() -> None:
    """Without --sizes, the defaults that do not fit this machine's memory are left out (and said so); given
    sizes are never changed silently."""
    from weightcache.tools.bench import sizes_that_fit

    gib = 1 << 30
    fit, note = sizes_that_fit((1.0, 8.0, 32.0), 20 * gib, explicit=False)
    assert fit == [1.0, 8.0] and note is not None and note.startswith("left out 32 GiB: needs about 64.0 GiB")
    assert sizes_that_fit((1.0, 8.0), 20 * gib, explicit=False) == ([1.0, 8.0], None)
    with pytest.raises(wc.WeightCacheError, match="--sizes 32 GiB needs about 64.0 GiB of memory"):
        sizes_that_fit((1.0, 32.0), 20 * gib, explicit=True)
    with pytest.raises(wc.WeightCacheError, match="even the smallest default"):
        sizes_that_fit((1.0, 8.0), gib, explicit=False)


def test_ls_shows_holders_and_budget(checkpoint: Path, socket_dir: Path) -> None:
    keeper = start_keeper(socket_dir, "--max-bytes", "cpu=1M")
    try:
        with wc.Cache(socket_dir).put(wc.Fingerprint.create(checkpoint), {"w": torch.ones(1024)}):
            table = wc_cli("ls", "--socket-dir", str(socket_dir)).stdout
            # the lease's age is whatever it is when `ls` runs: seconds on a loaded machine
            assert "HELD BY (PID SINCE)" in table and re.search(rf" {os.getpid()} \d+s\n", table)
            assert "budget  cpu 4.0 KiB of 1.0 MiB" in table
            shown = wc_cli("inspect", wc.Fingerprint.create(checkpoint).digest, "--socket-dir", str(socket_dir)).stdout
            assert re.search(rf"leases +1  pid {os.getpid()} since \d+s", shown)
    finally:
        terminate_keeper(keeper)


#: A sitecustomize.py for processes that must run where torch is not installed: importing torch fails, and every
#: attempt is noted in $WC_TORCH_LOG (with who asked), so that an ImportError caught somewhere cannot hide one.
#: A keeper forked by `serve --detach` inherits the hook.
NO_TORCH = """
import os, sys, traceback


class NoTorch:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            with open(os.environ["WC_TORCH_LOG"], "a") as log:
                log.write(f"pid {os.getpid()} imported {name}: {sys.argv}\\n{''.join(traceback.format_stack())}\\n")
            raise ModuleNotFoundError(f"No module named {name!r} (this test runs without torch)", name=name)
        return None


sys.meta_path.insert(0, NoTorch)
"""


def without_torch(tmp_path: Path, attempts: Path) -> dict[str, str]:
    """An environment whose Python cannot import torch (:data:`NO_TORCH` as its sitecustomize) and notes each
    attempt in ``attempts``."""
    site = tmp_path / "no-torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_TORCH)
    path = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "WC_TORCH_LOG": str(attempts)}


def test_keeper_commands_work_without_torch(checkpoint: Path, socket_dir: Path, tmp_path: Path) -> None:
    attempts = tmp_path / "torch-imports.log"
    env = without_torch(tmp_path, attempts)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, f"{' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
        return out

    def cli(*args: str) -> str:
        return run("-m", "weightcache", *args, "--socket-dir", str(socket_dir)).stdout

    # the hook works: torch cannot be imported there, and the attempt is noted
    blocked = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env)
    assert blocked.returncode != 0 and "runs without torch" in blocked.stderr and attempts.exists()
    attempts.unlink()

    cli("serve", "--detach")  # returns once the keeper has forked; it serves once its socket is in place
    assert wait_until(lambda: (socket_dir / "keeper.sock").exists(), 30)
    pid = keeper_pid(socket_dir)
    assert pid is not None
    fp = wc.Fingerprint.create(checkpoint)  # this process has torch: publish one entry for the others to see
    fd = sealed_memfd(512)
    try:
        with KeeperConnection.connect(socket_dir) as conn:
            assert conn.publish(one_tensor_manifest(fp.to_json()), [fd]).created
    finally:
        os.close(fd)

    assert fp.digest[:12] in cli("ls")
    [entry] = json.loads(cli("ls", "--json"))["entries"]
    assert entry["digest"] == fp.digest and entry["leases"] == 0
    shown = cli("inspect", fp.digest[:10], "--tensors")
    assert "model.safetensors" in shown and "  w  float32[4]" in shown
    assert json.loads(cli("inspect", fp.digest, "--json"))["entry"]["key"] == f"{fp.digest}@cpu"
    assert f"evicted {fp.digest}@cpu" in cli("evict", fp.digest[:10])
    assert "nothing to evict" in cli("evict", "--all")
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert cli("stop", "--wait").splitlines()[-1] == f"keeper pid {pid} stopped"
    assert "libtorch" not in maps
    assert not attempts.exists(), f"a keeper command imported torch:\n{attempts.read_text()}"


def test_doctor_works_without_torch_and_what_needs_torch_says_so(checkpoint: Path, tmp_path: Path) -> None:
    """Where torch is not installed (the keeper's image): `doctor` checks what it can and says in one line that the
    GPU checks and engines need torch; `load` says in one line that it needs torch; `warm ls` answers. No
    traceback anywhere."""
    env = without_torch(tmp_path, tmp_path / "torch.log")
    socket_dir = tmp_path / "s"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "weightcache", *args, "--socket-dir", str(socket_dir)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    doctor = cli("doctor")
    assert "Traceback" not in doctor.stderr + doctor.stdout, doctor.stderr
    assert "torch is not installed here" in doctor.stdout, doctor.stdout
    load = cli("load", str(checkpoint))
    assert load.returncode == 1 and "Traceback" not in load.stderr, load.stderr
    assert load.stderr.strip().count("\n") == 0 and "needs torch" in load.stderr, load.stderr
    warm = cli("warm", "ls")
    assert warm.returncode == 0 and "no warm process" in warm.stdout, warm.stderr


def test_parity_of_two_tables_runs_without_torch_as_the_needs_torch_line_says(tmp_path: Path) -> None:
    """`parity LEFT RIGHT` diffs two tables without torch (weightcache.parity imports it only to record them), and
    the line of a command that needs torch names it among those that do without."""
    left, right = tmp_path / "left.json", tmp_path / "right.json"
    parity.write_table({"w": torch.ones(3)}, left)  # this process has torch: it writes the tables
    parity.write_table({"w": torch.zeros(3)}, right)
    attempts = tmp_path / "torch.log"
    env = without_torch(tmp_path, attempts)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "weightcache", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    same = cli("parity", str(left), str(left))
    assert same.returncode == 0 and same.stdout.startswith("identical: 1 tensors"), same.stdout + same.stderr
    differ = cli("parity", str(right), str(left), "--json")
    assert differ.returncode == 1 and not json.loads(differ.stdout)["identical"], differ.stdout + differ.stderr
    assert not attempts.exists(), f"parity of two tables imported torch:\n{attempts.read_text()}"
    load = cli("load", str(tmp_path), "--socket-dir", str(tmp_path / "s"))
    assert load.returncode == 1 and len(load.stderr.splitlines()) == 1, load.stderr
    assert "doctor, parity of two tables and the warm commands run without it" in load.stderr, load.stderr


def test_load_engine_transformers_without_transformers_says_how_to_install_it(checkpoint: Path, tmp_path: Path) -> None:
    """Where transformers is not installed, `load --engine transformers` says in one line how to install it as the
    docs do: from a clone of the repository (weightcache is not on PyPI, so `weightcache[transformers]` is none)."""
    site = tmp_path / "no-transformers"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        NO_TORCH.replace('== "torch"', '== "transformers"').replace("without torch", "without transformers")
    )
    path = [str(site), ROOT.as_posix(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "WC_TORCH_LOG": str(tmp_path / "imports.log")}
    command = [sys.executable, "-m", "weightcache", "load", str(checkpoint), "--engine", "transformers"]
    out = subprocess.run(
        [*command, "--socket-dir", str(tmp_path / "s")], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("weightcache load: --engine transformers needs the transformers package"), out
    assert "`pip install '.[transformers]'` in a clone of the weightcache repository" in out.stderr, out.stderr
    assert "weightcache[" not in out.stderr, out.stderr


def imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved within weightcache)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def test_the_tools_sit_on_top_of_the_library() -> None:
    """weightcache/tools/ (L5) may use everything; nothing in the library uses it, or argparse, and neither the
    tools nor the benchmarks and examples reach for another module's private names."""
    library = [p for p in (ROOT / "weightcache").rglob("*.py") if "tools" not in p.relative_to(ROOT).parts]
    for path in library:
        imports = imported_modules(path)
        if path.name != "__main__.py":  # `python -m weightcache` is the CLI
            assert not any(m.startswith("weightcache.tools") for m in imports), f"{path} imports the tools"
        assert "argparse" not in imports, f"{path}: library modules take plain arguments; the CLI parses them"
    users = [*(ROOT / "weightcache" / "tools").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    users += (ROOT / "examples").glob("*.py")
    for path in users:
        text = path.read_text()  # text, not the AST: the benchmarks' embedded client scripts count too
        # torch documents its allocator's history recorder under a private name (torch_cuda_memory.html); vLLM has
        # no public way to set its graph pool, nor to list its graph wrappers, which the vLLM graph probe researches
        allowed = (
            r"self\.|os\._exit|memory\._record_memory_history|platform_cls\._global_graph_pool"
            r"|CUDAGraphWrapper\._all_instances"
        )
        if path.name == "graph_restore_cpu.py":  # a GraphCache's restore timed without a GPU: made without its
            allowed += r"|cache\._load\(\)"  # constructor (which needs one), whose last step this is
        private = re.findall(rf"import _[a-z]\w*|\b(?!{allowed})\w+\._[a-z]\w*", text)
        assert not private, f"{path} uses private names: {private}"
    for old in ("cli", "doctor", "bench", "bench_restart"):
        assert not (ROOT / "weightcache" / f"{old}.py").exists(), f"weightcache/{old}.py is in weightcache/tools/"


def test_a_second_detached_serve_fails_like_the_foreground(socket_dir: Path) -> None:
    """`serve --detach` while a keeper serves: the same message and exit status as `serve`, never a silent 0
    that drops its options."""
    wc_cli("serve", "--detach", "--socket-dir", str(socket_dir))
    foreground = wc_cli("serve", "--socket-dir", str(socket_dir), check=False)
    detached = wc_cli("serve", "--detach", "--max-bytes", "1GiB", "--socket-dir", str(socket_dir), check=False)
    assert foreground.returncode == detached.returncode == 1
    assert "already serves" in foreground.stderr
    assert detached.stderr.strip() == foreground.stderr.strip()


def test_without_a_keeper_ls_json_is_json_and_stop_says_its_name(socket_dir: Path) -> None:
    out = wc_cli("ls", "--json", "--socket-dir", str(socket_dir), check=False)
    assert out.returncode == 1
    listing = json.loads(out.stdout)  # a script reading --json gets JSON, also when nothing runs
    assert listing["keeper"] is None and listing["entries"] == [] and "no keeper" in listing["error"]
    out = wc_cli("stop", "--socket-dir", str(socket_dir), check=False)
    assert out.returncode == 1 and out.stderr.startswith("weightcache stop: no keeper to stop")
    socket_dir.mkdir(mode=0o755, exist_ok=True)
    socket_dir.chmod(0o755)  # a directory the keeper would refuse (not private): still JSON, saying why
    out = wc_cli("ls", "--json", "--socket-dir", str(socket_dir), check=False)
    assert out.returncode == 1 and "0755" in json.loads(out.stdout)["error"], out


def test_evict_all_evicts_what_is_free_and_names_the_flag_for_the_rest(
    checkpoint: Path, socket_dir: Path, keeper: object
) -> None:
    sd = ["--socket-dir", str(socket_dir)]
    cache = wc.Cache(socket_dir)
    free = wc.Fingerprint.create(checkpoint, dtype="float32")
    held = wc.Fingerprint.create(checkpoint, dtype="bfloat16")
    cache.put(free, {"w": torch.ones(1024)}).close()
    with cache.put(held, {"w": torch.ones(1024, dtype=torch.bfloat16)}):
        out = wc_cli("evict", "--all", *sd, check=False)
        assert out.returncode == 1
        assert out.stdout.splitlines() == [f"evicted {free.digest}@cpu"]
        assert out.stderr.splitlines() == [
            f"weightcache evict: kept {held.digest}@cpu: leased by pid {os.getpid()} (an engine uses it); "
            "--force evicts it too (its memory stays mapped in that process until it lets go)"
        ]
        out = wc_cli("evict", held.digest[:10], *sd, check=False)
        assert out.returncode == 1 and "--force evicts it" in out.stderr and "with force" not in out.stderr
        assert wc_cli("evict", "--all", "--force", *sd).stdout.splitlines() == [f"evicted {held.digest}@cpu"]


def test_ls_shows_each_shard_and_inspect_lines_up(checkpoint: Path, socket_dir: Path, keeper: object) -> None:
    sd = ["--socket-dir", str(socket_dir)]
    cache = wc.Cache(socket_dir)
    for rank in (0, 1):
        fp = wc.Fingerprint.create(checkpoint, parallel={"tp": (rank, 2)})
        cache.put(fp, {"w": torch.ones(4)}).close()
    table = wc_cli("ls", *sd).stdout
    assert re.search(r"TinyLM tp 0/2 ", table) and re.search(r"TinyLM tp 1/2 ", table), table
    shown = wc_cli("inspect", fp.digest[:10], *sd).stdout.splitlines()
    assert "in 1 segment, 1 tensor" in shown[3], shown[3]
    fields = [line for line in shown if not line.startswith("  ")]
    column = fields[0].index(fp.digest)
    for line in fields:  # every value starts in one column, however long its key
        key, value = line[:column], line[column:]
        assert key.rstrip() and not key[len(key.rstrip()) :].strip() and value[:1] != " ", line


def test_ls_counts_bytes_under_a_bare_budget_and_load_reports_what_it_evicted(
    checkpoint: Path, socket_dir: Path, tmp_path: Path
) -> None:
    sd = ["--socket-dir", str(socket_dir)]
    size = 400 << 10  # a float32 entry of TinyLM's checkpoint fits; adding the bfloat16 one does not
    keeper = start_keeper(socket_dir, "--max-bytes", str(size))
    try:
        first = wc_cli("load", str(checkpoint), "--dtype", "float32", *sd).stdout
        digest = first.split()[1]
        used = json.loads(wc_cli("ls", "--json", *sd).stdout)["entries"][0]["bytes"]
        assert used > size // 2, "the test needs entries that cannot both fit the budget"
        assert f"budget  cpu {format_bytes(used)} of {format_bytes(size)}" in wc_cli("ls", *sd).stdout
        second = wc_cli("load", str(checkpoint), "--dtype", "bfloat16", *sd).stdout
        assert re.search(rf"evicted {digest}\w*@cpu \(unleased, least recently used\) to make room", second), second
    finally:
        terminate_keeper(keeper)


def test_socket_dir_help_says_xdg_runtime_dir_counts_only_where_it_exists() -> None:
    """`--socket-dir`'s default, as weightcache.rundir resolves it: $XDG_RUNTIME_DIR/weightcache only where
    $XDG_RUNTIME_DIR names an existing directory (else /tmp/weightcache-<uid>), in every command's help."""
    for command in ("serve", "ls", "load", "warm"):
        out = wc_cli(command, "--help")
        text = " ".join(out.stdout.split())
        assert (
            "(default: $WEIGHTCACHE_DIR, else $XDG_RUNTIME_DIR/weightcache where $XDG_RUNTIME_DIR names an existing "
            "directory, else /tmp/weightcache-<uid>)" in text
        ), out.stdout


def test_every_option_has_a_whole_help_text() -> None:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        assert command.description and "..." not in command.description, f"weightcache {name}: no description"
        for action in command._actions:
            if "-h" in action.option_strings or action.help == argparse.SUPPRESS:
                continue
            text = action.help or ""
            assert len(text.split()) >= 2 and "..." not in text, f"weightcache {name} {action.dest}: help {text!r}"


def test_ctrl_c_while_load_reads_the_checkpoint_is_a_clean_exit(tmp_path: Path, socket_dir: Path) -> None:
    """SIGINT while `weightcache load` reads a checkpoint from a cold page cache (inside safetensors, which turned
    the KeyboardInterrupt into an unrelated ValueError): one line, exit status 130, nothing published."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(96)}  # 384 MiB in 96 tensors
    save_file(state, str(ckpt / "model.safetensors"))
    del state
    wc.Cache(socket_dir, spawn=True)  # a keeper already runs: the load goes straight to reading
    drop_page_cache(ckpt)
    load = subprocess.Popen(
        [sys.executable, "-m", "weightcache", "load", str(ckpt), "--socket-dir", str(socket_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # reading has begun once the file is mapped (safetensors maps it) or open
        def reading() -> bool:
            fds = Path(f"/proc/{load.pid}/fd")
            mapped = str(ckpt / "model.safetensors") in Path(f"/proc/{load.pid}/maps").read_text()
            return mapped or any(str(ckpt) in _link(fd) for fd in fds.iterdir())

        def _link(fd: Path) -> str:
            try:
                return os.readlink(fd)
            except FileNotFoundError:  # closed since the listing
                return ""

        assert wait_until(reading, 120), "the load never started reading"
        load.send_signal(signal.SIGINT)
        out, err = load.communicate(timeout=120)
    finally:
        load.kill()
    assert (load.returncode, err) == (130, "weightcache load: interrupted\n"), err
    assert "published" not in out
    assert wc.Cache(socket_dir).entries() == []


def test_ctrl_c_stops_a_foreground_serve_cleanly(socket_dir: Path) -> None:
    """The exception docs/cli.md names: SIGINT to a foreground `weightcache serve` stops the keeper as `stop` does
    (its log says so, keeper.stopped is left), exit status 0, and no `interrupted` line."""
    keeper = start_keeper(socket_dir)
    try:
        keeper.send_signal(signal.SIGINT)
        assert keeper.wait(30) == 0
    finally:
        keeper.kill()
    log = keeper.stderr.read().decode() if keeper.stderr else ""
    assert log.rstrip().endswith(f"keeper {keeper.pid} stopped") and "interrupted" not in log, log
    assert (socket_dir / "keeper.stopped").read_text() == f"{keeper.pid}\n"


def test_the_llama_restart_runs_tiny_on_cpu(tmp_path: Path) -> None:
    """benchmarks/restart_llama.py end to end with a two-layer model: every step timed, modes off, daemon,
    client and client from a warm process (``--warm``; the script fails if one started directly) served from where
    they should be, bitwise identical logits."""
    pytest.importorskip("transformers")
    report = tmp_path / "llama.json"
    shape = ("--num-hidden-layers", "2", "--hidden-size", "128", "--intermediate-size", "256")
    shape += ("--vocab-size", "512", "--num-attention-heads", "4", "--num-key-value-heads", "2")
    script = str(ROOT / "benchmarks" / "restart_llama.py")
    options = ("--device", "cpu", "--repeat", "1", "--workdir", str(tmp_path), "--no-drop", "--json", str(report))
    options += ("--warm",)
    out = subprocess.run(
        [sys.executable, script, *options, *shape],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["identical"] is True
    assert data["sources"] == {"off": ["disk"], "daemon": ["cache"], "client": ["cache"], "client (warm)": ["cache"]}
    steps = data["summary"]["client"]
    assert steps["attach / load"]["median"] > 0 and steps["total to first token"]["median"] > 0


def test_the_bench_peer_runs_its_holder_and_fresh_processes_on_cpu(tmp_path: Path) -> None:
    """The peer's code path (a holder exports with torch's reductions, fresh processes unpickle and bind, each
    checks the bits) without a GPU: on the CPU the reductions are shared-memory files instead of CUDA IPC."""
    from weightcache.tools import bench

    shapes = bench.layout(1 << 22, 12, 2)
    expected = bench.checksum([bench.pattern(i, n, torch.bfloat16, "cpu") for i, n in enumerate(shapes)])
    result = bench.peer_attach(tmp_path, shapes, "bfloat16", "cpu", 2, expected)
    assert result["identical"] is True and len(result["runs"]) == 2
    assert 0 < result["attach_ms"]["min"] <= result["attach_ms"]["median"] <= result["attach_ms"]["max"]


def test_serve_detach_says_what_it_started(socket_dir: Path) -> None:
    out = wc_cli("serve", "--detach", "--socket-dir", str(socket_dir))
    pid = keeper_pid(socket_dir)
    assert pid is not None and out.stdout.splitlines() == [
        f"keeper pid {pid} serving {socket_dir / 'keeper.sock'} (log {socket_dir / 'keeper.log'}); "
        "`weightcache stop` stops it"
    ]
    assert f"keeper pid {pid} stopping" in wc_cli("stop", "--wait", "--socket-dir", str(socket_dir)).stdout


def test_ls_shows_only_the_axes_that_are_split(checkpoint: Path, socket_dir: Path, keeper: object) -> None:
    """An engine records every parallel axis it knows (vLLM: dcp, dp, pcp, pp, tp), most of size 1: the MODEL
    column names the shard by the split ones only; inspect still lists them all."""
    fp = wc.Fingerprint.create(checkpoint, parallel={"dcp": (0, 1), "dp": (0, 1), "pp": (0, 1), "tp": (1, 2)})
    wc.Cache(socket_dir).put(fp, {"w": torch.ones(4)}).close()
    table = wc_cli("ls", "--socket-dir", str(socket_dir)).stdout
    assert re.search(r"  TinyLM tp 1/2  ", table) and "0/1" not in table, table
    assert (
        "dcp 0/1, dp 0/1, pp 0/1, tp 1/2" in wc_cli("inspect", fp.digest[:10], "--socket-dir", str(socket_dir)).stdout
    )


def test_load_takes_short_dtype_names_and_words_dtype_as_inspect_does(checkpoint: Path, socket_dir: Path) -> None:
    sd = ["--socket-dir", str(socket_dir)]
    out = wc_cli("load", str(checkpoint), "--dtype", "bf16", *sd).stdout
    assert " dtype=bfloat16 " in out
    assert " dtype=bfloat16 " in wc_cli("load", str(checkpoint), "--dtype", "bfloat16", *sd).stdout  # the same
    stored = wc_cli("load", str(checkpoint), *sd).stdout
    assert stored.startswith("published ") and " dtype=as-stored " in stored
    shown = wc_cli("inspect", stored.split()[1], *sd).stdout
    assert re.search(r"^dtype +as-stored$", shown, re.M), shown
    wrong = wc_cli("load", str(checkpoint), "--dtype", "bf17", *sd, check=False)
    assert wrong.returncode == 1 and "'bfloat16' (or 'bf16'); found 'bf17'" in wrong.stderr
    wc_cli("stop", *sd)


def test_a_closed_stdout_ends_quietly(socket_dir: Path, keeper: subprocess.Popen[bytes], checkpoint: Path) -> None:
    """Issue 22, finding 5: `weightcache ls | head -0` (a reader that closes at once) prints no traceback."""
    import hostile

    with KeeperConnection.connect(socket_dir) as conn:
        hostile.publish(conn, wc.Fingerprint.create(checkpoint).to_json(), 1)
    for extra in ("", " --json"):
        command = f"{sys.executable} -m weightcache ls --socket-dir {socket_dir}{extra} | head -0"
        out = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60)
        assert out.stderr == "" and out.returncode in (0, 141), out
