"""The GPU transfer engine's loads: leased pool pages -> GPU staging -> checked over what
arrived -> installed into the blocks (kvpool.gpu.transfer describes load() and its contracts).

  Loads   a base class of TransferEngine, never used alone: load(), its chunks (the copy
          stream brings the pages into a staging buffer; the check stream sketches the
          staged rows or reads them back; the host compares the digests; the install
          stream writes the verified prefix into the blocks: scatter kernels, or driver
          copies device to device; pages in device memory on the torch path with the Triton
          sketch: the copy stream's one kernel copies and sketches, CopySketchKernel, and the
          check stream copies the sketches out; with install_direct and a layout of whole
          pieces that kernel writes each page straight into its block, InstallSketchKernel,
          and there is no install pass), the lease's release and the report of a corrupt page,
          wait_for_load; the resources of loads (_init_load). Its methods read the
          engine's state (layout, streams, staging buffers), which TransferEngine sets up.
  LoadHandle    a load in flight: loaded, miss, failed_block_ids final at load()'s return.
  LoadOutcome   what a load did, once its lease was released (stale pages included).
  check_plan(kinds) -> (sketch, read_back)      the check-stream work a chunk needs.
  arrived_digests(kinds, sketches, readback, page_bytes)   per page, its digest by its
        kind from what arrived (the GPU's sketches, the read-back rows); pure, no CUDA.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvpool.client.keepalive import Keepalive
from kvpool.client.transfer import report_corrupt
from kvpool.errors import (
    ArenaError,
    InvalidRequest,
    LeaseLost,
    MalformedFrame,
    MissCause,
    PoolError,
    PoolTimeout,
    TransportError,
)
from kvpool.gpu.config import KVLayoutError, OrderingEdge, PageMemory
from kvpool.gpu.events import host_event
from kvpool.gpu.layout import as_width
from kvpool.gpu.sketch import Sketcher, staged_width
from kvpool.gpu.sketch import digests as sketch_digests
from kvpool.gpu.staging import IndexRing
from kvpool.gpu.tier import WrongInstance
from kvpool.pool.records import AcquireResult, Miss
from kvpool.pool.digest import (
    DIGEST_BYTES,
    SKETCH_COLS,
    SKETCH_ROW,
    DigestKind,
    page_digest,
    sketch_rows,
)

log = logging.getLogger("kvpool.gpu.transfer")  # the engine's logger

_LOAD_POLL_S = 20e-6  # load() itself waits for each chunk's sketch (the caller waits anyway)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadOutcome:
    handle: int
    requested: int
    loaded: int  # leading blocks installed, verified, and not reused under the lease
    miss: Miss | None
    stale: tuple[int, ...]  # block indexes whose page was reused under the lease (all: the release failed)
    errors: tuple[str, ...]
    seconds: float  # from load() to the lease's release


class LoadHandle:
    """A load in flight. `loaded`, `miss`, `failed_block_ids` are final at load()'s return;
    `result` (a Future) resolves to the LoadOutcome once the lease is released."""

    __slots__ = ("id", "block_ids", "requested", "loaded", "miss", "result", "_done", "_future", "_t0")

    def __init__(self, hid: int, block_ids: tuple[int, ...], loaded: int, miss: Miss | None,
                 done: torch.cuda.Event, t0: float):
        self.id = hid
        self.block_ids = block_ids
        self.requested = len(block_ids)
        self.loaded = loaded
        self.miss = miss
        self._done = done
        self._future: cf.Future | None = None
        self._t0 = t0
        self.result: cf.Future = cf.Future()

    @property
    def failed_block_ids(self) -> tuple[int, ...]:
        """Blocks the engine must recompute (known when load() returns)."""
        return self.block_ids[self.loaded:]

    def __repr__(self) -> str:
        return f"LoadHandle(id={self.id}, requested={self.requested}, loaded={self.loaded}, miss={self.miss})"


def check_plan(kinds: Sequence[DigestKind]) -> tuple[bool, bool]:
    """(sketch on the GPU, read back to the host): the check-stream work a chunk of pages
    of these kinds needs. Every page is checked over what arrived in GPU memory: a
    kv-sketch-1 page by the GPU's sketch of its staged row, an xxh3-128 page by XXH3-128
    over its staged row read back into private pinned memory."""
    return DigestKind.SKETCH in kinds, DigestKind.XXH3 in kinds


def arrived_digests(kinds: Sequence[DigestKind], sketches: np.ndarray | None, readback: np.ndarray | None,
                    page_bytes: int, mapper=map) -> list[bytes]:  # noqa: ANN001 - map or Executor.map
    """Per page, its digest by its kind from what arrived: `sketches` (int32 (pages, rows,
    SKETCH_COLS), the GPU's sketches of the staged rows; needed if any page is kv-sketch-1)
    and `readback` (uint8 (pages, >= page_bytes), the staged rows read back; needed if any
    is xxh3-128), row i for page i. `mapper` runs the XXH3-128s (a thread pool's map)."""
    if sketches is not None and sketches.shape[0] >= len(kinds) and all(k is DigestKind.SKETCH for k in kinds):
        return sketch_digests(sketches[: len(kinds)], page_bytes)  # every page sketched (the common case): a view
    out: list[bytes | None] = [None] * len(kinds)
    sk = [i for i, k in enumerate(kinds) if k is DigestKind.SKETCH]
    xx = [i for i, k in enumerate(kinds) if k is DigestKind.XXH3]
    if len(sk) + len(xx) != len(kinds):
        raise InvalidRequest(f"unknown digest kinds among {sorted(set(map(str, kinds)))}")
    if sk:
        if sketches is None or sketches.shape[0] < len(kinds):
            raise InvalidRequest("kv-sketch-1 pages without the sketches of what arrived")
        for i, d in zip(sk, sketch_digests(sketches[sk], page_bytes)):
            out[i] = d
    if xx:
        if readback is None or readback.shape[0] < len(kinds) or readback.shape[1] < page_bytes:
            raise InvalidRequest("xxh3-128 pages without the read-back of what arrived")
        for i, d in zip(xx, mapper(lambda i: page_digest(readback[i, :page_bytes]), xx)):
            out[i] = d
    return out  # type: ignore[return-value]


class Loads:
    """TransferEngine's loads (a base of kvpool.gpu.transfer.TransferEngine, never used
    alone: its methods use the state the engine sets up)."""

    def _init_load(self, layers: Sequence[torch.Tensor]) -> None:
        """The resources of loads (every engine, every digest kind): `load_buffers` staging
        buffers whose rows are padded to whole sketch rows (zero, never written past the
        page), the GPU sketcher and its device and host outputs, and per buffer a pinned
        host buffer the staged rows of xxh3-128 pages are read back into (allocated here
        on an engine that stores xxh3-128, on the first such page otherwise). Three
        streams: copies (load_stream), checks (sketches, read-backs), installs."""
        pb, cp = self.layout.page_bytes, self._chunk_pages
        dev = self.device
        self._sketch_gpu = Sketcher(dev, self.config.sketch_impl)
        self._sk_rows = sketch_rows(pb)
        width = staged_width(pb)
        n = self.config.load_buffers
        with torch.cuda.device(dev):
            self._load_k = torch.cuda.Stream(dev)  # checks of loads: sketches and read-backs of what arrived
            self._load_s = torch.cuda.Stream(dev)  # installs of verified chunks
        with torch.cuda.device(dev), torch.cuda.stream(self._load_k):
            self._sk_load_stage = [torch.zeros((cp, width), dtype=torch.uint8, device=dev) for _ in range(n)]
            self._sk_load_dev = [torch.empty((cp * self._sk_rows, SKETCH_COLS), dtype=torch.int32, device=dev)
                                 for _ in range(n)]
            # per buffer, the host's copy of its chunk's sketches: written only on the check
            # stream (in order), read by the host after that chunk's event
            self._sk_load_host = [torch.empty((cp, self._sk_rows, SKETCH_COLS), dtype=torch.int32, pin_memory=True)
                                  for _ in range(n)]
            self._sk_load_host_np = [h.numpy() for h in self._sk_load_host]
        self._readback: list[torch.Tensor | None] = [None] * n
        if self.config.digest is DigestKind.XXH3:
            for b in range(n):
                self._readback_buffer(b)
        with torch.cuda.device(dev), torch.cuda.stream(self._load_s):  # the scatters' ids (torch path)
            self._sk_scatter_ring = IndexRing(dev, self._load_s, max(4096, 4 * cp))
        with torch.cuda.device(dev), torch.cuda.stream(self.load_stream):  # the fused copies' page (and block) numbers
            self._page_ring = IndexRing(dev, self.load_stream, max(4096, 2 * (n + 1) * cp))
        # kvpool.gpu.sketch_kernel.CopySketchKernel once probed (on the first pages in device
        # memory: here, or when the engine follows its backend there); False where loads do not
        # fuse (another sketch, the driver path, pages of part sketch rows, a failed probe)
        self._copy_sketch = None
        # kvpool.gpu.sketch_kernel.InstallSketchKernel and the layout's pieces once probed (with
        # the fused copy), False where chunks are staged (install_direct off, a layout of part
        # pieces, a failed probe)
        self._direct = None if self.config.install_direct else False
        self.direct_loads = 0  # loads that took the direct install (_copy_in says when one can)
        if not (self.config.fuse_loads and self._sketch_gpu.impl == "triton-dot" and self._driver is None
                and self.layout.page_bytes % SKETCH_ROW == 0):
            self._copy_sketch = self._direct = False
        elif self._arena.memory is PageMemory.DEVICE:
            self._copy_sketch = self._probe_copy_sketch()
            self._direct_install()
        self._load_free: list[torch.cuda.Event | None] = [None] * n  # per buffer: its last install
        self._load_sketched: list[torch.cuda.Event | None] = [None] * n  # per buffer: its last check
        torch.cuda.synchronize(dev)  # the zeroed staging rows exist before any copy writes them

    def _readback_buffer(self, b: int) -> torch.Tensor:
        """Staging buffer b's pinned host twin for xxh3-128 checks, allocated once."""
        buf = self._readback[b]
        if buf is None:
            buf = self._readback[b] = torch.empty((self._chunk_pages, self.layout.page_bytes), dtype=torch.uint8,
                                                  pin_memory=True)
        return buf

    def _h2d(self, pages: Sequence[int], stage: torch.Tensor) -> None:
        """Pages -> rows of `stage` (one row per page, any row width), on the current stream
        (driver path: driver copies); host to device, or device to device from a keeper's
        tier in device memory."""
        pb = self.layout.page_bytes
        if self._driver is not None:
            ps, w, at = self._page_size, stage.stride(0), stage.data_ptr()
            runs = self._runs(pages) if w == pb else [(row, page, 1) for row, page in enumerate(pages)]
            self._driver.copies([at + row * w for row, _, _ in runs],
                                [self._region_ptr + page * ps for _, page, _ in runs],
                                [(k - 1) * ps + pb for _, _, k in runs], torch.cuda.current_stream(),
                                to_host=self._arena.from_pages)
            return
        if stage.shape[1] == pb:
            for row, page, k in self._runs(pages):
                stage[row : row + k].reshape(-1).copy_(self._host_rows(page, k), non_blocking=True)
            return
        for row, page in enumerate(pages):
            stage[row, :pb].copy_(self._host_rows(page, 1), non_blocking=True)

    def _fused_copy(self) -> bool:
        """Whether a chunk of kv-sketch-1 pages is copied and sketched in one pass: pages in
        device memory (a keeper's tier), the torch path, the Triton sketch, whole sketch rows.
        Then the copy stream's one kernel writes the staged rows and their sketches from the
        same registers; the check stream only copies the sketches to the host."""
        if self._arena.memory is not PageMemory.DEVICE or self._copy_sketch is False:
            return False
        if self._copy_sketch is None:  # the first device pages since the engine started on host pages
            self._copy_sketch = self._probe_copy_sketch()
        return self._copy_sketch is not False

    def _install_note(self) -> str:
        """TransferCapabilities.install at the engine's start."""
        if self._direct:
            return "direct"
        if self._direct is None and self.config.install_direct:
            return "staged until pages in device memory (decided then)"
        if self.config.install_direct and self._arena.memory is PageMemory.DEVICE:
            return "staged (the direct install's layout or probe failed: logged)"
        return "staged"

    def _direct_install(self) -> bool:
        """Whether fused chunks are written straight into the blocks (install_direct, the
        layout's runs whole pieces of the kernel's step, the kernel probed exact)."""
        if self._direct is None and self._fused_copy():
            self._direct = self._probe_install()
        return bool(self._direct) and self._fused_copy()

    def _probe_install(self):  # noqa: ANN202 - (InstallSketchKernel, InstallPieces), or False
        """The direct install, once it wrote seeded pages (3 and 16, out of order) into scratch
        blocks of pieces scattered as a layout's are, byte-exact, with the probed sketcher's
        sketches; False (logged) where the layout is not whole pieces or the probe fails. On a
        stream of its own, never into the engine's blocks."""
        from kvpool.gpu.sketch_kernel import InstallPieces, InstallSketchKernel, install_pieces

        pb, dev = self.layout.page_bytes, self.device
        kernel = InstallSketchKernel()
        try:
            pieces = install_pieces([(t, lb.block_stride, lb.runs) for t, lb in zip(self._layers, self.layout.layers)],
                                    pb, kernel.bk, dev)
        except (ValueError, RuntimeError) as exc:  # a layout of part pieces; a tensor torch cannot view so
            log.info("kvpool GPU transfer: loads stage their chunks (%s: %s)", type(exc).__name__, exc)
            return False
        try:
            with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):
                g = torch.Generator(device=dev)
                g.manual_seed(0x6B7674)
                ps = self._page_size  # the loads' page stride
                src = torch.randint(-128, 128, (16 * ps + pb,), dtype=torch.int8, device=dev, generator=g)
                q = pb // kernel.bk
                slots = torch.randperm(q, generator=g, device=dev)  # piece q of a block at slot[q]
                ok = True
                for order in ([2, 0, 3], [16 - i for i in range(16)]):
                    n = len(order)
                    idx = torch.tensor(order, dtype=torch.int64, device=dev)
                    blocks = torch.tensor([(5 * i + 3) % n for i in range(n)], dtype=torch.int64, device=dev)
                    dst = torch.zeros((n * pb,), dtype=torch.int8, device=dev)
                    scratch = InstallPieces(dst, slots * kernel.bk, torch.full((q,), pb, dtype=torch.int64,
                                                                               device=dev), kernel.bk)
                    out = torch.empty((n * (pb // SKETCH_ROW), SKETCH_COLS), dtype=torch.int32, device=dev)
                    kernel(src, idx, blocks, ps, pb, scratch, self._sketch_gpu.key, out)
                    want = torch.stack([src[p * ps : p * ps + pb] for p in order])
                    got = dst.view(n, q, kernel.bk)[blocks][:, slots].reshape(n, pb)
                    ok = ok and torch.equal(got, want) and torch.equal(
                        out, self._sketch_gpu.sketch(want.reshape(-1, SKETCH_ROW)))
        # as the fused copy's probe: Triton's errors are not RuntimeErrors
        except Exception as exc:  # noqa: BLE001 - logged with its cause, the loads stage
            log.warning("kvpool GPU transfer: the direct install failed its probe (%s: %s): loads stage their chunks",
                        type(exc).__name__, exc)
            return False
        if not ok:
            log.warning("kvpool GPU transfer: the direct install differs from a copy and the sketch: loads stage "
                        "their chunks")
            return False
        return kernel, pieces

    def _install_and_sketch(self, pages: Sequence[int], block_ids: Sequence[int], dev_out: torch.Tensor) -> None:
        """Pages -> their blocks and their sketches -> `dev_out`, one kernel on the current
        stream (the load's copy stream, ordered after the engine's reads of the blocks). The
        pages are the lease's, bounded by load() (_check_pages)."""
        kernel, pieces = self._direct
        idx = self._page_ring.upload(pages, align=2)
        blocks = self._page_ring.upload(block_ids, align=2)
        kernel(self._region.view(torch.int8), idx, blocks, self._page_size, self.layout.page_bytes, pieces,
               self._sketch_gpu.key, dev_out)

    def _check_pages(self, pages: Sequence[int]) -> None:
        """Every page the pool named (a lease's, a reservation's) inside the mapped region: the
        kernels and the driver path address page * page_size unchecked, and a torch slice
        would take a negative page from the region's end. Checked once per lease and per
        reservation (load() and store()), before any copy. ArenaError: the pool's answer cannot
        be addressed here (a failed load or store, corrupt)."""
        if pages and (min(pages) < 0 or max(pages) * self._page_size + self.layout.page_bytes > self._region.numel()):
            raise ArenaError(f"pages {min(pages)}..{max(pages)} of {self._page_size} bytes lie outside the "
                             f"{self._region.numel()}-byte mapping")

    def _probe_copy_sketch(self):  # noqa: ANN202 - a CopySketchKernel, or False
        """The fused kernel, once it copied seeded pages (out of order, 3 and 16 of them: Triton
        compiles a kernel for sizes that are multiples of 16 and one for those that are not, and
        a load's chunks can be either) byte-exact with the probed sketcher's sketches of them;
        False (logged) otherwise, and the loads copy then sketch. On a stream of its own: the
        caller's streams may hold work back (a fault delaying them) that this must not wait for."""
        from kvpool.gpu.sketch_kernel import CopySketchKernel

        pb, dev = self.layout.page_bytes, self.device
        kernel = CopySketchKernel()
        try:
            with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):
                g = torch.Generator(device=dev)
                g.manual_seed(0x6B7673)
                src = torch.randint(-128, 128, (17 * pb,), dtype=torch.int8, device=dev, generator=g)
                ok = True
                # the loads' shape: staged rows as wide as a page (whole sketch rows)
                for order in ([2, 0, 3], [16 - i for i in range(16)]):
                    idx = torch.tensor(order, dtype=torch.int64, device=dev)
                    dst = torch.zeros((len(order), pb), dtype=torch.int8, device=dev)
                    out = torch.empty((len(order) * (pb // SKETCH_ROW), SKETCH_COLS), dtype=torch.int32, device=dev)
                    kernel(src, idx, pb, pb, dst.view(-1), pb, self._sketch_gpu.key, out)
                    want = src.view(17, pb)[idx]
                    ok = ok and torch.equal(dst, want) and torch.equal(
                        out, self._sketch_gpu.sketch(want.reshape(-1, SKETCH_ROW)))
        # Triton's compile and resource errors are not RuntimeErrors: any failure to build or run
        # the kernel here leaves the loads on the copy-then-sketch path, logged with its cause
        except Exception as exc:  # noqa: BLE001 - logged with its cause, the loads fall back
            log.warning("kvpool GPU transfer: the fused copy and sketch failed its probe (%s: %s): loads copy, "
                        "then sketch", type(exc).__name__, exc)
            return False
        if not ok:
            log.warning("kvpool GPU transfer: the fused copy and sketch differs from a copy and the sketch: loads "
                        "copy, then sketch")
            return False
        return kernel

    def _copy_and_sketch(self, pages: Sequence[int], stage: torch.Tensor, dev_out: torch.Tensor) -> None:
        """Pages -> rows of `stage` and their sketches -> `dev_out`, one kernel on the current
        stream (the load's copy stream). The pages are the lease's, bounded by load()
        (_check_pages)."""
        idx = self._page_ring.upload(pages, align=2)  # a 16-byte boundary: one compiled kernel
        self._copy_sketch(self._region.view(torch.int8), idx, self._page_size, self.layout.page_bytes,
                          stage.view(torch.int8).view(-1), stage.stride(0), self._sketch_gpu.key, dev_out)

    def _scatter(self, block_ids: Sequence[int], buf: int, stage: torch.Tensor | None = None,
                 ring: IndexRing | None = None) -> None:
        """A load staging buffer -> blocks (torch path), on the current stream."""
        n = len(block_ids)
        if not n:
            return
        idx = self._index(block_ids, ring or self._sk_scatter_ring)
        stage = self._sk_load_stage[buf] if stage is None else stage
        if self._replay(stage, idx):
            return
        stage = as_width(stage, self._width)
        d, w = self.layout.block_dim, self._width
        for lb, layer in zip(self.layout.layers, self._layers_w):
            shape = (*lb.shape[:-1], lb.shape[-1] // w)
            src = stage[:n, lb.page_offset // w : (lb.page_offset + lb.nbytes) // w].view(n, *shape).movedim(0, d)
            layer.index_copy_(d, idx, src)

    def _read_back(self, stage: torch.Tensor, n: int, host: torch.Tensor) -> None:
        """The first `n` rows of `stage` (page bytes, no padding) -> `host` (pinned, (n,
        page_bytes)), on the current stream: what arrived, for a check on the host."""
        pb = self.layout.page_bytes
        if stage.shape[1] == pb:
            host[:n].copy_(stage[:n], non_blocking=True)
            return
        for row in range(n):
            host[row].copy_(stage[row, :pb], non_blocking=True)

    def _install(self, block_ids: Sequence[int], buf: int) -> None:
        """Load staging buffer `buf`'s first rows -> the blocks, on the current stream (the
        install stream): the scatter kernels (torch path) or driver copies device to device,
        one per (layer, block, contiguous run) (driver path)."""
        if not block_ids:
            return
        stage = self._sk_load_stage[buf]
        if self._driver is None:
            self._scatter(block_ids, buf, stage, self._sk_scatter_ring)
            return
        w, at = stage.stride(0), stage.data_ptr()
        dst: list[int] = []
        src: list[int] = []
        sizes: list[int] = []
        for lb, base in zip(self.layout.layers, self._layer_ptrs):
            for row, b in enumerate(block_ids):
                block_at = base + b * lb.block_stride
                row_at = at + row * w + lb.page_offset
                for off, n in lb.runs:
                    dst.append(block_at + off)
                    src.append(row_at)
                    sizes.append(n)
                    row_at += n
        self._driver.copies(dst, src, sizes, torch.cuda.current_stream(), to_host=None)

    def _arrived_digests(self, buf: int, kinds: Sequence[DigestKind]) -> list[bytes]:
        """The digests, by each page's kind, of what arrived in staging buffer `buf` (rows
        in chunk order), taken from the check stream's outputs once its event completed:
        kv-sketch-1 from the sketches the GPU took of the staged rows, xxh3-128 over the
        staged rows read back into pinned host memory. Never the pool's shared page."""
        n = len(kinds)
        sketches = self._sk_load_host_np[buf][:n] if DigestKind.SKETCH in kinds else None
        readback = self._readback[buf].numpy()[:n] if DigestKind.XXH3 in kinds else None
        return arrived_digests(kinds, sketches, readback, self.layout.page_bytes, self._hash_pool.map)

    # -- load -------------------------------------------------------------------------------
    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes], deadline_s: float | None = None) -> LoadHandle:
        ids = self._check_ids(block_ids, hashes)
        self._follow_segment()
        t0 = time.monotonic()
        with torch.cuda.device(self.device):
            if self._driver is not None:
                self._driver.ensure_context()
            engine = torch.cuda.current_stream(self.device)
            read = torch.cuda.Event()
            read.record(engine)
            done = host_event()
            bound = getattr(self.backend, "call_deadline", None)  # the acquire ends within the load's deadline
            try:
                with bound(deadline_s) if bound is not None and deadline_s is not None else contextlib.nullcontext():
                    lease = self.backend.acquire(self.ns, hashes)
            except PoolTimeout:
                done.record(engine)
                return self._finished_load(ids, Miss(0, MissCause.TIMEOUT), done, t0)
            except (TransportError, LeaseLost, MalformedFrame):
                done.record(engine)
                return self._finished_load(ids, Miss(0, MissCause.TRANSPORT_ERROR), done, t0)
            if self._segment(self.backend) != self._arena.instance:
                # The acquire reconnected to a restarted pool: the lease is on pages of another segment.
                if lease.lease_id:
                    try:
                        self.backend.release(lease.lease_id)
                    except PoolError as exc:  # the daemon reaps it at the TTL or when the connection drops
                        log.warning("release of lease %d after a pool restart failed: %s", lease.lease_id, exc)
                done.record(engine)
                return self._finished_load(ids, Miss(0, MissCause.TRANSPORT_ERROR), done, t0)
            hits = lease.hits
            miss = lease.miss
            try:
                if hits.lengths.count(self.layout.page_bytes) != len(hits.lengths):
                    raise KVLayoutError(f"the pool holds pages of {sorted(set(hits.lengths))} bytes under this "
                                        f"namespace; a block here is {self.layout.page_bytes}")
                self._check_pages(hits.pages)
                if len(hits):
                    loaded, stop = self._copy_in(ids, hits, t0, deadline_s, read, done)
                else:
                    loaded, stop = 0, None
                    done.record(engine)
            except BaseException:
                self.load_stream.synchronize()  # the lease outlives every copy that reads its pages
                self._load_k.synchronize()
                self._load_s.synchronize()
                self._release(lease)
                raise
            if stop is not None:
                miss = stop
        handle = LoadHandle(next(self._ids), ids, loaded, miss, done, t0)
        handle._future = self._release_exec.submit(self._finish_load, handle, lease)
        self._watch(handle)
        return handle

    def _copy_in(self, ids: tuple[int, ...], hits, t0: float, deadline_s: float | None,  # noqa: ANN001
                 read: torch.cuda.Event, done: torch.cuda.Event) -> tuple[int, Miss | None]:
        """Install leased pages, each verified over the bytes that arrived in GPU memory;
        (blocks installed, why it stopped early). Per chunk: the copy stream brings the
        pages into a staging buffer (torch copies, or driver copies on the driver path);
        the check stream, after that copy, sketches the staged rows (kv-sketch-1 pages)
        and reads the staged rows back into pinned host memory (xxh3-128 pages); the host
        waits for that, digests what arrived by each page's kind, and compares; only then
        the install stream writes the verified prefix from the same staged rows into the
        blocks (scatter kernels, or driver copies). A staged row is written only by its
        chunk's copy, so the bytes installed are the bytes checked; the pool's shared
        page, which other processes can write, is never read by the host here.
        `load_buffers` staging buffers: copies run that many chunks ahead of the checks.
        The direct install (fused chunks, install_direct, the engine's earlier work over):
        the copy stream's kernel writes the pages straight into their blocks and sketches the
        bytes it wrote; the host's check then only counts: a page that fails, and the pages
        after it already in flight, are in their blocks and reported failed (what a failed
        block holds is never read as loaded).
        `done` is recorded once every copy reading the pages and every kernel or copy
        touching the staged rows and the blocks is enqueued."""
        n = len(hits)
        pages = list(hits.pages)
        kinds = hits.kind_list()
        expected = [hits.digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i in range(n)]
        chunks = [range(a, min(a + self._chunk_pages, n)) for a in range(0, n, self._chunk_pages)]
        nbuf = len(self._sk_load_stage)
        fuse_of = [False] * len(chunks)
        copied: list[torch.cuda.Event] = []
        checked: list[torch.cuda.Event] = []
        installed = self._load_free  # per buffer: the last install that read it (this load's or an earlier one's)
        fuse = self._fused_copy()
        # Direct only where the engine's work queued before the load is over (`read` completed,
        # as it has by now on an idle engine: the acquire came between): the host waits for each
        # chunk's copy, and a copy into the blocks must follow that work (LOAD_AFTER_READ), so on
        # an engine still running a forward (asynchronous scheduling) the host would wait for the
        # forward; the staged chunks' copies overlap it, and only their installs wait.
        direct = self._direct_install() and read.query()
        check_read = self._load_sketched  # per buffer: the last check (sketch, read-back) that read it
        self._order(OrderingEdge.LOAD_AFTER_READ, self._load_s, read)  # the installs write the blocks
        if direct:  # and so do the fused chunks' copies (over already: kept as the stream's own order)
            self.direct_loads += 1
            self._order(OrderingEdge.LOAD_AFTER_READ, self.load_stream, read)

        def issue(i: int) -> None:
            chunk, b = chunks[i], i % nbuf
            stage = self._sk_load_stage[b]
            m = len(chunk)
            sketch, read_back = check_plan([kinds[j] for j in chunk])
            host_rows = self._readback_buffer(b) if read_back else None
            fused = fuse_of[i] = sketch and not read_back and fuse
            with torch.cuda.stream(self.load_stream):
                for reader in (installed[b], check_read[b]):  # the buffer's last install and check read it
                    if reader is not None:
                        self._order(OrderingEdge.REFILL_AFTER_INSTALL, self.load_stream, reader)
                if fused and direct:  # the blocks and their sketches, from the same registers
                    self._install_and_sketch([pages[j] for j in chunk], [ids[j] for j in chunk], self._sk_load_dev[b])
                elif fused:  # the staged rows and their sketches, from the same registers
                    self._copy_and_sketch([pages[j] for j in chunk], stage, self._sk_load_dev[b])
                else:
                    self._h2d([pages[j] for j in chunk], stage)
                ev = torch.cuda.Event()
                ev.record(self.load_stream)
                copied.append(ev)
            with torch.cuda.stream(self._load_k):
                self._order(OrderingEdge.CHECK_AFTER_COPY, self._load_k, ev)  # the check reads what the copy delivered
                if fused:
                    rows = m * self._sk_rows
                    self._sk_load_host[b][:m].view(rows, SKETCH_COLS).copy_(self._sk_load_dev[b][:rows],
                                                                            non_blocking=True)
                elif sketch:
                    self._sketch_to_host(stage, m, self._sk_load_dev[b], self._sk_load_host[b][:m])
                if read_back:
                    self._read_back(stage, m, host_rows)
                ev2 = host_event()
                ev2.record(self._load_k)
                checked.append(ev2)
                check_read[b] = ev2

        issued = min(nbuf, len(chunks))
        for i in range(issued):
            issue(i)
        loaded = 0
        stop: Miss | None = None
        for i, chunk in enumerate(chunks):
            self._await_copy(OrderingEdge.VERIFY_AFTER_CHECK, checked[i], _LOAD_POLL_S)
            b = i % nbuf
            got = self._arrived_digests(b, [kinds[j] for j in chunk])
            ok = self._verified(got, expected[chunk.start : chunk.stop])
            if deadline_s is not None and time.monotonic() - t0 > deadline_s:
                stop = Miss(loaded, MissCause.TIMEOUT)
                break
            if ok and not (direct and fuse_of[i]):  # a direct chunk is in its blocks already
                with torch.cuda.stream(self._load_s):
                    # after its copy: already so, through the check the host waited for
                    # (CHECK_AFTER_COPY, VERIFY_AFTER_CHECK); kept as the stream's own order
                    self._load_s.wait_event(copied[i])
                    self._install([ids[j] for j in range(chunk.start, chunk.start + ok)], b)
                    ev = torch.cuda.Event()
                    ev.record(self._load_s)
                    installed[b] = ev
            loaded += ok
            if ok < len(chunk):
                stop = Miss(loaded, MissCause.CORRUPT)
                break
            if issued < len(chunks):
                issue(issued)
                issued += 1
        self._load_s.wait_event(copied[-1])  # every copy reading the pages (and writing staged rows) ...
        self._load_s.wait_event(checked[-1])  # ... and every check reading the staged rows, in stream order
        done.record(self._load_s)
        return loaded, stop

    def _finished_load(self, ids: tuple[int, ...], miss: Miss, done: torch.cuda.Event, t0: float) -> LoadHandle:
        handle = LoadHandle(next(self._ids), ids, 0, miss, done, t0)
        future: cf.Future = cf.Future()
        future.set_result(((), (), None))  # (stale pages, errors, unverified): as _finish_load answers
        handle._future = future
        self._watch(handle)
        return handle

    def _release(self, lease: AcquireResult) -> tuple[tuple[int, ...], str | None, MissCause | None]:
        """(stale pages, error, cause): where the release fails the pages' generations were not
        checked, so nothing the copy read can be vouched for: `cause` says why (the lease had
        expired under a slow copy: timeout; the connection went, or a keeper's link refused a
        lease of the instance or session it replaced: transport_error)."""
        if not lease.lease_id:
            return (), None, None
        try:
            return tuple(self.backend.release(lease.lease_id).stale), None, None
        except WrongInstance as exc:  # a keeper's grant of a replaced instance or session: refused unsent
            return (), f"release: {type(exc).__name__}: {exc}", MissCause.TRANSPORT_ERROR
        except LeaseLost as exc:  # the daemon reaped it: its pages may have been reused while we copied
            return (), f"release: {type(exc).__name__}: {exc}", MissCause.TIMEOUT
        except (PoolTimeout, TransportError, MalformedFrame) as exc:  # the connection and its lease are gone
            return (), f"release: {type(exc).__name__}: {exc}", MissCause.TRANSPORT_ERROR

    def _finish_load(self, handle: LoadHandle, lease: AcquireResult) -> tuple[tuple[int, ...], tuple[str, ...],
                                                                             MissCause | None]:
        # `done` follows the installs, which follow the engine's reads queued before load()
        # (LOAD_AFTER_READ): forwards still running under asynchronous scheduling. The lease
        # is renewed meanwhile; a refused renewal needs no answer here: the release then
        # fails (LeaseLost) and nothing the load read is vouched for (_release).
        keepalive = Keepalive.of(self.backend, leases=(lease.lease_id,)) if lease.lease_id else None
        self._await_copy(OrderingEdge.RELEASE_AFTER_COPY, handle._done, keepalive=keepalive)
        miss = handle.miss
        if miss is not None and miss.cause is MissCause.CORRUPT and lease.lease_id \
                and miss.index < len(lease.hits.pages):
            # the page that failed its check on the GPU, its lease still held: the daemon
            # re-checks it at rest and drops it if it is corrupt there (kvpool.client.pool_client)
            report_corrupt(self.backend, lease, miss.index, None)
        stale_pages, error, unverified = self._release(lease)
        moved = set(stale_pages)
        stale = tuple(i for i in range(handle.loaded) if lease.hits.pages[i] in moved) if moved else ()
        return stale, ((error,) if error else ()), unverified

    def wait_for_load(self, handle: LoadHandle) -> None:
        """The engine's current stream waits for the load's copies (no host sync)."""
        self._order(OrderingEdge.READ_AFTER_LOAD, torch.cuda.current_stream(self.device), handle._done)

    wait = wait_for_load
