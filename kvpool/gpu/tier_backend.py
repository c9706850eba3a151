"""A keeper's tier as a pool backend (kvpool.client.backend.PoolBackend) over a TierLink, for a
tier in host memory (`kvpool keeper --backing memfd`): the generic publish and load
(kvpool.client.transfer) then move blocks through the keeper as through the pool daemon, and
every wrapper that speaks PoolBackend (the audit, the fault injectors) wraps it unchanged.

  TierBackend(link)            link: a connected kvpool.gpu.tier_client.TierLink.
      .lookup / .acquire / .release / .read_page        the load's half: a lease's pages are read
                               where they lie in the mapped buffer (a view, no copy), through
                               the mapping of the instance that granted the lease.
      .reserve / .reserved_view / .write_page / .commit / .abort
                               the publish's half: the caller copies into the reserved page
                               itself. Commits are of kv-sketch-1 digests (DigestKind.SKETCH),
                               the only kind the tier takes (publish with kind=SKETCH; another
                               kind is refused by the keeper as an InvalidRequest).
      .renew(reservations, leases), .reservation_ttl_s, .lease_ttl_s
                               renewal as the host pool's client has it (kvpool.client.keepalive).
      .evict                   InvalidRequest: the tier makes room by demotion, not by a client.

What it is not: the path for device memory (`--backing vmm`). A page there is a CudaArray that
the host cannot read; read_page and reserved_view refuse it (InvalidRequest) and the copies are
the GPU engine's. A grant of a keeper instance that has been replaced (the keeper restarted)
is refused as WrongInstance before anything is sent or touched (TierLink), which the transfer
functions count as a transport_error miss: the caller recomputes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from kvpool.errors import InvalidRequest, LeaseLost
from kvpool.gpu.tier_client import TierLease, TierLink, TierReservation
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.pool.records import (
    AcquireResult,
    CommitResult,
    EvictOutcome,
    LookupResult,
    ReleaseResult,
    RenewResult,
    ReserveResult,
)


class TierBackend:
    digest_kind = DigestKind.SKETCH  # the only kind the tier commits (the copier publishes with it)

    def __init__(self, link: TierLink):
        self.link = link
        self._lock = threading.Lock()
        self._leases: dict[int, TierLease] = {}  # this backend's open leases, by id
        self._reservations: dict[int, TierReservation] = {}

    # -- what the pool advertises -----------------------------------------------------------
    def _client(self):  # noqa: ANN202 - the link's current TierClient
        if self.link.client is None:
            self.link.connect()
        return self.link.client

    @property
    def page_size(self) -> int:
        return self._client().tier.descriptor.page_size

    @property
    def reservation_ttl_s(self) -> float:
        return self._client().reservation_ttl_s

    @property
    def lease_ttl_s(self) -> float:
        return self._client().lease_ttl_s

    # -- loads ----------------------------------------------------------------------------------
    def lookup(self, ns: Namespace, hashes: Sequence[bytes], wait_pending_s: float = 0.0) -> LookupResult:
        """The keeper answers at once: a publish in flight reads as missing (no wait)."""
        return self.link.lookup(ns, hashes)

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> AcquireResult:
        lease = self.link.acquire(ns, hashes)
        if lease.lease_id:
            with self._lock:
                self._leases[lease.lease_id] = lease
        return lease.result

    def _lease(self, lease_id: int) -> TierLease:
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseLost(f"lease {lease_id} is not one this backend holds")
        return lease

    def release(self, lease_id: int) -> ReleaseResult:
        lease = self._lease(lease_id)
        try:
            return self.link.release(lease)
        finally:
            with self._lock:
                self._leases.pop(lease_id, None)

    def _host_view(self, grant: TierLease | TierReservation, index: int) -> np.ndarray:
        view = self.link.page_view(grant, index)
        if not isinstance(view, memoryview):
            raise InvalidRequest("the tier's pages are device memory (--backing vmm): the host cannot read or "
                                 "write them; the GPU engine copies them")
        return np.frombuffer(view, dtype=np.uint8)

    def read_page(self, lease: AcquireResult, index: int) -> np.ndarray:
        return self._host_view(self._lease(lease.lease_id), index)[: lease.hits[index].length]

    # -- publishes --------------------------------------------------------------------------------
    def reserve(self, ns: Namespace, hashes: Sequence[bytes], lengths: Sequence[int],
                boundary: int | None = None) -> ReserveResult:
        res = self.link.reserve(ns, hashes, lengths, boundary)
        if res.reservation_id:
            with self._lock:
                self._reservations[res.reservation_id] = res
        return res.result

    def _reservation(self, reservation_id: int) -> TierReservation:
        with self._lock:
            res = self._reservations.get(reservation_id)
        if res is None:
            raise InvalidRequest(f"reservation {reservation_id} is not one this backend holds open")
        return res

    def reserved_view(self, reservation: ReserveResult, slot: int) -> np.ndarray:
        return self._host_view(self._reservation(reservation.reservation_id), slot)

    def write_page(self, reservation: ReserveResult, slot: int, data: np.ndarray | bytes) -> None:
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).ravel()
        view = self.reserved_view(reservation, slot)
        if src.size > view.size:
            raise InvalidRequest(f"slot {slot}: {src.size} bytes for a page of {view.size}")
        view[: src.size] = src

    def _end(self, reservation_id: int) -> TierReservation:
        res = self._reservation(reservation_id)
        with self._lock:
            self._reservations.pop(reservation_id, None)
        return res

    def commit(self, reservation_id: int, digests: Sequence[bytes],
               kind: DigestKind = DigestKind.SKETCH) -> CommitResult:
        """A refused or failed commit keeps the reservation here for the caller's abort (the
        generic publish aborts on any error)."""
        out = self.link.commit(self._reservation(reservation_id), digests, kind)
        self._end(reservation_id)
        return out

    def abort(self, reservation_id: int) -> int:
        return self.link.abort(self._end(reservation_id))

    def renew(self, reservations: Sequence[int] = (), leases: Sequence[int] = ()) -> RenewResult:
        return self.link.renew([self._reservation(r) for r in reservations], [self._lease(i) for i in leases])

    def evict(self, ns: Namespace, hashes: Sequence[bytes]) -> list[EvictOutcome]:
        raise InvalidRequest("the GPU tier makes room by demotion to the host pool; a client does not evict")

    def close(self) -> None:
        with self._lock:
            self._leases.clear()
            self._reservations.clear()
        self.link.close()
