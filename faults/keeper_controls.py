"""Negative controls of the GPU keeper's control plane (kvpool.gpu.keeper_server,
kvpool.gpu.tier_client): each is the production part with one guard dropped. Never served to a
replica; suites/pool/test_gpu_keeper_wire.py runs each and asserts that the oracle it validates
catches it.

  PeerBlindKeeperServer    no peer check: any session may release another's lease and commit or
                           abort another's reservation (the pool daemon's `_own_lease` /
                           `_own_reservation`, dropped).
  FragileKeeperServer      a frame that does not decode is not answered: the decode error ends
                           the connection, so the peer sees a hang-up where a typed MALFORMED
                           error was due.
  UnboundedKeeperServer    no frame bound: a length prefix is believed whatever it says, so a
                           4 GiB prefix makes the connection wait for bytes that never come
                           instead of an OVERSIZED error.
  EagerFreeKeeper          no quarantine: a producer's reservations are freed the moment its
                           connection ends, while its process (and a copy of it still landing)
                           may live on; the freed page is reused under the late write.
  HeartbeatBlindTierClient the client that never reads the keeper's heartbeat: a stopped keeper's
                           call waits for the socket's timeout and fails as PoolTimeout (a
                           `timeout` miss, backed off), not as KeeperStale at once.
  InstanceBlindTierLink    the link that skips the instance check: a lease or reservation of a
                           killed keeper's instance is sent to the restarted one, where its id
                           names another grant (ids restart at 1), and its page numbers are read
                           in the new buffer.
  StaleMappingTierLink     the link that keeps its first mapping across a restart: its sessions
                           follow the new instance, its page views stay in the old buffer (which
                           lives on while mapped), so what it publishes never reaches the new one.
  EagerUnmapTierLink       the link that drops the old instance's mapping at the reconnect while a
                           lease or reservation of it is still open: a copy out of (or into) those
                           pages still running on the GPU reads (writes) unmapped memory.
  KeeperIdTierBackend      the tier backend that hands out the keeper's own lease and
                           reservation ids: after a restart the new instance counts from 1 again,
                           so a lease of the old instance still open and the new instance's lease
                           of the same number share one id, and the old one's release ends the new.
  BytewiseBeatState / BytewiseBeatView
                           the heartbeat word written (read) with struct, one byte at a time: a
                           replica reading while the keeper beats can see half of one beat and
                           half of the next (a beating keeper taken for stale, or a dead one for
                           alive).
  KEEPERS, SERVERS, CLIENTS  name -> class, for the worker processes that pick one by name.
"""

from __future__ import annotations

import struct
import time

from kvpool.errors import MalformedFrame
from kvpool.gpu.handout import HEARTBEAT_OFF, PrivateState, PrivateView
from kvpool.gpu.keeper import GpuKeeper
from kvpool.gpu.keeper_server import KeeperServer, KeeperSession
from kvpool.gpu.tier_backend import TierBackend
from kvpool.gpu.tier_client import TierClient, TierLease, TierLink, TierReservation
from kvpool.gpu.tier_map import TierMap
from kvpool.pool import protocol as P


class PeerBlindKeeperServer(KeeperServer):
    def _own_lease(self, session: KeeperSession, lease_id: int) -> None:
        return None

    def _own_reservation(self, session: KeeperSession, reservation_id: int) -> None:
        return None


class FragileKeeperServer(KeeperServer):
    def _dispatch(self, session: KeeperSession, payload: bytes) -> bytes:
        try:
            P.decode_request(payload)
        except MalformedFrame as exc:
            raise ConnectionError(f"a frame that does not decode ends the connection: {exc}") from exc
        return super()._dispatch(session, payload)


class UnboundedKeeperServer(KeeperServer):
    def _frame_limit(self, session: KeeperSession) -> int:
        return 2**32


class EagerFreeKeeper(GpuKeeper):
    def client_gone(self, client: int) -> bool:
        with self.tier_lock:
            self.tier.disconnect(client)
            self.tier.exited(client)  # as if its process were gone already
            self._forget(client)
        return False


class HeartbeatBlindTierClient(TierClient):
    def keeper_stale(self) -> bool:
        return False


class InstanceBlindTierLink(TierLink):
    def _check(self, grant: TierLease | TierReservation) -> TierClient:
        return self.client


class StaleMappingTierLink(TierLink):
    _first: TierMap | None = None

    def _adopt(self, old: TierClient | None, new: TierClient) -> None:
        if old is not None and self._first is None:
            self._first = old.tier
            old.tier = None  # kept open: old.close() leaves it mapped
        super()._adopt(old, new)

    def _mapping(self, grant: TierLease | TierReservation) -> TierMap:
        self._check(grant)
        return self._first if self._first is not None else self.client.tier


class EagerUnmapTierLink(TierLink):
    def _adopt(self, old: TierClient | None, new: TierClient) -> None:
        if old is not None:
            old.close()
            self.reconnects += 1
        self.client = new


class KeeperIdTierBackend(TierBackend):
    def acquire(self, ns, hashes):  # noqa: ANN001, ANN201
        lease = self.link.acquire(ns, hashes)
        if lease.lease_id:
            with self._lock:
                self._leases[lease.lease_id] = lease
        return lease.result

    def reserve(self, ns, hashes, lengths, boundary=None):  # noqa: ANN001, ANN201
        res = self.link.reserve(ns, hashes, lengths, boundary)
        if res.reservation_id:
            with self._lock:
                self._reservations[res.reservation_id] = res
        return res.result


KEEPERS: dict[str, type[GpuKeeper]] = {"GpuKeeper": GpuKeeper, "EagerFreeKeeper": EagerFreeKeeper}
SERVERS: dict[str, type[KeeperServer]] = {
    "KeeperServer": KeeperServer, "PeerBlindKeeperServer": PeerBlindKeeperServer,
    "FragileKeeperServer": FragileKeeperServer, "UnboundedKeeperServer": UnboundedKeeperServer,
}
CLIENTS: dict[str, type[TierClient]] = {"TierClient": TierClient, "HeartbeatBlindTierClient": HeartbeatBlindTierClient}


# -- the heartbeat word, moved byte by byte (suites/pool/test_heartbeat_race.py) ---------------------

class BytewiseBeatState(PrivateState):
    """The keeper's private state writing its heartbeat with struct.pack_into (one byte at a time
    in CPython): a replica reading meanwhile can see half of one beat and half of the next."""

    def beat(self, now_ns: int | None = None) -> None:
        struct.pack_into("<Q", self._map, HEARTBEAT_OFF, time.monotonic_ns() if now_ns is None else now_ns)


class BytewiseBeatView(PrivateView):
    """A replica's view reading the heartbeat with struct.unpack_from (byte by byte)."""

    def heartbeat_ns(self) -> int:
        (ns,) = struct.unpack_from("<Q", self._map, HEARTBEAT_OFF)
        return ns
