"""The copy engine of a replica's worker: moves whole KV blocks between the engine's KV
tensors and pool pages, asynchronously, in an order the engine can rely on.

  HostCopier(backend, history, metrics)   the CPU engine: one thread runs the worker's
                     stores in submission order, LOAD_THREADS its loads (so that a load,
                     which the engine waits for, never queues behind a publish to a slow
                     pool, nor behind another request's slow load; the pool client
                     serializes their calls, each load's within its deadline).
  .register(layers)  the engine's per-layer KV tensors as byte arrays, block dimension
                     first; a page is one block of every layer, in layer order.
  .store(ns, run, keep) -> Future
                     publish blocks run.block_ids[i] for i in keep. The copy reads the
                     engine's blocks later, on the copy thread: the caller must keep
                     those blocks from being freed or rewritten until the future is done
                     (the connector delays freeing a finished request's blocks and waits
                     for a preempted request's stores before the next forward).
  .load(ns, run, deadline_s) -> Future
                     lease, copy, digest and release; blocks that could not be installed
                     are added to .failed (with every block after them). The engine must
                     not read the blocks before the future is done (wait_for_layer_load).
  .load_settled(future) -> bool
                     whether a load is over: its blocks installed or in .failed (the
                     connector reports an asynchronous load finished only then).
  .tier_load(tier, ns, run, deadline_s) / .tier_store(tier, ns, run, keep) -> Future
                     the same, from and to the network tier (kvpool.tier), on the same
                     lanes; records `tier_load` / `tier_publish`.
  .drop_unstarted(futures) -> list[Future]
                     cancel those of `futures` whose copy has not started (a preempted
                     request's stores queued behind others on a stalled pool: its blocks
                     are free, so they must never run, and nothing need wait for them);
                     returns the cancelled ones.
  .wait(futures, timeout_s)
                     block until every future is done. A copier's `ordered` flag says
                     whether a done future means the copy is complete (a known-bad
                     copier in kvgate.faults.controls reports completion early).
Each finished job writes its `publish` / `load` record to the history, from the copy
thread, with the time it was submitted and the time it completed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from kvpool.client.backend import PoolBackend
from kvpool.client.transfer import load, publish
from kvpool.pool.records import Miss
from kvpool.errors import MissCause, PoolError, PoolTimeout
from kvpool.connector.history import HistoryWriter
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.pool.metrics import ClientMetrics


LANES = ("store", "load", "tier")  # tier: publishes to the network tier, never ahead of the pool's
LOAD_THREADS = 4  # loads of one step run side by side: a slow one does not spend the others' deadlines
LANE_THREADS = {"store": 1, "load": LOAD_THREADS, "tier": 1}  # each lane's threads (one: in submission order)


@dataclasses.dataclass(frozen=True)
class CopyRun:
    """Consecutive blocks of one request: engine block ids and their pool keys."""

    req_id: str
    tag: str
    first_block: int  # index of block_ids[0] within the request's prompt
    block_ids: Sequence[int]
    hashes: Sequence[bytes]
    source: str = "pool"  # where a load reads: "pool" (this host's) or "tier" (kvpool.tier)


def note_load(copier: Any, event: str, run: CopyRun, loaded: int, miss: Any, error: str = "",
              fields: dict[str, Any] | None = None, **timing: float) -> list[int]:
    """A finished load's bookkeeping, the same for every copier: the blocks it did not
    install join `copier.failed` (under `copier._failed_lock`), and its record (`event`)
    goes to the history, with `error` (what stopped it) where something failed and the
    copier's own `fields` (the GPU's: which install the load took). Returns those blocks."""
    failed = list(run.block_ids[loaded:])
    with copier._failed_lock:
        copier.failed.update(failed)
    extra = {**(fields or {}), **({"error": error[:400]} if error else {})}
    copier.history.write(event, req=run.req_id, tag=run.tag, first_block=run.first_block, blocks=len(run.block_ids),
                         loaded=loaded, failed_block_ids=failed, miss_cause=miss.cause.value if miss else None,
                         miss_index=(run.first_block + miss.index) if miss else None, **extra,
                         **{k: round(v, 6) for k, v in timing.items()})
    return failed


def wait_all(futures: Sequence[Future], timeout_s: float, what: str) -> None:
    """Block until every future is done; PoolTimeout if some are not within timeout_s.
    A job's own pool errors are recorded by the job; anything else it raised propagates."""
    if not futures:
        return
    done, pending = wait(futures, timeout=timeout_s)
    if pending:
        raise PoolTimeout(f"{len(pending)} of {len(futures)} {what} still running after {timeout_s}s")
    for f in done:
        f.result()


class HostCopier:
    ordered = True

    def __init__(self, backend: PoolBackend, history: HistoryWriter, metrics: ClientMetrics | None = None):
        self.backend = backend
        self.history = history
        self.metrics = metrics
        self.failed: set[int] = set()
        self._failed_lock = threading.Lock()
        self._layers: list[np.ndarray] = []
        self._threads = {lane: ThreadPoolExecutor(LANE_THREADS[lane], thread_name_prefix=f"kvpool-{lane}")
                         for lane in LANES}

    def register(self, layers: list[np.ndarray]) -> None:
        self._layers = layers

    @property
    def block_bytes(self) -> int:
        return sum(layer[0].nbytes for layer in self._layers)

    def block_segments(self, block_id: int) -> list[np.ndarray]:
        """One block of every layer, in layer order: the page's byte order."""
        return [layer[block_id] for layer in self._layers]

    # -- jobs: what runs on the copy thread; a fault wrapper may run them later ----------
    def store_job(self, ns: Namespace, run: CopyRun, keep: Sequence[int]) -> Callable[[], Any]:
        submitted = time.monotonic()

        def job() -> Any:
            t0 = time.monotonic()
            fields = {"req": run.req_id, "tag": run.tag, "first_block": run.first_block, "blocks": len(keep),
                      "queued_s": round(t0 - submitted, 6)}
            try:
                blocks = [self.block_segments(run.block_ids[i]) for i in keep]
                res = publish(self.backend, ns, [run.hashes[i] for i in keep], blocks, metrics=self.metrics,
                              kind=getattr(self.backend, "digest_kind", DigestKind.XXH3))
            except PoolError as exc:  # publishing is best effort: the request itself is fine
                self.history.write("publish", **fields, error=f"{type(exc).__name__}: {exc}")
                return None
            except BaseException as exc:  # not the pool's: raised on (the worker's wait), recorded first
                self.history.write("publish", **fields, error=f"{type(exc).__name__}: {exc}"[:400], raised=True)
                raise
            self.history.write("publish", **fields, committed=res.committed, exists=res.exists,
                               pending=res.pending, not_admitted=res.not_admitted, no_capacity=res.no_capacity,
                               rejected=res.rejected, seconds=round(time.monotonic() - t0, 6))
            return res

        return job

    def load_job(self, ns: Namespace, run: CopyRun, deadline_s: float) -> Callable[[], Any]:
        submitted = time.monotonic()

        def job() -> Any:
            t0 = time.monotonic()
            left = deadline_s - (t0 - submitted)
            if left <= 0:  # the load waited past its deadline before it could start
                res, loaded, miss, error = None, 0, Miss(0, MissCause.TIMEOUT), "queued past its deadline"
            else:
                # load() ends every failure the pool or its pages can cause as a miss
                # (kvpool.client.transfer.load): what it raises is this process's own mistake
                res = load(self.backend, ns, run.hashes,
                           lambda i, ids=run.block_ids: self.block_segments(ids[i]),
                           deadline_s=left, metrics=self.metrics)
                loaded, miss, error = res.loaded, res.miss, res.error
            note_load(self, "load", run, loaded, miss, error, queued_s=t0 - submitted, seconds=time.monotonic() - t0)
            return res

        return job

    def tier_load_job(self, tier: Any, ns: Namespace, run: CopyRun, deadline_s: float) -> Callable[[], Any]:
        """A load from the network tier (kvpool.tier.interface.tier_load): its failed blocks join
        .failed as a pool load's do; its record is `tier_load`."""
        from kvpool.tier.interface import tier_load

        submitted = time.monotonic()

        def job() -> Any:
            t0 = time.monotonic()
            res = tier_load(tier, ns, run.hashes, lambda i, ids=run.block_ids: self.block_segments(ids[i]),
                            deadline_s=max(0.0, deadline_s - (t0 - submitted)))
            note_load(self, "tier_load", run, res.loaded, res.miss, queued_s=t0 - submitted,
                      seconds=time.monotonic() - t0)
            return res

        return job

    def tier_store_job(self, tier: Any, ns: Namespace, run: CopyRun, keep: Sequence[int]) -> Callable[[], Any]:
        from kvpool.tier.interface import tier_publish

        def job() -> Any:
            t0 = time.monotonic()
            try:
                res = tier_publish(tier, ns, [run.hashes[i] for i in keep],
                                   [self.block_segments(run.block_ids[i]) for i in keep])
            except BaseException as exc:  # tier_publish ends the tier's own failures; this is not one
                self.history.write("tier_publish", req=run.req_id, tag=run.tag, first_block=run.first_block,
                                   blocks=len(keep), error=f"{type(exc).__name__}: {exc}"[:400], raised=True,
                                   seconds=round(time.monotonic() - t0, 6))
                raise
            self.history.write("tier_publish", req=run.req_id, tag=run.tag, first_block=run.first_block,
                               blocks=len(keep), put=res.put, refused=res.refused, error=res.error,
                               seconds=round(time.monotonic() - t0, 6))
            return res

        return job

    def submit(self, job: Callable[[], Any], lane: str) -> Future:
        """Run `job` on the lane's thread ("store" or "load")."""
        return self._threads[lane].submit(job)

    # -- the interface the connector uses ------------------------------------------------
    def store(self, ns: Namespace, run: CopyRun, keep: Sequence[int]) -> Future:
        return self.submit(self.store_job(ns, run, keep), "store")

    def load(self, ns: Namespace, run: CopyRun, deadline_s: float) -> Future:
        return self.submit(self.load_job(ns, run, deadline_s), "load")

    def tier_load(self, tier: Any, ns: Namespace, run: CopyRun, deadline_s: float) -> Future:
        return self.submit(self.tier_load_job(tier, ns, run, deadline_s), "load")

    def tier_store(self, tier: Any, ns: Namespace, run: CopyRun, keep: Sequence[int]) -> Future:
        return self.submit(self.tier_store_job(tier, ns, run, keep), "tier")

    def drop_unstarted(self, futures: Sequence[Future]) -> list[Future]:
        return [f for f in futures if f.cancel()]  # only a job still queued can be cancelled

    def wait(self, futures: Sequence[Future], timeout_s: float) -> None:
        wait_all(futures, timeout_s, "KV copies")

    def load_settled(self, future: Future) -> bool:
        return future.done()  # the job adds its failed blocks before it returns

    def take_failed(self) -> set[int]:
        with self._failed_lock:
            failed, self.failed = self.failed, set()
        return failed

    def close(self) -> None:
        for thread in self._threads.values():
            thread.shutdown(wait=True)
