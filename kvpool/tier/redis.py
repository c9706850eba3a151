"""The network tier on Redis (or Valkey, a drop-in): kvpool.tier.interface's Tier over redis-py.

  RedisTier(url, auth, timeout_s=1.0, ttl_s=None)
        url: "redis://[USER:PASSWORD@]HOST:PORT/DB" or "unix:///path/redis.sock"; the
        credentials are the tenant's ACL user's (redis-py sends AUTH USER PASSWORD on
        connect), whose key pattern is the tenant's prefix (`~kvpool:TENANT:*`, the keys
        auth.key gives) and whose commands are GET, SET, EXISTS, DEL and PING: the tenant's
        replicas reach their own keys only, and no other tenant's, nor the key space's
        listing. The password never appears in an error or a record (kvpool.tier.interface.redact_url).
        Every call is bounded by timeout_s (connect and socket); past it, on a refused or
        reset connection, a failed AUTH or a call the store's access control refuses, the
        call raises TierUnavailable (a transport_error miss), never a redis exception.
  .put  one SET of the whole record (Redis applies a command atomically: complete or
        invisible); an out-of-memory refusal (maxmemory with noeviction) is False
  .get  one GET, then kvpool.tier.record.decode_record (authenticated, bound to its key); a
        missing key is None (Redis keeps no ghosts: never stored and evicted look alike, and
        there are no read leases: a key evicted during a read is a miss)
  .get_record  the GET alone (the raw record, unchecked)
  .exists  one pipelined EXISTS per hash, counted from the first
Capabilities: no read leases, atomic puts, evicts when its maxmemory policy says so.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.tier.record import TierAuth, TierCaps, TierPage, TierUnavailable, decode_record, encode_record, record_bound, record_too_long
from kvpool.tier.interface import redact_url

CAPS = TierCaps("redis", read_leases=False, atomic_put=True, evicts=True)


class RedisTier:
    caps = CAPS

    def __init__(self, url: str, auth: TierAuth, timeout_s: float = 1.0, ttl_s: float | None = None):
        self.url = redact_url(url)  # for messages: never the password
        self.auth = auth
        self.ttl_s = ttl_s
        # No retries inside redis-py (its default retries a refused connection with backoff):
        # a failed call is the tier rule's to judge (kvpool.tier.rule), at once.
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                       retry_on_timeout=False, retry=Retry(NoBackoff(), 0))

    def _call(self, what: str, fn, *args, **kwargs):  # noqa: ANN001, ANN202
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # refused, reset, no answer in time, bad AUTH
            raise TierUnavailable(f"redis {what} at {self.url}: {type(exc).__name__}: {exc}") from exc
        except redis.exceptions.NoPermissionError as exc:  # the ACL user may not run it, or not on that key
            raise TierUnavailable(f"redis {what} at {self.url} refused by the store's access control: {exc}") from exc

    def put(self, ns: Namespace, block_hash: bytes, page: bytes | memoryview, digest: bytes,
            kind: DigestKind = DigestKind.XXH3) -> bool:
        record = encode_record(self.auth, ns, block_hash, page, digest, kind)
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        try:
            return bool(self._call("SET", self._r.set, self.auth.key(ns, block_hash), record, px=px))
        except redis.exceptions.OutOfMemoryError:  # maxmemory reached under noeviction: not stored
            return False
        except redis.ResponseError as exc:
            raise TierUnavailable(f"redis SET at {self.url} refused: {exc}") from exc

    def get_record(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> bytes | None:
        key = self.auth.key(ns, block_hash)
        if max_page_bytes is None:
            return self._call("GET", self._r.get, key)
        bound = record_bound(max_page_bytes)
        blob = self._call("GETRANGE", self._r.getrange, key, 0, bound)  # at most bound + 1 bytes
        if not blob:  # no such key (a record is never empty)
            return None
        if len(blob) > bound:
            raise record_too_long(len(blob), max_page_bytes)
        return blob

    def get(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> TierPage | None:
        blob = self.get_record(ns, block_hash, max_page_bytes)
        return None if blob is None else decode_record(self.auth, ns, block_hash, blob)

    def exists(self, ns: Namespace, hashes: list[bytes]) -> int:
        pipe = self._r.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(self.auth.key(ns, h))
        found = self._call("EXISTS", pipe.execute)
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def remove(self, ns: Namespace, block_hash: bytes) -> None:
        self._call("DEL", self._r.delete, self.auth.key(ns, block_hash))

    def close(self) -> None:
        self._r.close()
