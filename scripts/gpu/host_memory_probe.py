"""Copy speed between one GPU and host memory of each kind the pool could use, next to a
cudaHostAlloc'd (pinned) buffer, measured in the same run: memfd shared memory registered
with cudaHostRegister (the arena as it is), the same with MADV_HUGEPAGE, anonymous
private memory registered. Prints one JSON line; the host's huge-page settings with it.

  python3 scripts/gpu/host_memory_probe.py [MiB]
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
from pathlib import Path

import torch
from cuda.bindings import runtime as rt


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"unreadable: {exc}"


def _timed(fn, reps: int = 5) -> float:  # noqa: ANN001
    best = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best.append(time.perf_counter() - t0)
    return sorted(best)[len(best) // 2]


def _memfd(nbytes: int, huge: bool) -> mmap.mmap:
    fd = os.memfd_create("kvgate-probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    os.close(fd)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    return m


def main() -> int:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    n = mib * 2**20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(), "MiB": mib,
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "hugepages_total": [ln for ln in _read("/proc/meminfo").splitlines() if ln.startswith(("HugePages_Total",
                                                                                           "Hugepagesize"))],
    }

    def measure(label: str, host: torch.Tensor) -> None:
        host.fill_(1)  # fault every page in
        d2h = _timed(lambda: host.copy_(dev, non_blocking=True))
        h2d = _timed(lambda: dev.copy_(host, non_blocking=True))
        out[label] = {"d2h_GBps": round(n / d2h / 1e9, 2), "h2d_GBps": round(n / h2d / 1e9, 2)}
        print(label, out[label], file=sys.stderr, flush=True)

    measure("pinned", pinned)
    for label, huge in (("memfd_registered", False), ("memfd_hugepage_registered", True)):
        m = _memfd(n, huge)
        t = torch.frombuffer(m, dtype=torch.uint8)
        t.fill_(0)
        t0 = time.perf_counter()
        (err,) = rt.cudaHostRegister(t.data_ptr(), n, rt.cudaHostRegisterPortable)
        reg_s = time.perf_counter() - t0
        if err != rt.cudaError_t.cudaSuccess:
            out[label] = {"error": err.name}
            continue
        measure(label, t)
        out[label]["register_s"] = round(reg_s, 3)
        smaps = _read("/proc/self/smaps_rollup")
        out[label]["shmem_huge"] = [ln for ln in smaps.splitlines() if "Huge" in ln]
        rt.cudaHostUnregister(t.data_ptr())
        del t
        m.close()
    anon = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(anon, dtype=torch.uint8)
    t.fill_(0)
    (err,) = rt.cudaHostRegister(t.data_ptr(), n, rt.cudaHostRegisterPortable)
    if err == rt.cudaError_t.cudaSuccess:
        measure("anonymous_registered", t)
        rt.cudaHostUnregister(t.data_ptr())
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
