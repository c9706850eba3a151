"""The index of a tenant's committed blocks, in its own segment, that clients on the same
host probe without a round trip to the daemon.

  ShmIndex(entries)              over the segment's index region (Arena.index_entries).
  .insert(key, fp, page)         the daemon, when a page is committed (False: its bucket is
                                 full; the block is then found by asking the daemon only).
  .remove(key, fp, page)         the daemon, before a committed page is freed.
  .probe(fp, hashes) -> int      a client: how many of `hashes`, from the first, are
                                 committed under the namespace of fingerprint `fp`.
  ns_fingerprint(ns) -> int      64 bits of BLAKE2b over the namespace's wire encoding.

Layout: buckets of SLOTS entries of 32 bytes (seq, page + 1, namespace fingerprint, the
block hash as two 64-bit words); a block's bucket is the low bits of its hash's first 8
bytes (block hashes are BLAKE2b: uniform). An entry with page + 1 == 0 is empty. The
daemon is the only writer, on its event loop; each entry is a seqlock: `seq` is odd while
the daemon rewrites it, and a reader keeps an entry only if it read the same even `seq`
before and after it (x86 keeps stores in order and loads in order; numpy's copies are
plain loads and stores). What the probe may get wrong is bounded by what it is for: it
never reports a block the daemon did not commit under that namespace, but a block can be
evicted right after the probe (as after any lookup: the load then misses and the block is
recomputed), and a block whose bucket was full is not in the index (the probe stops
there and the caller asks the daemon).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

_ODD = np.uint64(1)
_SHIFT = np.uint64(32)
ENTRY = np.dtype([("seq", "<u4"), ("page1", "<u4"), ("fp", "<u8"), ("k0", "<u8"), ("k1", "<u8")])
SLOTS = 4


def buckets_for(num_pages: int) -> int:
    """Buckets of an index for `num_pages` pages: a power of two, room for twice the pages."""
    b = 1
    while b * SLOTS < 2 * num_pages:
        b <<= 1
    return b


def index_bytes(num_pages: int) -> int:
    return buckets_for(num_pages) * SLOTS * ENTRY.itemsize


def ns_fingerprint(ns) -> int:  # noqa: ANN001 - a kvpool.keys.Namespace
    return int.from_bytes(hashlib.blake2b(msgspec.msgpack.encode(ns), digest_size=8).digest(), "little")


class ShmIndex:
    def __init__(self, entries: np.ndarray):
        if entries.dtype != ENTRY or entries.size % SLOTS or entries.size & (entries.size - 1):
            raise ValueError(f"an index region of {entries.size} entries of {entries.dtype}")
        self.e = entries
        self.mask = np.uint64(entries.size // SLOTS - 1)
        self.words = entries.view(np.uint64).reshape(-1, 4)  # the probe's view: (seq, page + 1), fp, k0, k1
        self._head = self.words[:, 0]
        self._lanes = np.arange(SLOTS, dtype=np.intp)
        self.overflow = 0  # inserts that found their bucket full

    def _slots(self, key: bytes) -> tuple[int, int, int]:
        k0 = int.from_bytes(key[:8], "little")
        k1 = int.from_bytes(key[8:16], "little")
        start = (k0 & int(self.mask)) * SLOTS
        return start, k0, k1

    def insert(self, key: bytes, fp: int, page: int) -> bool:
        start, k0, k1 = self._slots(key)
        e = self.e
        for i in range(start, start + SLOTS):
            if e["page1"][i] == 0:
                e["seq"][i] += 1  # odd: being written
                e["fp"][i], e["k0"][i], e["k1"][i] = fp, k0, k1
                e["page1"][i] = page + 1
                e["seq"][i] += 1
                return True
        self.overflow += 1
        return False

    def remove(self, key: bytes, fp: int, page: int) -> bool:
        start, k0, k1 = self._slots(key)
        e = self.e
        for i in range(start, start + SLOTS):
            if e["page1"][i] == page + 1 and e["k0"][i] == k0 and e["k1"][i] == k1 and e["fp"][i] == fp:
                e["seq"][i] += 1
                e["page1"][i] = 0
                e["seq"][i] += 1
                return True
        return False

    def probe(self, fp: int, hashes: Sequence[bytes]) -> int:
        n = len(hashes)
        if not n:
            return 0
        want = np.empty((n, 3), dtype=np.uint64)  # per block: fp, k0, k1
        want[:, 0] = fp
        want[:, 1:] = np.frombuffer(b"".join(hashes), dtype="<u8").reshape(n, 2)
        slots = ((want[:, 1] & self.mask) * np.uint64(SLOTS)).astype(np.intp)
        slots = (slots[:, None] + self._lanes).ravel()  # every slot of each block's bucket
        words, head = self.words, self._head
        before = head.take(slots)  # seq | (page + 1) << 32: read before and after the entry
        got = words.take(slots, axis=0)
        after = head.take(slots)
        ok = (before == after) & (before & _ODD == 0) & (before >> _SHIFT != 0)
        ok &= (got[:, 1:] == want.repeat(SLOTS, axis=0)).all(axis=1)
        hit = ok.reshape(n, SLOTS).any(axis=1)
        return n if hit.all() else int(hit.argmin())
