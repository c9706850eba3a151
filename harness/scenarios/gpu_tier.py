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
                                       "host" sketches the pages on the GPU after the copy (same
                                       stream) and answers their kv-sketch-1 digests once the host
                                       saw copy and sketch complete (the tier's commit edge: what
                                       the keeper commits); "ipc" records an interprocess event
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
      ("verify", digests)              the pages read, sketched on the GPU, against the digests
                                       the keeper committed: the indexes of those that differ.
      ("rate", pages, repeats)         seconds of `repeats` copies of the pages into the worker's
                                       tensor (one copy of the whole run of pages each).
      ("sync",) / ("exit",)
  host_worker(conn, path, ticket)      the same protocol's fill / check on a host stand-in
      (MEMFD) buffer, for the tests without a GPU.
Answers are tuples whose first item is "ok" or "error" (with the exception's type and text).

  ManualClock()                        the keeper's clock in the tests (GpuKeeper(clock=...)): it
      moves only when the test advances it, so a ticket minted before a replica's (slow,
      spawned) start is still valid when the replica presents it, and one expires when the
      test says.
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


class ManualClock:
    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


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

    from kvpool.gpu.sketch import Sketcher, digests
    from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW
    from kvpool.gpu.tier_map import TierMap
    from kvpool.gpu.vmm import IpcEvent

    torch.cuda.set_device(device)
    dev = torch.device("cuda", device)
    torch.zeros(1, device=dev)  # torch's context first: the mapping is made in the same primary context
    tier = TierMap.attach(path, ticket, device_index=device)
    size = tier.descriptor.page_size
    vmm = tier.mapping.vmm
    side = torch.cuda.Stream(dev)
    assert size % SKETCH_ROW == 0, "the tests' pages are whole sketch rows"
    sketcher = Sketcher(dev)

    def sketched(data: torch.Tensor, n: int) -> list[bytes]:
        """kv-sketch-1 digests of `n` pages laid end to end in `data` (on the current stream)."""
        sk = sketcher.sketch(data.view(-1, SKETCH_ROW))
        return digests(sk.cpu().numpy().reshape(n, size // SKETCH_ROW, SKETCH_COLS), size)

    own: torch.Tensor | None = None
    own_pages: list[int] = []
    events: list[IpcEvent] = []

    def alias(view) -> torch.Tensor:  # noqa: ANN001 - a CudaArray
        """The tier's bytes as a tensor that aliases them (never a copy: checked). Its device is
        where the memory lives (the keeper's GPU), which torch reads from the pointer."""
        t = torch.as_tensor(view)
        if t.data_ptr() != view.ptr or t.device.type != "cuda":
            raise RuntimeError(f"torch.as_tensor copied the tier's bytes (at {t.data_ptr():#x} on {t.device}, "
                               f"not {view.ptr:#x}): a write would miss the tier")
        return t

    def page(p: int) -> torch.Tensor:
        return alias(tier.page_view(p))

    def seeded(seed: int, p: int) -> torch.Tensor:
        """The seeded content of page p, made on this GPU (the same in every process: torch's
        CUDA generator is counter-based)."""
        g = torch.Generator(device=dev)
        g.manual_seed(int(digest(f"{seed}:{p}".encode())[:15], 16))
        return torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev, generator=g)

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
                        with torch.cuda.stream(side):  # the sketch reads the pages after the copy
                            sums = sketched(torch.cat([page(p) for p in pages]), len(pages))
                        side.synchronize()
                        conn.send(("ok", sums))
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
                elif op == "verify":
                    _, want = cmd
                    torch.cuda.synchronize(dev)
                    assert own is not None, "verify before read"
                    got = sketched(own, len(own_pages))
                    conn.send(("ok", [i for i, (a, b) in enumerate(zip(got, want)) if a != b]))
                elif op == "rate":
                    _, pages, repeats = cmd
                    first, n = min(pages), len(pages)
                    assert sorted(pages) == list(range(first, first + n)), "rate copies a run of pages"
                    src = alias(tier.mapping.view(first * size, n * size))
                    dst = torch.empty(n * size, dtype=torch.uint8, device=dev)
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
