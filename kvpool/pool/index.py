"""The index of a tenant's committed blocks, in the tenant's private segment
(kvpool.pool.arena: the daemon's mapping is the only writable one, clients map it read-only),
that clients on the same host probe without a round trip to the daemon.

  ShmIndex(entries)              over the segment's index region (Arena.index_entries;
                                 read-only entries serve probe() only).
  .insert(key, fp, page)         the daemon, when a page is committed (False: both its
                                 buckets are full; the block is then found by asking the
                                 daemon only).
  .remove(key, fp, page)         the daemon, before a committed page is freed.
  .probe(fp, hashes) -> int      a client: how many of `hashes`, from the first, are
                                 committed under the namespace of fingerprint `fp`.
                                 Whatever the region holds (torn, scribbled, garbage), it
                                 raises nothing: an entry that is not one the daemon wrote
                                 whole (odd seq, no page, a page past the segment's
                                 `num_pages`) is a block not held.
  ns_fingerprint(ns) -> int      64 bits of BLAKE2b over the namespace's wire encoding.

Layout: buckets of SLOTS entries of 32 bytes (seq, page + 1, namespace fingerprint, the
block hash as two 64-bit words); a block may sit in either of two buckets, the low bits of
its hash's first 8 bytes and of its last 8 (block hashes are BLAKE2b: uniform), the less
full one taken. With one bucket per block, a pool filled to its pages left about one
block in fifty out of the index, and a run of thousands of blocks nearly always had one
missing (the probe then stops and the caller asks the daemon); with two choices of four
slots at a quarter load at most an insert practically never finds both full. An empty
entry is all zeros but its seq. The daemon is the only writer, on its event loop; each
entry is a seqlock: `seq` is odd while
the daemon rewrites it and grows by two with every rewrite, and a reader reads each entry
twice, first word first, and keeps it only if both reads agree and `seq` is even (x86
keeps stores in order and loads in order; numpy's copies are plain loads and stores). What the probe may get wrong is bounded by what it is for: it
never reports a block the daemon did not commit under that namespace, but a block can be
evicted right after the probe (as after any lookup: the load then misses and the block is
recomputed), and a block whose buckets were both full is not in the index (the probe stops
there and the caller asks the daemon).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

_ODD = np.uint64(1)
_READS = 4
_LOW32 = 0xFFFF_FFFF
_PROBE_VIEW = np.dtype({"names": ["head", "tail"], "formats": ["<u8", "V24"], "offsets": [0, 8], "itemsize": 32})
ENTRY = np.dtype([("seq", "<u4"), ("page1", "<u4"), ("fp", "<u8"), ("k0", "<u8"), ("k1", "<u8")])
SLOTS = 4  # a power of two
_TWO = np.uint64(SLOTS.bit_length() - 1)  # log2(SLOTS): a bucket's first slot is its number shifted by it


def buckets_for(num_pages: int) -> int:
    """Buckets of an index for `num_pages` pages: a power of two, room for four times the
    pages (32 bytes an entry: 128 bytes a page at least, under 0.2% of 64 KiB pages)."""
    b = 1
    while b * SLOTS < 4 * num_pages:
        b <<= 1
    return b


def index_bytes(num_pages: int) -> int:
    return buckets_for(num_pages) * SLOTS * ENTRY.itemsize


def ns_fingerprint(ns) -> int:  # noqa: ANN001 - a kvpool.pool.keys.Namespace
    return int.from_bytes(hashlib.blake2b(msgspec.msgpack.encode(ns), digest_size=8).digest(), "little")


class ShmIndex:
    def __init__(self, entries: np.ndarray, num_pages: int | None = None):
        if entries.dtype != ENTRY or not entries.size or entries.size % SLOTS or entries.size & (entries.size - 1):
            raise ValueError(f"an index region of {entries.size} entries of {entries.dtype}")
        self.e = entries
        # a reader's bound on an entry's page + 1 (the segment's page count): an entry naming
        # no page of the segment is garbage, never a hit (2**32 - 1: any)
        self._max_page1 = np.uint64(_LOW32 if num_pages is None else min(num_pages, _LOW32))
        self.mask = np.uint64(entries.size // SLOTS - 1)
        self._words = entries.view(np.uint64).reshape(-1, 4)  # seq | (page + 1) << 32, fp, k0, k1
        self._lanes = np.arange(SLOTS, dtype=np.uint64)
        self.overflow = 0  # inserts that found both their buckets full

    def _slots(self, key: bytes) -> tuple[tuple[int, int], int, int]:
        """The first entries of a block's two buckets, and its hash's two words."""
        k0 = int.from_bytes(key[:8], "little")
        k1 = int.from_bytes(key[8:16], "little")
        mask = int(self.mask)
        return ((k0 & mask) * SLOTS, (k1 & mask) * SLOTS), k0, k1

    def _write(self, i: int, head: int, fp: int, k0: int, k1: int, page1: int) -> None:
        """Rewrite entry i: its seq odd first, then the block, then seq even with page + 1."""
        w = self._words[i]
        seq = head & _LOW32
        w[0] = seq + 1  # odd: being written (page + 1 reads 0 meanwhile)
        w[1], w[2], w[3] = fp, k0, k1
        w[0] = ((seq + 2) & _LOW32) | page1 << 32

    def insert(self, key: bytes, fp: int, page: int) -> bool:
        """Into the less full of the block's two buckets (the first on a tie)."""
        starts, k0, k1 = self._slots(key)
        best = None
        for start in starts:
            heads = self._words[start : start + SLOTS, 0].tolist()
            free = [j for j, head in enumerate(heads) if head >> 32 == 0]
            if free and (best is None or len(free) > best[0]):
                best = (len(free), start + free[0], heads[free[0]])
        if best is None:
            self.overflow += 1
            return False
        _, i, head = best
        self._write(i, head, fp, k0, k1, page + 1)
        return True

    def remove(self, key: bytes, fp: int, page: int) -> bool:
        starts, k0, k1 = self._slots(key)
        for start in starts:
            for j, (head, efp, ek0, ek1) in enumerate(self._words[start : start + SLOTS].tolist()):
                if head >> 32 == page + 1 and (efp, ek0, ek1) == (fp, k0, k1):
                    self._write(start + j, head, 0, 0, 0, 0)  # an empty entry matches no block
                    return True
        return False

    def probe(self, fp: int, hashes: Sequence[bytes]) -> int:
        n = len(hashes)
        if not n:
            return 0
        fpb = fp.to_bytes(8, "little")
        raw = b"".join([fpb + h for h in hashes])  # per block: fp, k0, k1
        want = np.frombuffer(raw, dtype="V24")[:, None]
        starts = (np.frombuffer(raw, dtype="<u8").reshape(n, 3)[:, 1:] & self.mask) << _TWO  # k0's, k1's bucket
        slots = (starts[:, :, None] + self._lanes).ravel()  # every slot of each block's two buckets
        for _ in range(_READS):
            got = self._words.take(slots, axis=0)  # read twice, first word first: a batch the daemon
            again = self._words.take(slots, axis=0)  # rewrote in between is read again
            if np.array_equal(got, again):  # compared in place (tobytes copied both: most of the probe's time)
                break
        else:
            return 0  # the daemon kept rewriting these entries: ask it instead
        rec = got.view(_PROBE_VIEW).reshape(n, 2 * SLOTS)
        head = rec["head"]
        page1 = head >> np.uint64(32)
        # an odd seq: the daemon is inside it; a page + 1 of 0 (empty) or past the segment's
        # pages: not an entry the daemon wrote whole, whatever its block words say
        ok = (head & _ODD == 0) & (page1 != 0) & (page1 <= self._max_page1) & (rec["tail"] == want)
        hit = ok.any(axis=1)
        return n if hit.all() else int(hit.argmin())
