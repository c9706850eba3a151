"""Negative controls for the network tier (kvpool.tier): known-bad readers the suites must
catch, as kvgate.faults.transport_controls holds the known-bad loaders of the host pool; and what
a client of the store who lacks the tenant's tier secret can do to records.

  BlindTier(inner)   a tier (RedisTier, MooncakeTier) whose reads defeat the record's safeguards against bytes
                     changed at rest: the header is read and its namespace checked, but
                     neither the tag nor the digest taken at publish: the page is handed
                     out with a digest taken over the bytes as read (a store that
                     re-checksums what it returns). A page corrupted in the store is
                     returned, and installed, as good; a byte-exact check must see it.
  UnauthenticatedTier(inner)
                     the reader before records were authenticated and bound to their key:
                     the header's namespace, the length and the header's plain digest are
                     checked, the tag and the header's block hash are not. A record moved
                     under another block's key, or a page rewritten with its plain digest
                     recomputed, is installed as good; a byte-exact check must see it.
  UNAUTHENTICATED_TIER  the name of that control where a fault-control file arms it
  SizeThenFetchTier(inner)
                     a MooncakeTier's reader before its fetches were bounded: the record's
                     size is read and checked against the bound, then the record is fetched
                     whole. A record replaced by a larger one between the two calls (any
                     client of the store may) is brought whole into the reader's memory; an
                     oracle on the bytes each fetch may move must see it.
  EagerBufferTier(inner)
                     a MooncakeTier's bounded reader that takes its fetch buffer back when
                     the wait for the fetch ends (its timeout included) rather than when the
                     fetch does: a fetch past its timeout lands later in a buffer another
                     read is using, and that read hands out the late record's bytes.

A store client without the secret (the store's operator, another tenant with write access
to the key, anyone on an open Redis or Mooncake):
  forge_record(blob, page=None, **fields) -> bytes
                     the record with its page replaced by `page` (the header's length and
                     plain digest recomputed to match) and/or header fields rewritten (its
                     namespace, its block hash: a record rebound to another key); the tag
                     kept (it cannot make one)
  records_under(client, prefix) -> {key: record}
                     every record under a key prefix, as a Redis client with SCAN and GET
                     rights sees them (the store's operator)
  rotate(keys) -> [(from, to), ...]
                     each record moved to the next key (a derangement of the keys: none
                     stays where it was)
"""

from __future__ import annotations

import msgspec

from kvpool.pool.digest import DigestKind, kind_of, page_digest
from kvpool.pool.keys import Namespace
from kvpool.tier.record import (HEADER_ENCODER, LENGTH_PREFIX, TierCorrupt, TierIncompatible, TierPage, decode_record,
                                record_bound, record_too_long, split_record)

UNAUTHENTICATED_TIER = "unauthenticated_tier"


class _Reader:
    def __init__(self, inner):  # noqa: ANN001 - a RedisTier or a MooncakeTier
        self.inner = inner
        self.caps = inner.caps

    def __getattr__(self, name: str):  # noqa: ANN204 - put, exists, remove, close, auth, get_record
        return getattr(self.inner, name)

    def _parts(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None):  # noqa: ANN202
        blob = self.inner.get_record(ns, block_hash, max_page_bytes)
        if not blob:  # Redis: None; Mooncake: b''
            return None
        _tag, header, data = split_record(blob)  # the defect: the tag is never checked
        writer = Namespace.from_dict(dict(header.namespace))
        if writer != ns:
            raise TierIncompatible("another namespace", ns.differing_fields(writer))
        return header, data


class BlindTier(_Reader):
    """Negative controls only."""

    def get(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> TierPage | None:
        parts = self._parts(ns, block_hash, max_page_bytes)
        if parts is None:
            return None
        _header, data = parts
        return TierPage(data, page_digest(data), DigestKind.XXH3)  # the defect: the digest of what was read


class UnauthenticatedTier(_Reader):
    """Negative controls only."""

    def get(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> TierPage | None:
        parts = self._parts(ns, block_hash, max_page_bytes)
        if parts is None:
            return None
        header, data = parts  # the defect: header.block_hash is never compared with block_hash
        kind = kind_of(header.digest_kind)
        if len(data) != header.length or page_digest(data, kind) != header.digest:
            raise TierCorrupt("the record's page does not match the digest taken at publish")
        return TierPage(data, header.digest, kind)


class SizeThenFetchTier(_Reader):
    """Negative controls only."""

    def get_record(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> bytes | None:
        store, key = self.inner._s, self.inner.auth.key(ns, block_hash)
        size = store.get_size(key)
        if size < 0:
            return None
        if max_page_bytes is not None and size > record_bound(max_page_bytes):
            raise record_too_long(size, max_page_bytes)
        return bytes(store.get(key)) or None  # the defect: measured, then fetched without a bound

    def get(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> TierPage | None:
        blob = self.get_record(ns, block_hash, max_page_bytes)
        return None if blob is None else decode_record(self.inner.auth, ns, block_hash, blob)


class EagerBufferTier(_Reader):
    """Negative controls only."""

    def get_record(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> bytes | None:
        tier, key, bound = self.inner, self.inner.auth.key(ns, block_hash), record_bound(max_page_bytes)
        buf = tier._buffer(bound)
        try:
            n = tier._call("get_into", tier._s.get_into, key, buf.ctypes.data, bound)
            return bytes(buf[:n]) if n > 0 else None
        finally:
            tier._give_back(buf)  # the defect: back when the wait ends; the fetch may still run

    def get(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> TierPage | None:
        blob = self.get_record(ns, block_hash, max_page_bytes)
        return None if blob is None else decode_record(self.inner.auth, ns, block_hash, blob)


def forge_record(blob: bytes, page: bytes | None = None, **fields: object) -> bytes:
    """`blob` with its page replaced (and the header's plain digest and length recomputed
    to match) and/or header fields replaced (namespace=..., block_hash=...); the tag kept."""
    tag, header, data = split_record(blob)
    if page is not None:
        data = bytes(page)
        fields = {**fields, "digest": page_digest(data, kind_of(header.digest_kind)), "length": len(data)}
    raw = HEADER_ENCODER.encode(msgspec.structs.replace(header, **fields))
    return tag + len(raw).to_bytes(LENGTH_PREFIX, "big") + raw + data


def records_under(client, prefix: str) -> dict[str, bytes]:  # noqa: ANN001 - a redis.Redis
    out = {}
    for key in client.scan_iter(match=f"{prefix}*", count=1000):
        blob = client.get(key)
        if blob is not None:
            out[key.decode() if isinstance(key, bytes) else key] = blob
    return out


def rotate(keys: list[str]) -> list[tuple[str, str]]:
    """(from, to): the record of keys[i] goes to keys[i+1], the last to the first."""
    if len(keys) < 2:
        raise ValueError(f"moving records needs two keys at least, got {len(keys)}")
    return [(keys[i], keys[(i + 1) % len(keys)]) for i in range(len(keys))]
