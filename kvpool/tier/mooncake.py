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
  .get  with `max_page_bytes` (the connector's reads): one `get_into` a registered buffer of
        a record's bound, which the store refuses (-600, nothing moved) for a larger record:
        corrupt, not read, whenever the larger record was put. Without it: `get_size`, then
        `get`. A missing key (-704) is None. An empty fetch of a key the master still indexes
        is a storage node that cannot serve it (dead or cut off): TierUnavailable; a key gone
        since is None. Then kvpool.tier.record.decode_record. Reads hold a lease on the
        master's side (default 10 s), so a page being read is not evicted or removed under
        the reader.
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

import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from urllib.parse import parse_qs, urlsplit

import numpy as np

from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.tier.record import TierAuth, TierCaps, TierError, TierPage, TierUnavailable, decode_record, encode_record, record_bound, record_too_long

CAPS = TierCaps("mooncake", read_leases=True, atomic_put=True, evicts=True)

# Mooncake's error codes (its ErrorCode enum) the tier distinguishes
NO_SPACE = -200  # NO_AVAILABLE_HANDLE
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800  # the bytes could not be moved to or from the node holding them
RPC_FAIL = -900
BUFFER_TOO_SMALL = -600  # INVALID_PARAMS: get_into's answer for a record larger than the buffer
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
        self._buffers: list = []  # registered fetch buffers not in use (_buffer)
        self._buffers_lock = threading.Lock()
        self._state = threading.Condition()  # _closed, and the count of calls the client is running
        self._closed = False
        self._running = 0
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

    def _call(self, what: str, fn, *args, then=None):  # noqa: ANN001, ANN202
        """fn(*args) on a helper thread, waited for timeout_s at most; `then()` runs once the
        call itself has ended (on the helper, whether or not it was waited for). Every call to
        the store's client goes through here: a closed tier refuses it (the client must not be
        called once closed: it crashes the process)."""
        closed = TierUnavailable(f"mooncake {what} at {self.master}: the tier is closed")

        def run():  # noqa: ANN202
            with self._state:  # a call starts only while the tier is open, and is counted until it ends
                if self._closed:
                    raise closed
                self._running += 1
            try:
                return fn(*args)
            finally:
                with self._state:
                    self._running -= 1
                    self._state.notify_all()

        if self._closed:
            raise closed
        try:
            future = self._calls.submit(run)
        except RuntimeError:  # the executor shut down by close()
            raise closed from None
        if then is not None:
            future.add_done_callback(lambda _f: then())
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
        if max_page_bytes is not None:
            return self._get_bounded(key, max_page_bytes)
        size = self._check("get_size", self._call("get_size", self._s.get_size, key))
        if size == OBJECT_NOT_FOUND:
            return None
        blob = self._call("get", self._s.get, key)
        if not blob:
            self._empty_get(key)
            return None
        return bytes(blob)

    def _get_bounded(self, key: str, max_page_bytes: int) -> bytes | None:
        """One `get_into` a buffer of the record's bound: the store measures the record before
        it moves a byte, so a larger one (any client may put any size under any key, and
        between any two of the reader's calls) is refused by the store, never fetched."""
        bound = record_bound(max_page_bytes)
        buf = self._buffer(bound)

        def fetch() -> tuple[int, bytes]:
            n = self._s.get_into(key, buf.ctypes.data, bound)
            return n, bytes(buf[:n]) if n > 0 else b""

        # The buffer goes back when the helper's call ends, not when the wait for it does: a call
        # past its timeout may still write into it.
        n, blob = self._call("get_into", fetch, then=lambda: self._give_back(buf))
        if n == BUFFER_TOO_SMALL:
            size = self._check("get_size", self._call("get_size", self._s.get_size, key))
            if size == OBJECT_NOT_FOUND:
                return None  # removed since
            if size > bound:
                raise record_too_long(size, max_page_bytes)
            raise TierError(f"mooncake get_into at {self.master}: error {n} for a record of {size} bytes "
                            f"(at most {bound} here)")
        n = self._check("get_into", n)
        if n == OBJECT_NOT_FOUND:
            return None
        if n < 0:  # NO_SPACE: the client found no staging buffer for the transfer
            raise TierUnavailable(f"mooncake get_into at {self.master}: no transfer buffer ({n})")
        if n == 0:
            self._empty_get(key)
            return None
        if n > bound:  # the client never answers more than the size it was given
            raise TierError(f"mooncake get_into at {self.master}: {n} bytes into a buffer of {bound}")
        return blob

    def _buffer(self, nbytes: int):  # noqa: ANN202 - a numpy uint8 array
        """A fetch buffer of at least `nbytes`, registered with the client (an RDMA transfer
        lands only in registered memory): one per concurrent reader, kept for the next."""
        with self._buffers_lock:
            fits = [i for i, b in enumerate(self._buffers) if b.nbytes >= nbytes]
            if fits:
                return self._buffers.pop(min(fits, key=lambda i: self._buffers[i].nbytes))
        b = np.empty(nbytes, dtype=np.uint8)
        # registering tells the metadata server about the buffer: bounded like any call
        rc = self._call("register_buffer", self._s.register_buffer, b.ctypes.data, b.nbytes)
        if rc != 0:
            # the client registers with the metadata server: refused when it cannot reach it
            raise TierUnavailable(f"mooncake register_buffer of {b.nbytes} bytes at {self.master}: error {rc}")
        return b

    def _give_back(self, buf) -> None:  # noqa: ANN001
        with self._buffers_lock:
            self._buffers.append(buf)

    def _empty_get(self, key: str) -> None:
        """An empty fetch of a key: removed or evicted since the reader looked (a miss), or the
        master indexes it and the storage node holding it does not serve it (dead or cut off)."""
        self._alive("get")
        if self._call("get_size", self._s.get_size, key) > 0:
            raise TierUnavailable(f"mooncake get at {self.master}: the master indexes the key, and the "
                                  "storage node holding it does not serve it")

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

    def close(self, wait_s: float | None = None) -> bool:
        """Refuse new calls, drop those queued, wait for those the client is running (at most
        `wait_s`, default the tier's timeout), then close the client. A call still running
        then (a hung store) keeps the client open, never closed under it: False."""
        with self._state:
            self._closed = True
        self._calls.shutdown(wait=False, cancel_futures=True)
        with self._state:
            idle = self._state.wait_for(lambda: self._running == 0,
                                        timeout=self.timeout_s if wait_s is None else wait_s)
        if idle:
            self._s.close()
        return idle
