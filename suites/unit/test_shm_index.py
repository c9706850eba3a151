"""The segment's index of committed blocks (kvpool.shm_index): what a probe finds, the
seqlock, a full bucket, and the index an arena carries."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.keys import Namespace, block_hashes
from kvpool.shm_index import ENTRY, SLOTS, ShmIndex, buckets_for, index_bytes, ns_fingerprint

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


def test_the_index_region_fits_twice_the_pages():
    for pages in (1, 3, 64, 1000, 262_144):
        b = buckets_for(pages)
        assert b & (b - 1) == 0 and b * SLOTS >= 2 * pages and index_bytes(pages) == b * SLOTS * 32
    with pytest.raises(ValueError):
        ShmIndex(np.zeros(12, dtype=ENTRY))


def test_an_arena_carries_its_index():
    from kvpool.arena import Arena

    arena = Arena.anonymous("kvgate:test-index", 4096, 100)
    try:
        assert arena.index_entries.size == buckets_for(100) * SLOTS and not arena.index_entries["page1"].any()
        ShmIndex(arena.index_entries).insert(b"k" * 16, 5, 42)
        other = Arena.from_fd(__import__("os").dup(arena.fileno()), "kvgate:test-index")
        try:
            assert ShmIndex(other.index_entries).probe(5, [b"k" * 16]) == 1
        finally:
            other.close()
    finally:
        arena.close()
