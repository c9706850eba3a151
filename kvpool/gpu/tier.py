"""The GPU tier's bookkeeping: which device page holds which block, who may touch it, what is
demoted to the host pool next, and where a lookup falls through to. Pure state, no CUDA, no
sockets, time passed in; the keeper (kvpool.gpu.keeper) owns one GpuTier and calls it from one
thread.

It is the host pool's catalog (kvpool.pool.catalog.Catalog), one per tenant, over the pages of
that tenant's device buffer (page i at byte i x page_size), so the GPU tier keeps every rule of
the pool as they are: two-phase publish (reserve -> write -> commit; a page is visible only
after its commit), leases (a leased page is never evicted, demoted or reused), a generation per
page bumped at every free (the array lives in the private state the keeper hands out, so a
replica checks a page's generation without asking), tenants apart (their own buffer, catalog,
ids and counters), ghosts (a block demoted or evicted misses as `evicted`), admission, load
limits and miss causes. What differs:

  * Digests are kv-sketch-1 (DigestKind.SKETCH), taken on the GPU over the page as it lies in
    the tier, after the producer's copy completed (kvpool.gpu.sketch): the keeper never reads
    page bytes on the host. A commit of another kind is refused (InvalidRequest). Commits are
    taken on trust and queued for the keeper's scrub on the GPU (scrub_first), as the host
    pool does for sketched pages.
  * A reserve at capacity evicts nothing (CatalogConfig.evict_on_reserve False): the blocks it
    could not place get NO_CAPACITY, and their producer publishes them to the host pool (the
    publish falls through as the lookup does). Room is made by demotion, never by dropping.
  * Demotion (LRU): when a tenant's free pages fall below `low_free`, demotion_due says how many
    to move for `high_free` to be free again; begin_demotion pins the least recently used
    unleased pages under a lease of the demoter (so no reuse, no eviction while their bytes are
    copied out) and names them (block, namespace, digest); the keeper copies each to the host
    pool (published there with the same digest) and calls finish_demotion: with the host's
    commit the page leaves the GPU tier (a ghost: a later GPU lookup misses `evicted` and falls
    through to the host pool, where the block is), unless a loader leased it meanwhile (it stays:
    it is hot again); without it the page stays where it is. The block is in one tier or both at
    every instant, never in neither.
  * Crash of a producer (kvpool.gpu.keeper tells disconnect, then exited): at its connection's end
    its leases are released at once (a dying consumer's copy reads the page into its own memory,
    which dies with it), but its reservations are kept, unreadable and unusable, until its
    process has exited (a dying producer's copies may still write them): only then are they
    aborted, the pages freed and their generations bumped. A page not completely written is
    never visible: a commit comes only after the producer's host saw its copy and its sketch
    complete, and what was reserved and never committed is never indexed.
  * A producer alive past its reservation's TTL loses it (reap) and its pages may be reused; a
    late write of its into a page another block now holds is caught by that block's digest,
    which every load verifies on the GPU (a `corrupt` miss, recomputed; never a silent one).

  WrongInstance   a lease or reservation of one keeper instance (or session) presented to
        another (kvpool.gpu.tier_client.TierLink refuses it; the GPU engine counts it as a
        transport_error: kvpool.gpu.load).
  fall_through(hashes, tiers) -> FallThrough   the lookup order across tiers: at each block the
        first tier (GPU, then the host pool, then the network tier) that holds a run from there
        serves the whole run it holds (one lease per tier and run), and the block where that run
        stops asks the GPU tier first again; the run stops at the first
        block no tier holds, whose miss cause is the first cause other than never_published in
        tier order (a block demoted from the GPU tier and then evicted from the host pool is
        `evicted`), else never_published.
  ask_in_order(hashes, members, cause_of, served, through=fall_through, errored=None)
        -> (served blocks, Miss | None)   fall_through over members' answers, with what a
        composite of tiers keeps from them (kvpool.gpu.tiered.TieredBackend's lookups and
        acquires, kvpool.gpu.tiered_engine.TieredEngine's loads): each member is
        (name, call), call(tail, start) -> (held, miss, answer) for the blocks from `start`;
        a PoolError it raises is that member's miss for its run (cause_of(exc); None: not a
        miss, raised on). Runs that held blocks go to `served` as (member index, start,
        answer) as they come. The miss carries the fields of the member whose cause it is.
        Where every member raised at the first block, the last one's error is raised, the
        others as notes.
  UNREACHABLE    the errors of a member that cannot answer now (TransportError, PoolTimeout,
        Busy): a composite asks the next one.
  raise_first(errors, what)   raise errors[0] with the others as notes (none: nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.errors import Busy, InvalidRequest, LeaseLost, MissCause, PoolError, PoolTimeout, TransportError
from kvpool.pool.catalog import AdmissionPolicy, Catalog, CatalogConfig, LoadLimits, LruPage
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.pool.records import (
    AcquireResult,
    Miss,
    CommitResult,
    EvictOutcome,
    LookupResult,
    ReleaseResult,
    RenewResult,
    ReserveResult,
    SlotStatus,
)


class WrongInstance(LeaseLost):
    """A lease or reservation granted by one keeper instance (or session) presented to another:
    refused on the client, nothing sent, no page touched. Its pages are lost to the caller as
    a lease is (the connector recomputes or republishes)."""


class KeeperRefused(TransportError):
    """The keeper answered and refused this replica's hello (a token it does not know, no room
    for another session, a handout it would not give): unreachable for its calls, as a transport
    error; at a replica's start, a configuration to fix rather than a keeper to wait for."""


DEMOTER = 0  # the client id of the keeper's demoter (replicas' ids start at 1)


@dataclasses.dataclass(frozen=True)
class GpuTierConfig:
    page_size: int
    pages: dict[str, int]  # tenant -> pages of its device buffer
    low_free: float = 0.05  # demote when a tenant's free pages fall below this fraction ...
    high_free: float = 0.15  # ... until this fraction is free again
    demote_batch: int = 256  # pages one begin_demotion pins at most
    admission: AdmissionPolicy = AdmissionPolicy()
    limits: LoadLimits = LoadLimits()
    reservation_ttl_s: float = 30.0
    lease_ttl_s: float = 60.0
    reservation_max_s: float = 3600.0  # a reservation's age past which no renewal extends it
    lease_max_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.page_size <= 0 or not self.pages or any(n <= 0 for n in self.pages.values()):
            raise InvalidRequest(f"the GPU tier needs a positive page size and pages per tenant, got "
                                 f"{self.page_size} and {self.pages}")
        if not 0.0 <= self.low_free <= self.high_free <= 1.0 or self.demote_batch <= 0:
            raise InvalidRequest(f"watermarks 0 <= low {self.low_free} <= high {self.high_free} <= 1 and a "
                                 f"positive demote batch ({self.demote_batch}) are needed")


@dataclasses.dataclass(frozen=True)
class Demotion:
    """A page pinned for demotion: copy its bytes to the host pool under (tenant, ns, key) with
    its digest, then finish_demotion."""

    lease_id: int
    page: LruPage

    @property
    def tenant(self) -> str:
        return self.page.tenant


class GpuTier:
    """The catalogs of the tenants' device buffers, the demoter's pins, the quarantine."""

    def __init__(self, config: GpuTierConfig, generations: dict[str, np.ndarray] | None = None):
        self.config = config
        self.catalogs: dict[str, Catalog] = {}
        for tenant, n in config.pages.items():
            cfg = CatalogConfig(num_pages=n, page_size=config.page_size, admission=config.admission,
                                limits=config.limits, evict_on_reserve=False,
                                reservation_ttl_s=config.reservation_ttl_s, lease_ttl_s=config.lease_ttl_s,
                                reservation_max_s=config.reservation_max_s, lease_max_s=config.lease_max_s)
            self.catalogs[tenant] = Catalog(cfg, (generations or {}).get(tenant))
        self._reservations: dict[int, dict[str, set[int]]] = {}  # client -> tenant -> open reservation ids
        self._leases: dict[int, dict[str, set[int]]] = {}  # client -> tenant -> held lease ids
        self._quarantined: set[int] = set()  # clients gone whose process may still be writing
        self._demoting: dict[tuple[str, int], Demotion] = {}  # (tenant, lease id) -> its demotion
        self.counters: dict[str, int] = {"demoted_pages": 0, "demotion_kept": 0, "demotion_failed": 0,
                                         "quarantined_reservations": 0, "released_on_disconnect": 0,
                                         "no_capacity_blocks": 0}

    def _catalog(self, tenant: str) -> Catalog:
        cat = self.catalogs.get(tenant)
        if cat is None:
            raise InvalidRequest(f"tenant {tenant!r} has no buffer in this GPU tier")
        return cat

    def page_offset(self, page: int) -> int:
        return page * self.config.page_size

    # -- the pool's operations, per tenant --------------------------------------------
    def lookup(self, tenant: str, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        return self._catalog(tenant).lookup(tenant, ns, hashes)

    def acquire(self, client: int, tenant: str, ns: Namespace, hashes: Sequence[bytes], now: float) -> AcquireResult:
        self._live_client(client)
        got = self._catalog(tenant).acquire(client, tenant, ns, hashes, now)
        if got.lease_id:
            self._leases.setdefault(client, {}).setdefault(tenant, set()).add(got.lease_id)
        return got

    def release(self, client: int, tenant: str, lease_id: int) -> ReleaseResult:
        """After the consumer's host saw its copy out of the pages complete (the release edge:
        a page is reused only after every copy out of it ran)."""
        self._leases.get(client, {}).get(tenant, set()).discard(lease_id)
        return self._catalog(tenant).release(lease_id)

    def reserve(self, client: int, tenant: str, ns: Namespace, hashes: Sequence[bytes], lengths: Sequence[int],
                now: float, boundary: int | None = None) -> ReserveResult:
        self._live_client(client)
        got = self._catalog(tenant).reserve(client, tenant, ns, hashes, lengths, now, boundary)
        self.counters["no_capacity_blocks"] += sum(1 for s in got.slots if s.status == SlotStatus.NO_CAPACITY)
        if got.reservation_id:
            self._reservations.setdefault(client, {}).setdefault(tenant, set()).add(got.reservation_id)
        return got

    def commit(self, client: int, tenant: str, reservation_id: int, digests: Sequence[bytes | None],
               kind: DigestKind = DigestKind.SKETCH) -> CommitResult:
        """After the producer's host saw its copy into the pages and its sketch of them complete
        (the commit edge: a page is visible only when all its bytes are there)."""
        if DigestKind(kind) != DigestKind.SKETCH:
            raise InvalidRequest(f"the GPU tier commits pages digested on the GPU (kind "
                                 f"{DigestKind.SKETCH.value}), not {DigestKind(kind).value}")
        result = self._catalog(tenant).commit(reservation_id, digests, DigestKind.SKETCH, scrub_first=True)
        self._reservations.get(client, {}).get(tenant, set()).discard(reservation_id)
        return result

    def abort(self, client: int, tenant: str, reservation_id: int) -> int:
        self._reservations.get(client, {}).get(tenant, set()).discard(reservation_id)
        return self._catalog(tenant).abort(reservation_id)

    def renew(self, client: int, tenant: str, reservations: Sequence[int], leases: Sequence[int],
              now: float) -> RenewResult:
        """The host pool's renewal (Catalog.renew) on the tenant's catalog: `client`'s own open
        reservations and leases move to now + their TTL, never past their grant + the maximum
        age; another client's, an expired or an unknown id is refused per id and left as it
        was. A quarantined client (disconnected, its process maybe still writing) renews
        nothing (InvalidRequest): its reservations end when its process does."""
        self._live_client(client)
        return self._catalog(tenant).renew(client, reservations, now, leases)

    def holds_lease(self, client: int, tenant: str, lease_id: int) -> bool:
        """`lease_id` was granted to `client` and not released since (its TTL may have run out:
        the catalog says so at release)."""
        return lease_id in self._leases.get(client, {}).get(tenant, ())

    def holds_reservation(self, client: int, tenant: str, reservation_id: int) -> bool:
        """`reservation_id` was granted to `client` and is neither committed, aborted nor reaped."""
        return reservation_id in self._reservations.get(client, {}).get(tenant, ())

    def reap(self, now: float) -> tuple[int, int]:
        res = leases = 0
        for cat in self.catalogs.values():
            r, le = cat.reap(now)
            res, leases = res + r, leases + le
        # forget the reservations the catalogs expired (their pages were freed)
        for per_tenant in self._reservations.values():
            for tenant, ids in per_tenant.items():
                ids.intersection_update({i for i in ids if self.catalogs[tenant].reservation_open(i)})
        return res, leases

    # -- a replica's end ---------------------------------------------------------------
    def _live_client(self, client: int) -> None:
        if client in self._quarantined:
            raise InvalidRequest(f"client {client} disconnected; its reservations wait for its process to exit")

    def disconnect(self, client: int) -> int:
        """A replica's connection ended: its leases are released now; its reservations stay
        reserved (not visible, not reusable) until exited(client). Returns the leases released."""
        released = 0
        for tenant, ids in self._leases.pop(client, {}).items():
            for lid in ids:
                try:
                    self._catalog(tenant).release(lid)
                except LeaseLost:  # expired meanwhile (reap): nothing left to release
                    continue
                released += 1
        self.counters["released_on_disconnect"] += released
        if any(self._reservations.get(client, {}).values()):
            self._quarantined.add(client)
            self.counters["quarantined_reservations"] += sum(len(v) for v in self._reservations[client].values())
        else:
            self._reservations.pop(client, None)
        return released

    def exited(self, client: int) -> int:
        """The replica's process is gone (no copy of it can still run): its reservations are
        aborted and their pages freed. Returns the reservations aborted."""
        self._quarantined.discard(client)
        aborted = 0
        for tenant, ids in self._reservations.pop(client, {}).items():
            cat = self._catalog(tenant)
            for rid in ids:
                if cat.reservation_open(rid):
                    cat.abort(rid)
                    aborted += 1
        return aborted

    def quarantined(self) -> frozenset[int]:
        return frozenset(self._quarantined)

    def holds_reservations(self, client: int) -> bool:
        """The client still has a reservation open (not committed, aborted or expired)."""
        return any(self._reservations.get(client, {}).values())

    # -- demotion ----------------------------------------------------------------------
    def demotion_due(self, tenant: str) -> int:
        """Pages to demote now for `tenant`: 0 while its free pages are at least `low_free`,
        else enough for `high_free` to be free (those being demoted counted as freed)."""
        cat = self._catalog(tenant)
        n = cat.config.num_pages
        pinned = sum(1 for (t, _) in self._demoting if t == tenant)
        free = n - cat.used_pages() + pinned
        if free >= self.config.low_free * n:
            return 0
        return max(0, int(np.ceil(self.config.high_free * n)) - free)

    def begin_demotion(self, tenant: str, n: int, now: float) -> list[Demotion]:
        """Pin up to min(n, demote_batch) least recently used unleased pages for their copy to the
        host pool, least recent first."""
        cat = self._catalog(tenant)
        out: list[Demotion] = []
        for victim in cat.lru_pages(min(n, self.config.demote_batch)):
            lease_id = cat.pin(DEMOTER, victim.page, victim.generation, now)
            if lease_id:  # lru_pages lists committed pages: always, on this single thread
                demotion = Demotion(lease_id, victim)
                self._demoting[(tenant, lease_id)] = demotion
                out.append(demotion)
        return out

    def finish_demotion(self, demotion: Demotion, host_committed: bool) -> EvictOutcome | None:
        """The copy to the host pool ended: with its commit there the page leaves the GPU tier
        (EVICTED), unless a loader holds it now (LEASED: it stays, hot again); without it the
        page stays (None)."""
        tenant = demotion.tenant
        if self._demoting.pop((tenant, demotion.lease_id), None) is None:
            raise InvalidRequest(f"lease {demotion.lease_id} of tenant {tenant!r} is not a demotion in progress")
        cat = self._catalog(tenant)
        try:
            stale = cat.release(demotion.lease_id).stale
        except LeaseLost:  # the demoter's lease expired under a slow copy: the page may be reused
            stale = (demotion.page.page,)
        if not host_committed or stale:
            self.counters["demotion_failed"] += 1
            return None
        outcome = cat.evict(tenant, demotion.page.ns, [demotion.page.key])[0]
        self.counters["demoted_pages" if outcome == EvictOutcome.EVICTED else "demotion_kept"] += 1
        return outcome

    # -- accounting --------------------------------------------------------------------
    def stats(self, tenant: str | None = None) -> dict[str, int]:
        """Every tenant's catalog stats summed (or one tenant's), the tier's own counters, all
        keyed gpu_tier_*."""
        out: dict[str, int] = {}
        for cat in ([self._catalog(tenant)] if tenant is not None else self.catalogs.values()):
            for k, v in cat.stats().items():
                out[f"gpu_tier_{k}"] = out.get(f"gpu_tier_{k}", 0) + int(v)
        out.update({f"gpu_tier_{k}": v for k, v in self.counters.items()})
        out["gpu_tier_demoting_pages"] = len(self._demoting)
        out["gpu_tier_quarantined_clients"] = len(self._quarantined)
        return out


# -- the lookup order across tiers ------------------------------------------------------------

TierRun = Callable[[Sequence[bytes]], "tuple[int, MissCause | None]"]


@dataclasses.dataclass(frozen=True)
class FallThrough:
    """Which tier serves which blocks: (tier name, first block, end) in block order; `served`
    blocks from the start; the cause of the first block no tier holds (None: all served)."""

    segments: tuple[tuple[str, int, int], ...]
    served: int
    miss: MissCause | None


def fall_through(hashes: Sequence[bytes], tiers: Sequence[tuple[str, TierRun]]) -> FallThrough:
    """`tiers`: (name, run) in lookup order (the GPU tier first); run(hashes) gives how many
    blocks from the first it holds, and the miss cause where it stops (None: all of them)."""
    segments: list[tuple[str, int, int]] = []
    pos = 0
    while pos < len(hashes):
        causes: list[MissCause] = []
        for name, run in tiers:
            held, cause = run(hashes[pos:])
            if held < 0 or held > len(hashes) - pos:
                raise InvalidRequest(f"tier {name!r} claims {held} blocks of {len(hashes) - pos}")
            if held:
                if segments and segments[-1][0] == name:
                    segments[-1] = (name, segments[-1][1], pos + held)
                else:
                    segments.append((name, pos, pos + held))
                pos += held
                break
            causes.append(cause or MissCause.NEVER_PUBLISHED)
        else:
            miss = next((c for c in causes if c != MissCause.NEVER_PUBLISHED), MissCause.NEVER_PUBLISHED)
            return FallThrough(tuple(segments), pos, miss)
    return FallThrough(tuple(segments), pos, None)


UNREACHABLE = (TransportError, PoolTimeout, Busy)  # a member that cannot answer now: the next one is asked


def raise_first(errors: Sequence[BaseException], what: str) -> None:
    if not errors:
        return
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"{what}, also: {type(other).__name__}: {other}")
    raise first


MemberCall = Callable[[Sequence[bytes], int], tuple[int, "Miss | None", object]]


def ask_in_order(hashes: Sequence[bytes], members: Sequence[tuple[str, MemberCall]],
                 cause_of: Callable[[PoolError], MissCause | None], served: list[tuple[int, int, object]],
                 through: Callable[..., FallThrough] = fall_through,
                 errored: Callable[[int], None] | None = None) -> tuple[int, Miss | None]:
    at_stop: list[tuple[MissCause, Miss | None]] = []  # the answers at the current block
    errors: list[PoolError] = []
    cursor = [0]

    def run_of(k: int, call: MemberCall) -> TierRun:
        def run(tail: Sequence[bytes]) -> tuple[int, MissCause | None]:
            start = cursor[0]
            try:
                held, miss, answer = call(tail, start)
            except PoolError as exc:
                cause = cause_of(exc)
                if cause is None:
                    raise
                if errored is not None:
                    errored(k)
                if start == 0:
                    errors.append(exc)
                at_stop.append((cause, None))
                return 0, cause
            if held:
                served.append((k, start, answer))
                cursor[0] += held
                at_stop.clear()
                errors.clear()
                return held, None if miss is None else miss.cause
            cause = MissCause.NEVER_PUBLISHED if miss is None else miss.cause
            at_stop.append((cause, None if miss is None else Miss(start, cause, miss.fields)))
            return 0, cause
        return run

    out = through(hashes, [(name, run_of(k, call)) for k, (name, call) in enumerate(members)])
    if not served and hashes and len(errors) == len(members):
        raise_first(errors[::-1], "members that could not be reached")
    if out.miss is None:
        return out.served, None
    return out.served, next((m for c, m in at_stop if c == out.miss and m is not None), None) or Miss(out.served,
                                                                                                       out.miss)
