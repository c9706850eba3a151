"""The pool daemon's lookups that wait for a publish in flight (mixed into
kvpool.pool.daemon.PoolDaemon).

  LookupWaits._lookup_waiting    park, look up again, repeat within the bound.
  LookupWaits._until_closed      park on one reservation until it closes or a timeout.
  LookupWaits._wake_closed       wake what is parked on the reservations no longer open;
                                 called after every catalog call that can close one.

Contracts:
  * A lookup with `wait_pending_ms` whose first missing block is being published (an
    open reservation of the same tenant and namespace; never another tenant's) is
    parked on that reservation, not the loop: it is woken when the reservation closes
    (commit, abort, its publisher's connection dropping, its TTL), looks up again and
    waits for a publish further on within the same bound (capped by
    `max_lookup_wait_s`). A bound that runs out answers MissCause.IN_FLIGHT, counted
    with the other misses; waits are counted and timed (stats `lookup_waits`,
    `lookup_wait_us`, `lookup_waiting`; metrics kvpool_lookup_waits{result},
    kvpool_lookup_wait_seconds). A waiting lookup whose client disconnects is dropped.
"""

from __future__ import annotations

import asyncio
import time

from kvpool.errors import MissCause
from kvpool.pool import protocol as P
from kvpool.pool.metrics import PoolMetrics
from kvpool.pool.records import LookupResult, Miss
from kvpool.pool.state import Session, TenantPool


class LookupWaits:
    """The lookup waits of PoolDaemon; of the daemon they use its loop and metrics."""

    metrics: PoolMetrics
    _loop: asyncio.AbstractEventLoop | None

    async def _lookup_waiting(self, session: Session, tp: TenantPool, op: P.Lookup, res: LookupResult,
                              wait_s: float) -> P.LookupOk:
        """Park until the first missing block's publish closes, look up again; repeat
        while the answer stops at a pending block, until `wait_s` has passed."""
        loop = self._loop
        deadline = loop.time() + wait_s
        # The time waited is measured with the monotonic clock: uvloop's loop.time() has a
        # millisecond grain, and a wait woken within one tick measured 0.
        started = time.monotonic()
        result = "abandoned"  # unless it returns: cancelled because its client went away
        tp.waits["lookup_waiting"] += 1
        try:
            while res.pending:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    result = MissCause.IN_FLIGHT.value
                    assert res.miss is not None  # a pending reservation is always at the first miss
                    tp.catalog.count_miss(MissCause.IN_FLIGHT)
                    self.metrics.misses.labels(MissCause.IN_FLIGHT.value).inc()
                    return P.LookupOk(res.hits, Miss(res.miss.index, MissCause.IN_FLIGHT))
                await self._until_closed(tp, res.pending, remaining)
                res = tp.catalog.lookup(session.tenant, op.ns, op.hashes)
            result = "settled"
            return P.LookupOk(res.hits, res.miss)
        finally:
            waited = time.monotonic() - started
            session.waiting = False
            tp.waits["lookup_waiting"] -= 1
            tp.waits["lookup_waits"] += 1
            tp.waits["lookup_wait_us"] += round(waited * 1e6)
            self.metrics.lookup_waits.labels(result).inc()
            self.metrics.lookup_wait_seconds.observe(waited)

    async def _until_closed(self, tp: TenantPool, reservation_id: int, timeout: float) -> None:
        """Return when the reservation closes (see _wake_closed) or `timeout` passes."""
        parked = self._loop.create_future()
        tp.parked.setdefault(reservation_id, []).append(parked)
        try:
            await asyncio.wait((parked,), timeout=timeout)
        finally:
            if not parked.done():  # timed out or cancelled: unpark
                parked.cancel()
                others = tp.parked.get(reservation_id)
                if others is not None:
                    others.remove(parked)
                    if not others:
                        del tp.parked[reservation_id]

    @staticmethod
    def _wake_closed(tp: TenantPool) -> None:
        """Wake the lookups parked on the tenant's reservations that are no longer open.
        Called after every catalog call that can close one: commit, abort, drop_client, reap."""
        if not tp.parked:
            return
        cat = tp.catalog
        for rid in [r for r in tp.parked if not cat.reservation_open(r)]:
            for parked in tp.parked.pop(rid):
                if not parked.done():
                    parked.set_result(None)
