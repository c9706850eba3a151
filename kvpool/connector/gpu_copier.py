"""The connector's copier interface (kvpool.connector.copier.HostCopier's) on the GPU transfer
engine (kvpool.gpu.transfer), so the worker picks one by device and calls both alike.

  CudaCopier(backend, history, metrics=None, config=TransferConfig(), lanes=())
  .register(layers, ns=..., block_dim=0)   [register_kv_caches]
        the engine's CUDA KV tensors in layer order; `block_dim` is the dimension that
        indexes blocks (vLLM GPU (num_blocks, 2, B, H, D): 0; (2, num_blocks, B, H, D): 1).
  .load(ns, run, deadline_s) -> Future      [start_load_kv]
        resolved when it returns: every page was checked over the bytes that arrived in
        GPU memory (kvpool.gpu.transfer: the sketch of the staged rows, or XXH3-128 of
        them read back), the installs of the verified ones are enqueued, and `.failed`
        already holds the blocks that will not be installed (and every block after them).
        Nothing the pool holds or fails at raises out of it: a load the engine cannot start
        on the pool's pages (pages of another length, a restarted pool's smaller pages, a
        pool error) is a failed load of the whole run with its cause (corrupt for pages the
        layout cannot take; transport_error, timeout, throttled for the pool's failures).
  .load_settled(future) -> bool             [get_finished, asynchronous loads]
        the load's copies are complete on the device, its lease released and its stale
        blocks (if the pool reported any) in `.failed`.
  .wait(futures, timeout_s)                 [wait_for_layer_load, and for stores]
        a load: the current stream waits for its copies (a stream wait, no host sync);
        a store: the host waits for its commit.
  .store(ns, run, keep) -> Future           [wait_for_save]
        the copies are ordered after the engine's KV writes, and the engine's later
        writes after the copies' reads (stream waits enqueued before store returns), so
        the caller may reuse the blocks at once; the future resolves after the commit.
        A store the pool's state keeps from starting is a failed store (its `publish`
        record says why), never an exception.
  .failed / take_failed() / block_bytes / close()   as HostCopier's.
History records: `load` when a load is enqueued (what will be installed), `load_stale`
if the pool later reports a page reused under the lease (its blocks join `.failed`),
`publish` when a store's commit finished.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from kvpool.pool.records import Miss
from kvpool.client.backend import PoolBackend
from kvpool.connector.copier import CopyRun, note_load, wait_all
from kvpool.errors import (
    ArenaError,
    Busy,
    CorruptPage,
    InternalError,
    InvalidRequest,
    LeaseLost,
    MalformedFrame,
    MissCause,
    NoCapacity,
    OversizedFrame,
    PoolError,
    PoolTimeout,
    TransportError,
    Unauthenticated,
    WrongVersion,
)
from kvpool.gpu.config import KVLayoutError, RegionRefused, TransferConfig, TransferError
from kvpool.gpu.load import LoadHandle, LoadOutcome
from kvpool.gpu.tiered import TieredBackend
from kvpool.gpu.tiered_engine import TieredEngine
from kvpool.gpu.store import StoreOutcome
from kvpool.gpu.transfer import TransferEngine
from kvpool.connector.history import HistoryWriter
from kvpool.pool.keys import Namespace
from kvpool.pool.metrics import ClientMetrics


# What the pool or its pages can make the transfer engine raise, each a failed load or
# store of the run instead: the pool's failures and error replies (InvalidRequest included:
# the engine raises it for the caller's block ids too, and those are checked before the
# call, so what is left is the daemon's reply), a page outside the segment (ArenaError) and
# pages the engine cannot take (KVLayoutError: pooled pages of another length, a restarted
# pool's smaller pages). TransferError itself is the device's, and raises.
_POOL_CAUSED = (KVLayoutError, RegionRefused, ArenaError, Busy, CorruptPage, InternalError, InvalidRequest,
                LeaseLost, MalformedFrame, NoCapacity, OversizedFrame, PoolTimeout, TransportError, Unauthenticated,
                WrongVersion)


def _cause_of(exc: PoolError) -> MissCause:
    if isinstance(exc, (KVLayoutError, ArenaError, CorruptPage)):
        return MissCause.CORRUPT  # the pool holds pages this engine's layout cannot take
    if isinstance(exc, PoolTimeout):
        return MissCause.TIMEOUT
    if isinstance(exc, Busy):
        return MissCause.THROTTLED
    return MissCause.TRANSPORT_ERROR


class CudaCopier:
    ordered = True

    def __init__(self, backend: PoolBackend, history: HistoryWriter, metrics: ClientMetrics | None = None,
                 config: TransferConfig = TransferConfig(), lanes: Sequence[PoolBackend] = ()):
        self.backend = backend
        self.history = history
        self.metrics = metrics
        self.config = config
        self.lanes = tuple(lanes)
        self.failed: set[int] = set()
        self._failed_lock = threading.Lock()
        self.engine: TransferEngine | None = None

    def register(self, layers: Sequence[torch.Tensor], *, ns: Namespace, block_dim: int = 0) -> None:
        config = dataclasses.replace(self.config, block_dim=block_dim)
        self.engine = self._new_engine(ns, layers, config)
        members = getattr(self.engine, "member_capabilities", None)
        for name, caps in (members or {"": self.engine.capabilities}).items():
            self.history.write("gpu_transfer", **({"tier": name} if name else {}),
                               **{k: str(v) for k, v in dataclasses.asdict(caps).items()})
        for name, why in getattr(self.engine, "absent", {}).items():
            self.history.write("gpu_transfer", tier=name, absent=why[:400])

    def _new_engine(self, ns: Namespace, layers: Sequence[torch.Tensor], config: TransferConfig) -> TransferEngine:
        """The engine register() builds (a fault wrapper may build a known-bad one): on a
        TieredBackend (a keeper's tier and the host pool), an engine per member in lookup order
        (kvpool.gpu.tiered_engine.TieredEngine; each member is its engine's only lane)."""
        if isinstance(self.backend, TieredBackend):
            return TieredEngine(self.backend, ns, layers, config)
        return TransferEngine(self.backend, ns, layers, config, self.lanes)

    @property
    def block_bytes(self) -> int:
        return self.engine.layout.page_bytes if self.engine is not None else 0

    def _engine(self, ns: Namespace) -> TransferEngine:
        if self.engine is None:
            raise TransferError("CudaCopier.register() has not been called")
        if ns != self.engine.ns:
            raise TransferError("CudaCopier serves the namespace it was registered with")
        self.engine.poll()  # forget finished transfers (their records were written by callbacks)
        return self.engine

    def load(self, ns: Namespace, run: CopyRun, deadline_s: float) -> Future:
        engine = self._engine(ns)
        engine._check_ids(run.block_ids, run.hashes)  # the caller's own mistakes raise, before the pool is asked
        t0 = time.monotonic()
        direct_before = getattr(engine, "direct_loads", None)
        try:
            h = engine.load(run.block_ids, run.hashes, deadline_s=deadline_s)
        except _POOL_CAUSED as exc:  # the pool or its pages: a failed load of the whole run, never an exception
            return self._failed_load(run, exc, t0)
        # which install a load took (the direct one only for device pages, on an engine whose earlier
        # work was over); none where it installed nothing
        fields = {} if direct_before is None or not h.loaded else {"direct": engine.direct_loads > direct_before}
        failed = note_load(self, "load", run, h.loaded, h.miss, fields=fields, seconds=time.monotonic() - h._t0)
        if self.metrics is not None:
            self.metrics.blocks_loaded.inc(h.loaded)
            self.metrics.bytes_loaded.inc(h.loaded * self.block_bytes)
            if h.miss is not None:
                self.metrics.misses.labels(h.miss.cause.value).inc()
            self.metrics.loads.labels("hit" if not failed else ("partial" if h.loaded else "miss")).inc()
        done: Future = Future()
        done.settled = Future()  # resolved by _loaded, once the stale blocks are in .failed
        h.result.add_done_callback(lambda f, run=run, h=h, settled=done.settled: self._loaded(run, h, f, settled))
        done.set_result(h)
        return done

    def _failed_load(self, run: CopyRun, exc: PoolError, t0: float) -> Future:
        """A load the engine could not start on what the pool holds: every block of the run
        joins .failed, counted as a miss with its cause and recorded as any failed load."""
        cause = _cause_of(exc)
        note_load(self, "load", run, 0, Miss(0, cause), f"{type(exc).__name__}: {exc}",
                  seconds=time.monotonic() - t0)
        if self.metrics is not None:
            self.metrics.misses.labels(cause.value).inc()
            self.metrics.loads.labels("miss").inc()
        done: Future = Future()
        done.settled = Future()
        done.settled.set_result(None)
        done.set_result(None)  # no copy was enqueued: nothing for the engine's stream to wait for
        return done

    def _loaded(self, run: CopyRun, h: LoadHandle, f: Future, settled: Future) -> None:
        try:
            outcome: LoadOutcome = f.result()
            if outcome.stale:  # a pool bug: a page changed under the lease; those blocks are not trusted
                stale = list(run.block_ids[outcome.loaded:h.loaded])
                with self._failed_lock:
                    self.failed.update(stale)
                self.history.write("load_stale", req=run.req_id, tag=run.tag, failed_block_ids=stale)
        finally:
            settled.set_result(None)

    def load_settled(self, future: Future) -> bool:
        if not future.done():
            return False
        return future.exception() is not None or future.settled.done()

    def store(self, ns: Namespace, run: CopyRun, keep: Sequence[int]) -> Future:
        t0 = time.monotonic()
        engine = self._engine(ns)
        ids, hashes = [run.block_ids[i] for i in keep], [run.hashes[i] for i in keep]
        engine._check_ids(ids, hashes)  # the caller's own mistakes raise, before the pool is asked
        try:
            h = engine.store(ids, hashes)
        except _POOL_CAUSED as exc:  # a restarted pool whose pages do not fit, say: a failed store
            self.history.write("publish", req=run.req_id, tag=run.tag, first_block=run.first_block, blocks=len(keep),
                               error=f"{type(exc).__name__}: {exc}"[:400], committed=0,
                               seconds=round(time.monotonic() - t0, 6))
            failed: Future = Future()
            failed.set_result(None)
            return failed

        def record(f: Future) -> None:
            fields = {"req": run.req_id, "tag": run.tag, "first_block": run.first_block, "blocks": len(keep)}
            if f.cancelled():  # never started: nothing to record
                return
            exc = f.exception()
            if exc is not None:  # raised to the worker's wait on it; recorded here
                self.history.write("publish", **fields, error=f"{type(exc).__name__}: {exc}"[:400], raised=True,
                                   committed=0, seconds=round(time.monotonic() - t0, 6))
                return
            o: StoreOutcome = f.result()
            if o.errors:
                fields["error"] = "; ".join(o.errors)
            self.history.write("publish", **fields, committed=o.committed, exists=o.exists, pending=o.pending,
                               not_admitted=o.not_admitted, no_capacity=o.no_capacity, rejected=o.rejected,
                               seconds=round(time.monotonic() - t0, 6))
            if self.metrics is not None:
                self.metrics.bytes_published.inc(o.bytes_committed)

        h.result.add_done_callback(record)
        return h.result

    def wait(self, futures: Sequence[Future], timeout_s: float) -> None:
        def is_load(f: Future) -> bool:
            return f.done() and f.exception() is None and isinstance(f.result(), LoadHandle)

        for f in futures:
            if is_load(f):
                self.engine.wait_for_load(f.result())
        wait_all([f for f in futures if not is_load(f)], timeout_s, "KV stores")

    def take_failed(self) -> set[int]:
        with self._failed_lock:
            failed, self.failed = self.failed, set()
        return failed

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
