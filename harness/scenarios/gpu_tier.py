"""Worker processes of the GPU tier's tests (started with the `spawn` method: each has its own
CUDA context and maps the keeper's buffer itself, as a replica does). A worker attaches with
a ticket, then obeys the commands its parent sends over a pipe and answers each; the parent
plays the keeper (kvpool.gpu.keeper.GpuKeeper: the tier's bookkeeping) and decides when a page
is committed or released, so each ordering edge is the parent's to keep or drop.

  tier_worker(conn, path, ticket, device)   on the GPU (VMM):
      ("fill", pages, seed)            seeded bytes into the pages, synchronized.
      ("write", pages, seed, delay, edge)
                                       on a side stream: torch.cuda._sleep(delay) (the stream
                                       delay), then the seeded bytes into the pages. `edge`:
                                       "host" answers once the host saw the copy complete (the
                                       tier's commit edge); "ipc" records an interprocess event
                                       after the copy and answers its handle at once; "none"
                                       answers at once (the control: the edge dropped).
      ("read", pages, delay, handle, edge)
                                       on a side stream: cuStreamWaitEvent on the event `handle`
                                       names (if any), the delay, then the pages copied into the
                                       worker's own tensor (device to device, or peer to peer).
                                       `edge`: "host" answers once the copy completed (the tier's
                                       release edge), "none" at once (the control).
      ("check", seed)                  synchronize; the bytes of the worker's tensor that differ
                                       from the seed's (the byte-exact oracle).
      ("rate", pages, repeats)         seconds of `repeats` copies of the pages into the worker's
                                       tensor (one copy of the whole run of pages each).
      ("sync",) / ("exit",)
  host_worker(conn, path, ticket)      the same protocol's fill / check on a host stand-in
      (MEMFD) buffer, for the tests without a GPU.
Answers are tuples whose first item is "ok" or "error" (with the exception's type and text).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from kvpool.errors import PoolError


def page_bytes(seed: int, page: int, size: int) -> np.ndarray:
    """The seeded content of `page` (the same in every process)."""
    return np.random.default_rng([seed, page]).integers(0, 256, size, dtype=np.uint8)


def digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def host_worker(conn: Any, path: str, ticket: bytes) -> None:  # noqa: ANN401 - a multiprocessing connection
    from kvpool.gpu.tier_map import TierMap

    tier = TierMap.attach(path, ticket)
    size = tier.descriptor.page_size
    try:
        while True:
            cmd = conn.recv()
            try:
                if cmd[0] == "fill":
                    for p in cmd[1]:
                        tier.page_view(p)[:] = page_bytes(cmd[2], p, size).tobytes()
                    conn.send(("ok",))
                elif cmd[0] == "check":
                    _, pages, seed = cmd
                    differing = sum(int(np.count_nonzero(np.frombuffer(tier.page_view(p), np.uint8)
                                                         != page_bytes(seed, p, size))) for p in pages)
                    conn.send(("ok", differing))
                elif cmd[0] == "generation":
                    conn.send(("ok", [tier.generation(p) for p in cmd[1]]))
                elif cmd[0] == "exit":
                    conn.send(("ok",))
                    return
                else:
                    conn.send(("error", "ValueError", f"unknown command {cmd[0]!r}"))
            except (PoolError, RuntimeError, AssertionError, ValueError, IndexError) as exc:  # the parent fails the test
                conn.send(("error", type(exc).__name__, str(exc)))
    finally:
        tier.close()


def tier_worker(conn: Any, path: str, ticket: bytes, device: int = 0) -> None:  # noqa: ANN401, C901
    import torch

    from kvpool.gpu.tier_map import TierMap
    from kvpool.gpu.vmm import IpcEvent

    torch.cuda.set_device(device)
    dev = torch.device("cuda", device)
    torch.zeros(1, device=dev)  # torch's context first: the mapping is made in the same primary context
    tier = TierMap.attach(path, ticket, device_index=device)
    size = tier.descriptor.page_size
    vmm = tier.mapping.vmm
    side = torch.cuda.Stream(dev)
    own: torch.Tensor | None = None
    own_pages: list[int] = []
    events: list[IpcEvent] = []

    def page(p: int) -> torch.Tensor:
        return torch.as_tensor(tier.page_view(p), device=dev)

    def seeded(seed: int, p: int) -> torch.Tensor:
        return torch.from_numpy(page_bytes(seed, p, size)).to(dev)

    conn.send(("ok", tier.same_gpu, torch.cuda.get_device_name(dev)))
    try:
        while True:
            cmd = conn.recv()
            try:
                op = cmd[0]
                if op == "fill":
                    _, pages, seed = cmd
                    for p in pages:
                        page(p).copy_(seeded(seed, p))
                    torch.cuda.synchronize(dev)
                    conn.send(("ok",))
                elif op == "write":
                    _, pages, seed, delay, edge = cmd
                    sources = [seeded(seed, p) for p in pages]
                    torch.cuda.synchronize(dev)  # the sources exist before the side stream reads them
                    with torch.cuda.stream(side):
                        if delay:
                            torch.cuda._sleep(delay)
                        for p, src in zip(pages, sources):
                            page(p).copy_(src)
                    if edge == "ipc":
                        ev = IpcEvent.create(vmm)
                        ev.record(side.cuda_stream)
                        events.append(ev)
                        conn.send(("ok", ev.handle()))
                    elif edge == "host":
                        side.synchronize()
                        conn.send(("ok", None))
                    else:
                        conn.send(("ok", None))
                elif op == "read":
                    _, pages, delay, handle, edge = cmd
                    own = torch.zeros(len(pages) * size, dtype=torch.uint8, device=dev)
                    own_pages = list(pages)
                    torch.cuda.synchronize(dev)
                    if handle is not None:
                        ev = IpcEvent.open(vmm, handle)
                        events.append(ev)
                        ev.wait(side.cuda_stream)
                    with torch.cuda.stream(side):
                        if delay:
                            torch.cuda._sleep(delay)
                        for i, p in enumerate(pages):
                            own[i * size:(i + 1) * size].copy_(page(p))
                    if edge == "host":
                        side.synchronize()
                    conn.send(("ok",))
                elif op == "check":
                    _, seed = cmd
                    torch.cuda.synchronize(dev)
                    assert own is not None, "check before read"
                    want = torch.cat([seeded(seed, p) for p in own_pages])
                    conn.send(("ok", int((own != want).sum().item())))
                elif op == "rate":
                    _, pages, repeats = cmd
                    first, n = min(pages), len(pages)
                    assert sorted(pages) == list(range(first, first + n)), "rate copies a run of pages"
                    src = torch.as_tensor(tier.mapping.view(first * size, n * size), device=dev)
                    dst = torch.empty_like(src)
                    dst.copy_(src)
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    for _ in range(repeats):
                        dst.copy_(src)
                    torch.cuda.synchronize(dev)
                    conn.send(("ok", (time.perf_counter() - t0) / repeats, n * size))
                elif op == "sync":
                    torch.cuda.synchronize(dev)
                    conn.send(("ok",))
                elif op == "exit":
                    torch.cuda.synchronize(dev)
                    conn.send(("ok",))
                    return
                else:
                    conn.send(("error", "ValueError", f"unknown command {op!r}"))
            except (PoolError, RuntimeError, AssertionError, ValueError, IndexError) as exc:  # the parent fails the test
                conn.send(("error", type(exc).__name__, str(exc)))
    finally:
        torch.cuda.synchronize(dev)
        for ev in events:
            ev.close()
        tier.close()
