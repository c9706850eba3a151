"""The segment's index of committed blocks (kvpool.pool.index): what a probe finds, the
seqlock, a full bucket, and the index an arena carries."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.index import ENTRY, SLOTS, ShmIndex, buckets_for, index_bytes, ns_fingerprint

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


def _index(pages: int = 64) -> ShmIndex:
    return ShmIndex(np.zeros(buckets_for(pages) * SLOTS, dtype=ENTRY))


def test_a_probe_finds_the_leading_run_of_its_namespace(test_seed):
    ix = _index()
    hashes = block_hashes(range(16 * 12), 16)
    fp = ns_fingerprint(NS)
    assert ix.probe(fp, hashes) == 0 and ix.probe(fp, []) == 0
    for i, h in enumerate(hashes[:8]):
        assert ix.insert(h, fp, i)
    assert ix.probe(fp, hashes) == 8
    assert ix.probe(fp, hashes[:5]) == 5
    assert ix.probe(ns_fingerprint(NS.replace(model_revision="r2")), hashes) == 0  # another namespace
    assert ix.remove(hashes[3], fp, 3) and not ix.remove(hashes[3], fp, 3)
    assert ix.probe(fp, hashes) == 3
    assert not ix.remove(hashes[4], fp, 99)  # another page of that block: nothing removed
    assert ix.probe(fp, hashes[4:]) == 4


def test_an_entry_being_rewritten_is_not_a_hit():
    ix = _index()
    hashes = block_hashes(range(16 * 3), 16)
    for i, h in enumerate(hashes):
        ix.insert(h, 7, i)
    slot = int(np.flatnonzero(ix.e["page1"] == 2)[0])  # block 1's entry
    ix.e["seq"][slot] += 1  # the daemon is in the middle of it
    assert ix.probe(7, hashes) == 1
    ix.e["seq"][slot] += 1
    assert ix.probe(7, hashes) == 3


def test_a_full_bucket_leaves_the_block_to_the_daemon():
    ix = ShmIndex(np.zeros(SLOTS, dtype=ENTRY))  # one bucket
    hashes = block_hashes(range(16 * (SLOTS + 1)), 16)
    assert all(ix.insert(h, 1, i) for i, h in enumerate(hashes[:SLOTS]))
    assert not ix.insert(hashes[SLOTS], 1, SLOTS) and ix.overflow == 1
    assert ix.probe(1, hashes) == SLOTS  # stops where the index has nothing: the caller asks the daemon


def test_the_index_region_fits_four_times_the_pages():
    for pages in (1, 3, 64, 1000, 262_144):
        b = buckets_for(pages)
        assert b & (b - 1) == 0 and b * SLOTS >= 4 * pages and index_bytes(pages) == b * SLOTS * 32
    with pytest.raises(ValueError):
        ShmIndex(np.zeros(12, dtype=ENTRY))


def test_an_arena_carries_its_index():
    """The daemon's arena writes its index; a client's mapping of it (read-only) probes it."""
    import os

    from kvpool.pool.arena import Arena

    arena = Arena.anonymous("kvgate:test-index", 4096, 100)
    try:
        assert arena.index_entries.size == buckets_for(100) * SLOTS and not arena.index_entries["page1"].any()
        ShmIndex(arena.index_entries).insert(b"k" * 16, 5, 42)
        other = Arena.from_fds(*(os.dup(fd) for fd in arena.handout_fds()), "kvgate:test-index")
        try:
            assert not other.index_entries.flags.writeable
            assert ShmIndex(other.index_entries).probe(5, [b"k" * 16]) == 1
        finally:
            other.close()
    finally:
        arena.close()


class _OneChoice(ShmIndex):
    """The control: every block in its first bucket only (the layout before two choices)."""

    def insert(self, key: bytes, fp: int, page: int) -> bool:
        starts, k0, k1 = ShmIndex._slots(self, key)
        for j, head in enumerate(self._words[starts[0] : starts[0] + SLOTS, 0].tolist()):
            if head >> 32 == 0:
                self._write(starts[0] + j, head, fp, k0, k1, page + 1)
                return True
        self.overflow += 1
        return False


@pytest.mark.parametrize("index_class, whole", [(ShmIndex, True), (_OneChoice, False)])
def test_a_full_pool_keeps_every_block_of_a_long_run_in_the_index(index_class, whole):
    """A pool of 8192 pages filled by runs of thousands of blocks (the GPU bench's 32k and
    64k prompts): with two buckets per block every insert finds room and the last run is
    probed whole; with one (the control) blocks fall out and the probe stops short."""
    pages = 8192
    ix = index_class(np.zeros(buckets_for(pages) * SLOTS, dtype=ENTRY))
    fp = ns_fingerprint(NS)
    runs = [block_hashes(range(r * 10**6, r * 10**6 + 16 * 2048), 16) for r in range(3)]
    runs.append(block_hashes(range(9 * 10**6, 9 * 10**6 + 16 * (pages - 3 * 2048)), 16))
    page = 0
    for run in runs:
        for h in run:
            ix.insert(h, fp, page)
            page += 1
    assert page == pages
    found = [ix.probe(fp, run) for run in runs]
    if whole:
        assert ix.overflow == 0 and found == [len(r) for r in runs]
    else:
        assert ix.overflow > 0 and any(f < len(r) for f, r in zip(found, runs))
