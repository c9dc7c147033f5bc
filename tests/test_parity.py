"""weightcache.parity and `weightcache parity`: tensor tables of a disk-loaded and an attached model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from models import meta_model, model_kwargs

import weightcache as wc
from weightcache import parity


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weightcache", "parity", *args], capture_output=True, text=True)


def test_disk_and_attached_models_have_identical_tables(checkpoint: Path, socket_dir: Path, tmp_path: Path) -> None:
    disk = meta_model(**model_kwargs(checkpoint))
    wc.attach(disk, checkpoint, mode="off")
    attached = meta_model(**model_kwargs(checkpoint))
    with wc.attach(attached, checkpoint, mode="daemon", socket_dir=socket_dir) as handle:
        assert handle.source == "cache"
        table = parity.record(attached)
        assert "head.weight" in table and "embed.weight" in table  # tied names are both listed
        assert table["scale"].kind == "buffer" and table["embed.weight"].kind == "parameter"
        assert parity.compare(parity.record(disk), table) == []
        parity.write_table(disk, tmp_path / "disk.json", source="disk")
        parity.write_table(attached, tmp_path / "cache.json", source="cache")
    out = cli(str(tmp_path / "disk.json"), str(tmp_path / "cache.json"))
    assert out.returncode == 0 and out.stdout.startswith("identical: "), out.stdout + out.stderr


def test_every_difference_is_named(tmp_path: Path) -> None:
    base = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2), "gone": torch.zeros(1)}
    other = {
        "a": torch.arange(6.0).reshape(3, 2).t().contiguous().t(),  # same values? no: other layout and values
        "b": torch.ones(2, dtype=torch.float16),
        "new": torch.zeros(1),
    }
    differences = parity.compare(parity.record(base), parity.record(other))
    assert "gone: only in the left table" in differences
    assert "new: only in the right table" in differences
    assert "b: dtype float32 vs float16" in differences
    assert any(d.startswith("a: shape (2, 3) vs (3, 2)") for d in differences) or any(
        d.startswith("a: stride") for d in differences
    )
    parity.write_table(base, tmp_path / "l.json")
    parity.write_table(other, tmp_path / "r.json")
    out = cli(str(tmp_path / "l.json"), str(tmp_path / "r.json"), "--json")
    assert out.returncode == 1
    assert json.loads(out.stdout)["differences"] == differences


def test_equal_values_in_another_layout_hash_equal() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    assert parity.tensor_sha256(t.t().contiguous().t()) == parity.tensor_sha256(t)
    assert parity.record({"t": t.t().contiguous().t()})["t"].stride != parity.record({"t": t})["t"].stride


def test_a_bad_table_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("{}")
    out = cli(str(tmp_path / "x.json"), str(tmp_path / "x.json"))
    assert out.returncode == 1
    assert "cannot read the tensor table" in out.stderr and "write_table" in out.stderr
    out = cli("--engine", "vllm", "--model", str(tmp_path), "--prompt-ids", "a,b")  # checked before any engine
    assert out.returncode == 1 and out.stderr.startswith("weightcache parity: --prompt-ids takes"), out.stderr
