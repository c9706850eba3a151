"""The network tier on Redis (or Valkey, a drop-in): kvpool.tier's interface over redis-py.

  RedisTier(url, timeout_s=1.0, ttl_s=None)
        url: "redis://HOST:PORT/DB" or "unix:///path/redis.sock". Every call is bounded by
        timeout_s (connect and socket); past it, or on a refused or reset connection, the
        call raises TierUnavailable (a transport_error miss), never a redis exception.
  .put  one SET of the whole record (Redis applies a command atomically: complete or
        invisible); an out-of-memory refusal (maxmemory with noeviction) is False
  .get  one GET; a missing key is None (Redis keeps no ghosts: never stored and evicted
        look alike, and there are no read leases: a key evicted during a read is a miss)
  .exists  one pipelined EXISTS per hash, counted from the first
Capabilities: no read leases, atomic puts, evicts when its maxmemory policy says so.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvpool.digest import DigestKind
from kvpool.keys import Namespace
from kvpool.tier import TierCaps, TierPage, TierUnavailable, decode_record, encode_record, tier_key

CAPS = TierCaps("redis", read_leases=False, atomic_put=True, evicts=True)


class RedisTier:
    caps = CAPS

    def __init__(self, url: str, timeout_s: float = 1.0, ttl_s: float | None = None):
        self.url = url
        self.ttl_s = ttl_s
        # No retries inside redis-py (its default retries a refused connection with backoff):
        # a failed call is the tier rule's to judge (kvpool.tier_rule), at once.
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                       retry_on_timeout=False, retry=Retry(NoBackoff(), 0))

    def _call(self, what: str, fn, *args, **kwargs):  # noqa: ANN001, ANN202
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # refused, reset, or no answer in time
            raise TierUnavailable(f"redis {what} at {self.url}: {type(exc).__name__}: {exc}") from exc

    def put(self, ns: Namespace, block_hash: bytes, page: bytes | memoryview, digest: bytes,
            kind: DigestKind = DigestKind.XXH3) -> bool:
        record = encode_record(ns, page, digest, kind)
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        try:
            return bool(self._call("SET", self._r.set, tier_key(ns, block_hash), record, px=px))
        except redis.exceptions.OutOfMemoryError:  # maxmemory reached under noeviction: not stored
            return False
        except redis.ResponseError as exc:
            raise TierUnavailable(f"redis SET at {self.url} refused: {exc}") from exc

    def get(self, ns: Namespace, block_hash: bytes) -> TierPage | None:
        blob = self._call("GET", self._r.get, tier_key(ns, block_hash))
        return None if blob is None else decode_record(ns, blob)

    def exists(self, ns: Namespace, hashes: list[bytes]) -> int:
        pipe = self._r.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(tier_key(ns, h))
        found = self._call("EXISTS", pipe.execute)
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def remove(self, ns: Namespace, block_hash: bytes) -> None:
        self._call("DEL", self._r.delete, tier_key(ns, block_hash))

    def close(self) -> None:
        self._r.close()
