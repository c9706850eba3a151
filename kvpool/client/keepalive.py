"""Renewal of what a client holds while it waits on something it cannot bound: a reservation
whose pages a GPU copies only after a forward still running, a lease whose release waits for
installs queued behind one. The pool's TTL reclaims what a client forgot; a client still
working on a grant says so (Renew), every third of the TTL the pool advertised at hello.

  wait_renewing(wait, renew, every_s) -> PoolError | None
      wait(every_s) until it answers True (done), renew() after each False. A refusal that
      renew() raises (a PoolError other than PoolTimeout, which is tried again at the next
      interval) ends the renewals, not the wait: the wait goes on to its end
      (what is in flight completes before its owner gives anything back or reports), and the
      refusal is returned; None when every renewal held. wait(None) waits without a bound.
  Keepalive.of(backend, reservations=(), leases=()) -> Keepalive | None
      the renewals of those grants on `backend`'s connection (the one they were granted on),
      every third of the shorter TTL it holds; None where the pool advertised no TTL (a daemon
      that predates Renew, or a backend without renew()): nothing to renew, the wait is plain.
  Keepalive.renew()        one Renew; RenewRefused if any id was refused.
  Keepalive.hold(wait)     wait_renewing(wait, self.renew, self.every_s).
  LaneGrants(backend, clock=time.monotonic)
      the reservations open on one connection whose commits run one after another on one
      thread (a GPU store's commit lane): a unit queued behind others waits longer than its
      own wait, so they are renewed together, on a schedule of their own, whichever unit the
      thread is waiting for. .opened(id) at reserve, .closed(id) at commit or abort;
      .keepalive(own) -> an object with .hold(wait) (as Keepalive's), or None where the pool
      advertised no TTL. While it waits it renews every open reservation last renewed (or
      opened) a third of the TTL ago or more, checking every sixth of the TTL, so none goes
      half a TTL unrenewed while the lane works. A refusal of `own` ends the renewals of the
      wait (returned once the wait ends); a refusal of another unit's id drops that id (its
      own commit then fails); a lane whose client lock stayed busy (PoolTimeout) tries again at
      the next check.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from kvpool.client.backend import PoolBackend
from kvpool.errors import PoolError, PoolTimeout, RenewRefused

RENEW_FRACTION = 3  # renew every TTL / 3: two renewals may be lost or late before the grant expires


def wait_renewing(wait: Callable[[float | None], bool], renew: Callable[[], None],
                  every_s: float) -> PoolError | None:
    if every_s <= 0:
        raise ValueError(f"renewal interval must be positive, got {every_s}")
    while not wait(every_s):
        try:
            renew()
        except PoolTimeout:  # the client's lock stayed busy, or the daemon was slow: the grant stands
            continue
        except PoolError as exc:  # refused, or the connection failed: the grant may be gone
            wait(None)
            return exc
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Keepalive:
    backend: PoolBackend
    reservations: tuple[int, ...]
    leases: tuple[int, ...]
    every_s: float

    @classmethod
    def of(cls, backend: PoolBackend, reservations: Sequence[int] = (),
           leases: Sequence[int] = ()) -> Keepalive | None:
        if getattr(backend, "renew", None) is None:
            return None
        ttls = []
        if reservations:
            ttls.append(float(getattr(backend, "reservation_ttl_s", 0.0) or 0.0))
        if leases:
            ttls.append(float(getattr(backend, "lease_ttl_s", 0.0) or 0.0))
        if not ttls or min(ttls) <= 0:
            return None
        return cls(backend, tuple(reservations), tuple(leases), min(ttls) / RENEW_FRACTION)

    def renew(self) -> None:
        got = self.backend.renew(self.reservations, self.leases)
        refused = [f"{what} {r.id} ({r.refused.value})" for what, answers in
                   (("reservation", got.reservations), ("lease", got.leases)) for r in answers if r.refused is not None]
        if refused:
            raise RenewRefused(f"the pool refused to renew {', '.join(refused)}")

    def hold(self, wait: Callable[[float | None], bool]) -> PoolError | None:
        return wait_renewing(wait, self.renew, self.every_s)


class LaneGrants:
    def __init__(self, backend: PoolBackend, clock: Callable[[], float] = time.monotonic):
        self.backend = backend
        self.clock = clock
        self._open: dict[int, float] = {}  # reservation id -> when opened or last renewed
        self._lock = threading.Lock()

    def opened(self, reservation_id: int) -> None:
        with self._lock:
            self._open[int(reservation_id)] = self.clock()

    def closed(self, reservation_id: int) -> None:
        with self._lock:
            self._open.pop(int(reservation_id), None)

    def open_ids(self) -> list[int]:
        with self._lock:
            return list(self._open)

    @property
    def every_s(self) -> float:
        ttl = float(getattr(self.backend, "reservation_ttl_s", 0.0) or 0.0)
        return ttl / RENEW_FRACTION if ttl > 0 and getattr(self.backend, "renew", None) is not None else 0.0

    def keepalive(self, own: int) -> _LaneHold | None:
        return _LaneHold(self, int(own)) if self.every_s > 0 else None

    def renew_due(self, own: int) -> PoolError | None:
        """Renew the open reservations due (and `own` if due): the refusal of `own`, if any."""
        every = self.every_s
        now = self.clock()
        with self._lock:
            due = [rid for rid, at in self._open.items() if now - at >= every]
        if not due:
            return None
        try:
            got = self.backend.renew(due, ())
        except PoolTimeout:  # the client's lock stayed busy, or the daemon was slow: the grants stand
            return None
        except PoolError as exc:  # the connection failed: what it held may be gone
            return exc if own in due else None
        refused_own = None
        with self._lock:
            for answer in got.reservations:
                if answer.refused is None:
                    if answer.id in self._open:
                        self._open[answer.id] = now
                    continue
                self._open.pop(answer.id, None)  # its own commit fails: nothing to renew any more
                if answer.id == own:
                    refused_own = RenewRefused(f"the pool refused to renew reservation {own} "
                                               f"({answer.refused.value})")
        return refused_own


@dataclasses.dataclass(frozen=True, slots=True)
class _LaneHold:
    lane: LaneGrants
    own: int

    def hold(self, wait: Callable[[float | None], bool]) -> PoolError | None:
        every = self.lane.every_s
        step = every / 2
        refused = self.lane.renew_due(self.own)  # those the lane left waiting while it worked
        while refused is None:
            if wait(step):
                return None
            refused = self.lane.renew_due(self.own)
        wait(None)  # what is in flight completes before its owner gives anything back
        return refused
