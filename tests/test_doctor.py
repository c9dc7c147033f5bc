"""``weightcache doctor`` run as a user would: real keeper, real socket directories, real memfds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cuda_available, keeper_pid
from test_cli import wc_cli


def doctor(socket_dir: Path, *, check: bool = True) -> tuple[int, dict[str, dict[str, str]]]:
    out = wc_cli("doctor", "--json", "--socket-dir", str(socket_dir), check=check)
    return out.returncode, {c["name"]: c for c in json.loads(out.stdout)}


def test_no_keeper_is_a_warning_with_what_to_do(socket_dir: Path) -> None:
    rc, checks = doctor(socket_dir)
    assert rc == 0
    for name in ("platform", "versions", "memfd", "fd passing"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["socket dir"]["status"] == "ok" and "does not exist yet" in checks["socket dir"]["detail"]
    assert checks["keeper"]["status"] == "warn" and "weightcache serve" in checks["keeper"]["fix"]
    assert not socket_dir.exists(), "doctor must not create the socket directory"
    if not cuda_available():
        assert checks["cuda"]["status"] == "skip"


def test_versions_of_a_source_tree_that_is_not_installed_are_a_warning() -> None:
    from weightcache.tools import doctor

    [check] = doctor.check_versions("weightcache-not-installed-here")
    assert check.status == "warn" and "without being installed" in check.detail, check
    assert check.fix is not None and check.fix.startswith("pip install -e ")
    [installed] = doctor.check_versions()
    assert installed.status == "ok" and "torch " in installed.detail and "packaging " in installed.detail, installed


def test_a_socket_dir_under_missing_parents_is_fine(socket_dir: Path) -> None:
    nested = socket_dir / "a" / "b"  # ensure_private_dir creates the parents too
    rc, checks = doctor(nested)
    assert rc == 0 and checks["socket dir"]["status"] == "ok", checks["socket dir"]
    assert not socket_dir.exists()


def test_a_running_keeper_is_reported(socket_dir: Path, keeper: object) -> None:
    rc, checks = doctor(socket_dir)
    assert rc == 0
    assert checks["socket dir"]["status"] == "ok" and "private (0700" in checks["socket dir"]["detail"]
    assert checks["keeper"]["status"] == "ok"
    assert f"pid {keeper_pid(socket_dir)}," in checks["keeper"]["detail"]
    assert "0 entries" in checks["keeper"]["detail"] and "0 compiled artifacts" in checks["keeper"]["detail"]


def test_the_keeper_check_counts_compiled_artifacts_and_their_bytes(socket_dir: Path, keeper: object) -> None:
    """Issue 32: doctor counted entries and ignored the artifacts' bytes, which share the same budget."""
    import weightcache as wc

    wc.Cache(socket_dir).put_artifact("ab" * 32, wc.ArtifactKey("test.kind", {"n": 1}), b"x" * 3000)
    rc, checks = doctor(socket_dir)
    assert rc == 0 and "1 compiled artifact (2.9 KiB)" in checks["keeper"]["detail"], checks["keeper"]


def test_an_open_socket_directory_fails_with_the_fix(socket_dir: Path) -> None:
    socket_dir.mkdir(mode=0o755)
    os.chmod(socket_dir, 0o755)
    rc, checks = doctor(socket_dir, check=False)
    assert rc == 1
    assert checks["socket dir"]["status"] == "fail" and "0755" in checks["socket dir"]["detail"]
    assert checks["socket dir"]["fix"] == f"Run: chmod 700 {socket_dir}"
    text = wc_cli("doctor", "--socket-dir", str(socket_dir), check=False)
    assert text.returncode == 1
    assert "FAIL  socket dir" in text.stdout and f"-> Run: chmod 700 {socket_dir}" in text.stdout
    assert "1 problem(s): socket dir" in text.stdout


def test_a_symlinked_socket_directory_fails(socket_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    socket_dir.symlink_to(target)
    rc, checks = doctor(socket_dir, check=False)
    assert rc == 1 and checks["socket dir"]["status"] == "fail" and "symlink" in checks["socket dir"]["detail"]


@pytest.mark.cuda
def test_every_gpu_passes_the_vmm_round_trip(socket_dir: Path) -> None:
    """Each GPU's line also says, as the device reports it, whether its segments are created RDMA-capable."""
    import torch
    from cuda.bindings import driver as cu

    rc, checks = doctor(socket_dir)
    assert rc == 0 and checks["cuda"]["status"] == "ok", checks["cuda"]
    torch.zeros(1, device="cuda:0")  # initialises the driver for the attribute queries below
    attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    for i in range(torch.cuda.device_count()):
        gpu = checks[f"cuda:{i}"]
        assert gpu["status"] == "ok" and "mapped read-only" in gpu["detail"], gpu
        err, supported = cu.cuDeviceGetAttribute(attribute, cu.cuDeviceGet(i)[1])
        assert err == cu.CUresult.CUDA_SUCCESS
        rdma = (
            "GPUDirect RDMA with VMM: supported (segments created RDMA-capable)"
            if supported
            else "GPUDirect RDMA with VMM: not supported (segments created without the flag)"
        )
        assert rdma in gpu["detail"], gpu


@pytest.mark.cuda
def test_writable_gpu_mappings_are_a_warning(socket_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "doctor", "--json", "--socket-dir", str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WEIGHTCACHE_CUDA_WRITABLE": "1"},
    )
    gpu = {c["name"]: c for c in json.loads(out.stdout)}["cuda:0"]
    assert gpu["status"] == "warn" and "read-WRITE (WEIGHTCACHE_CUDA_WRITABLE is set)" in gpu["detail"], gpu


def test_a_relative_weightcache_dir_fails_the_socket_dir_check_with_its_fix_and_skips_the_keeper() -> None:
    """$WEIGHTCACHE_DIR relative: the socket directory check fails saying why and what to do, and the keeper
    check is skipped (both failed as 'the check itself failed', without a fix)."""
    env = {**os.environ, "WEIGHTCACHE_DIR": "relative/dir"}
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "doctor", "--json"], capture_output=True, text=True, env=env
    )
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert out.returncode == 1
    assert checks["socket dir"]["status"] == "fail" and "relative" in checks["socket dir"]["detail"]
    assert "the check itself failed" not in checks["socket dir"]["detail"] and checks["socket dir"]["fix"]
    assert checks["keeper"]["status"] == "skip"
