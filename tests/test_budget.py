"""Parsing memory budgets (`weightcache serve --max-bytes/--max-fraction`); their effect is in test_cache.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weightcache.budget import Budget, host_memory_bytes, parse_budget, parse_size


def test_budget_parsing() -> None:
    assert parse_size("512") == 512 and parse_size("64K") == 65536 and parse_size("1.5GiB") == 3 << 29
    assert parse_budget(["8G", "cpu=1M", "GPU-abc=2T"]) == Budget(8 << 30, {"cpu": 1 << 20, "GPU-abc": 2 << 40})
    assert parse_budget(["GPU-x=4G"]).limit("cpu") is None
    assert parse_budget(max_fraction=0.5).limit("cpu") == host_memory_bytes() // 2
    # the fraction caps whatever --max-bytes gave the CPU, a bare size included; it never raises it
    half = host_memory_bytes() // 2
    assert parse_budget(["1M"], 0.5).limit("cpu") == 1 << 20
    assert parse_budget([f"{4 * half}"], 0.5).limit("cpu") == half
    assert parse_budget(["1M"], 0.5).limit("GPU-x") == 1 << 20
    for bad in (["lots"], ["-1G"], ["gpu0=4G"]):
        with pytest.raises(ValueError, match="expected|positive"):
            parse_budget(bad)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        parse_budget(max_fraction=1.5)
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "serve", "--socket-dir", "/tmp/unused", "--max-bytes", "x"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "bad budget: size 'x'" in out.stderr
