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


def test_buckets_are_the_least_power_of_two_with_room_for_four_times_the_pages():
    assert [buckets_for(p) for p in (1, 2, 3, 64, 65, 100)] == [1, 2, 4, 64, 128, 128]


def test_the_namespace_fingerprint_is_pinned():
    """The daemon writes it, every client compares it: 64 bits of BLAKE2b over the
    namespace's msgpack, little-endian, in every process and release."""
    assert ns_fingerprint(NS) == 3178136980800762991


@pytest.mark.parametrize("entries", [np.zeros(0, dtype=ENTRY), np.zeros(128, dtype=np.uint8),
                                     np.zeros(12, dtype=ENTRY), np.zeros(6, dtype=ENTRY)])
def test_a_region_that_is_not_a_power_of_two_of_buckets_of_entries_is_refused(entries):
    with pytest.raises(ValueError, match=f"an index region of {entries.size} entries of "):
        ShmIndex(entries)


def test_an_entry_naming_a_page_past_the_segment_is_no_hit():
    ix = ShmIndex(np.zeros(buckets_for(4) * SLOTS, dtype=ENTRY), num_pages=4)
    hashes = block_hashes(range(16 * 2), 16)
    ix.insert(hashes[0], 9, 3)  # the segment's last page: a hit
    ix.insert(hashes[1], 9, 4)  # one past it: garbage whatever its words say
    assert ix.probe(9, hashes[:1]) == 1 and ix.probe(9, hashes[1:]) == 0 and ix.probe(9, hashes) == 1


class _Recording(np.ndarray):
    """The index's words, with every store to them logged in order (word, value)."""

    log: list = []

    def __setitem__(self, key, value):  # noqa: ANN001
        _Recording.log.append((key, int(value)))
        super().__setitem__(key, value)


def test_an_entry_is_rewritten_under_its_seqlock_in_order():
    """seq odd first (and page + 1 zero: no reader takes it meanwhile), then the block, then
    seq even, two more than before, with page + 1: the order a reader's re-check relies on."""
    ix = ShmIndex(np.zeros(SLOTS, dtype=ENTRY))
    ix._words = ix._words.view(_Recording)
    key = block_hashes(range(16), 16)[0]
    k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    for seq, (fp, page1) in [(0, (5, 8)), (2, (0, 0))]:
        _Recording.log = []
        (ix.insert(key, fp, page1 - 1) if page1 else ix.remove(key, 5, 7))
        words = (fp, k0, k1) if page1 else (0, 0, 0)
        assert _Recording.log == [(0, seq + 1), (1, words[0]), (2, words[1]), (3, words[2]), (0, (seq + 2) | page1 << 32)]
    assert ix.e["seq"][0] == 4 and tuple(ix.e[["page1", "fp", "k0", "k1"]][0].item()) == (0, 0, 0, 0)


def test_a_removed_entry_is_empty_and_taken_again():
    ix = ShmIndex(np.zeros(SLOTS, dtype=ENTRY))  # one bucket
    hashes = block_hashes(range(16 * (SLOTS + 2)), 16)
    assert all(ix.insert(h, 1, i) for i, h in enumerate(hashes[:SLOTS]))
    assert not ix.insert(hashes[SLOTS], 1, SLOTS) and not ix.insert(hashes[SLOTS + 1], 1, SLOTS + 1)
    assert ix.overflow == 2
    assert ix.remove(hashes[2], 1, 2)
    assert tuple(ix.e[["page1", "fp", "k0", "k1"]][2].item()) == (0, 0, 0, 0)  # all zeros but its seq
    assert ix.insert(hashes[SLOTS], 1, SLOTS)  # the removed entry is free again
    assert ix.probe(1, [hashes[0], hashes[1], hashes[3], hashes[SLOTS]]) == 4 and ix.probe(1, [hashes[2]]) == 0


def test_every_block_removed_is_gone_and_no_other_is():
    ix = _index(16)  # 16 buckets: several blocks share a bucket
    hashes = block_hashes(range(16 * 40), 16)
    for i, h in enumerate(hashes):
        assert ix.insert(h, 3, i)
    for i, h in enumerate(hashes):
        assert ix.remove(h, 3, i)
        assert ix.probe(3, [h]) == 0 and all(ix.probe(3, [g]) == 1 for g in hashes[i + 1:])


def test_a_block_goes_to_the_first_of_its_two_buckets_on_a_tie():
    ix = _index(64)
    key = block_hashes(range(16), 16)[0]
    ix.insert(key, 1, 0)
    slot = int(np.flatnonzero(ix.e["page1"] == 1)[0])
    assert slot // SLOTS == int.from_bytes(key[:8], "little") & int(ix.mask)


class _Flapping(np.ndarray):
    """Words the daemon rewrites between any two reads."""

    def take(self, *args, **kwargs):  # noqa: ANN002, ANN003
        out = np.asarray(self).take(*args, **kwargs)
        _Flapping.reads = getattr(_Flapping, "reads", 0) + 1
        out[..., 1] ^= np.uint64(_Flapping.reads)
        return out


def test_a_probe_that_never_reads_the_same_twice_claims_nothing():
    ix = _index()
    hashes = block_hashes(range(16 * 3), 16)
    for i, h in enumerate(hashes):
        ix.insert(h, 7, i)
    assert ix.probe(7, hashes) == 3
    ix._words = ix._words.view(_Flapping)
    assert ix.probe(7, hashes) == 0  # ask the daemon instead
