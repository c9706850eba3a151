"""The pool daemon's request handlers (mixed into kvpool.pool.daemon.PoolDaemon): a decoded
frame to its handler, the handler's answer to an encoded reply.

  RequestHandlers._dispatch      a frame's payload to its encoded reply, or an awaitable of it
                                 for the ops whose work leaves the loop (_finish).
  RequestHandlers._apply         the handler of each op; _check_bounds first.
  RequestHandlers._reply/_error  the encoded reply (at most the frame limit) / typed error.
  RequestHandlers._commit, _write_pages, _read_pages, report_corrupt
                                 the ops whose page work runs in the thread pool (_offload).
  RequestHandlers.pool_stats     every tenant's stats summed; _tenant_stats, one tenant's;
                                 _refresh_gauges, the metrics' gauges from them.

Contracts:
  * Bounded per frame: after a hello a frame, either way, is at most `frame_limit` bytes
    (by default kvpool.pool.protocol.frame_limit(page_size): 16 pages and 4 MiB for the rest);
    every list a request carries has a static bound (kvpool.pool.protocol: 65536 blocks, 16
    pages) checked by the decoder before its elements are read, and names each block hash,
    lease index or reservation slot at most once, within what the session holds (indexes
    within its lease, slots within its reservation, one digest per reserved page); a
    namespace's text fields are at most 1024 characters. Anything else is MALFORMED or
    INVALID and does nothing; no reply over the frame limit is sent (INTERNAL instead). A
    connection says hello once (each hello mints an attach ticket): a second is INVALID.
  * Commit by digest kind (kvpool.pool.digest): xxh3-128 pages are re-hashed in the thread
    pool before they become visible (a mismatch is rejected, never visible; with
    `verify_commits` off they are trusted like kv-sketch-1 pages); kv-sketch-1 pages
    (taken by a GPU over the KV it copied) are trusted at commit. Loaders verify every
    page they install whatever its kind.
  * A loader whose digest check refuses a leased page reports it (ReportCorrupt: indexes
    of its own lease, each at most once). The daemon does not take its word: it re-hashes
    the page at rest in the thread pool and, only if the bytes there do not match, drops
    the page and its index entry at once (a later lookup misses as `evicted`); bytes that
    match mean the copy went wrong on the loader's side, and the page stays (a buggy or
    hostile loader cannot empty its tenant's pool of good pages this way, nor cost the
    daemon more than a read of the pages it already leases). Stats `report_dropped`,
    `report_intact`.
  * Renew moves only the session's own open reservations and leases (another session's
    id is refused per id, NOT_YOURS, and left as it was; one past its deadline is refused
    EXPIRED and never resurrected), each at most to its grant + the pool's maximum age
    (PoolConfig.reservation_max_s, lease_max_s). The hello advertises both TTLs.
  * Pool-wide operations (SetCapacity, Metrics, the pool's Stats) are for admin tenants
    (`admins`; by default the only tenant of a single-tenant pool). Another tenant's
    Stats counts only its own pages; its SetCapacity or Metrics is refused as
    Unauthenticated.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvpool.errors import (
    Busy,
    InternalError,
    InvalidRequest,
    LeaseLost,
    PoolError,
    Unauthenticated,
)
from kvpool.pool import protocol as P
from kvpool.pool.catalog import LoadLimits
from kvpool.pool.config import PoolConfig
from kvpool.pool.digest import page_digest
from kvpool.pool.metrics import PoolMetrics
from kvpool.pool.records import CorruptOutcome
from kvpool.pool.state import Session, TenantPool

log = logging.getLogger("kvpool.pool.daemon")  # the daemon's logger, whichever of its modules logs
SERVER_NAME = "kvgate-pool/0.1"
MAX_NAMESPACE_FIELD_CHARS = 1024  # each text field of a namespace (a model id, a revision, ...)


class RequestHandlers:
    """The request handlers of PoolDaemon. Of the daemon they use its config, tenant pools,
    metrics, clock (the time grants live by), loop, thread pool and queue count, and what its other parts provide: the
    attach ticket of a hello (SegmentHandout._ticket, kvpool.pool.attach) and the lookup
    waits (LookupWaits._lookup_waiting and _wake_closed, kvpool.pool.lookup_wait)."""

    config: PoolConfig
    pools: dict[str, TenantPool]
    metrics: PoolMetrics
    clock: Callable[[], float]
    attach_path: Path | None
    restarted_after_crash: bool
    _loop: asyncio.AbstractEventLoop | None
    _executor: ThreadPoolExecutor | None
    _queued: int

    def _dispatch(self, session: Session, payload: bytes) -> bytes | Awaitable[bytes]:
        """The encoded reply, or an awaitable of it for ops whose work leaves the loop."""
        request_id = 0
        op_name = "frame"
        try:
            request_id, op = P.decode_request(payload)
            op_name = type(op).__name__.lower()
            result = self._apply(session, op)
            if inspect.isawaitable(result):
                return self._finish(request_id, op_name, result)
            return self._reply(request_id, op_name, result)
        except PoolError as err:
            return self._error(getattr(err, "request_id", request_id), op_name, err)

    async def _finish(self, request_id: int, op_name: str, pending: Awaitable[P.Reply]) -> bytes:
        try:
            result = await pending
        except PoolError as err:
            return self._error(request_id, op_name, err)
        return self._reply(request_id, op_name, result)

    def _reply(self, request_id: int, op_name: str, result: P.Reply) -> bytes:
        """The encoded reply, at most the frame limit: the bounds of kvpool.pool.protocol and the
        handlers' checks keep every reply under it, and one that is not is a daemon bug,
        answered as one rather than sent."""
        data = P.encode_reply(request_id, result)
        if len(data) - P.LENGTH.size > self.config.frame_limit:
            return self._error(request_id, op_name, InternalError(
                f"{type(result).__name__} of {len(data) - P.LENGTH.size} bytes exceeds the frame limit of "
                f"{self.config.frame_limit}: not sent"))
        self.metrics.requests.labels(op_name, "ok").inc()
        return data

    def _error(self, request_id: int, op_name: str, err: PoolError) -> bytes:
        self.metrics.requests.labels(op_name, err.code.value).inc()
        return P.encode_reply(request_id, P.Error(err.code, err.message))

    def _apply(self, session: Session, op: P.Request) -> P.Reply | Awaitable[P.Reply]:
        if isinstance(op, P.Hello):
            expected = self.config.tenants.get(op.tenant)
            if expected is None or not hmac.compare_digest(expected.encode(), op.token.encode()):
                raise Unauthenticated(f"unknown tenant or bad token for tenant {op.tenant!r}")
            if session.tenant is not None:  # each hello mints an attach ticket; a session has one
                raise InvalidRequest(f"this connection is already authenticated (tenant {session.tenant!r}): a "
                                     "connection says hello once")
            session.tenant, session.name = op.tenant, op.client_name
            arena = self.pools[op.tenant].arena
            return P.HelloOk(session.client, str(self.attach_path), arena.instance, arena.page_size,
                             arena.num_pages, SERVER_NAME, self.restarted_after_crash, self._ticket(op.tenant),
                             self.config.reservation_ttl_s, self.config.lease_ttl_s)
        if session.tenant is None:
            raise Unauthenticated(f"{type(op).__name__} before a successful hello")
        self._check_bounds(op)
        tenant = session.tenant
        tp = self.pools[tenant]
        cat = tp.catalog
        now = self.clock()
        if isinstance(op, P.Ping):
            return P.Pong()
        if isinstance(op, P.Lookup):
            self._check_tenant(op.ns, tenant)
            res = cat.lookup(tenant, op.ns, op.hashes)
            wait_s = min(op.wait_pending_ms / 1000, self.config.max_lookup_wait_s)
            if res.pending and wait_s > 0:
                session.waiting = True
                return self._lookup_waiting(session, tp, op, res, wait_s)
            return P.LookupOk(res.hits, res.miss)
        if isinstance(op, P.Acquire):
            self._check_tenant(op.ns, tenant)
            acq = cat.acquire(session.client, tenant, op.ns, op.hashes, now)
            if acq.lease_id:
                tp.lease_started[acq.lease_id] = now
                self.metrics.hits.labels("remote").inc()
                self.metrics.hit_blocks.inc(len(acq.hits))
                self.metrics.bytes_read.inc(acq.hits.total_bytes)
            if acq.miss is not None:
                self.metrics.misses.labels(acq.miss.cause.value).inc()
            return P.AcquireOk(acq.lease_id, acq.hits, acq.miss)
        if isinstance(op, P.Release):
            self._own_lease(session, op.lease_id)
            rel = cat.release(op.lease_id)
            started = tp.lease_started.pop(op.lease_id, None)
            if started is not None:
                self.metrics.lease_seconds.observe(now - started)
            return P.ReleaseOk(list(rel.stale))
        if isinstance(op, P.Reserve):
            self._check_tenant(op.ns, tenant)
            evictions = cat.counters["evictions"]
            res = cat.reserve(session.client, tenant, op.ns, op.hashes, op.lengths, now, op.boundary)
            self.metrics.evictions.inc(cat.counters["evictions"] - evictions)
            return P.ReserveOk(res.reservation_id, list(res.slots))
        if isinstance(op, P.WritePages):
            return self._write_pages(session, op)
        if isinstance(op, P.Commit):
            return self._commit(session, op)
        if isinstance(op, P.Abort):
            self._own_reservation(session, op.reservation_id)
            freed = cat.abort(op.reservation_id)
            self._wake_closed(tp)
            return P.AbortOk(freed)
        if isinstance(op, P.Renew):  # only the session's own grants move (the catalog checks the client)
            got = cat.renew(session.client, op.reservations, now, op.leases)
            return P.RenewOk(list(got.reservations), list(got.leases))
        if isinstance(op, P.ReadPages):
            return self._read_pages(session, op)
        if isinstance(op, P.Evict):
            self._check_tenant(op.ns, tenant)
            outcomes = cat.evict(tenant, op.ns, op.hashes)
            self.metrics.evictions.inc(sum(o == "evicted" for o in outcomes))
            return P.EvictOk(outcomes)
        if isinstance(op, (P.SetCapacity, P.SetLimits, P.Stats, P.Metrics)) and not self.config.is_admin(tenant):
            if isinstance(op, P.Stats):  # a tenant sees its own segment, never the pool's or another tenant's
                return P.StatsOk(self._tenant_stats(tp))
            raise Unauthenticated(f"{type(op).__name__} is a pool-wide operation: tenant {tenant!r} is not an "
                                  "admin of this pool")
        if isinstance(op, P.SetCapacity):
            target = self.pools.get(op.tenant or tenant)
            if target is None:
                raise InvalidRequest(f"SetCapacity of tenant {op.tenant!r}: the pool has no such tenant")
            evicted = target.catalog.set_capacity(op.pages)
            self.metrics.evictions.inc(evicted)
            return P.CapacityOk(evicted)
        if isinstance(op, P.SetLimits):
            target = self.pools.get(op.tenant or tenant)
            if target is None:
                raise InvalidRequest(f"SetLimits of tenant {op.tenant!r}: the pool has no such tenant")
            old = target.catalog.set_limits(LoadLimits(per_client=op.per_client, total=op.total))
            return P.LimitsOk(old.per_client, old.total)
        if isinstance(op, P.Stats):
            return P.StatsOk(self.pool_stats())
        if isinstance(op, P.Metrics):
            self._refresh_gauges()
            return P.MetricsOk(self.metrics.exposition())
        if isinstance(op, P.ReportCorrupt):
            return self.report_corrupt(session, op)
        raise InvalidRequest(f"unhandled op {type(op).__name__}")

    def _check_bounds(self, op: P.Request) -> None:
        """What one frame may name, beyond the decoder's static bounds (kvpool.pool.protocol):
        each block hash, lease index and reservation slot at most once (a repeat would only
        repeat the work and the reply), and a namespace whose text fields are at most
        MAX_NAMESPACE_FIELD_CHARS each (a namespace is interned while the pool has pages of
        it). The handlers check what the session holds: indexes within its lease, slots
        within its reservation, one digest per reserved page, payloads of the reserved
        length. InvalidRequest otherwise; nothing of the frame is done."""
        if isinstance(op, (P.Lookup, P.Acquire, P.Reserve, P.Evict)):
            for name in op.ns.__struct_fields__:
                value = getattr(op.ns, name)
                if isinstance(value, str) and len(value) > MAX_NAMESPACE_FIELD_CHARS:
                    raise InvalidRequest(f"namespace field {name} of {len(value)} characters (at most "
                                         f"{MAX_NAMESPACE_FIELD_CHARS})")
            _check_distinct("block hash", op.hashes)
        elif isinstance(op, P.ReadPages):
            _check_distinct("lease index", op.indexes)
        elif isinstance(op, P.WritePages):
            _check_distinct("reservation slot", op.slots)
        elif isinstance(op, P.Renew):
            _check_distinct("reservation id", op.reservations)
            _check_distinct("lease id", op.leases)

    @staticmethod
    def _tenant_stats(tp: TenantPool) -> dict[str, int]:
        stats = {**tp.catalog.stats(), **tp.waits, **tp.scrubbed, "scrub_queued": tp.catalog.scrub_queued(),
                 "scrub_queue_bound": tp.catalog.config.num_pages}
        own = tp.catalog.tenant_stats(tp.tenant)
        return {**stats, **own}

    def pool_stats(self) -> dict[str, int]:
        """Every tenant's stats summed (the page size is the pool's)."""
        total: dict[str, int] = {}
        for tp in self.pools.values():
            for key, value in self._tenant_stats(tp).items():
                total[key] = total.get(key, 0) + value
        total["page_size"] = self.config.page_size
        total["tenants"] = len(self.pools)
        return total

    def _refresh_gauges(self) -> None:
        self.metrics.refresh(self.pool_stats())
        for tp in self.pools.values():
            self.metrics.refresh_tenant(tp.tenant, tp.catalog.stats())

    @staticmethod
    def _check_tenant(ns, tenant: str) -> None:  # noqa: ANN001
        if ns.tenant != tenant:
            raise Unauthenticated(f"session of tenant {tenant!r} cannot use namespace of tenant {ns.tenant!r}")

    def _own_lease(self, session: Session, lease_id: int) -> list[int]:
        lease = self.pools[session.tenant].catalog._leases.get(lease_id)  # noqa: SLF001 - the daemon owns the catalog
        if lease is None or lease.client != session.client:
            raise LeaseLost(f"lease {lease_id} is not held by this session")
        return lease.pages

    def _own_reservation(self, session: Session, reservation_id: int) -> list[int]:
        res = self.pools[session.tenant].catalog._reservations.get(reservation_id)  # noqa: SLF001
        if res is None or res.client != session.client:
            raise InvalidRequest(f"reservation {reservation_id} is not open in this session")
        return res.pages

    async def _offload(self, fn, *args, ended=None):  # noqa: ANN001, ANN202
        """fn(*args) in the thread pool. `ended` runs on the loop once fn has ended (returned,
        raised, or was never started): not when the awaiting request is cancelled (a session
        that ends while its job runs), which leaves the job running."""
        if self._queued >= self.config.max_queue:
            if ended is not None:
                ended()
            raise Busy(f"{self._queued} requests already queued (limit {self.config.max_queue})")
        self._queued += 1
        try:
            try:
                job = self._executor.submit(fn, *args)
            except BaseException:
                if ended is not None:
                    ended()
                raise
            if ended is not None:
                loop = self._loop

                def after(_: object) -> None:
                    if not loop.is_closed():  # else the daemon is gone, and its catalog with it
                        loop.call_soon_threadsafe(ended)
                job.add_done_callback(after)
            return await asyncio.wrap_future(job, loop=self._loop)
        finally:
            self._queued -= 1

    async def _commit(self, session: Session, op: P.Commit) -> P.CommitOk:
        pages = self._own_reservation(session, op.reservation_id)
        if len(op.digests) != len(pages):
            raise InvalidRequest(f"{len(op.digests)} digests for {len(pages)} reserved pages")
        tp = self.pools[session.tenant]
        arena, cat = tp.arena, tp.catalog
        lengths = [int(cat.length[p]) for p in pages]
        if not (op.kind.verified_at_commit and self.config.verify_commits):
            # Trusted at commit (the writer took it over the bytes it copied; every loader
            # re-takes it over what it installed); the scrub re-takes it at rest.
            res = cat.commit(op.reservation_id, list(op.digests), op.kind, scrub_first=True)
            self._wake_closed(tp)
            self.metrics.bytes_written.inc(sum(n for n, p in zip(lengths, pages) if cat.state[p]))
            return P.CommitOk(res.committed, list(res.rejected))

        def verify() -> list[bytes | None]:
            return [page_digest(arena.page(p, n)) for p, n in zip(pages, lengths)]

        actual = await self._offload(verify)
        # The reservation may have expired while hashing; commit re-checks it.
        digests = [a if hmac.compare_digest(a, c) else None for a, c in zip(actual, op.digests)]
        res = cat.commit(op.reservation_id, digests)
        self._wake_closed(tp)
        self.metrics.bytes_written.inc(sum(n for n, d in zip(lengths, digests) if d is not None))
        return P.CommitOk(res.committed, list(res.rejected))

    async def _write_pages(self, session: Session, op: P.WritePages) -> P.WriteOk:
        """The bytes into the reserved pages, in the thread pool. The pages stay reserved until
        the write has ended (Catalog.begin_write / end_write), whatever happens meanwhile to the
        reservation (its TTL passing while the write waits in the queue, the session ending)."""
        pages = self._own_reservation(session, op.reservation_id)
        if len(op.slots) != len(op.data):
            raise InvalidRequest(f"{len(op.slots)} slots but {len(op.data)} payloads")
        tp = self.pools[session.tenant]
        targets = []
        for slot, data in zip(op.slots, op.data):
            if not 0 <= slot < len(pages):
                raise InvalidRequest(f"slot {slot} outside reservation of {len(pages)} pages")
            expected = int(tp.catalog.length[pages[slot]])
            if len(data) != expected:
                raise InvalidRequest(f"slot {slot}: {len(data)} bytes, reserved {expected}")
            targets.append((pages[slot], data))
        arena = tp.arena

        def write() -> int:
            for page, data in targets:
                arena.page(page, len(data))[:] = memoryview(data)
            return len(targets)

        cat = tp.catalog
        held = cat.begin_write(op.reservation_id, session.client)  # _offload ends it, whatever happens
        return P.WriteOk(await self._offload(write, ended=lambda: cat.end_write(held)))

    async def _read_pages(self, session: Session, op: P.ReadPages) -> P.PagesOk:
        """The bytes of distinct pages of the session's lease: at most the lease's pages and
        MAX_PAGES_PER_FRAME (protocol), so the reply is at most that many pages."""
        pages = self._own_lease(session, op.lease_id)
        tp = self.pools[session.tenant]
        targets = []
        for i in op.indexes:
            if not 0 <= i < len(pages):
                raise InvalidRequest(f"index {i} outside lease of {len(pages)} pages")
            targets.append((pages[i], int(tp.catalog.length[pages[i]])))
        arena = tp.arena
        return P.PagesOk(await self._offload(lambda: [arena.page(p, n).tobytes() for p, n in targets]))

    async def report_corrupt(self, session: Session, op: P.ReportCorrupt) -> P.ReportOk:
        """A loader's digest check refused these pages of its lease: re-hash each at rest
        and drop the ones whose bytes there do not match (see the module docstring)."""
        tp = self.pools[session.tenant]
        cat = tp.catalog
        pages = self._own_lease(session, op.lease_id)
        if len(op.indexes) > len(pages) or len(set(op.indexes)) != len(op.indexes):
            raise InvalidRequest(f"{len(op.indexes)} indexes for a lease of {len(pages)} pages: each at most once")
        generations = cat._leases[op.lease_id].generations  # noqa: SLF001 - the daemon owns the catalog
        targets = []
        for i in op.indexes:
            if not 0 <= i < len(pages):
                raise InvalidRequest(f"index {i} outside lease of {len(pages)} pages")
            targets.append((pages[i], generations[i]))
        jobs = []
        for page, gen in targets:
            kind = cat.committed_as(page, gen)  # None: dropped already (a leased page is never reused)
            if kind is not None:
                jobs.append((page, gen, kind, cat.digest[page].tobytes(), tp.arena.page(page, int(cat.length[page]))))
        got = await self._offload(lambda: [page_digest(view, kind) for _, _, kind, _, view in jobs])
        hashed = {(page, gen): (kind, want, digest) for (page, gen, kind, want, _), digest in zip(jobs, got)}
        outcomes = []
        for page, gen in targets:
            found = hashed.get((page, gen))
            if found is None or cat.committed_as(page, gen) is None or not hmac.compare_digest(found[2], found[1]):
                if cat.discard(page, gen):
                    tp.scrubbed["report_dropped"] += 1
                    log.warning("kvgate pool %s: tenant %s page %d (generation %d), reported corrupt by client %d, "
                                "no longer matches its %s digest at rest: dropped", self.config.name, tp.tenant,
                                page, gen, session.client, found[0].value if found else "?")
                outcomes.append(CorruptOutcome.DROPPED)
            else:
                tp.scrubbed["report_intact"] += 1
                outcomes.append(CorruptOutcome.INTACT)
        return P.ReportOk(outcomes)


def _check_distinct(what: str, items: list) -> None:
    """InvalidRequest unless every item is distinct (one frame names each block, page or
    slot at most once: a repeat would only repeat the work and the reply)."""
    if len(set(items)) != len(items):
        seen: set = set()
        first = next(x for x in items if x in seen or seen.add(x))  # add() is None: falsy
        raise InvalidRequest(f"{what} {first!r} named more than once in one frame "
                             f"({len(items) - len(set(items))} repeats)")
