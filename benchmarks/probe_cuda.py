"""One-off probe of the facts the CUDA transport relies on (run on a GPU machine; prints JSON lines).

- the format of torch's GPU UUID, and what a VMM POSIX fd looks like to a process without CUDA (fstat, link);
- whether cuMemSetAccess accepts read-only access for device memory;
- import + map + set-access cost per segment, for several segment sizes and counts;
- sequential disk read bandwidth with the page cache dropped, and pinned host-to-device bandwidth.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time

import torch
from cuda.bindings import driver as cu


def ck(r):
    err = r[0]
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(err))
    return r[1] if len(r) == 2 else (r[1:] if len(r) > 2 else None)


def loc(i: int):
    location = cu.CUmemLocation()
    location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    location.id = i
    return location


def create(size: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = loc(0)
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    g = ck(
        cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    )
    size = -(-size // g) * g
    h = ck(cu.cuMemCreate(size, prop, 0))
    fd = ck(
        cu.cuMemExportToShareableHandle(h, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
    )
    return h, int(fd), size, g


def import_map(fd: int, size: int, flags):
    h = ck(cu.cuMemImportFromShareableHandle(fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    p = ck(cu.cuMemAddressReserve(size, 0, 0, 0))
    ck(cu.cuMemMap(p, size, 0, h, 0))
    ck(cu.cuMemRelease(h))
    a = cu.CUmemAccessDesc()
    a.location = loc(0)
    a.flags = flags
    ck(cu.cuMemSetAccess(p, size, [a], 1))
    return p


def main() -> None:
    torch.zeros(1, device="cuda")
    props = torch.cuda.get_device_properties(0)
    print(
        json.dumps(
            {
                "uuid_str": str(props.uuid),
                "name": props.name,
                "cc": f"{props.major}.{props.minor}",
                "torch": torch.__version__,
                "total_gib": props.total_memory / 2**30,
            }
        ),
        flush=True,
    )
    _, fd, size, g = create(64 << 20)
    st = os.fstat(fd)
    print(
        json.dumps(
            {
                "granularity": g,
                "fd_link": os.readlink(f"/proc/self/fd/{fd}"),
                "mode": oct(st.st_mode),
                "isreg": stat.S_ISREG(st.st_mode),
                "ischr": stat.S_ISCHR(st.st_mode),
                "size": st.st_size,
                "rdev": st.st_rdev,
            }
        ),
        flush=True,
    )
    ro = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    rw = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    try:
        p = import_map(fd, size, ro)

        class A:
            pass

        o = A()
        o.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (int(p), False), "version": 3}
        t = torch.as_tensor(o, device="cuda")
        s = float(t[:1024].float().sum())
        print(json.dumps({"read_only_map": "ok", "read_sum": s}), flush=True)
    except Exception as e:
        print(json.dumps({"read_only_map": repr(e)}), flush=True)
    os.close(fd)
    # import cost by segment size and count
    for seg_gib, count in ((1, 8), (2, 16), (4, 8), (16, 2)):
        segs = [create(seg_gib << 30) for _ in range(count)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ptrs = [import_map(fd_, size_, rw) for (_, fd_, size_, _) in segs]
        t1 = time.perf_counter()
        print(
            json.dumps(
                {
                    "segment_gib": seg_gib,
                    "count": count,
                    "import_map_total_ms": (t1 - t0) * 1e3,
                    "per_segment_ms": (t1 - t0) * 1e3 / count,
                }
            ),
            flush=True,
        )
        for p, (h_, fd_, size_, _) in zip(ptrs, segs):
            ck(cu.cuMemUnmap(p, size_))
            ck(cu.cuMemAddressFree(p, size_))
            ck(cu.cuMemRelease(h_))
            os.close(fd_)
    # pinned H2D bandwidth
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dev.copy_(host)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    print(json.dumps({"pinned_h2d_gbps": 5 * (1 << 30) / (time.perf_counter() - t0) / 1e9}), flush=True)
    pageable = torch.empty(1 << 30, dtype=torch.uint8)
    pageable.fill_(1)
    t0 = time.perf_counter()
    dev.copy_(pageable)
    torch.cuda.synchronize()
    print(json.dumps({"pageable_h2d_gbps": (1 << 30) / (time.perf_counter() - t0) / 1e9}), flush=True)
    # disk
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/probe.bin"
    n = 4 << 30
    buf = os.urandom(64 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n // len(buf)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    mv = bytearray(64 << 20)
    t0 = time.perf_counter()
    total = 0
    while k := os.readv(fd, [mv]):
        total += k
    read_s = time.perf_counter() - t0
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        drop = "ok"
    except OSError as e:
        drop = repr(e)
    os.lseek(fd, 0, 0)
    t0 = time.perf_counter()
    total2 = 0
    while k := os.readv(fd, [mv]):
        total2 += k
    read2_s = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    print(
        json.dumps(
            {
                "disk_write_gbps": n / write_s / 1e9,
                "disk_read_fadvise_gbps": total / read_s / 1e9,
                "drop_caches": drop,
                "disk_read_after_drop_gbps": total2 / read2_s / 1e9,
                "df": os.statvfs(os.path.dirname(path) or ".").f_bavail * os.statvfs(".").f_frsize / 2**30,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
