"""Negative controls: known-bad strategies the harness must catch.

Each is a small subclass or wrapper of a real component with one deliberate defect.
A check that passes with a control plugged in proves nothing; the suites run each
control and assert that it is caught.

  ForgetfulCatalog    keeps no ghosts: an evicted block's miss reads "never published".
  LeaselessCatalog    evicts pages that are leased (a loader without a pin).
  LeakyCatalog        never returns an aborted publish's pages to the free list.
  CrossedCatalog      answers a run of blocks with their pages in reverse order, each with
                      its own page's digest: a loader's digest check passes, the bytes are
                      another block's (a pool that serves other bytes).
  StaleIndexCatalog   leaves a freed page in the segment's index (kvpool.pool.index): a
                      probe finds blocks the pool evicted.
  EarlyCompletionCopier
                      reports a KV copy done when it is queued (the copy issued
                      without its ordering dependency).
"""

from __future__ import annotations

from concurrent.futures import Future

from kvpool.pool.catalog import Catalog
from kvpool.pool.records import Hits


class ForgetfulCatalog(Catalog):
    def _unindex(self, page: int) -> None:
        super()._unindex(page)
        self._ghosts.clear()


class LeaselessCatalog(Catalog):
    def _may_evict(self, page: int) -> bool:
        return True  # a lease pins nothing: neither LRU eviction nor an explicit evict is refused


class LeakyCatalog(Catalog):
    def _abort(self, res) -> int:  # noqa: ANN001
        self._unpend(res)
        return len(res.pages)


class CrossedCatalog(Catalog):
    def _refs(self, pages: list[int]) -> Hits:
        return super()._refs(pages[::-1])


class StaleIndexCatalog(Catalog):
    """Leaves a freed page's entry in the segment's index: a probe keeps finding blocks
    the pool evicted."""

    def _unindex(self, page: int) -> None:
        shm, self._shm = self._shm, None
        try:
            super()._unindex(page)
        finally:
            self._shm = shm


CATALOG_CONTROLS = {"forgetful": ForgetfulCatalog, "leaseless": LeaselessCatalog, "leaky": LeakyCatalog,
                    "crossed": CrossedCatalog, "stale_index": StaleIndexCatalog}
# The behaviour each known-bad catalog breaks, as a kind of finding of kvgate.harness.scenarios.pool_machine's state
# machine (FINDINGS): a control counts as caught only by a finding of that kind, with every
# other kind (the page-accounting invariant first) kept from ending the run.
CATALOG_BREAKS = {"forgetful": "miss_cause", "leaseless": "lease", "leaky": "capacity", "crossed": "bytes",
                  "stale_index": "probe"}


class EarlyCompletionCopier:
    """A copier that reports a copy done when it is queued, not when it has run: the
    CPU twin of a device copy issued without waiting on the engine's stream. The engine
    then frees blocks whose store has not read them yet, and reads blocks whose load
    has not written them yet."""

    ordered = False

    def __init__(self, inner):  # noqa: ANN001 - a kvpool.connector.copier.HostCopier
        self.inner = inner

    def submit(self, job, lane):  # noqa: ANN001, ANN201
        self.inner.submit(job, lane)
        done: Future = Future()
        done.set_result(None)
        return done
