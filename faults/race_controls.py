"""Known-bad catalogs for the race suites (suites/pool/test_lookup_wait_race.py,
suites/pool/test_lease_race.py): each breaks one guarantee that a lookup parked on a
publish, or a lease, relies on while other connections commit, abort, evict and scrub.
Runnable as a daemon like the others: `python -m kvgate.faults.pool serve --catalog NAME`.
Never the production daemon.

  The lookup wait (a lookup parked on a publish in flight, kvpool.pool.daemon):
  AbortVisibleCatalog   an abandoned publish (aborted, its publisher gone, expired) is
                        committed instead of freed, under an all-zero digest: lookups answer
                        hits for blocks whose publish was aborted.
  LostWakeupCatalog     a publish closed without a commit still reads as open to
                        `reservation_open`: the daemon never wakes the lookups parked on it,
                        which wait out their bound and answer in_flight for a publish that is
                        over.
  LateVisibleCatalog    a commit closes its publish before its blocks are visible: the first
                        lookup after it (the one the commit woke) does not see them and answers
                        never_published for blocks the commit just made visible.

  The lease (a loader's pin on the pages it copies):
  EagerDropCatalog      a page dropped as corrupt (by the scrub, or a confirmed report) is
                        freed at once, even while a loader holds it: the page is reused under
                        the lease.
  KeptDropCatalog       a page dropped while leased is never freed: its last release leaves it
                        dropped (the page is lost to the pool).
  PinnedReleaseCatalog  a release does not unpin: the lease's pages are never evicted again.

(LeaselessCatalog, kvgate.faults.controls, is the lease's first control: it evicts leased pages.)

  The daemon's write into a reservation (WritePages, run in its thread pool,
  suites/pool/test_write_pages_race.py):
  FreedUnderWriteCatalog
                        a reservation that goes (its TTL passed while the write waited in the
                        queue, its client gone) frees its pages at once, although the daemon's
                        write into them is still to run: another client reserves and commits
                        the page, and the late write overwrites it.

  Two publishes of one block (the same_key_race conformance scenario,
  kvgate.harness.conformance.race, on live replicas):
  VisibleAtReserveCatalog
                        enters a reserved page in the index at its reserve, before its bytes
                        are written or its digest known: a reader mid-publish finds a block
                        whose page holds nothing yet, and a second publisher of the block is
                        told it exists (Mooncake#1374: "exists" with no value).
  PendingLeakCatalog    takes a page for every block it offers before it finds the block's
                        publish in flight, and keeps it when the block turns out pending: the
                        second publisher of a prefix leaks a reserved page per block, with
                        no reservation to reclaim it.
"""

from __future__ import annotations

from kvpool.errors import MissCause
from kvpool.pool.catalog import Catalog, LookupResult, Miss, PageState, SlotStatus
from kvpool.pool.digest import DIGEST_BYTES


class AbortVisibleCatalog(Catalog):
    def _abort(self, res) -> int:  # noqa: ANN001 - a catalog _Reservation, already closed
        rid = next(self._ids)
        self._reservations[rid] = res
        self.commit(rid, [bytes(DIGEST_BYTES)] * len(res.pages))
        self.counters["aborted_pages"] += len(res.pages)
        return len(res.pages)


class LostWakeupCatalog(Catalog):
    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._closed_uncommitted: set[int] = set()

    def abort(self, reservation_id: int) -> int:
        if reservation_id in self._reservations:
            self._closed_uncommitted.add(reservation_id)
        return super().abort(reservation_id)

    def drop_client(self, client: int) -> tuple[int, int]:
        self._closed_uncommitted.update(r for r, res in self._reservations.items() if res.client == client)
        return super().drop_client(client)

    def reap(self, now: float) -> tuple[int, int]:
        self._closed_uncommitted.update(r for r, res in self._reservations.items() if res.deadline <= now)
        return super().reap(now)

    def reservation_open(self, reservation_id: int) -> bool:
        return reservation_id in self._reservations or reservation_id in self._closed_uncommitted


class LateVisibleCatalog(Catalog):
    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._unseen: set[tuple[int, int, bytes]] = set()  # committed since the last lookup

    def commit(self, reservation_id: int, digests, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        res = self._reservations.get(reservation_id)
        out = super().commit(reservation_id, digests, *args, **kwargs)
        if res is not None:
            self._unseen.update((res.tenant, res.ns, key) for key in res.keys)
        return out

    def lookup(self, tenant, ns, hashes) -> LookupResult:  # noqa: ANN001
        found = super().lookup(tenant, ns, hashes)
        unseen, self._unseen = self._unseen, set()
        tid, nid = self._tenants.get(tenant, -1), self._ns_ids.get(ns, -2)
        for i in range(len(found.hits)):
            if (tid, nid, hashes[i]) in unseen:
                return LookupResult(self._refs(found.hits.pages[:i]), Miss(i, MissCause.NEVER_PUBLISHED))
        return found


class EagerDropCatalog(Catalog):
    _dropping = False

    def discard(self, page: int, generation: int) -> bool | None:
        self._dropping = True
        try:
            return super().discard(page, generation)
        finally:
            self._dropping = False

    def _may_evict(self, page: int) -> bool:
        return self._dropping or super()._may_evict(page)


class KeptDropCatalog(Catalog):
    _unpinning = False

    def _unpin(self, lease) -> None:  # noqa: ANN001
        self._unpinning = True
        try:
            super()._unpin(lease)
        finally:
            self._unpinning = False

    def _free_page(self, page: int) -> None:
        if self._unpinning and self.state[page] == PageState.DROPPED:
            return
        super()._free_page(page)


class PinnedReleaseCatalog(Catalog):
    def _unpin(self, lease) -> None:  # noqa: ANN001
        super()._unpin(lease)
        for p in lease.pages:
            if self.state[p] == PageState.COMMITTED:
                self.leases_on[p] += 1


class VisibleAtReserveCatalog(Catalog):
    def reserve(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        out = super().reserve(*args, **kwargs)
        res = self._reservations.get(out.reservation_id)
        if res is not None:
            index = self._index[res.tenant]
            for key, page in zip(res.keys, res.pages):
                if key not in index:  # visible now (under one namespace: the race's case)
                    index[key] = page
        return out

    def _hide(self, res) -> None:  # noqa: ANN001 - the early entries go before a commit enters them again
        index = self._index[res.tenant]
        for key, page in zip(res.keys, res.pages):
            if index.get(key) == page:
                del index[key]

    def commit(self, reservation_id: int, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        res = self._reservations.get(reservation_id)
        if res is not None:
            self._hide(res)
        return super().commit(reservation_id, *args, **kwargs)

    def _abort(self, res) -> int:  # noqa: ANN001
        self._hide(res)
        return super()._abort(res)


class PendingLeakCatalog(Catalog):
    def _classify_offer(self, tid: int, nid: int, key: bytes, admitted: bool) -> SlotStatus | None:
        status = super()._classify_offer(tid, nid, key, admitted)
        if status == SlotStatus.PENDING:
            page = self._allocate()
            if page >= 0:  # taken for the offer, and never returned
                self.state[page] = PageState.RESERVED
        return status


class FreedUnderWriteCatalog(Catalog):
    def _retire(self, res) -> int:  # noqa: ANN001
        return self._abort(res)  # the defect: the write still to run is not waited for


RACE_CATALOG_CONTROLS: dict[str, type[Catalog]] = {
    "abort_visible": AbortVisibleCatalog, "lost_wakeup": LostWakeupCatalog, "late_visible": LateVisibleCatalog,
    "eager_drop": EagerDropCatalog, "kept_drop": KeptDropCatalog, "pinned_release": PinnedReleaseCatalog,
    "visible_at_reserve": VisibleAtReserveCatalog, "pending_leak": PendingLeakCatalog,
    "freed_under_write": FreedUnderWriteCatalog,
}
