"""Replica processes for the GPU keeper served over its sockets on a real GPU: `kvpool keeper
--backing vmm` runs as its own process (the command an operator starts), and each replica here
is a spawned process with its own CUDA context that reaches it as a connector would, through
kvpool.gpu.tier_client.TierClient (hello on the control socket, the buffer's descriptors over
the attach socket, mapped with CUDA's VMM), then moves pages on the GPU.

  socket_replica(conn, sock_path, tenant, token, device)
      answers ("ok", client_id, same_gpu, device_name) once connected, then obeys:
      ("publish", keys, seed, delay, edge)
                 reserve the keys' pages at the keeper; on a side stream torch.cuda._sleep(delay)
                 (the stream delay), then each page's seeded bytes written into the tier. `edge`:
                 "host": the pages sketched on the GPU after the write (same stream), the host
                 waits for both, then commits the sketches (the tier's commit edge); "none": the
                 commit sent at once with the sketches of the sources (the control: the edge
                 dropped, the write still queued behind the delay). Answers (committed, pages).
      ("load", keys, seed)
                 acquire the keys at the keeper, copy each page device to device into the
                 replica's own tensor, wait for the copy, sketch the copy on the GPU, release.
                 Answers (bytes differing from the seed's content, indexes whose sketch differs
                 from the digest the keeper committed, miss cause or None).
      ("sync",) / ("exit",)
Answers are tuples whose first item is "ok" or "error" (the exception's type and text).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from kvpool.errors import PoolError
from kvpool.pool.keys import Namespace

NS = Namespace("keeper-socket", "r1", "tok", "bfloat16", "cuda", 16, 2, 2, 64)


def keys(n: int, base: int = 0) -> list[bytes]:
    return [hashlib.blake2b(f"key:{base + i}".encode(), digest_size=16).digest() for i in range(n)]


def socket_replica(conn: Any, sock_path: str, tenant: str, token: str, device: int = 0) -> None:  # noqa: ANN401, C901
    import torch

    from kvpool.gpu.sketch import Sketcher, digests
    from kvpool.gpu.tier_client import TierClient
    from kvpool.pool.digest import SKETCH_COLS, SKETCH_ROW

    torch.cuda.set_device(device)
    dev = torch.device("cuda", device)
    torch.zeros(1, device=dev)  # torch's primary context first: the mapping is made in it
    client = TierClient(sock_path, tenant, token, name=f"replica-{os.getpid()}", device_index=device,
                        timeout_s=30.0, stale_after_s=30.0).connect()
    tier = client.tier
    size = tier.descriptor.page_size
    side = torch.cuda.Stream(dev)
    sketcher = Sketcher(dev)

    def page(p: int) -> torch.Tensor:
        view = tier.page_view(p)
        t = torch.as_tensor(view)
        if t.data_ptr() != view.ptr or t.device.type != "cuda":
            raise RuntimeError(f"torch.as_tensor copied the tier's page {p}: a write would miss the tier")
        return t

    def seeded(seed: int, p: int) -> torch.Tensor:
        g = torch.Generator(device=dev)
        g.manual_seed(int(hashlib.blake2b(f"{seed}:{p}".encode()).hexdigest()[:15], 16))
        return torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev, generator=g)

    def sketched(data: torch.Tensor, n: int) -> list[bytes]:
        sk = sketcher.sketch(data.view(-1, SKETCH_ROW))
        return digests(sk.cpu().numpy().reshape(n, size // SKETCH_ROW, SKETCH_COLS), size)

    def publish(ks: list[bytes], seed: int, delay: int, edge: str) -> tuple:
        res = client.reserve(NS, ks, [size] * len(ks))
        if not res.reservation_id:
            return 0, [s.status.value for s in res.slots]
        pages = [s.page for s in res.slots]
        sources = [seeded(seed, p) for p in pages]
        torch.cuda.synchronize(dev)  # the sources exist before the side stream reads them
        with torch.cuda.stream(side):
            if delay:
                torch.cuda._sleep(delay)
            for p, src in zip(pages, sources):
                page(p).copy_(src)
        if edge == "host":
            with torch.cuda.stream(side):  # the sketch reads the pages after the write
                sums = sketched(torch.cat([page(p) for p in pages]), len(pages))
            side.synchronize()
        elif edge == "none":
            sums = sketched(torch.cat(sources), len(pages))  # of the sources: the write still queued
        else:
            raise ValueError(f"edge {edge!r}: host or none")
        return client.commit(res.reservation_id, sums).committed, pages

    def load(ks: list[bytes], seed: int) -> tuple:
        acq = client.acquire(NS, ks)
        if not acq.lease_id:
            return None, None, acq.miss.cause.value
        try:
            refs = [acq.hits[i] for i in range(len(acq.hits))]
            own = torch.empty(len(refs) * size, dtype=torch.uint8, device=dev)
            for i, ref in enumerate(refs):
                own[i * size:(i + 1) * size].copy_(page(ref.page))
            torch.cuda.synchronize(dev)  # the copy out completed before the release
        finally:
            client.release(acq.lease_id)
        want = torch.cat([seeded(seed, ref.page) for ref in refs])
        differ = int((own != want).sum().item())
        got = sketched(own, len(refs))
        bad = [i for i, (g, ref) in enumerate(zip(got, refs)) if g != ref.digest]
        miss = None if acq.miss is None else acq.miss.cause.value
        return differ, bad, miss

    conn.send(("ok", client.client_id, tier.same_gpu, torch.cuda.get_device_name(dev)))
    try:
        while True:
            cmd = conn.recv()
            try:
                op = cmd[0]
                if op == "publish":
                    conn.send(("ok", *publish(*cmd[1:])))
                elif op == "load":
                    conn.send(("ok", *load(*cmd[1:])))
                elif op == "sync":
                    torch.cuda.synchronize(dev)
                    conn.send(("ok",))
                elif op == "exit":
                    torch.cuda.synchronize(dev)
                    conn.send(("ok",))
                    return
                else:
                    conn.send(("error", "ValueError", f"unknown command {op!r}"))
            except (PoolError, RuntimeError, AssertionError, ValueError, IndexError) as exc:  # the parent judges it
                conn.send(("error", type(exc).__name__, str(exc)))
    finally:
        torch.cuda.synchronize(dev)
        client.close()
