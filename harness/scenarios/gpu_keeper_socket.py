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
      ("publish_bulk", keys, seed)
                 the same as publish with edge "host" and no delay, for a run of pages too long to
                 write one at a time: one seeded tensor for all of them, written into the tier with
                 one scatter; answers (committed, seconds).
      ("load_bulk", keys, seed, repeats)
                 the load a connector makes of a long prefix, timed `repeats` times: acquire (one
                 frame), one gather of every page from the tier into the replica's own tensor, the
                 host waits for it, release; then, untimed, the bytes checked against the
                 producer's seeded tensor and the pages sketched on the GPU against the committed
                 digests. Also timed, as the baseline in the same process: a plain device-to-device
                 copy of the same number of bytes, and the GPU sketch of them. Answers a dict.
      ("sync",) / ("exit",)
Answers are tuples whose first item is "ok" or "error" (the exception's type and text).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from kvpool.errors import PoolError
from kvpool.pool.keys import Namespace

BULK_CHUNK = 512  # pages per step of a bulk run's writes and checks (bounded scratch memory)
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

    def pages_tensor() -> torch.Tensor:
        """Every page of the tier, as one (pages, page_size) tensor aliasing the mapping."""
        first = tier.page_view(0)
        n = tier.descriptor.num_pages
        if tier.page_view(n - 1).ptr != first.ptr + (n - 1) * size:
            raise RuntimeError("the tier's pages are not laid end to end: no single gather over them")
        view = tier.mapping.view(first.ptr - tier.mapping.ptr, n * size)
        t = torch.as_tensor(view)
        if t.data_ptr() != view.ptr:
            raise RuntimeError("torch.as_tensor copied the tier's pages")
        return t.view(n, size)

    def bulk_source(seed: int, first: int, count: int) -> torch.Tensor:
        """The seeded content of pages first..first+count of a bulk run (chunk by chunk, each
        chunk its own generator: the same in every process and at any chunking of the check)."""
        out = torch.empty(count, size, dtype=torch.uint8, device=dev)
        for c in range(first // BULK_CHUNK, (first + count - 1) // BULK_CHUNK + 1):
            g = torch.Generator(device=dev)
            g.manual_seed(seed * 1_000_003 + c)
            chunk = torch.randint(0, 256, (BULK_CHUNK, size), dtype=torch.uint8, device=dev, generator=g)
            lo, hi = max(first, c * BULK_CHUNK), min(first + count, (c + 1) * BULK_CHUNK)
            out[lo - first:hi - first] = chunk[lo - c * BULK_CHUNK:hi - c * BULK_CHUNK]
        return out

    def chunked_sketches(pages: torch.Tensor, times: dict[str, float] | None = None) -> list[bytes]:
        """kv-sketch-1 digests of (n, size) pages: every chunk sketched on the GPU into one
        int32 tensor (no wait between chunks), one copy of the sketches to the host, then the
        digests. `times` gets the GPU's part (sketch_s) and the host's (digests_s)."""
        n, rows = pages.shape[0], size // SKETCH_ROW
        t0 = time.perf_counter()
        out = torch.empty((n * rows, SKETCH_COLS), dtype=torch.int32, device=dev)
        for lo in range(0, n, BULK_CHUNK):
            part = pages[lo:lo + BULK_CHUNK]
            sketcher.sketch(part.reshape(-1, SKETCH_ROW), out=out[lo * rows:(lo + part.shape[0]) * rows])
        host = out.cpu().numpy()  # waits for the sketches
        t1 = time.perf_counter()
        got = digests(host.reshape(n, rows, SKETCH_COLS), size)
        if times is not None:
            times["sketch_s"], times["digests_s"] = t1 - t0, time.perf_counter() - t1
        return got

    def publish_bulk(ks: list[bytes], seed: int) -> tuple:
        t0 = time.perf_counter()
        res = client.reserve(NS, ks, [size] * len(ks))
        if not res.reservation_id:
            return 0, [s.status.value for s in res.slots]
        pages = [s.page for s in res.slots]
        whole = pages_tensor()
        sums: list[bytes] = []
        for lo in range(0, len(ks), BULK_CHUNK):
            idx = torch.tensor(pages[lo:lo + BULK_CHUNK], dtype=torch.long, device=dev)
            whole.index_copy_(0, idx, bulk_source(seed, lo, len(idx)))
            sums += sketched(whole.index_select(0, idx).view(-1), len(idx))  # after the write, same stream
        torch.cuda.synchronize(dev)
        return client.commit(res.reservation_id, sums).committed, time.perf_counter() - t0

    def load_bulk(ks: list[bytes], seed: int, repeats: int) -> dict:
        whole = pages_tensor()
        own = torch.empty(len(ks), size, dtype=torch.uint8, device=dev)
        times: dict[str, list[float]] = {"acquire": [], "gather": [], "release": [], "load": []}
        refs = []
        for _ in range(repeats + 1):  # the first round warms up (its times are not kept)
            t0 = time.perf_counter()
            acq = client.acquire(NS, ks)
            if not acq.lease_id or len(acq.hits) != len(ks):
                raise AssertionError(f"the bulk load found {len(acq.hits)} of {len(ks)} pages: {acq.miss}")
            t1 = time.perf_counter()
            idx = torch.tensor(acq.hits.pages, dtype=torch.long, device=dev)
            torch.index_select(whole, 0, idx, out=own)
            torch.cuda.synchronize(dev)  # the copy out completed before the release
            t2 = time.perf_counter()
            client.release(acq.lease_id)
            t3 = time.perf_counter()
            refs = [acq.hits[i] for i in range(len(acq.hits))]
            for k, v in (("acquire", t1 - t0), ("gather", t2 - t1), ("release", t3 - t2), ("load", t3 - t0)):
                times[k].append(v)
        for v in times.values():
            v.pop(0)
        differ = sum(int((own[lo:lo + BULK_CHUNK] != bulk_source(seed, lo, min(BULK_CHUNK, len(ks) - lo))).sum())
                     for lo in range(0, len(ks), BULK_CHUNK))
        torch.cuda.synchronize(dev)
        check: dict[str, float] = {}
        t0 = time.perf_counter()
        got = chunked_sketches(own, check)
        sketch_s = time.perf_counter() - t0
        bad = [i for i, (g, ref) in enumerate(zip(got, refs)) if g != ref.digest]
        flat, dst = own.view(-1), torch.empty(len(ks) * size, dtype=torch.uint8, device=dev)
        dst.copy_(flat)
        torch.cuda.synchronize(dev)
        raw = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(flat)
            torch.cuda.synchronize(dev)
            raw.append(time.perf_counter() - t0)
        return {"pages": len(ks), "bytes": len(ks) * size, "times_s": times, "raw_copy_s": raw,
                "sketch_and_digests_s": sketch_s, "check_s": check, "bytes_differ": differ,
                "digests_differ": len(bad)}

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
                elif op == "publish_bulk":
                    conn.send(("ok", *publish_bulk(*cmd[1:])))
                elif op == "load_bulk":
                    conn.send(("ok", load_bulk(*cmd[1:])))
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
