"""pyproject.toml: the package builds without a warning, with an SPDX license expression."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def test_the_license_is_an_spdx_expression() -> None:
    """PEP 639: ``license = "Apache-2.0"``; setuptools deprecates the TOML table (builds stop on 2027-02-18)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in project["project"].get("classifiers", []))  # PEP 639
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first setuptools that reads it


def test_building_the_wheel_prints_no_warning(tmp_path: Path) -> None:
    """What `pip install .` runs (the build backend), with this environment's setuptools: no warning at all."""
    setuptools = pytest.importorskip("setuptools")
    if Version(setuptools.__version__) < Version("77"):
        pytest.skip(f"setuptools {setuptools.__version__} here; the package needs >= 77 to build")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "Warning" not in text and "deprecated" not in text, text
    [wheel] = tmp_path.glob("weightcache-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        assert "License-Expression: Apache-2.0" in archive.read(name).decode().splitlines()
