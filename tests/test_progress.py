"""Progress bars on long loads: shown when asked for (or on a terminal for big loads), never otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from models import meta_model

import weightcache as wc
from weightcache import progress


@pytest.mark.parametrize(("setting", "shown"), [(True, True), (False, False), (None, False)])
def test_attach_shows_a_bar_only_when_wanted(
    checkpoint: Path, socket_dir: Path, capsys: pytest.CaptureFixture[str], setting: bool | None, shown: bool
) -> None:
    # None: stderr is captured (not a terminal) and the checkpoint is tiny, so no bar.
    with wc.attach(meta_model(), checkpoint, mode="off", socket_dir=socket_dir, progress=setting) as handle:
        assert handle.source == "disk"
    err = capsys.readouterr().err
    assert ("loading checkpoint" in err) is shown, err


def test_auto_needs_a_terminal_and_a_big_load(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    class Pipe:
        def isatty(self) -> bool:
            return False

    assert progress.wanted(True, 0) and not progress.wanted(False, 1 << 40)
    monkeypatch.setattr("sys.stderr", Pipe())
    assert not progress.wanted(None, progress.AUTO_MIN_BYTES)
    monkeypatch.setattr("sys.stderr", None)  # started with stderr closed (2>&-)
    assert not progress.wanted(None, progress.AUTO_MIN_BYTES)
    monkeypatch.setattr("sys.stderr", Tty())
    assert progress.wanted(None, progress.AUTO_MIN_BYTES)
    assert not progress.wanted(None, progress.AUTO_MIN_BYTES - 1)


def test_loads_count_the_bytes_stored_in_the_files(checkpoint: Path) -> None:
    """The CPU bar counts what is read, not what a dtype conversion makes of it (which would pass 100 %)."""
    import torch

    from weightcache.checkpoint import safetensors_files
    from weightcache.loader import iter_tensors

    stored = sum(t.numel() * t.element_size() for _, t in iter_tensors(checkpoint))
    counted: list[int] = []
    converted = dict(iter_tensors(checkpoint, dtype=torch.float64, progress=counted.append))
    assert sum(counted) == stored < sum(t.numel() * t.element_size() for t in converted.values())
    assert stored <= sum(f.stat().st_size for f in safetensors_files(checkpoint))  # the bar's total


def test_the_bar_counts_bytes_in_binary_units(capsys: pytest.CaptureFixture[str]) -> None:
    with progress.byte_bar(3 << 20, "reading", True) as update:
        assert update is not None
        update(1 << 20)
        update(2 << 20)
    err = capsys.readouterr().err
    assert "reading" in err and " B/3.0 MiB [" in err and "B/s]" in err, err  # sizes as format_bytes prints them
    with progress.byte_bar(10, "reading", False) as update:
        assert update is None


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["off", "daemon"])
def test_gpu_loads_show_a_bar(
    checkpoint: Path, socket_dir: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    # off: streamed through pinned buffers into tensors; daemon: streamed straight into VMM segments, then hashed
    # from them (a bar of its own).
    with wc.attach(
        meta_model(), checkpoint, mode=mode, device="cuda:0", socket_dir=socket_dir, progress=True
    ) as handle:
        assert handle.source in ("disk", "cache")
    err = capsys.readouterr().err
    assert "loading checkpoint" in err, err
    assert ("hashing what was published" in err) is (mode == "daemon"), err


@pytest.mark.parametrize("setting", [True, False])
def test_a_daemon_start_shows_the_publish_too(
    checkpoint: Path, socket_dir: Path, capsys: pytest.CaptureFixture[str], setting: bool
) -> None:
    """The read is one bar; packing into segments (copies and digests, most of a big CPU load) is another, so the
    screen is never blank while a start publishes."""
    with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir, progress=setting) as handle:
        assert handle.source == "cache" and handle.read_disk
    err = capsys.readouterr().err
    assert ("loading checkpoint" in err) is setting, err
    assert ("publishing into the cache" in err) is setting, err
