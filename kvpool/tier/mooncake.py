"""The network tier on Mooncake Store: kvpool.tier.interface's Tier over Mooncake's Python client
(`mooncake.store.MooncakeDistributedStore`, package mooncake-transfer-engine-non-cuda or
mooncake-transfer-engine), over TCP or RDMA.

  MooncakeTier(master, metadata, auth, local_hostname="127.0.0.1", segment_bytes=...,
               buffer_bytes=..., protocol="tcp", devices="", timeout_s=1.0)
        master: "HOST:PORT" of `mooncake_master`; metadata: its HTTP metadata server
        ("http://HOST:PORT/metadata"). The client mounts `segment_bytes` of this process's
        memory into the store (0: none, a pure client of storage nodes such as
        `mooncake_client`), and stages each put and get through a local buffer of
        `buffer_bytes` (it must hold a whole page). Mooncake's calls take no timeout: each
        runs on a helper thread and is waited for `timeout_s` at most; past it the call is
        TierUnavailable (the helper finishes or fails on its own, into its own buffer).
        Mooncake has no access control: any client of the master reads, writes and removes
        any key. The tenant's keys (auth.key: its prefix, then an opaque keyed hash) hide
        which blocks it holds, and the records' MAC (kvpool.tier.record.decode_record) is what
        keeps a written, moved or replayed record from being installed.
  MooncakeTier.from_url(url, auth, timeout_s=1.0)
        the same from "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata"
        (also `segment_bytes`, `buffer_bytes`, `protocol`, `devices`, `local_hostname` in
        the query); a URL without `metadata` is a ValueError.
  .put  `upsert` of the whole record (a plain `put` on an existing key keeps the old bytes);
        the store answers complete-or-invisible; "no space" is False
  .get  `get_size` first: a missing key (-704) is None; then `get`. An empty `get` of a
        key the master still indexes is a storage node that cannot serve it (dead or cut
        off): TierUnavailable; a key gone between the two calls is None. Then
        kvpool.tier.record.decode_record. Reads hold a lease on the master's side (default 10 s),
        so a page being read is not evicted or removed under the reader.
  .get_record  the same reads, the raw record unchecked
  .exists  one `batch_is_exist`, counted from the first
  .remove  `remove(force=True)` (a lease held by a reader would otherwise refuse it)
Every call first asks the client's `health_check()`, which answers at once when the master
is unreachable: a dead master is TierUnavailable without the client's own 4 s of retries.
A master restarted without persistence comes back empty; clients remount on their own.
Capabilities: read leases, atomic puts, evicts (the master evicts the oldest pages at its
high watermark).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from urllib.parse import parse_qs, urlsplit

from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.tier.record import TierAuth, TierCaps, TierCorrupt, TierError, TierPage, TierUnavailable, decode_record, encode_record, record_bound, record_too_long

CAPS = TierCaps("mooncake", read_leases=True, atomic_put=True, evicts=True)

# Mooncake's error codes (its ErrorCode enum) the tier distinguishes
NO_SPACE = -200  # NO_AVAILABLE_HANDLE
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800  # the bytes could not be moved to or from the node holding them
RPC_FAIL = -900
_HEALTHY = 0


class MooncakeTier:
    caps = CAPS

    def __init__(self, master: str, metadata: str, auth: TierAuth, local_hostname: str = "127.0.0.1",
                 segment_bytes: int = 64 * 2**20, buffer_bytes: int = 64 * 2**20, protocol: str = "tcp",
                 devices: str = "", timeout_s: float = 1.0):
        from mooncake.store import MooncakeDistributedStore

        self.master = master
        self.auth = auth
        self.timeout_s = timeout_s
        # A call past its timeout keeps its thread until Mooncake gives up: a few threads, so
        # one hung call does not hold the next back (each is still bounded by timeout_s).
        self._calls = ThreadPoolExecutor(4, thread_name_prefix="kvpool-mooncake")
        self._s = MooncakeDistributedStore()
        rc = self._s.setup(local_hostname, metadata, int(segment_bytes), int(buffer_bytes), protocol, devices, master)
        if rc != 0:
            raise TierUnavailable(f"mooncake setup against master {master} (metadata {metadata}) failed: {rc}")

    @classmethod
    def from_url(cls, url: str, auth: TierAuth, timeout_s: float = 1.0) -> MooncakeTier:
        parts = urlsplit(url)
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if "metadata" not in q:
            raise ValueError(f"{url!r}: a mooncake tier needs ?metadata=http://HOST:PORT/metadata")
        sizes = {k: int(q[k]) for k in ("segment_bytes", "buffer_bytes") if k in q}
        return cls(parts.netloc, q["metadata"], auth, q.get("local_hostname", "127.0.0.1"),
                   protocol=q.get("protocol", "tcp"), devices=q.get("devices", ""), timeout_s=timeout_s, **sizes)

    def _call(self, what: str, fn, *args):  # noqa: ANN001, ANN202
        future = self._calls.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise TierUnavailable(f"mooncake {what} at {self.master}: no answer within {self.timeout_s} s") from None

    def _alive(self, what: str) -> None:
        rc = self._call("health_check", self._s.health_check)
        if rc != _HEALTHY:
            raise TierUnavailable(f"mooncake {what}: master {self.master} unreachable (health_check {rc})")

    def _check(self, what: str, rc: int) -> int:
        if rc in (RPC_FAIL, TRANSFER_FAIL):
            raise TierUnavailable(f"mooncake {what} at {self.master}: "
                                  f"{'RPC' if rc == RPC_FAIL else 'transfer to the storage node'} failed ({rc})")
        if rc < 0 and rc not in (OBJECT_NOT_FOUND, NO_SPACE):
            raise TierError(f"mooncake {what} at {self.master}: error {rc}")
        return rc

    def put(self, ns: Namespace, block_hash: bytes, page: bytes | memoryview, digest: bytes,
            kind: DigestKind = DigestKind.XXH3) -> bool:
        self._alive("put")
        record = encode_record(self.auth, ns, block_hash, page, digest, kind)
        rc = self._check("upsert", self._call("upsert", self._s.upsert, self.auth.key(ns, block_hash), record))
        return rc == 0

    def get(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> TierPage | None:
        blob = self.get_record(ns, block_hash, max_page_bytes)
        return None if blob is None else decode_record(self.auth, ns, block_hash, blob)

    def get_record(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> bytes | None:
        self._alive("get")
        key = self.auth.key(ns, block_hash)
        size = self._check("get_size", self._call("get_size", self._s.get_size, key))
        if size == OBJECT_NOT_FOUND:
            return None
        if max_page_bytes is not None and size > record_bound(max_page_bytes):  # any client may put any size
            raise record_too_long(size, max_page_bytes)
        blob = self._call("get", self._s.get, key)
        if not blob:  # removed or evicted since get_size, the master gone, or the node holding it
            self._alive("get")
            if self._call("get_size", self._s.get_size, key) > 0:
                raise TierUnavailable(f"mooncake get at {self.master}: the master indexes the key, and the "
                                      "storage node holding it does not serve it")
            return None
        if max_page_bytes is not None and len(blob) > record_bound(max_page_bytes):
            # put again under the key, larger, between the size and the fetch (any client may):
            # fetched, but not decoded, digested or copied further
            raise TierCorrupt(f"a record of {len(blob)} bytes fetched under this key, {size} when its size was "
                              f"read (replaced between the two); a record here is at most "
                              f"{record_bound(max_page_bytes)}: not decoded")
        return bytes(blob)

    def exists(self, ns: Namespace, hashes: list[bytes]) -> int:
        self._alive("exists")
        n = 0
        for rc in self._call("batch_is_exist", self._s.batch_is_exist, [self.auth.key(ns, h) for h in hashes]):
            if self._check("batch_is_exist", rc) != 1:
                break
            n += 1
        return n

    def remove(self, ns: Namespace, block_hash: bytes) -> None:
        self._alive("remove")
        self._check("remove", self._call("remove", self._s.remove, self.auth.key(ns, block_hash), True))

    def close(self) -> None:
        self._s.close()
        self._calls.shutdown(wait=False)
