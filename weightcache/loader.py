"""Loading a safetensors checkpoint onto a GPU at the speed of the disk.

Each file is read front to back with large sequential reads into a few pinned host buffers, and each buffer
is copied to the GPU asynchronously while the next one is read: the disk never waits for the GPU, and the
host never holds more than the staging buffers. Tensors are allocated on the device once, in their stored
dtype, then converted if a ``dtype`` was asked for.

(On CPU, :func:`load_state_dict` maps the files instead, through safetensors: nothing to stage.) All loading of
tensor data lives here; :mod:`weightcache.checkpoint` reads only headers.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import attrs
import torch
from safetensors import SafetensorError, safe_open

from .binding import check_tensors
from .checkpoint import qualified_name, read_header, safetensors_files
from .errors import CheckpointError
from .progress import byte_bar, wanted
from .torch_dtypes import SAFETENSORS_DTYPES, convertible

#: Bytes per sequential read (and per pinned staging buffer). Small enough that pinning the buffers (a fixed
#: cost of every load: page-locking runs at ~1 GB/s) stays small; large enough that per-read costs vanish.
CHUNK_BYTES = 8 << 20
STAGING_BUFFERS = 4
#: How far ahead of the current chunk the kernel is asked to read.
PREFETCH_BYTES = 64 << 20
#: How much of the checkpoint's beginning the kernel is asked to read while a load sets up (pinning staging
#: buffers, allocating tensors or segments: ~0.1-0.2 s on an H200 host, i.e. a few hundred MB of disk time).
HEAD_PREFETCH_BYTES = 384 << 20


@attrs.frozen
class StoredTensor:
    """One tensor as a safetensors file stores it: where its bytes are, and what they are."""

    name: str
    file: Path
    #: absolute byte range of the data in ``file``
    begin: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def checkpoint_layout(checkpoint: str | os.PathLike[str]) -> list[StoredTensor]:
    """Every tensor of the checkpoint, in file order, from the headers (checked against the files)."""
    out: list[StoredTensor] = []
    seen: set[str] = set()
    for file in safetensors_files(checkpoint):
        raw, header = read_header(file)
        start = 8 + len(raw)
        entries = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            assert isinstance(info, dict)
            dtype = SAFETENSORS_DTYPES.get(str(info.get("dtype")))
            if dtype is None:
                raise CheckpointError(
                    f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}, which torch cannot hold"
                )
            shape = info.get("shape")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise CheckpointError(f"{file}: tensor {name!r} has a malformed shape {shape!r}")
            begin, end = info["data_offsets"]  # bounds checked by read_header
            expected = math.prod(shape) * dtype.itemsize
            if expected != end - begin:
                raise CheckpointError(
                    f"{file}: tensor {name!r} is {dtype} {shape} ({expected} bytes) but its data_offsets span "
                    f"{end - begin} bytes; the file is corrupt"
                )
            if name in seen:
                raise CheckpointError(f"tensor {name!r} appears in more than one file of the checkpoint ({file.name})")
            seen.add(name)
            entries.append(StoredTensor(name, file, start + begin, start + end, dtype, tuple(shape)))
        out.extend(sorted(entries, key=lambda e: e.begin))
    return out


def iter_tensors(
    checkpoint: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    progress: Callable[[int], object] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, on CPU, one at a time.

    Floating point tensors (float16, bfloat16, float32, float64) are converted to ``dtype`` when it is given;
    integer, boolean and FP8 tensors (quantized weights) are not. ``progress``, when given, is called with the
    bytes each tensor takes in the file (before any conversion).
    """
    seen: dict[str, Path] = {}
    for file in safetensors_files(checkpoint):
        read_header(file)  # clear errors for truncation before safetensors' own
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if name in seen:
                        raise CheckpointError(f"tensor {name!r} is in both {seen[name].name} and {file.name}")
                    seen[name] = file
                    with interrupts_deferred():
                        tensor = f.get_tensor(name)
                    if progress is not None:
                        progress(tensor.numel() * tensor.element_size())
                    if dtype is not None and tensor.dtype != dtype and convertible(tensor.dtype):
                        tensor = tensor.to(dtype)
                    yield name, tensor
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read {file}: {exc}; the file is corrupt or truncated") from exc


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until it ends, then raise KeyboardInterrupt.

    safetensors turns a KeyboardInterrupt raised while it reads a tensor into an unrelated ValueError ("could not
    determine the shape of object type 'torch.storage.UntypedStorage'"), so reading never sees one: a first Ctrl-C
    is noted and raised when the read returns; a second one is raised at once. Only where Python's own handler
    is in place (the main thread, no handler of the application's); elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return
    pending = False

    def note(signum: int, frame: object) -> None:
        nonlocal pending
        if pending:
            raise KeyboardInterrupt  # asked twice
        pending = True

    signal.signal(signal.SIGINT, note)
    try:
        yield
    except BaseException:
        if pending:
            raise KeyboardInterrupt from None  # whatever the read made of the interrupt, it was an interrupt
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def load_state_dict(
    checkpoint: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    progress: bool | None = False,
) -> dict[str, torch.Tensor]:
    """Load the whole checkpoint into a CPU state dict, convert it to ``dtype`` and apply ``transform``.

    ``progress``: show a bar of the bytes read on stderr (None: only on a terminal and for a checkpoint of at
    least 1 GiB; see :mod:`weightcache.progress`).
    """
    total = sum(f.stat().st_size for f in safetensors_files(checkpoint)) if progress is not False else 0
    state: dict[str, torch.Tensor] = {}
    with byte_bar(total, "loading checkpoint", wanted(progress, total)) as update:
        for name, tensor in iter_tensors(checkpoint, dtype=dtype, progress=update):
            state[name] = tensor
    return apply_transform(state, transform)


def apply_transform(
    state: dict[str, torch.Tensor],
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
) -> dict[str, torch.Tensor]:
    """``transform(state)``, checked to return a state dict (``state`` itself when there is no transform)."""
    if transform is None:
        return state
    out = transform(state)
    if not isinstance(out, dict):
        raise CheckpointError(
            f"transform {qualified_name(transform)} returned {type(out).__name__}; expected a dict of name -> tensor"
        )
    check_tensors(out)
    return out


def load_to_device(
    checkpoint: str | os.PathLike[str],
    device: torch.device,
    *,
    dtype: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read every tensor of ``checkpoint`` into ``device`` memory (a CUDA device); returns name -> tensor.

    ``progress``, when given, is called with the number of bytes read after each chunk.
    """
    if device.type != "cuda":
        raise ValueError(f"load_to_device streams to a CUDA device; got {device}")
    staging = pinned_staging()  # before the prefetch starts: see pinned_staging
    prefetch_head(safetensors_files(checkpoint))
    layout = checkpoint_layout(checkpoint)
    out: dict[str, torch.Tensor] = {}
    for stored in layout:
        out[stored.name] = torch.empty(stored.shape, dtype=stored.dtype, device=device)
    stream_into(layout, device, lambda t: out[t.name].view(-1).view(torch.uint8), progress, staging)
    if dtype is not None:
        for name, t in out.items():
            if t.dtype != dtype and convertible(t.dtype):
                out[name] = t.to(dtype)
    torch.cuda.synchronize(device)
    return out


def load_weights(
    checkpoint: str | os.PathLike[str],
    device: torch.device,
    dtype: torch.dtype | None = None,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    progress: bool | None = False,
) -> dict[str, torch.Tensor]:
    """The checkpoint as a state dict on ``device``, converted to ``dtype``, with ``transform`` applied there.

    CPU: the files are memory-mapped (pages are read when first touched). CUDA: they are streamed with large
    sequential reads through pinned buffers (:func:`load_to_device`). ``progress``: a bar of the bytes read on
    stderr (None: only on a terminal and for at least 1 GiB; see :mod:`weightcache.progress`).
    """
    if device.type == "cuda":
        total = sum(f.stat().st_size for f in safetensors_files(checkpoint)) if progress is not False else 0
        with byte_bar(total, "loading checkpoint", wanted(progress, total)) as update:
            state = load_to_device(checkpoint, device, dtype=dtype, progress=update)
        return apply_transform(state, transform)
    return load_state_dict(checkpoint, dtype=dtype, transform=transform, progress=progress)


def pinned_staging() -> torch.Tensor:
    """The page-locked host buffer that :func:`stream_into` reads through (``STAGING_BUFFERS`` chunks).

    Allocate it before :func:`prefetch_head` starts: measured on an H200 host with the page cache dropped,
    pinning 32 MiB took ~23 ms alone but 350-440 ms while the kernel was reading the checkpoint ahead
    (``benchmarks/probe_pin.py``).
    """
    return torch.empty(STAGING_BUFFERS * CHUNK_BYTES, dtype=torch.uint8).pin_memory()


def prefetch_head(files: Iterable[Path], nbytes: int = HEAD_PREFETCH_BYTES) -> threading.Thread:
    """Ask the kernel, from a background thread, to start reading the first ``nbytes`` of ``files`` (in order).

    A load's set-up (pinning the staging buffers, allocating every tensor or segment on the device) takes a
    fixed ~0.1-0.2 s; with this the disk reads during it instead of idling, which is most of the difference
    between a 1 GiB load and the disk's bandwidth. Advice only: errors are ignored, nothing waits for it.
    """
    files = list(files)

    def run() -> None:
        left = nbytes
        for file in files:
            if left <= 0:
                return
            with contextlib.suppress(OSError):
                fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    size = os.fstat(fd).st_size
                    pos = 0
                    while pos < size and left > 0:  # in chunks, so the first bytes are asked for first
                        n = min(CHUNK_BYTES, size - pos, left)
                        os.posix_fadvise(fd, pos, n, os.POSIX_FADV_WILLNEED)
                        pos += n
                        left -= n
                finally:
                    os.close(fd)

    thread = threading.Thread(target=run, name="weightcache-prefetch", daemon=True)
    thread.start()
    return thread


def stream_into(
    layout: list[StoredTensor],
    device: torch.device,
    destination: Callable[[StoredTensor], torch.Tensor],
    progress: Callable[[int], None] | None = None,
    staging: torch.Tensor | None = None,
) -> None:
    """Copy every tensor's bytes from its file into ``destination(tensor)`` (a flat ``uint8`` device view of
    ``tensor.nbytes``), reading each file front to back through pinned staging buffers (``staging``, from
    :func:`pinned_staging`, or allocated here). Returns when done."""
    if staging is None:
        staging = pinned_staging()
    buffers = [staging[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES] for i in range(STAGING_BUFFERS)]
    events: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    turn = 0
    by_file: dict[Path, list[StoredTensor]] = {}
    for t in layout:
        by_file.setdefault(t.file, []).append(t)
    with torch.cuda.device(device):
        for file, tensors in by_file.items():
            plan = [(t.begin, t.end, destination(t)) for t in tensors if t.nbytes]
            turn = _stream_file(file, plan, buffers, events, stream, turn, progress)
        stream.synchronize()
    torch.cuda.current_stream(device).wait_stream(stream)


def _stream_file(
    file: Path,
    plan: list[tuple[int, int, torch.Tensor]],
    buffers: list[torch.Tensor],
    events: list[torch.cuda.Event | None],
    stream: torch.cuda.Stream,
    turn: int,
    progress: Callable[[int], None] | None,
) -> int:
    plan.sort(key=lambda p: p[0])
    if not plan:
        return turn
    first, last = plan[0][0], max(p[1] for p in plan)
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_SEQUENTIAL)
        k = 0  # index into plan of the first tensor not yet completely copied
        pos = first
        asked = first  # the kernel has been asked to read [first, asked)
        while pos < last:
            n = min(CHUNK_BYTES, last - pos)
            # Keep the kernel reading PREFETCH_BYTES ahead while this chunk goes to the GPU: the disk never idles.
            # Only the part not asked for yet: advice over a range costs time per page even when cached.
            want = min(pos + n + PREFETCH_BYTES, last)
            if want > asked:
                start = max(asked, pos + n)
                if want > start:
                    os.posix_fadvise(fd, start, want - start, os.POSIX_FADV_WILLNEED)
                asked = want
            slot = turn % len(buffers)
            if events[slot] is not None:
                events[slot].synchronize()  # type: ignore[union-attr]
            buf = buffers[slot]
            view = buf.numpy().data.cast("B")[:n]
            got = 0
            while got < n:
                r = os.preadv(fd, [view[got:]], pos + got)
                if r == 0:
                    raise CheckpointError(f"{file} ended early at byte {pos + got}: the file is truncated")
                got += r
            with torch.cuda.stream(stream):
                while k < len(plan) and plan[k][0] < pos + n:
                    begin, end, dst = plan[k]
                    lo, hi = max(begin, pos), min(end, pos + n)
                    dst[lo - begin : hi - begin].copy_(buf[lo - pos : hi - pos], non_blocking=True)
                    if end <= pos + n:
                        k += 1
                    else:
                        break
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events[slot] = event
            turn += 1
            pos += n
            if progress is not None:
                progress(n)
    finally:
        os.close(fd)
    return turn
