"""Negative controls for the network tier (kvpool.tier): known-bad readers the suites must
catch, as faults.transport_controls holds the known-bad loaders of the host pool.

  BlindTier(inner)   a tier (RedisTier, MooncakeTier) whose reads defeat the record's safeguard against bytes
                     changed at rest: the header is read and its namespace checked, but
                     the page is handed out with a digest taken over the bytes as read
                     instead of the one taken at publish (a store that re-checksums what
                     it returns). A page corrupted in the store is returned, and installed,
                     as good; a byte-exact check must see it.
"""

from __future__ import annotations

from kvpool.digest import DigestKind, page_digest
from kvpool.keys import Namespace
from kvpool.tier import _HEADER_DECODER, _LENGTH_PREFIX, TierIncompatible, TierPage, tier_key


class BlindTier:
    """Negative controls only."""

    def __init__(self, inner):  # noqa: ANN001 - a RedisTier or a MooncakeTier
        self.inner = inner
        self.caps = inner.caps

    def __getattr__(self, name: str):  # noqa: ANN204 - put, exists, remove, close
        return getattr(self.inner, name)

    def get(self, ns: Namespace, block_hash: bytes) -> TierPage | None:
        raw = getattr(self.inner, "_r", None) or self.inner._s  # the store's own client
        blob = raw.get(tier_key(ns, block_hash))
        if not blob:  # Redis: None; Mooncake: b''
            return None
        n = int.from_bytes(blob[:_LENGTH_PREFIX], "big")
        header = _HEADER_DECODER.decode(blob[_LENGTH_PREFIX:_LENGTH_PREFIX + n])
        writer = Namespace.from_dict(dict(header.namespace))
        if writer != ns:
            raise TierIncompatible("another namespace", ns.differing_fields(writer))
        data = blob[_LENGTH_PREFIX + n:]
        return TierPage(data, page_digest(data), DigestKind.XXH3)  # the defect: the digest of what was read
