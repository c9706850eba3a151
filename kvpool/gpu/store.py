"""The GPU transfer engine's stores: KV blocks -> pages reserved in the pool, digested and
committed in units (kvpool.gpu.transfer describes store() and its contracts).

  Stores   a base class of TransferEngine, never used alone: store(), its commit units
           (reserved on the engine's lanes), its chunks (torch path: gather into a staging
           buffer, copy to the pages; driver path: one copy per layer, block and run
           straight from the KV tensors), the GPU's sketches of a kv-sketch-1 store, and
           each unit's commit once its copies completed; the resources of kv-sketch-1
           stores (_init_sketch). Its methods read the engine's state (layout, streams,
           lanes, staging buffers), which TransferEngine sets up.
  StoreHandle    a store in flight; `result` resolves to its StoreOutcome.
  StoreOutcome   what a store did: committed, exists, pending, not admitted, no capacity,
                 rejected, errors.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from kvpool.errors import PoolError
from kvpool.gpu.config import OrderingEdge
from kvpool.gpu.events import host_event
from kvpool.gpu.layout import as_width
from kvpool.gpu.tier import UNREACHABLE
from kvpool.gpu.sketch import digests as sketch_digests
from kvpool.gpu.sketch import staged_width
from kvpool.gpu.staging import IndexRing, PinnedSketches
from kvpool.pool.records import ReserveResult, SlotStatus
from kvpool.pool.digest import SKETCH_COLS, DigestKind

log = logging.getLogger("kvpool.gpu.transfer")  # the engine's logger


@dataclasses.dataclass(frozen=True, slots=True)
class StoreOutcome:
    handle: int
    requested: int
    committed: int
    exists: int
    pending: int
    not_admitted: int
    no_capacity: int
    rejected: int  # the pool's re-verify found other bytes than the digest (never visible)
    errors: tuple[str, ...]  # pool errors met while reserving or committing
    bytes_committed: int
    seconds: float  # from store() to the last commit


@dataclasses.dataclass(slots=True)
class _Unit:
    """One reservation: committed as a whole on its lane."""

    lane: int
    reservation: ReserveResult
    pages: list[int]
    event: torch.cuda.Event | None = None  # the copy chunk holding its last page
    future: cf.Future | None = None
    # kv-sketch-1: the sketches' D2H of its last chunk, and where each page's sketch lands
    sketch_event: torch.cuda.Event | None = None
    host_sketch: torch.Tensor | None = None
    sketch_index: dict[int, int] = dataclasses.field(default_factory=dict)


class StoreHandle:
    """A store in flight; `result` (a Future) resolves to the StoreOutcome after the last
    commit. Final at store()'s return: `spilled`, the positions (in block_ids) the pool answered
    NO_CAPACITY; `answered`, how many leading positions the pool answered at all (the first
    position of the unit the store stopped at: its reserve refused or failed, or the pool
    restarted under it; else all of them); and `unreached_from`, that position where the
    store stopped because the pool could not be reached (TransportError, PoolTimeout, Busy)
    or had restarted (None otherwise): what a tiered engine (kvpool.gpu.tiered_engine)
    offers the next tier."""

    __slots__ = ("id", "block_ids", "requested", "counts", "errors", "result", "spilled", "answered",
                 "unreached_from", "_units", "_t0", "_sketch")

    def __init__(self, hid: int, block_ids: tuple[int, ...], t0: float):
        self.id = hid
        self.block_ids = block_ids
        self.requested = len(block_ids)
        self.counts = {s: 0 for s in SlotStatus}
        self.errors: list[str] = []
        self.spilled: list[int] = []
        self.answered = len(block_ids)
        self.unreached_from: int | None = None
        self._units: list[_Unit] = []
        self._t0 = t0
        self._sketch: torch.Tensor | None = None  # its pinned sketch buffer, until the last commit
        self.result: cf.Future = cf.Future()

    def __repr__(self) -> str:
        return f"StoreHandle(id={self.id}, requested={self.requested}, reserved={self.counts[SlotStatus.RESERVED]})"


class Stores:
    """TransferEngine's stores (a base of kvpool.gpu.transfer.TransferEngine, never used
    alone: its methods use the state the engine sets up)."""

    def _init_sketch(self, layers: Sequence[torch.Tensor]) -> None:
        """kv-sketch-1 stores' resources: a kernel stream (gathers and sketches run beside
        the copies), staging rows padded to whole sketch rows (zero, and never written
        past the page), device and host sketch buffers."""
        pb, cp = self.layout.page_bytes, self._chunk_pages
        self._sketcher = self._sketch_gpu
        width = staged_width(pb)
        ring = max(4096, 4 * cp)
        largest = max(lb.nbytes for lb in self.layout.layers)
        dev = self.device
        with torch.cuda.device(dev):
            self._store_k = torch.cuda.Stream(dev)  # gathers and sketches of stores
        with torch.cuda.device(dev), torch.cuda.stream(self._store_k):
            self._sk_store_stage = [torch.zeros((cp, width), dtype=torch.uint8, device=dev) for _ in range(2)]
            self._sk_store_dev = [torch.empty((cp * self._sk_rows, SKETCH_COLS), dtype=torch.int32, device=dev)
                                  for _ in range(2)]
            self._sk_store_scratch = torch.empty(cp * largest, dtype=torch.uint8, device=dev)
            self._sk_store_ring = IndexRing(dev, self._store_k, ring)
        self._store_sketches = PinnedSketches(self._sk_rows, cp)
        self._store_buf = 0
        self._store_free: list[torch.cuda.Event | None] = [None, None]
        torch.cuda.synchronize(dev)  # the zeroed staging rows exist before any copy writes them

    # -- copies -----------------------------------------------------------------------------
    def _driver_lists(self, block_ids: Sequence[int], pages: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """(page addresses, KV addresses, sizes) of every run of every layer of the blocks (the
        pages in host memory, or in a keeper's tier in device memory)."""
        ps = self._page_size
        host: list[int] = []
        dev: list[int] = []
        sizes: list[int] = []
        for lb, base in zip(self.layout.layers, self._layer_ptrs):
            for b, p in zip(block_ids, pages):
                block_at = base + b * lb.block_stride
                page_at = self._region_ptr + p * ps + lb.page_offset
                for off, n in lb.runs:
                    dev.append(block_at + off)
                    host.append(page_at)
                    sizes.append(n)
                    page_at += n
        return host, dev, sizes

    def _copy_out(self, block_ids: Sequence[int], pages: Sequence[int]) -> torch.cuda.Event:
        """Blocks -> pages, enqueued on the current stream (the store stream). Returns an
        event recorded once the KV has been read (after the gather on the torch path,
        after the copies themselves on the driver path)."""
        read = torch.cuda.Event()
        if self._driver is not None:
            host, dev, sizes = self._driver_lists(block_ids, pages)
            self._driver.copies(host, dev, sizes, self.store_stream, to_host=self._arena.to_pages)
            read.record(self.store_stream)
            return read
        n = len(block_ids)
        idx = self._index(block_ids, self._store_ring)
        stage = self._store_stage
        d = self.layout.block_dim
        for lb, layer in zip(self.layout.layers, self._layers_u8):
            picked_shape = (*lb.shape[:d], n, *lb.shape[d:])
            picked = self._gather_scratch[: n * lb.nbytes].view(picked_shape)
            torch.index_select(layer, d, idx, out=picked)
            stage[:n, lb.page_offset : lb.page_offset + lb.nbytes].view(n, *lb.shape).copy_(picked.movedim(d, 0))
        read.record(self.store_stream)
        for row, page, k in self._runs(pages):
            self._host_rows(page, k).copy_(stage[row : row + k].reshape(-1), non_blocking=True)
        return read

    def _d2h(self, stage: torch.Tensor, pages: Sequence[int]) -> None:
        """Rows of `stage` -> pages, on the current stream."""
        pb = self.layout.page_bytes
        if stage.shape[1] == pb:
            for row, page, k in self._runs(pages):
                self._host_rows(page, k).copy_(stage[row : row + k].reshape(-1), non_blocking=True)
            return
        for row, page in enumerate(pages):
            self._host_rows(page, 1).copy_(stage[row, :pb], non_blocking=True)

    def _gather(self, block_ids: Sequence[int], stage: torch.Tensor, scratch: torch.Tensor, ring: IndexRing) -> None:
        """Blocks -> rows of `stage` in page order, on the current stream (the ring's)."""
        n = len(block_ids)
        idx = self._index(block_ids, ring)
        if self._replay(stage, idx):
            return
        d, w = self.layout.block_dim, self._width
        stage_w, scratch_w = as_width(stage, w), as_width(scratch, w)
        for lb, layer in zip(self.layout.layers, self._layers_w):
            shape = (*lb.shape[:-1], lb.shape[-1] // w)
            rows = stage_w[:n, lb.page_offset // w : (lb.page_offset + lb.nbytes) // w].view(n, *shape)
            if d == 0:  # blocks first: the selection lands in the staged rows as it is (one kernel)
                torch.index_select(layer, 0, idx, out=rows)
                continue
            picked = scratch_w[: n * lb.nbytes // w].view((*shape[:d], n, *shape[d:]))
            torch.index_select(layer, d, idx, out=picked)
            rows.copy_(picked.movedim(d, 0))

    # -- store ------------------------------------------------------------------------------
    def _plan_units(self, n: int, boundary: int | None) -> list[tuple[int, int, int | None]]:
        """[start, stop) and the reservation's boundary of each commit unit."""
        limit = n if boundary is None else max(0, min(boundary, n))
        size = self._unit_blocks
        units: list[tuple[int, int, int | None]] = []
        start = 0
        while start < limit:
            stop = start + size if limit - start >= 2 * size else limit
            units.append((start, stop, None))
            start = stop
        if limit < n:
            units.append((limit, n, 0))
        return units

    def store(self, block_ids: Sequence[int], hashes: Sequence[bytes], boundary: int | None = None) -> StoreHandle:
        ids = self._check_ids(block_ids, hashes)
        self._follow_segment()
        handle = StoreHandle(next(self._ids), ids, time.monotonic())
        pb = self.layout.page_bytes
        with torch.cuda.device(self.device):
            if self._driver is not None:
                self._driver.ensure_context()
            engine = torch.cuda.current_stream(self.device)
            written = torch.cuda.Event()
            written.record(engine)
            pending: list[tuple[int, int, _Unit]] = []  # (block id, page, unit) not yet copied
            self._kv_read: list[torch.cuda.Event] = []  # the last chunk's "KV read" events
            if self._sketcher is not None:
                self._store_sketch = handle._sketch = self._store_sketches.take(len(ids))
                self._store_sketched = 0
            try:
                with torch.cuda.stream(self.store_stream):
                    self._order(OrderingEdge.STORE_AFTER_WRITE, self.store_stream, written)
                    if self._sketcher is not None:
                        self._order(OrderingEdge.STORE_AFTER_WRITE, self._store_k, written)
                    for start, stop, unit_boundary in self._plan_units(len(ids), boundary):
                        lane = self._pick_lane()
                        try:
                            res = self._lanes[lane].reserve(self.ns, hashes[start:stop], [pb] * (stop - start),
                                                            unit_boundary)
                        except PoolError as exc:  # refused, or the connection failed: what is copying still commits
                            self._lane_done(lane)
                            handle.errors.append(f"reserve: {type(exc).__name__}: {exc}")
                            handle.answered = start
                            if isinstance(exc, UNREACHABLE):
                                handle.unreached_from = start
                            break
                        if self._segment(self._lanes[lane]) not in (None, self._arena.instance):
                            # The lane reconnected to a restarted pool: its pages are in another segment.
                            self._abort(_Unit(lane, res, []))
                            handle.errors.append("reserve: the pool restarted (a new segment); the next store "
                                                 "re-registers it")
                            handle.answered = handle.unreached_from = start  # not answered: the new pool is asked next time
                            break
                        unit = _Unit(lane, res, [])
                        if res.reservation_id:
                            self._lane_grants[lane].opened(res.reservation_id)
                        for k, slot in enumerate(res.slots):
                            handle.counts[slot.status] += 1
                            if slot.status == SlotStatus.RESERVED:
                                unit.pages.append(slot.page)
                                pending.append((ids[start + k], slot.page, unit))
                            elif slot.status == SlotStatus.NO_CAPACITY:
                                handle.spilled.append(start + k)
                        if not unit.pages:
                            self._lane_done(lane)
                            continue
                        handle._units.append(unit)
                        self._check_pages(unit.pages)  # the pages the pool named, inside the mapping
                        while len(pending) >= self._chunk_pages:
                            self._issue_store_chunk(pending[: self._chunk_pages])
                            pending = pending[self._chunk_pages :]
                    if pending:
                        self._issue_store_chunk(pending)
                    kv_read = self._kv_read
                    if not kv_read:  # nothing was copied
                        kv_read = [torch.cuda.Event()]
                        kv_read[0].record(self.store_stream)
                    self._kv_read = []
                for event in kv_read:
                    self._order(OrderingEdge.REUSE_AFTER_STORE, engine, event)
            except BaseException:
                # Nothing enqueued can be trusted: let it finish, give every page back, re-raise.
                self.store_stream.synchronize()
                if self._sketcher is not None:
                    self._store_k.synchronize()
                for unit in handle._units:
                    self._abort(unit)
                raise
        for unit in handle._units:
            unit.future = self._lane_exec[unit.lane].submit(self._finish_unit, unit)
        self._watch(handle)
        return handle

    def _issue_store_chunk(self, entries: list[tuple[int, int, _Unit]]) -> None:
        entries = sorted(entries, key=lambda e: e[1])  # ascending pages: consecutive ones copy as one
        if self._sketcher is not None:
            self._issue_store_chunk_sketched(entries)
            return
        self._kv_read = [self._copy_out([e[0] for e in entries], [e[1] for e in entries])]
        event = host_event()
        event.record(self.store_stream)
        for _, _, unit in entries:
            unit.event = event  # chunks complete in order: the last one holding a page wins

    def _issue_store_chunk_sketched(self, entries: list[tuple[int, int, _Unit]]) -> None:
        """One chunk of a store digested on the GPU. Kernel stream: gather the blocks into a
        staging buffer (page order), sketch it, copy the sketches to the host. Copy stream:
        the pages to the arena (from the staging buffer; on the driver path straight from
        the KV tensors). Two staging buffers: a gather waits for the copy that last read its
        buffer, so gathers and sketches run beside the copies."""
        n = len(entries)
        ids, pages = [e[0] for e in entries], [e[1] for e in entries]
        b = self._store_buf
        self._store_buf ^= 1
        stage, dev_out = self._sk_store_stage[b], self._sk_store_dev[b]
        base = self._store_sketched
        self._store_sketched += n
        host = self._store_sketch[base : base + n]
        with torch.cuda.stream(self._store_k):
            free = self._store_free[b]
            if free is not None:  # the copy that last read this buffer
                self._order(OrderingEdge.GATHER_AFTER_COPY, self._store_k, free)
            self._gather(ids, stage, self._sk_store_scratch, self._sk_store_ring)
            gathered = torch.cuda.Event()
            gathered.record(self._store_k)
            self._sketch_to_host(stage, n, dev_out, host)
            sketched = host_event()
            sketched.record(self._store_k)
        if self._driver is not None:
            host_at, dev_at, sizes = self._driver_lists(ids, pages)
            self._driver.copies(host_at, dev_at, sizes, self.store_stream, to_host=self._arena.to_pages)
            read = torch.cuda.Event()
            read.record(self.store_stream)
            self._kv_read = [gathered, read]  # both read the KV
        else:
            self._order(OrderingEdge.COPY_AFTER_GATHER, self.store_stream, gathered)  # the staged pages are complete
            self._d2h(stage, pages)
            self._kv_read = [gathered]
        event = host_event()
        event.record(self.store_stream)
        if self._driver is None:
            self._store_free[b] = event  # the next gather into this buffer waits for these copies
        for row, (_, page, unit) in enumerate(entries):
            unit.event = event
            unit.sketch_event = sketched
            unit.host_sketch = self._store_sketch
            unit.sketch_index[page] = base + row

    def _abort(self, unit: _Unit) -> None:
        self._lane_grants[unit.lane].closed(unit.reservation.reservation_id)
        try:
            self._lanes[unit.lane].abort(unit.reservation.reservation_id)
        except PoolError as exc:  # the daemon reclaims it at the TTL or when the connection drops
            log.warning("abort of reservation %d failed: %s: %s", unit.reservation.reservation_id,
                        type(exc).__name__, exc)
        finally:
            self._lane_done(unit.lane)

    def _finish_unit(self, unit: _Unit) -> tuple[int, int, str | None]:
        """(committed, rejected, error) of one reservation, on its lane's thread. The copies
        may wait behind forwards still queued on the engine's stream (asynchronous scheduling,
        long prefill chunks): meanwhile the lane renews the reservation on its connection
        every third of the pool's TTL; a refused renewal ends the unit as a failed commit
        does (after its copies completed). The lane renews every reservation it holds open,
        not only this unit's: the units queued behind this one wait as long (LaneGrants)."""
        try:
            keepalive = self._lane_grants[unit.lane].keepalive(unit.reservation.reservation_id)
            refused = self._await_copy(OrderingEdge.COMMIT_AFTER_COPY, unit.event, keepalive=keepalive)
            if unit.host_sketch is not None:  # waited for in any case: its pinned buffer outlives the copy
                again = self._await_copy(OrderingEdge.COMMIT_AFTER_COPY, unit.sketch_event,
                                         keepalive=keepalive if refused is None else None)
                refused = refused or again
            if refused is not None:
                raise refused
            if unit.host_sketch is not None:
                sk = unit.host_sketch.numpy()
                rows = [unit.sketch_index[p] for p in unit.pages]
                digests = sketch_digests(sk[rows], self.layout.page_bytes)
                kind = DigestKind.SKETCH
            else:
                digests = list(self._hash_pool.map(self._digest, unit.pages))
                kind = DigestKind.XXH3
            with self._lane_lock:
                self._lane_committing[unit.lane] += 1
            try:
                out = self._lanes[unit.lane].commit(unit.reservation.reservation_id, digests, kind)
                self._lane_grants[unit.lane].closed(unit.reservation.reservation_id)
            finally:
                with self._lane_lock:
                    self._lane_committing[unit.lane] -= 1
        except PoolError as exc:
            self._abort(unit)
            return 0, 0, f"commit: {type(exc).__name__}: {exc}"
        except BaseException:
            self._abort(unit)
            raise
        self._lane_done(unit.lane)
        return out.committed, len(out.rejected), None
