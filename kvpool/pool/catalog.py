"""The pool's bookkeeping: which page holds which block, and who may touch it.

Pure state: no sockets, no bytes, time passed in. The daemon owns one Catalog and
calls it from a single thread. What it answers (Hits, Miss, Slot, the results and
outcomes) is kvpool.pool.records.

One module of some 750 lines, as one cohesive thing: a single state machine whose every
operation keeps the same invariants over the same per-page arrays and tables (the index and
the segment's, the LRU list, pending publishes, leases, ghosts, the scrub's queue), which a
split into files would scatter.

  lookup(tenant, ns, hashes)            longest run of committed blocks from the start and,
                                        if it stops early, the one MissCause of the first
                                        missing block, and the id of the open reservation
                                        publishing that block under the same tenant and
                                        namespace (`pending`; 0 if none). Side-effect free.
  reservation_open(res_id)              whether a reservation is still open (neither
                                        committed, aborted nor reclaimed).
  count_miss(cause)                     count a miss decided outside the catalog (a
                                        lookup whose wait for a pending publish ran out).
  acquire(client, tenant, ns, hashes)   lookup + a lease on the run's pages (pinned: never
                                        evicted, freed or reused until released), subject to
                                        the per-client and global load limits (THROTTLED).
  release(lease_id)                     unpin; re-checks every page's generation.
  pin(client, page, generation, now)    a lease on one committed page by id, outside the load
                                        limits and hit counters, not a touch (the GPU tier's
                                        demotion reads pages this way).
  reserve(client, tenant, ns, hashes, lengths, boundary)
                                        phase one of publish: admission, then a RESERVED page
                                        per admitted block (evicting LRU victims if needed).
  commit(res_id, digests, kind)         phase two: pages become visible (a None digest means
                                        the daemon's verify failed: that page is freed); `kind`
                                        (kvpool.pool.digest.DigestKind) is recorded with each page.
  committed_as(page, generation)        the page's kind if it still holds that commit, else None.
  discard(page, generation)             drop a committed page found corrupt at rest (by the scrub, or
                                        on a loader's report the daemon confirmed): out of the index
                                        (and the segment's) at once, so no lookup, probe or acquire
                                        finds it again; its page is freed at once, or, while loaders
                                        hold it (state DROPPED), when the last of them releases it.
  scrub_fresh(n) / scrub_cycle(n)       the scrub's next pages (page, generation): the oldest commits
                                        taken on trust and not yet scrubbed (commit(..., scrub_first=
                                        True)); and the next committed pages of a cyclic cursor over
                                        the page ids (every kind, every committed page in turn).
  scrubbed(page, generation)            the page's first scrub is done (it leaves the fresh queue).
  abort(res_id) / drop_client(client)   an abandoned or crashed publish returns its pages.
  reap(now)                             expire reservations and leases past their deadline.
  renew(client, reservations, now, leases)
                                        a client still working on its own open reservations
                                        (leases) moves their deadlines to now + TTL, never past
                                        the grant's maximum age (reservation_max_s, lease_max_s);
                                        per id a Renewal: the seconds ahead, or a refusal
                                        (RenewRefusal: another client's, untouched; past its
                                        deadline, even if not yet reaped, never resurrected;
                                        unknown). The TTL still reclaims what a live client
                                        forgot; the maximum age, what a stuck one keeps renewing.
  evict(...) / set_capacity(pages)      forced eviction and capacity squeeze; leased pages
                                        are never evicted.
  lru_pages(n)                          the next n pages an eviction would take (LruPage),
                                        read-only: what the GPU tier demotes (with
                                        CatalogConfig.evict_on_reserve False, a reserve at
                                        capacity evicts nothing: its blocks get NO_CAPACITY).
  evict(tenant, ns, [NAMESPACE_RESET])  the namespace's reset (reset_namespace): every block
                                        committed under it leaves the index at once (freed, or
                                        DROPPED while leased), and every open publish under it is
                                        cancelled (its commit rejects every page).

With a `shm_index` (the daemon passes its segment's), every committed block is also
entered in the segment's index and taken out of it before its page is freed.

The scrub's state is bounded by the pages, whatever the churn: the fresh queue holds at
most one entry per page (a page's new commit replaces its entry; freeing a page removes
it, O(1)), and the at-rest pass is a cursor (one int) plus a count of completed cycles.

Bounded state per client and per frame: a client's leases pin at most
`max_leased_pages_per_client` pages in all (default 4 x num_pages; past it an acquire is
THROTTLED), and at most `max_namespaces` namespaces are interned (a full table forgets
those without pages or open publishes, then refuses a new one).

Every freed page has its generation bumped, so a reader that held it across a reuse
can tell. Evicted keys leave a ghost so a later miss is EVICTED, not NEVER_PUBLISHED.
Tenants are separate indexes: a lookup never sees another tenant's blocks, committed
or pending.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvpool.errors import InvalidRequest, LeaseLost, MissCause
from kvpool.pool.digest import DIGEST_BYTES, KINDS, DigestKind
from kvpool.pool.index import ShmIndex, ns_fingerprint
from kvpool.pool.keys import NAMESPACE_RESET, Namespace
from kvpool.pool.records import (
    AcquireResult,
    CommitResult,
    EvictOutcome,
    Hits,
    LookupResult,
    Miss,
    ReleaseResult,
    RenewRefusal,
    RenewResult,
    Renewal,
    ReserveResult,
    Slot,
    SlotStatus,
)


class PageState(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    COMMITTED = 2
    DROPPED = 3  # found corrupt while leased: out of the index, freed when its last lease is released


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """What is worth publishing. Unique tails are not.

    min_blocks: a publish of fewer admitted blocks than this is declined whole.
    second_hit: a block is admitted only the second time it is offered.
    seen_capacity: how many first offers second-hit admission remembers.
    """

    min_blocks: int = 1
    second_hit: bool = False
    seen_capacity: int = 65536


@dataclasses.dataclass(frozen=True, slots=True)
class LoadLimits:
    """Concurrent leases allowed; 0 means unlimited. Past a limit the loader recomputes."""

    per_client: int = 0
    total: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class CatalogConfig:
    num_pages: int
    page_size: int
    admission: AdmissionPolicy = AdmissionPolicy()
    limits: LoadLimits = LoadLimits()
    ghost_capacity: int | None = None  # default: num_pages
    # Pages one client's leases pin in all (a page leased twice counts twice): an acquire past
    # it is THROTTLED. Default: 4 x num_pages. Each lease costs the daemon memory per page
    # until it is released or expires, so a client cannot pile up leases without bound.
    max_leased_pages_per_client: int | None = None
    # Namespaces the catalog holds at once (a namespace is interned at its first reserve); a
    # reserve under a new one past it first forgets the namespaces that hold no page and no
    # open publish (with their ghosts and second-hit offers), then, if the table is still
    # full, is refused (InvalidRequest).
    max_namespaces: int = 4096
    # A reserve that finds the pages at capacity evicts the least recently used (True), or
    # leaves those blocks unreserved (NO_CAPACITY) for its owner to make room its own way
    # (False: the GPU tier, which demotes to the host pool instead of dropping: kvpool.gpu.tier).
    evict_on_reserve: bool = True
    reservation_ttl_s: float = 30.0
    lease_ttl_s: float = 60.0
    # The oldest a renewed reservation (lease) may grow: renew() never moves a deadline past
    # its grant + this, so a stuck client that keeps renewing still gives the pages back.
    reservation_max_s: float = 3600.0
    lease_max_s: float = 3600.0
    # Ids of expired reservations and leases remembered (with their client), so a late renew
    # is answered EXPIRED rather than UNKNOWN.
    expired_memory: int = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class LruPage:
    """A committed page as lru_pages lists it: where it is, which block it holds, its digest."""

    page: int
    generation: int
    tenant: str
    ns: Namespace
    key: bytes
    length: int
    digest: bytes
    kind: DigestKind


@dataclasses.dataclass(slots=True)
class _Reservation:
    client: int
    tenant: int
    ns: int
    keys: list[bytes]
    pages: list[int]  # -1 where the slot holds no page
    deadline: float
    born: float = 0.0  # when it was granted: renewals stop at born + reservation_max_s
    cancelled: bool = False  # its namespace was reset while it was open: its commit rejects every page
    writing: int = 0  # the daemon's writes into its pages still running (WritePages, in the thread pool)
    doomed: bool = False  # gone (expired, aborted, its client gone) while writing: freed when the writes end
    unpended: bool = False  # its blocks no longer pending (a doomed one's, before its pages are freed)


@dataclasses.dataclass(slots=True)
class _Lease:
    client: int
    pages: list[int]
    generations: list[int]
    deadline: float
    born: float = 0.0  # when it was granted: renewals stop at born + lease_max_s


class Catalog:
    def __init__(self, config: CatalogConfig, generations: np.ndarray | None = None,
                 shm_index: ShmIndex | None = None):
        n = config.num_pages
        if n <= 0:
            raise ValueError(f"num_pages must be positive, got {n}")
        self.config = config
        # Generation per page; the daemon passes the arena's array so clients see it.
        self.gen = generations if generations is not None else np.zeros(n, dtype=np.uint64)
        if self.gen.shape != (n,):
            raise ValueError(f"generations has shape {self.gen.shape}, expected ({n},)")
        # The segment's index of committed blocks (kvpool.pool.index), kept in step with
        # `_index`: what same-host clients probe without asking.
        self._shm = shm_index
        self._fps: list[int] = []  # namespace fingerprint by namespace id
        self.state = np.zeros(n, dtype=np.uint8)
        self.length = np.zeros(n, dtype=np.uint32)
        self.digest = np.zeros((n, DIGEST_BYTES), dtype=np.uint8)
        self.kind = np.zeros(n, dtype=np.uint8)  # DigestKind.code of each committed page's digest
        self.ns_of = np.full(n, -1, dtype=np.int32)
        self.tenant_of = np.full(n, -1, dtype=np.int32)
        self.leases_on = np.zeros(n, dtype=np.uint32)
        self.key_of: list[bytes | None] = [None] * n
        # Free pages in a min-heap: a reservation gets the lowest free pages, in ascending
        # order along its blocks, so a run published together lies in consecutive pages
        # where it can (one copy per run instead of one per page, both ways).
        self._free: list[int] = list(range(n))
        # Eviction order: the committed pages in a doubly linked list, least recently touched
        # first; a touch moves a page to the tail, freeing unlinks it. An eviction walks from
        # the head past the pages a loader holds (at most the lease limits' worth), so it
        # costs O(1) per page evicted, not a scan of the arena. Plain lists, not numpy arrays:
        # a lease of 8,000 pages touches each one, and a numpy element read or written from
        # Python costs several times a list's (the acquire's 8,000 touches took 6 ms).
        self._prev: list[int] = [-1] * n
        self._next: list[int] = [-1] * n
        self._linked: list[bool] = [False] * n
        self._head = self._tail = -1
        self.capacity = n  # pages that may be reserved or committed (set_capacity)
        # tenant id -> {block hash -> page, or a tuple of pages under several namespaces}
        self._index: list[dict[bytes, int | tuple[int, ...]]] = []
        self._tenants: dict[str, int] = {}
        self._namespaces: list[Namespace] = []
        self._ns_ids: dict[Namespace, int] = {}
        # (tenant, namespace, block hash) -> the open reservation publishing it
        self._pending: dict[tuple[int, int, bytes], int] = {}
        self._ghosts: OrderedDict[tuple[int, int, bytes], None] = OrderedDict()
        self._ghost_capacity = n if config.ghost_capacity is None else config.ghost_capacity
        self._seen: OrderedDict[tuple[int, int, bytes], None] = OrderedDict()
        self._reservations: dict[int, _Reservation] = {}
        self._leases: dict[int, _Lease] = {}
        self._leases_by_client: dict[int, int] = {}
        self._leased_pages_by_client: dict[int, int] = {}
        self._leased_pages_cap = (4 * n if config.max_leased_pages_per_client is None
                                  else config.max_leased_pages_per_client)
        self._free_ns: list[int] = []  # ids of forgotten namespaces, for reuse
        self._ids = itertools.count(1)
        # The scrub (see the module docstring): page -> generation of commits taken on trust
        # and not yet scrubbed, oldest first (at most one entry per page); the at-rest cursor.
        self._unscrubbed: OrderedDict[int, int] = OrderedDict()
        self._scrub_cursor = 0
        self.counters: dict[str, int] = {
            "hits": 0, "hit_blocks": 0, "evictions": 0, "commits": 0, "aborted_pages": 0,
            "rejected_pages": 0, "expired_reservations": 0, "expired_leases": 0,
            "discarded_corrupt": 0, "scrub_cycles": 0, "namespace_resets": 0, "reset_pages": 0,
            "renewals": 0, "renewals_refused": 0,
        }
        self._expired: OrderedDict[int, int] = OrderedDict()  # expired id -> its client (bounded)
        self.miss_counters: dict[MissCause, int] = {c: 0 for c in MissCause}

    # -- interning ---------------------------------------------------------------------
    def _tenant_id(self, tenant: str, create: bool) -> int:
        tid = self._tenants.get(tenant)
        if tid is None and create:
            tid = len(self._index)
            self._tenants[tenant] = tid
            self._index.append({})
        return -1 if tid is None else tid

    def _ns_id(self, ns: Namespace) -> int:
        nid = self._ns_ids.get(ns)
        if nid is not None:
            return nid
        if len(self._ns_ids) >= self.config.max_namespaces:
            self._forget_namespaces()
            if len(self._ns_ids) >= self.config.max_namespaces:
                raise InvalidRequest(f"{len(self._ns_ids)} namespaces hold pages or open publishes in this pool "
                                     f"(at most {self.config.max_namespaces}): no new one until some are evicted")
        if self._free_ns:
            nid = self._free_ns.pop()
            self._namespaces[nid], self._fps[nid] = ns, ns_fingerprint(ns)
        else:
            nid = len(self._namespaces)
            self._namespaces.append(ns)
            self._fps.append(ns_fingerprint(ns))
        self._ns_ids[ns] = nid
        return nid

    def _forget_namespaces(self) -> int:
        """Forget the namespaces that hold no page and no open publish, with their ghosts and
        second-hit offers: O(pages + ghosts + offers), only when the table is full."""
        live = {int(x) for x in np.unique(self.ns_of[self.ns_of >= 0])}
        live.update(r.ns for r in self._reservations.values())
        dead = [nid for nid in self._ns_ids.values() if nid not in live]
        if not dead:
            return 0
        gone = set(dead)
        for table in (self._ghosts, self._seen):
            for key in [k for k in table if k[1] in gone]:
                del table[key]
        for nid in dead:
            del self._ns_ids[self._namespaces[nid]]
            self._free_ns.append(nid)
        return len(dead)

    def namespace(self, ns_id: int) -> Namespace:
        return self._namespaces[ns_id]

    # -- reading -----------------------------------------------------------------------
    def _pages_for(self, tid: int, key: bytes) -> tuple[int, ...]:
        if tid < 0:
            return ()
        entry = self._index[tid].get(key)
        if entry is None:
            return ()
        return entry if isinstance(entry, tuple) else (entry,)

    def _find(self, tid: int, nid: int, ns: Namespace, key: bytes, index: int) -> int | Miss:
        pages = self._pages_for(tid, key)
        for p in pages:
            if self.ns_of[p] == nid:
                return p
        if (tid, nid, key) in self._ghosts:
            return Miss(index, MissCause.EVICTED)
        if pages:
            other = self._namespaces[int(self.ns_of[pages[0]])]
            return Miss(index, MissCause.INCOMPATIBLE, ns.differing_fields(other))
        return Miss(index, MissCause.NEVER_PUBLISHED)

    def _refs(self, pages: list[int]) -> Hits:
        if not pages:
            return Hits()
        at = np.asarray(pages, dtype=np.int64)  # once: each column below is a gather by it
        kinds = self.kind[at]
        return Hits(pages, self.gen[at].tolist(), self.length[at].tolist(), self.digest[at].tobytes(),
                    kinds.tobytes() if kinds.any() else b"")

    def lookup(self, tenant: str, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        tid = self._tenant_id(tenant, create=False)
        nid = self._ns_ids.get(ns, -2)
        # Fast path, the common case: each block under one namespace (an int entry).
        get = (self._index[tid] if tid >= 0 else {}).get
        pages: list[int] = []
        for key in hashes:
            entry = get(key)
            if type(entry) is not int:
                break
            pages.append(entry)
        if pages:
            same = self.ns_of[pages] == nid
            if not same.all():
                del pages[int(np.argmin(same)) :]
        # Slow path from the first block the fast path could not settle.
        for i in range(len(pages), len(hashes)):
            found = self._find(tid, nid, ns, hashes[i], i)
            if isinstance(found, Miss):
                return LookupResult(self._refs(pages), found, self._pending_reservation(tid, nid, hashes[i]))
            pages.append(found)
        return LookupResult(self._refs(pages), None)

    def _pending_reservation(self, tid: int, nid: int, key: bytes) -> int:
        if tid < 0 or nid < 0:
            return 0
        rid = self._pending.get((tid, nid, key), 0)
        return rid if rid in self._reservations else 0

    def reservation_open(self, reservation_id: int) -> bool:
        return reservation_id in self._reservations

    def count_miss(self, cause: MissCause) -> None:
        self.miss_counters[cause] += 1

    def acquire(self, client: int, tenant: str, ns: Namespace, hashes: Sequence[bytes],
                now: float) -> AcquireResult:
        found = self.lookup(tenant, ns, hashes)
        if not found.hits:
            if found.miss is not None:
                self.miss_counters[found.miss.cause] += 1
            return AcquireResult(0, Hits(), found.miss)
        limits = self.config.limits
        pages = list(found.hits.pages)
        if (limits.per_client and self._leases_by_client.get(client, 0) >= limits.per_client) or (
            limits.total and len(self._leases) >= limits.total
        ) or self._leased_pages_by_client.get(client, 0) + len(pages) > self._leased_pages_cap:
            self.miss_counters[MissCause.THROTTLED] += 1
            return AcquireResult(0, Hits(), Miss(0, MissCause.THROTTLED))
        np.add.at(self.leases_on, pages, 1)  # a page named twice is leased twice, as released twice
        self._touch_all(pages)
        lease_id = next(self._ids)
        self._leases[lease_id] = _Lease(client, pages, list(found.hits.generations),
                                        now + self.config.lease_ttl_s, now)
        self._leases_by_client[client] = self._leases_by_client.get(client, 0) + 1
        self._leased_pages_by_client[client] = self._leased_pages_by_client.get(client, 0) + len(pages)
        self.counters["hits"] += 1
        self.counters["hit_blocks"] += len(pages)
        if found.miss is not None:
            self.miss_counters[found.miss.cause] += 1
        return AcquireResult(lease_id, found.hits, found.miss)

    def pin(self, client: int, page: int, generation: int, now: float) -> int:
        """A lease on one committed page by its id, outside the load limits and the hit
        counters, and without making it recently used: the owner's own read of a page (the GPU
        tier's demotion copies it out). Released with release(). 0: the page no longer holds
        that commit."""
        if self.committed_as(page, generation) is None:
            return 0
        self.leases_on[page] += 1
        lease_id = next(self._ids)
        self._leases[lease_id] = _Lease(client, [page], [generation], now + self.config.lease_ttl_s, now)
        self._leases_by_client[client] = self._leases_by_client.get(client, 0) + 1
        self._leased_pages_by_client[client] = self._leased_pages_by_client.get(client, 0) + 1
        return lease_id

    def release(self, lease_id: int) -> ReleaseResult:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseLost(f"lease {lease_id} is not held (released, expired, or never granted)")
        # Taken before the unpin, which frees a page dropped under this lease: what the lease
        # read was not reused while it held it.
        if lease.pages:
            moved = self.gen[lease.pages] != np.asarray(lease.generations, dtype=self.gen.dtype)
            stale = tuple(int(p) for p in np.asarray(lease.pages)[moved])
        else:
            stale = ()
        self._unpin(lease)
        return ReleaseResult(stale)

    def _unpin(self, lease: _Lease) -> None:
        if lease.pages:
            pages = np.asarray(lease.pages, dtype=np.int64)
            np.subtract.at(self.leases_on, pages, 1)
            # the pages this release left unleased that were dropped under a lease: freed now
            # (once each, a page named twice in the lease included)
            done = pages[(self.leases_on[pages] == 0) & (self.state[pages] == int(PageState.DROPPED))]
            for p in np.unique(done).tolist():
                self._free_page(p)
        left = self._leases_by_client[lease.client] - 1
        if left:
            self._leases_by_client[lease.client] = left
        else:
            del self._leases_by_client[lease.client]
        held = self._leased_pages_by_client[lease.client] - len(lease.pages)
        if held:
            self._leased_pages_by_client[lease.client] = held
        else:
            del self._leased_pages_by_client[lease.client]

    # -- publishing --------------------------------------------------------------------
    def reserve(self, client: int, tenant: str, ns: Namespace, hashes: Sequence[bytes],
                lengths: Sequence[int], now: float, boundary: int | None = None) -> ReserveResult:
        if len(lengths) != len(hashes):
            raise InvalidRequest(f"{len(hashes)} hashes but {len(lengths)} lengths")
        for n in lengths:
            if not 0 < n <= self.config.page_size:
                raise InvalidRequest(f"block of {n} bytes does not fit a page of {self.config.page_size}")
        if ns.tenant != tenant:
            raise InvalidRequest(f"namespace tenant {ns.tenant!r} is not the session's tenant {tenant!r}")
        tid = self._tenant_id(tenant, create=True)
        nid = self._ns_id(ns)
        admission = self.config.admission
        limit = len(hashes) if boundary is None else max(0, min(boundary, len(hashes)))
        slots: list[Slot] = []
        res_keys: list[bytes] = []
        res_pages: list[int] = []
        declined_whole = limit < admission.min_blocks
        for i, key in enumerate(hashes):
            status = self._classify_offer(tid, nid, key, admitted=(i < limit and not declined_whole))
            if status is not None:
                slots.append(Slot(status))
                continue
            page = self._allocate()
            if page < 0:
                slots.append(Slot(SlotStatus.NO_CAPACITY))
                continue
            self.state[page] = PageState.RESERVED
            self.length[page] = lengths[i]
            self.ns_of[page] = nid
            self.tenant_of[page] = tid
            self.key_of[page] = key
            self._pending[(tid, nid, key)] = 0  # the reservation's id once it has one, below
            res_keys.append(key)
            res_pages.append(page)
            slots.append(Slot(SlotStatus.RESERVED, page, int(self.gen[page])))
        if not res_pages:
            return ReserveResult(0, tuple(slots))
        rid = next(self._ids)
        self._reservations[rid] = _Reservation(client, tid, nid, res_keys, res_pages,
                                               now + self.config.reservation_ttl_s, now)
        for key in res_keys:
            self._pending[(tid, nid, key)] = rid
        return ReserveResult(rid, tuple(slots))

    def _classify_offer(self, tid: int, nid: int, key: bytes, admitted: bool) -> SlotStatus | None:
        for p in self._pages_for(tid, key):
            if self.ns_of[p] == nid:
                self._touch(p)
                return SlotStatus.EXISTS
        if (tid, nid, key) in self._pending:
            return SlotStatus.PENDING
        if not admitted:
            return SlotStatus.NOT_ADMITTED
        admission = self.config.admission
        if admission.second_hit:
            seen_key = (tid, nid, key)
            if seen_key not in self._seen:
                self._seen[seen_key] = None
                if len(self._seen) > admission.seen_capacity:
                    self._seen.popitem(last=False)
                return SlotStatus.NOT_ADMITTED
            del self._seen[seen_key]
        return None

    def _allocate(self) -> int:
        if self.used_pages() >= self.capacity:
            if not self.config.evict_on_reserve or not self._evict_lru(1):
                return -1
        if not self._free:
            return -1
        return heapq.heappop(self._free)

    def used_pages(self) -> int:
        return self.config.num_pages - len(self._free)

    def commit(self, reservation_id: int, digests: Sequence[bytes | None],
               kind: DigestKind = DigestKind.XXH3, scrub_first: bool = False) -> CommitResult:
        """`scrub_first`: the digests were taken on trust (not re-hashed by the daemon): each
        committed page joins the scrub's fresh queue, ahead of the at-rest cycle."""
        res = self._reservations.get(reservation_id)
        if res is None:
            raise InvalidRequest(f"reservation {reservation_id} is not open (committed, aborted or expired)")
        if res.writing:
            raise InvalidRequest(f"reservation {reservation_id}: the daemon is still writing into its pages")
        del self._reservations[reservation_id]
        if len(digests) != len(res.pages):
            self._reservations[reservation_id] = res
            raise InvalidRequest(f"{len(digests)} digests for {len(res.pages)} reserved pages")
        committed = 0
        rejected: list[int] = []
        index = self._index[res.tenant]
        self._unpend(res)
        for i, (key, page, digest) in enumerate(zip(res.keys, res.pages, digests)):
            if res.cancelled:  # computed before its namespace's reset: never visible after it
                rejected.append(i)
                self._free_page(page)
                self.counters["reset_pages"] += 1
                continue
            if digest is None or len(digest) != DIGEST_BYTES:
                rejected.append(i)
                self._free_page(page)
                self.counters["rejected_pages"] += 1
                continue
            self.digest[page] = np.frombuffer(digest, dtype=np.uint8)
            self.kind[page] = kind.code
            self.state[page] = PageState.COMMITTED
            self._touch(page)
            entry = index.get(key)
            if entry is None:
                index[key] = page
            else:
                index[key] = (entry if isinstance(entry, tuple) else (entry,)) + (page,)
            if self._shm is not None:
                self._shm.insert(key, self._fps[res.ns], page)
            self._ghosts.pop((res.tenant, res.ns, key), None)
            if scrub_first:
                self._unscrubbed[page] = int(self.gen[page])  # a freed page's entry went with it
            committed += 1
        self.counters["commits"] += committed
        return CommitResult(committed, tuple(rejected))

    def committed_as(self, page: int, generation: int) -> DigestKind | None:
        """The digest kind of `page` if it still holds the commit of `generation`."""
        if int(self.state[page]) != PageState.COMMITTED or int(self.gen[page]) != generation:  # int(): see _unpin
            return None
        return KINDS[int(self.kind[page])]

    def discard(self, page: int, generation: int) -> bool | None:
        """Drop a committed page whose bytes no longer match its digest (found at rest by the
        scrub, or by the daemon's check of a loader's report). It leaves the index and the
        segment's index at once (a later lookup of its block misses as `evicted`: a ghost,
        as an eviction leaves; the pool no longer has it, a network tier may). An unleased
        page is freed at once; a leased one is DROPPED, freed when its last lease is released
        (a loader holding it re-checks its digest itself). True: dropped; None: the page no
        longer holds that commit (evicted, dropped or reused since)."""
        if self.committed_as(page, generation) is None:
            return None
        self._unindex(page)
        self._unscrubbed.pop(page, None)
        self.counters["discarded_corrupt"] += 1
        if self._may_evict(page):
            self._free_page(page)
        else:
            self.state[page] = PageState.DROPPED
            self._unlink(page)  # never an eviction candidate again; _unpin frees it
        return True

    # -- the scrub's queue and cursor --------------------------------------------------
    def scrub_fresh(self, n: int) -> list[tuple[int, int]]:
        """Up to `n` of the oldest commits taken on trust and not yet scrubbed, as (page,
        generation); they stay queued until scrubbed() or until their page is freed."""
        return list(itertools.islice(self._unscrubbed.items(), max(0, n)))

    def scrubbed(self, page: int, generation: int) -> None:
        """The first scrub of that commit is over (whatever it found)."""
        if self._unscrubbed.get(page) == generation:
            del self._unscrubbed[page]

    def scrub_queued(self) -> int:
        """Entries of the fresh queue: at most num_pages, whatever the churn."""
        return len(self._unscrubbed)

    def scrub_cycle(self, n: int) -> list[tuple[int, int]]:
        """The next `n` committed pages (page, generation) of the at-rest pass, a cursor over
        the page ids that wraps around (counted in `scrub_cycles`): every committed page, of
        every digest kind, is visited once per cycle of at most num_pages / n calls. O(1)
        memory; one vectorised scan of the states per call. A page under a lease is passed
        over: its loaders check it and report it (ReportCorrupt), so what a loader meets is
        judged by the loader's report, not by when the cursor happens to pass."""
        if n <= 0:
            return []
        total = self.config.num_pages
        start = self._scrub_cursor
        at_rest = (self.state == PageState.COMMITTED) & (self.leases_on == 0)
        picked = np.flatnonzero(at_rest[start:])[:n] + start
        if len(picked) < n:  # past the last page: the cycle is over, the next begins at page 0
            self.counters["scrub_cycles"] += 1
            more = np.flatnonzero(at_rest[:start])[: n - len(picked)]
            picked = np.concatenate([picked, more])
            self._scrub_cursor = int(more[-1]) + 1 if len(more) else 0
        else:
            self._scrub_cursor = int(picked[-1]) + 1
        if self._scrub_cursor >= total:
            self._scrub_cursor = 0
            self.counters["scrub_cycles"] += 1
        return [(int(p), int(self.gen[p])) for p in picked]

    def abort(self, reservation_id: int) -> int:
        res = self._reservations.pop(reservation_id, None)
        if res is None:
            raise InvalidRequest(f"reservation {reservation_id} is not open (committed, aborted or expired)")
        return self._retire(res)

    def _retire(self, res: _Reservation) -> int:
        """A reservation gone (aborted, expired, its client gone): its pages are freed, unless the
        daemon is still writing into them (a WritePages in its thread pool), in which case they
        stay reserved until the last write ends (end_write): a page freed under a running write
        could be reserved and committed by another client and then overwritten by it."""
        if res.writing:
            res.doomed = True
            self._unpend(res)  # its blocks are free to publish again now; only its pages wait
            return len(res.pages)
        return self._abort(res)

    def _unpend(self, res: _Reservation) -> None:
        if res.unpended:
            return
        res.unpended = True
        for key in res.keys:
            del self._pending[(res.tenant, res.ns, key)]

    def begin_write(self, reservation_id: int, client: int) -> _Reservation:
        """The daemon is about to write into the pages of `client`'s open reservation: they are
        not freed until end_write (InvalidRequest if it is not that client's open reservation)."""
        res = self._reservations.get(reservation_id)
        if res is None or res.client != client:
            raise InvalidRequest(f"reservation {reservation_id} is not open in this session")
        res.writing += 1
        return res

    def end_write(self, res: _Reservation) -> None:
        """A write begin_write announced has ended (done, failed, or never started)."""
        res.writing -= 1
        if not res.writing and res.doomed:
            res.doomed = False
            self._abort(res)

    def _abort(self, res: _Reservation) -> int:
        self._unpend(res)
        for page in res.pages:
            self._free_page(page)
        self.counters["aborted_pages"] += len(res.pages)
        return len(res.pages)

    def reservation_pages(self, reservation_id: int) -> list[int]:
        res = self._reservations.get(reservation_id)
        if res is None:
            raise InvalidRequest(f"reservation {reservation_id} is not open (committed, aborted or expired)")
        return list(res.pages)

    # -- freeing and eviction ----------------------------------------------------------
    def _free_page(self, page: int) -> None:
        self._unscrubbed.pop(page, None)
        self.state[page] = PageState.FREE
        self.length[page] = 0
        self.ns_of[page] = -1
        self.tenant_of[page] = -1
        self.key_of[page] = None
        self.digest[page] = 0
        self.kind[page] = 0
        self.gen[page] += np.uint64(1)
        self._unlink(page)
        heapq.heappush(self._free, page)

    def _unindex(self, page: int) -> None:
        tid = int(self.tenant_of[page])
        key = self.key_of[page]
        assert key is not None
        if self._shm is not None:  # out of the index before anything else changes
            self._shm.remove(key, self._fps[int(self.ns_of[page])], page)
        index = self._index[tid]
        entry = index[key]
        if isinstance(entry, tuple):
            rest = tuple(p for p in entry if p != page)
            index[key] = rest[0] if len(rest) == 1 else rest
        else:
            del index[key]
        ghost = (tid, int(self.ns_of[page]), key)
        self._ghosts[ghost] = None
        self._ghosts.move_to_end(ghost)
        while len(self._ghosts) > self._ghost_capacity:
            self._ghosts.popitem(last=False)

    def _evict_page(self, page: int) -> None:
        self._unindex(page)
        self._free_page(page)
        self.counters["evictions"] += 1

    def _touch(self, page: int) -> None:
        """A committed page was used (committed, found on offer, leased): it becomes the most
        recently used."""
        self._touch_all((int(page),))

    def _touch_all(self, pages: list[int]) -> None:
        """_touch of each page in turn (the last one the most recently used), in two passes over
        the lists: every page out of the list, then all of them at its tail in order."""
        if len(set(pages)) != len(pages):  # a page named again moves to its last place, as touched in turn
            pages = list(dict.fromkeys(reversed(pages)))[::-1]
        for page in pages:
            self._unlink(page)
        prev_of, next_of, linked = self._prev, self._next, self._linked
        head, tail = self._head, self._tail
        for page in pages:
            page = int(page)
            prev_of[page] = tail
            next_of[page] = -1
            if tail >= 0:
                next_of[tail] = page
            else:
                head = page
            tail = page
            linked[page] = True
        self._head, self._tail = head, tail

    def _unlink(self, page: int) -> None:
        if not self._linked[page]:
            return
        prev, nxt = self._prev[page], self._next[page]
        if prev >= 0:
            self._next[prev] = nxt
        else:
            self._head = nxt
        if nxt >= 0:
            self._prev[nxt] = prev
        else:
            self._tail = prev
        self._linked[page] = False

    def _may_evict(self, page: int) -> bool:
        """A committed page may be evicted unless a loader holds it."""
        return self.leases_on[page] == 0

    def _evict_lru(self, n: int) -> int:
        """Evict the `n` least recently used unleased committed pages; returns how many."""
        evicted, page = 0, self._head
        while evicted < n and page >= 0:
            nxt = self._next[page]
            if self._may_evict(page):  # a leased page stays where it is, in its turn
                self._evict_page(page)
                evicted += 1
            page = nxt
        return evicted

    def lru_pages(self, n: int) -> list[LruPage]:
        """The `n` least recently used committed pages no loader holds, least recent first:
        what an eviction would take next (read-only; the GPU tier demotes them). O(n + leased)."""
        names = {tid: name for name, tid in self._tenants.items()}
        out: list[LruPage] = []
        page = self._head
        while len(out) < n and page >= 0:
            if self._may_evict(page):
                key = self.key_of[page]
                assert key is not None
                out.append(LruPage(page, int(self.gen[page]), names[int(self.tenant_of[page])],
                                   self._namespaces[int(self.ns_of[page])], key, int(self.length[page]),
                                   self.digest[page].tobytes(), KINDS[int(self.kind[page])]))
            page = self._next[page]
        return out

    def evict(self, tenant: str, ns: Namespace, hashes: Sequence[bytes]) -> list[EvictOutcome]:
        """Each block's outcome; the one key NAMESPACE_RESET: the namespace's reset
        (reset_namespace), one outcome per page it took out of the pool."""
        if len(hashes) == 1 and hashes[0] == NAMESPACE_RESET:
            return self.reset_namespace(tenant, ns)
        tid = self._tenant_id(tenant, create=False)
        nid = self._ns_ids.get(ns, -2)
        out: list[EvictOutcome] = []
        for key in hashes:
            page = next((p for p in self._pages_for(tid, key) if self.ns_of[p] == nid), None)
            if page is None:
                out.append(EvictOutcome.NOT_FOUND)
            elif not self._may_evict(page):
                out.append(EvictOutcome.LEASED)
            else:
                self._evict_page(page)
                out.append(EvictOutcome.EVICTED)
        return out

    def reset_namespace(self, tenant: str, ns: Namespace) -> list[EvictOutcome]:
        """Take everything published under (tenant, ns) out of the pool, at once for every
        client: a committed block leaves the index and the segment's index now (no lookup,
        probe or acquire finds it after this call; a later lookup misses as `evicted`) and
        its page is freed, or, while loaders hold it, DROPPED and freed at their release
        (what they read was leased before the reset); an open publish under it is
        cancelled: its pages stay reserved until its publisher commits or aborts (the
        publisher may be writing them), and its commit then rejects every page. A publish
        reserved after this call is a new block. One outcome per page: EVICTED, DROPPED,
        CANCELLED. O(pages)."""
        tid = self._tenant_id(tenant, create=False)
        nid = self._ns_ids.get(ns, -2)
        if tid < 0 or nid < 0:
            return []
        self.counters["namespace_resets"] += 1
        out: list[EvictOutcome] = []
        mine = (self.ns_of == nid) & (self.tenant_of == tid) & (self.state == PageState.COMMITTED)
        for page in np.flatnonzero(mine).tolist():
            self._unindex(page)
            self._unscrubbed.pop(page, None)
            self.counters["reset_pages"] += 1
            if self._may_evict(page):
                self._free_page(page)
                out.append(EvictOutcome.EVICTED)
            else:
                self.state[page] = PageState.DROPPED
                self._unlink(page)  # never an eviction candidate again; _unpin frees it
                out.append(EvictOutcome.DROPPED)
        for res in self._reservations.values():
            if res.tenant == tid and res.ns == nid and not res.cancelled:
                res.cancelled = True
                out.extend([EvictOutcome.CANCELLED] * len(res.pages))
        return out

    def set_limits(self, limits: LoadLimits) -> LoadLimits:
        """New load limits for the leases to come (leases held now are kept). Returns the old."""
        if limits.per_client < 0 or limits.total < 0:
            raise InvalidRequest(f"load limits must be 0 (none) or positive, got {limits}")
        old = self.config.limits
        self.config = dataclasses.replace(self.config, limits=limits)
        return old

    def set_capacity(self, pages: int) -> int:
        """Squeeze (or restore) the usable pages; evicts LRU down to it. Returns evictions."""
        if not 0 <= pages <= self.config.num_pages:
            raise InvalidRequest(f"capacity {pages} outside 0..{self.config.num_pages}")
        self.capacity = pages
        over = self.used_pages() - pages
        return self._evict_lru(over) if over > 0 else 0

    # -- clients and time --------------------------------------------------------------
    def drop_client(self, client: int) -> tuple[int, int]:
        """A client went away: abort its publishes, release its leases."""
        res_ids = [r for r, res in self._reservations.items() if res.client == client]
        for rid in res_ids:
            self._retire(self._reservations.pop(rid))
        lease_ids = [lid for lid, lease in self._leases.items() if lease.client == client]
        for lid in lease_ids:
            self._unpin(self._leases.pop(lid))
        return len(res_ids), len(lease_ids)

    def reap(self, now: float) -> tuple[int, int]:
        """Expire reservations and leases whose deadline has passed."""
        res_ids = [r for r, res in self._reservations.items() if res.deadline <= now]
        for rid in res_ids:
            res = self._reservations.pop(rid)
            self._remember_expired(rid, res.client)
            self._retire(res)
        lease_ids = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        for lid in lease_ids:
            lease = self._leases.pop(lid)
            self._remember_expired(lid, lease.client)
            self._unpin(lease)
        self.counters["expired_reservations"] += len(res_ids)
        self.counters["expired_leases"] += len(lease_ids)
        return len(res_ids), len(lease_ids)

    def _remember_expired(self, grant_id: int, client: int) -> None:
        self._expired[grant_id] = client
        while len(self._expired) > self.config.expired_memory:
            self._expired.popitem(last=False)

    def renew(self, client: int, reservations: Sequence[int], now: float,
              leases: Sequence[int] = ()) -> RenewResult:
        """Move the deadlines of `client`'s own open reservations and leases to now + their
        TTL, capped at their grant + reservation_max_s (lease_max_s). Per id, in order, a
        Renewal: the seconds from `now` to the new deadline, or why not (RenewRefusal):
        NOT_YOURS (another client's; left as it was), EXPIRED (its deadline has passed, reaped
        or not yet: it stays expired, and the next reap frees it), UNKNOWN (never granted, or
        committed, aborted, released, or expired and forgotten). A grant at its maximum age
        has nothing left to renew: EXPIRED once its deadline passes. O(ids)."""
        cfg = self.config
        out_res = tuple(self._renew_one(self._reservations.get(rid), rid, client, now, cfg.reservation_ttl_s,
                                        cfg.reservation_max_s) for rid in reservations)
        out_leases = tuple(self._renew_one(self._leases.get(lid), lid, client, now, cfg.lease_ttl_s, cfg.lease_max_s)
                           for lid in leases)
        return RenewResult(out_res, out_leases)

    def _renew_one(self, grant: _Reservation | _Lease | None, grant_id: int, client: int, now: float,
                   ttl_s: float, max_s: float) -> Renewal:
        refusal: RenewRefusal | None = None
        if grant is None:
            owner = self._expired.get(grant_id)
            refusal = (RenewRefusal.UNKNOWN if owner is None else
                       RenewRefusal.EXPIRED if owner == client else RenewRefusal.NOT_YOURS)
        elif grant.client != client:
            refusal = RenewRefusal.NOT_YOURS
        elif grant.deadline <= now:
            refusal = RenewRefusal.EXPIRED
        if refusal is not None:
            self.counters["renewals_refused"] += 1
            return Renewal(grant_id, 0.0, refusal)
        grant.deadline = max(grant.deadline, min(now + ttl_s, grant.born + max_s))
        self.counters["renewals"] += 1
        return Renewal(grant_id, grant.deadline - now)

    # -- accounting --------------------------------------------------------------------
    def tenant_stats(self, tenant: str) -> dict[str, int]:
        """One tenant's own pages, by state (nothing of the pool's or other tenants')."""
        tid = self._tenants.get(tenant, -2)
        mine = self.tenant_of == tid
        return {"tenant_committed_pages": int(np.count_nonzero(mine & (self.state == PageState.COMMITTED))),
                "tenant_reserved_pages": int(np.count_nonzero(mine & (self.state == PageState.RESERVED))),
                "tenant_leased_pages": int(np.count_nonzero(mine & (self.leases_on > 0)))}

    def stats(self) -> dict[str, int]:
        committed = int(np.count_nonzero(self.state == PageState.COMMITTED))
        reserved = int(np.count_nonzero(self.state == PageState.RESERVED))
        leased_pages = int(np.count_nonzero(self.leases_on))
        return {
            "num_pages": self.config.num_pages,
            "page_size": self.config.page_size,
            "capacity_pages": self.capacity,
            "free_pages": len(self._free),
            "committed_pages": committed,
            "reserved_pages": reserved,
            "leased_pages": leased_pages,
            "leased_bytes": int(self.length[self.leases_on > 0].sum()),
            "effective_capacity_pages": max(0, self.capacity - reserved - leased_pages),
            "open_reservations": len(self._reservations),
            "open_leases": len(self._leases),
            "ghosts": len(self._ghosts),
            "dropped_pages": int(np.count_nonzero(self.state == PageState.DROPPED)),
            "entries": sum(len(ix) for ix in self._index),
            **self.counters,
            **{f"miss_{c.value}": n for c, n in self.miss_counters.items()},
        }
