"""The network tier on Mooncake Store: kvpool.tier's interface over Mooncake's Python client
(`mooncake.store.MooncakeDistributedStore`, package mooncake-transfer-engine-non-cuda or
mooncake-transfer-engine), over TCP or RDMA.

  MooncakeTier(master, metadata, local_hostname="127.0.0.1", segment_bytes=..., buffer_bytes=...,
               protocol="tcp", devices="")
        master: "HOST:PORT" of `mooncake_master`; metadata: its HTTP metadata server
        ("http://HOST:PORT/metadata"). The client mounts `segment_bytes` of this process's
        memory into the store, and stages each put and get through a local buffer of
        `buffer_bytes` (it must hold a whole page).
  .put  `upsert` of the whole record (a plain `put` on an existing key keeps the old bytes);
        the store answers complete-or-invisible; "no space" is False
  .get  `get_size` first: a missing key (-704) is None; then `get` (a key removed between
        the two is None too). Reads hold a lease on the master's side (default 10 s), so
        a page being read is not evicted or removed under the reader.
  .exists  one `batch_is_exist`, counted from the first
  .remove  `remove(force=True)` (a lease held by a reader would otherwise refuse it)
Every call first asks the client's `health_check()`, which answers at once when the master
is unreachable: a dead master is TierUnavailable without the client's own 4 s of retries.
A master restarted without persistence comes back empty; clients remount on their own.
Capabilities: read leases, atomic puts, evicts (the master evicts the oldest pages at its
high watermark).
"""

from __future__ import annotations

from kvpool.digest import DigestKind
from kvpool.keys import Namespace
from kvpool.tier import TierCaps, TierError, TierPage, TierUnavailable, decode_record, encode_record, tier_key

CAPS = TierCaps("mooncake", read_leases=True, atomic_put=True, evicts=True)

# Mooncake's error codes (its ErrorCode enum) the tier distinguishes
NO_SPACE = -200  # NO_AVAILABLE_HANDLE
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
RPC_FAIL = -900
_HEALTHY = 0


class MooncakeTier:
    caps = CAPS

    def __init__(self, master: str, metadata: str, local_hostname: str = "127.0.0.1",
                 segment_bytes: int = 64 * 2**20, buffer_bytes: int = 64 * 2**20, protocol: str = "tcp",
                 devices: str = ""):
        from mooncake.store import MooncakeDistributedStore

        self.master = master
        self._s = MooncakeDistributedStore()
        rc = self._s.setup(local_hostname, metadata, int(segment_bytes), int(buffer_bytes), protocol, devices, master)
        if rc != 0:
            raise TierUnavailable(f"mooncake setup against master {master} (metadata {metadata}) failed: {rc}")

    def _alive(self, what: str) -> None:
        rc = self._s.health_check()
        if rc != _HEALTHY:
            raise TierUnavailable(f"mooncake {what}: master {self.master} unreachable (health_check {rc})")

    def _check(self, what: str, rc: int) -> int:
        if rc == RPC_FAIL:
            raise TierUnavailable(f"mooncake {what} at {self.master}: RPC failed ({rc})")
        if rc < 0 and rc not in (OBJECT_NOT_FOUND, NO_SPACE):
            raise TierError(f"mooncake {what} at {self.master}: error {rc}")
        return rc

    def put(self, ns: Namespace, block_hash: bytes, page: bytes | memoryview, digest: bytes,
            kind: DigestKind = DigestKind.XXH3) -> bool:
        self._alive("put")
        rc = self._check("upsert", self._s.upsert(tier_key(ns, block_hash), encode_record(ns, page, digest, kind)))
        return rc == 0

    def get(self, ns: Namespace, block_hash: bytes) -> TierPage | None:
        self._alive("get")
        key = tier_key(ns, block_hash)
        if self._check("get_size", self._s.get_size(key)) == OBJECT_NOT_FOUND:
            return None
        blob = self._s.get(key)
        if not blob:  # removed or evicted since get_size, or the master went away meanwhile
            self._alive("get")
            return None
        return decode_record(ns, blob)

    def exists(self, ns: Namespace, hashes: list[bytes]) -> int:
        self._alive("exists")
        n = 0
        for rc in self._s.batch_is_exist([tier_key(ns, h) for h in hashes]):
            if self._check("batch_is_exist", rc) != 1:
                break
            n += 1
        return n

    def remove(self, ns: Namespace, block_hash: bytes) -> None:
        self._alive("remove")
        self._check("remove", self._s.remove(tier_key(ns, block_hash), True))

    def close(self) -> None:
        self._s.close()
