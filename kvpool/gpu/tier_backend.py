"""A keeper's tier as a pool backend (kvpool.client.backend.PoolBackend) over a TierLink: for a
tier in host memory (`kvpool keeper --backing memfd`) the generic publish and load
(kvpool.client.transfer) then move blocks through the keeper as through the pool daemon, and
every wrapper that speaks PoolBackend (the audit, the fault injectors) wraps it unchanged; for
either backing the GPU transfer engine (kvpool.gpu.transfer) copies through the mapping its
`arena` names, as it copies through the host pool's segment.

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
      Lease and reservation ids are this backend's own (one count across every session and
      instance of the link), not the keeper's: a restarted keeper counts its ids from 1 again,
      and a lease of the old instance still open here must not name the new instance's lease of
      the same number (its release would end the new lease under a copy out of its pages). The
      results, renewals included, carry this backend's ids.
      .evict                   InvalidRequest: the tier makes room by demotion, not by a client.
      .arena                   the TierArena of the link's current session (None while it has
                               none): what the GPU transfer engine copies through.

  TierArena.of(client)     one session's mapping of the tier as a pool's arena is to the GPU
                           engine (kvpool.gpu.region.page_region): `instance` (the keeper's
                           instance id and the session's id: another session maps the buffer
                           at another address, so the engine follows a new session as it
                           follows a restarted pool), `session`, `page_size`, `num_pages`,
                           `same_gpu`, and every page as one range: `device_pages` (a CudaArray,
                           `--backing vmm`) or `pages_region` (a numpy view, `--backing memfd`).

The host path is not the path for device memory (`--backing vmm`): a page there is a CudaArray
that the host cannot read; read_page and reserved_view refuse it (InvalidRequest) and the copies
are the GPU engine's. A grant of a keeper instance that has been replaced (the keeper
restarted) is refused as WrongInstance before anything is sent or touched (TierLink), which the
transfer functions and the GPU engine count as a transport_error miss: the caller recomputes.
The engine never copies through a replaced session's range: it compares the arena's instance
before each transfer and after each acquire and reserve (kvpool.gpu.transfer), and the link
keeps a replaced mapping while a grant of it is open, so a copy already enqueued completes
against mapped memory before its release or commit ends the grant.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence

import msgspec
import numpy as np

from kvpool.errors import InvalidRequest, LeaseLost, MalformedFrame
from kvpool.gpu.tier_client import TierClient, TierLease, TierLink, TierReservation
from kvpool.gpu.vmm import CudaArray
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.pool.records import (
    AcquireResult,
    CommitResult,
    EvictOutcome,
    LookupResult,
    ReleaseResult,
    Renewal,
    RenewResult,
    ReserveResult,
)


@dataclasses.dataclass(frozen=True)
class TierArena:
    """One session's mapping of the tier, as the GPU transfer engine takes a pool's arena."""

    instance: bytes  # the keeper instance's 16 bytes, then the session's id (8 bytes, big-endian)
    session: int
    page_size: int
    num_pages: int
    same_gpu: bool
    device_pages: CudaArray | None = None  # --backing vmm
    pages_region: np.ndarray | None = None  # --backing memfd

    @classmethod
    def of(cls, client: TierClient) -> TierArena:
        tier = client.tier
        if tier is None or client.hello is None:
            raise InvalidRequest("the tier client is not connected: no mapping to name")
        desc = tier.descriptor
        whole = tier.pages()
        key = bytes(client.instance) + int(client.client_id).to_bytes(8, "big")
        common = dict(instance=key, session=int(client.client_id), page_size=desc.page_size,
                      num_pages=desc.num_pages, same_gpu=bool(tier.same_gpu))
        if isinstance(whole, memoryview):
            return cls(**common, pages_region=np.frombuffer(whole, dtype=np.uint8))
        return cls(**common, device_pages=whole)


def _own_ids(answers: Sequence[Renewal], own: dict[int, int]) -> tuple[Renewal, ...]:
    """The keeper's renewal answers under this backend's ids; an answer for an id not asked for
    is a malformed reply."""
    stray = [a.id for a in answers if a.id not in own]
    if stray:
        raise MalformedFrame(f"the keeper answered a renewal of ids {stray[:4]} it was not asked to renew")
    return tuple(msgspec.structs.replace(a, id=own[a.id]) for a in answers)


class TierBackend:
    digest_kind = DigestKind.SKETCH  # the only kind the tier commits (the copier publishes with it)

    def __init__(self, link: TierLink):
        self.link = link
        self._lock = threading.Lock()
        self._leases: dict[int, TierLease] = {}  # this backend's open leases, by this backend's id
        self._reservations: dict[int, TierReservation] = {}
        self._ids = itertools.count(1)  # this backend's grant ids (the keeper's restart at 1 per instance)
        self._arena: tuple[TierClient, TierArena] | None = None  # the last arena named, and its client

    @property
    def arena(self) -> TierArena | None:
        """The TierArena of the link's current session, None while it has none (the engine's
        next call into the link connects, or fails as a transport error)."""
        client = self.link.client
        if client is None or client.tier is None or client.hello is None:
            return None
        cached = self._arena
        if cached is not None and cached[0] is client:
            return cached[1]
        arena = TierArena.of(client)
        self._arena = (client, arena)
        return arena

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
        if not lease.lease_id:
            return lease.result
        with self._lock:
            own = next(self._ids)
            self._leases[own] = lease
        return dataclasses.replace(lease.result, lease_id=own)

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
        if not res.reservation_id:
            return res.result
        with self._lock:
            own = next(self._ids)
            self._reservations[own] = res
        return dataclasses.replace(res.result, reservation_id=own)

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
        """The keeper's answers under this backend's ids (the link refuses grants of another
        session before anything is sent, so the keeper's ids of one call are one session's)."""
        res = {r: self._reservation(r) for r in reservations}
        held = {i: self._lease(i) for i in leases}
        got = self.link.renew(list(res.values()), list(held.values()))
        return RenewResult(_own_ids(got.reservations, {g.reservation_id: own for own, g in res.items()}),
                           _own_ids(got.leases, {g.lease_id: own for own, g in held.items()}))

    def evict(self, ns: Namespace, hashes: Sequence[bytes]) -> list[EvictOutcome]:
        raise InvalidRequest("the GPU tier makes room by demotion to the host pool; a client does not evict")

    def close(self) -> None:
        with self._lock:
            self._leases.clear()
            self._reservations.clear()
        self._arena = None
        self.link.close()
