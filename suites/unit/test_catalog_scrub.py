"""The catalog's part of corruption at rest: discard (at once, or at the last release of a
leased page), the scrub's fresh queue (at most one entry per page) and its cyclic cursor."""

import numpy as np
import pytest

from kvgate.faults.corrupt_controls import HoardingCatalog
from kvpool.pool.catalog import Catalog, CatalogConfig, PageState
from kvpool.pool.records import SlotStatus
from kvpool.errors import MissCause
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
D = b"d" * 16


def hashes(n, start=0):
    return block_hashes(list(range(start, start + 16 * n)), 16)


def put(cat, hs, scrub_first=False, now=0.0):
    res = cat.reserve(1, NS.tenant, NS, hs, [100] * len(hs), now)
    n = sum(s.status == SlotStatus.RESERVED for s in res.slots)
    if res.reservation_id:
        cat.commit(res.reservation_id, [D] * n, scrub_first=scrub_first)
    return [s.page for s in res.slots]


def test_discard_of_an_unleased_page_frees_it_and_leaves_an_evicted_ghost():
    cat = Catalog(CatalogConfig(num_pages=4, page_size=1024))
    hs = hashes(2)
    pages = put(cat, hs)
    gen = int(cat.gen[pages[1]])
    assert cat.discard(pages[1], gen) is True
    assert cat.state[pages[1]] == PageState.FREE and int(cat.gen[pages[1]]) == gen + 1
    found = cat.lookup(NS.tenant, NS, hs)
    assert len(found.hits) == 1 and found.miss.cause == MissCause.EVICTED
    assert cat.discard(pages[1], gen) is None  # that commit is gone
    assert cat.stats()["discarded_corrupt"] == 1


def test_a_leased_page_is_dropped_from_the_index_at_once_and_freed_at_its_last_release():
    cat = Catalog(CatalogConfig(num_pages=4, page_size=1024))
    hs = hashes(1)
    (page,) = put(cat, hs)
    a = cat.acquire(1, NS.tenant, NS, hs, 0.0)
    b = cat.acquire(2, NS.tenant, NS, hs, 0.0)
    gen = int(cat.gen[page])
    assert cat.discard(page, gen) is True
    assert cat.state[page] == PageState.DROPPED and int(cat.gen[page]) == gen  # bytes kept for its loaders
    assert cat.lookup(NS.tenant, NS, hs).miss.cause == MissCause.EVICTED
    assert cat.acquire(3, NS.tenant, NS, hs, 0.0).lease_id == 0
    assert cat.committed_as(page, gen) is None and cat.discard(page, gen) is None
    assert cat.set_capacity(0) == 0 and cat.state[page] == PageState.DROPPED  # never an eviction candidate
    cat.set_capacity(4)
    assert cat.release(a.lease_id).stale == ()
    assert cat.state[page] == PageState.DROPPED and cat.stats()["dropped_pages"] == 1
    assert cat.release(b.lease_id).stale == ()  # the generation moves only after the last release
    assert cat.state[page] == PageState.FREE and cat.stats()["free_pages"] == 4
    assert int(cat.gen[page]) == gen + 1


def test_a_dropped_page_is_freed_when_its_lease_expires_or_its_client_goes():
    cat = Catalog(CatalogConfig(num_pages=4, page_size=1024, lease_ttl_s=1.0))
    hs = hashes(2)
    pages = put(cat, hs)
    assert cat.acquire(1, NS.tenant, NS, hs[:1], 0.0).lease_id
    assert cat.acquire(2, NS.tenant, NS, hs[1:], 0.0).lease_id
    cat.discard(pages[0], int(cat.gen[pages[0]]))
    cat.discard(pages[1], int(cat.gen[pages[1]]))
    assert cat.stats()["dropped_pages"] == 2
    cat.drop_client(2)
    cat.reap(5.0)
    assert cat.stats()["dropped_pages"] == 0 and cat.stats()["free_pages"] == 4


def test_the_cursor_visits_every_committed_page_once_per_cycle():
    cat = Catalog(CatalogConfig(num_pages=64, page_size=1024))
    committed = set(put(cat, hashes(40)))
    for p in list(committed)[::3]:
        cat.evict(NS.tenant, NS, [cat.key_of[p]])
        committed.discard(p)
    seen: list[int] = []
    while cat.counters["scrub_cycles"] == 0:
        seen += [p for p, _ in cat.scrub_cycle(5)]
    first = seen[: len(committed)]
    assert sorted(first) == sorted(committed) and len(set(first)) == len(first)
    assert all(cat.state[p] == PageState.COMMITTED for p in seen)
    assert cat.scrub_cycle(0) == []


def test_the_cursor_passes_over_a_leased_page_and_visits_it_after_its_release():
    """A page under a lease is its loaders' to judge (they check it and report it): the pass
    at rest skips it, so a loader meeting a corrupt page is never raced by the cursor; once
    released, the next cycle visits it."""
    cat = Catalog(CatalogConfig(num_pages=16, page_size=1024))
    hs = hashes(6)
    pages = put(cat, hs)
    lease = cat.acquire(3, NS.tenant, NS, hs[:2], 0.0)
    assert lease.lease_id
    leased = set(pages[:2])

    def one_cycle():
        seen, cycles = [], cat.counters["scrub_cycles"]
        while cat.counters["scrub_cycles"] == cycles:
            seen += [p for p, _ in cat.scrub_cycle(4)]
        return seen

    one_cycle()  # the cursor wherever it was: start from a cycle's beginning
    assert not leased & set(one_cycle()) and set(pages[2:]) <= set(one_cycle())
    cat.release(lease.lease_id)
    assert leased <= set(one_cycle())


@pytest.mark.parametrize("catalog", [Catalog, HoardingCatalog], ids=["bounded", "control-hoarding"])
def test_the_fresh_queue_never_holds_more_entries_than_pages(catalog):
    """Far more trusted commits than pages, with evictions: at most one entry per page, and
    an evicted page's entry goes with it. The control (a queue of every commit) is caught."""
    cat = catalog(CatalogConfig(num_pages=8, page_size=1024))
    peak = 0
    for i in range(1000):
        hs = hashes(1, 16 * i)
        put(cat, hs, scrub_first=True)
        if i % 4 == 0:
            cat.evict(NS.tenant, NS, hs)
        peak = max(peak, cat.scrub_queued())
    if catalog is Catalog:
        assert peak <= 8
        fresh = cat.scrub_fresh(100)
        assert all(cat.committed_as(p, g) is not None for p, g in fresh) and len(fresh) == cat.scrub_queued()
        for p, g in fresh:
            cat.scrubbed(p, g)
        assert cat.scrub_queued() == 0
    else:
        assert peak > 500, "negative control not caught"


def test_a_new_commit_of_a_page_replaces_its_fresh_entry():
    cat = Catalog(CatalogConfig(num_pages=1, page_size=1024))
    (p,) = put(cat, hashes(1), scrub_first=True)
    g0 = int(cat.gen[p])
    (p2,) = put(cat, hashes(1, 16), scrub_first=True)  # evicts the first: same page, next generation
    assert p2 == p and cat.scrub_fresh(10) == [(p, g0 + 1)]
    cat.scrubbed(p, g0)  # the outcome of the old commit's scrub leaves the new entry alone
    assert cat.scrub_queued() == 1
    assert np.count_nonzero(cat.state == PageState.COMMITTED) == 1
