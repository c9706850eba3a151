"""Renewal of what a client holds while it waits on something it cannot bound: a reservation
whose pages a GPU copies only after a forward still running, a lease whose release waits for
installs queued behind one. The pool's TTL reclaims what a client forgot; a client still
working on a grant says so (Renew), every third of the TTL the pool advertised at hello.

  wait_renewing(wait, renew, every_s) -> PoolError | None
      wait(every_s) until it answers True (done), renew() after each False. A refusal that
      renew() raises (a PoolError) ends the renewals, not the wait: the wait goes on to its end
      (what is in flight completes before its owner gives anything back or reports), and the
      refusal is returned; None when every renewal held. wait(None) waits without a bound.
  Keepalive.of(backend, reservations=(), leases=()) -> Keepalive | None
      the renewals of those grants on `backend`'s connection (the one they were granted on),
      every third of the shorter TTL it holds; None where the pool advertised no TTL (a daemon
      that predates Renew, or a backend without renew()): nothing to renew, the wait is plain.
  Keepalive.renew()        one Renew; RenewRefused if any id was refused.
  Keepalive.hold(wait)     wait_renewing(wait, self.renew, self.every_s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvpool.client.backend import PoolBackend
from kvpool.errors import PoolError, RenewRefused

RENEW_FRACTION = 3  # renew every TTL / 3: two renewals may be lost or late before the grant expires


def wait_renewing(wait: Callable[[float | None], bool], renew: Callable[[], None],
                  every_s: float) -> PoolError | None:
    if every_s <= 0:
        raise ValueError(f"renewal interval must be positive, got {every_s}")
    while not wait(every_s):
        try:
            renew()
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
