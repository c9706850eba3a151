"""The GPU tier's bookkeeping without a GPU (kvpool.gpu.tier): page accounting, the LRU order
of demotion, a demotion that races a loader, the quarantine of a crashed producer's pages,
digest kinds, the fall-through order across tiers, and the catalog's parts it relies on
(evict_on_reserve, lru_pages, pin)."""

import random

import pytest

from kvpool.errors import InvalidRequest, MissCause
from kvpool.gpu.tier import DEMOTER, GpuTier, GpuTierConfig, fall_through
from kvpool.pool.catalog import Catalog, CatalogConfig, PageState
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.records import EvictOutcome, SlotStatus

NS = Namespace("m", "r1", "tok", "bfloat16", "cuda", 16, 2, 2, 64)
NS_B = Namespace("m", "r1", "tok", "bfloat16", "cuda", 16, 2, 2, 64, tenant="b")
D = b"s" * 16
PAGE = 4096


def hashes(n, start=0):
    return block_hashes(list(range(start, start + 16 * n)), 16)


def tier(pages=8, **kw):
    return GpuTier(GpuTierConfig(page_size=PAGE, pages={"default": pages, "b": pages}, **kw))


def publish(t, hs, client=1, tenant="default", ns=NS, now=0.0):
    res = t.reserve(client, tenant, ns, hs, [PAGE] * len(hs), now)
    n = sum(s.status == SlotStatus.RESERVED for s in res.slots)
    if res.reservation_id:
        t.commit(client, tenant, res.reservation_id, [D] * n)
    return res


# -- the catalog's parts -----------------------------------------------------------------------

def test_a_catalog_that_does_not_evict_on_reserve_answers_no_capacity_and_keeps_its_pages():
    cat = Catalog(CatalogConfig(num_pages=2, page_size=PAGE, evict_on_reserve=False))
    first = cat.reserve(1, "default", NS, hashes(2), [PAGE] * 2, 0.0)
    cat.commit(first.reservation_id, [D, D])
    more = cat.reserve(1, "default", NS, hashes(1, start=999), [PAGE], 0.0)
    assert [s.status for s in more.slots] == [SlotStatus.NO_CAPACITY]
    assert cat.stats()["evictions"] == 0 and len(cat.lookup("default", NS, hashes(2)).hits) == 2
    # the control: the default catalog evicts the least recently used page for the new block
    evicting = Catalog(CatalogConfig(num_pages=2, page_size=PAGE))
    res = evicting.reserve(1, "default", NS, hashes(2), [PAGE] * 2, 0.0)
    evicting.commit(res.reservation_id, [D, D])
    assert evicting.reserve(1, "default", NS, hashes(1, start=999), [PAGE], 0.0).slots[0].status == SlotStatus.RESERVED
    assert evicting.stats()["evictions"] == 1


def test_lru_pages_lists_least_recent_first_skips_leased_and_pin_is_no_use():
    cat = Catalog(CatalogConfig(num_pages=6, page_size=PAGE))
    hs = hashes(4)
    for h in hs:  # four commits, oldest first
        res = cat.reserve(1, "default", NS, [h], [PAGE], 0.0)
        cat.commit(res.reservation_id, [D])
    order = [p.key for p in cat.lru_pages(10)]
    assert order == hs
    lease = cat.acquire(2, "default", NS, [hs[0]], 0.0)  # a use: hs[0] becomes the most recent, and leased
    assert [p.key for p in cat.lru_pages(10)] == hs[1:]
    cat.release(lease.lease_id)
    assert [p.key for p in cat.lru_pages(10)] == hs[1:] + hs[:1]
    hits_before = cat.stats()["hits"]
    victim = cat.lru_pages(1)[0]
    pinned = cat.pin(DEMOTER, victim.page, victim.generation, 0.0)
    assert pinned and cat.stats()["hits"] == hits_before  # not a hit
    assert [p.key for p in cat.lru_pages(10)] == hs[2:] + hs[:1]  # leased: skipped, and not moved
    assert cat.evict("default", NS, [victim.key]) == [EvictOutcome.LEASED]
    cat.release(pinned)
    assert [p.key for p in cat.lru_pages(10)] == hs[1:] + hs[:1]  # back in its place, the least recent
    assert cat.pin(DEMOTER, victim.page, victim.generation + 1, 0.0) == 0  # another generation: no pin
    assert victim.tenant == "default" and victim.ns == NS and victim.digest == D and victim.kind == DigestKind.XXH3


# -- the tier ----------------------------------------------------------------------------------

def test_the_tier_keeps_two_phase_publish_tenants_and_generations():
    t = tier()
    hs = hashes(3)
    res = t.reserve(1, "default", NS, hs, [PAGE] * 3, 0.0)
    assert t.lookup("default", NS, hs).miss.cause == MissCause.NEVER_PUBLISHED  # reserved: invisible
    t.commit(1, "default", res.reservation_id, [D] * 3)
    assert len(t.lookup("default", NS, hs).hits) == 3
    assert t.lookup("b", NS_B, hs).miss.cause == MissCause.NEVER_PUBLISHED  # another tenant sees nothing
    got = t.acquire(2, "default", NS, hs, 0.0)
    assert [t.page_offset(p) for p in got.hits.pages] == [p * PAGE for p in got.hits.pages]
    assert t.release(2, "default", got.lease_id).stale == ()
    with pytest.raises(InvalidRequest):
        t.lookup("nobody", NS, hs)


def test_the_tier_commits_only_gpu_digests():
    t = tier()
    res = t.reserve(1, "default", NS, hashes(1), [PAGE], 0.0)
    with pytest.raises(InvalidRequest, match="digested on the GPU"):
        t.commit(1, "default", res.reservation_id, [D], kind=DigestKind.XXH3)
    t.commit(1, "default", res.reservation_id, [D])
    assert t.catalogs["default"].scrub_queued() == 1  # taken on trust, queued for the scrub on the GPU


def test_a_full_tier_refuses_instead_of_dropping_and_demotion_is_lru_ordered():
    t = tier(pages=8, low_free=0.25, high_free=0.5)
    blocks = [hashes(1, start=100 * i) for i in range(8)]
    for b in blocks:
        publish(t, b)
    assert t.stats("default")["gpu_tier_free_pages"] == 0
    extra = hashes(1, start=9999)
    res = t.reserve(1, "default", NS, extra, [PAGE], 0.0)
    assert res.slots[0].status == SlotStatus.NO_CAPACITY and t.stats("default")["gpu_tier_evictions"] == 0
    assert t.stats()["gpu_tier_no_capacity_blocks"] == 1
    # a use of blocks[0] and blocks[1] makes them the most recent
    for b in blocks[:2]:
        t.release(2, "default", t.acquire(2, "default", NS, b, 0.0).lease_id)
    due = t.demotion_due("default")
    assert due == 4  # 0 free of 8 < 25 %: demote until 50 % free
    demotions = t.begin_demotion("default", due, 0.0)
    assert [d.page.key for d in demotions] == [b[0] for b in blocks[2:6]]  # least recent first
    assert t.demotion_due("default") == 0  # the pinned ones count as freed
    assert t.begin_demotion("default", 4, 0.0)[0].page.key == blocks[6][0]  # never a pinned page twice
    for d in demotions:
        assert t.finish_demotion(d, host_committed=True) == EvictOutcome.EVICTED
        # gone from the GPU tier: a ghost, so the miss is `evicted` and the lookup falls through
        assert t.lookup("default", NS, [d.page.key]).miss.cause == MissCause.EVICTED
    assert t.stats()["gpu_tier_demoted_pages"] == 4
    assert t.stats()["gpu_tier_hits"] == 2  # the demoter's pins are not hits


def test_a_demotion_raced_by_a_loader_keeps_the_page_and_a_failed_copy_drops_nothing():
    t = tier(pages=4, low_free=0.5, high_free=1.0)
    blocks = [hashes(1, start=100 * i) for i in range(4)]
    for b in blocks:
        publish(t, b)
    d0, d1, d2, _ = t.begin_demotion("default", 4, 0.0)
    loader = t.acquire(7, "default", NS, [d0.page.key], 0.0)  # a loader leases it during the copy
    assert loader.lease_id
    assert t.finish_demotion(d0, host_committed=True) == EvictOutcome.LEASED
    assert len(t.lookup("default", NS, [d0.page.key]).hits) == 1  # stays: hot again
    assert t.finish_demotion(d1, host_committed=False) is None  # the host pool did not take it
    assert len(t.lookup("default", NS, [d1.page.key]).hits) == 1  # never in neither tier
    with pytest.raises(InvalidRequest):
        t.finish_demotion(d1, host_committed=True)  # finished already
    st = t.stats()
    assert (st["gpu_tier_demotion_kept"], st["gpu_tier_demotion_failed"], st["gpu_tier_demoted_pages"]) == (1, 1, 0)
    assert t.finish_demotion(d2, host_committed=True) == EvictOutcome.EVICTED


def test_a_crashed_producers_pages_stay_reserved_until_its_process_exits():
    t = tier(pages=4)
    res = t.reserve(5, "default", NS, hashes(2), [PAGE] * 2, 0.0)
    pages = [s.page for s in res.slots]
    gens = [int(t.catalogs["default"].gen[p]) for p in pages]
    held = t.acquire(6, "default", NS, hashes(1, start=500), 0.0)
    assert not held.lease_id
    publish(t, hashes(1, start=500), client=6)
    lease = t.acquire(5, "default", NS, hashes(1, start=500), 0.0)
    assert t.disconnect(5) == 1  # its lease: released at once
    cat = t.catalogs["default"]
    assert [int(cat.state[p]) for p in pages] == [PageState.RESERVED] * 2  # quarantined, not reusable
    assert 5 in t.quarantined()
    assert [int(cat.gen[p]) for p in pages] == gens
    with pytest.raises(InvalidRequest):
        t.reserve(5, "default", NS, hashes(1, start=900), [PAGE], 0.0)
    # a reserve of someone else cannot get those pages: one page free of four
    other = t.reserve(8, "default", NS, hashes(3, start=700), [PAGE] * 3, 0.0)
    assert [s.status for s in other.slots].count(SlotStatus.RESERVED) == 1
    assert t.lookup("default", NS, hashes(2)).miss.cause == MissCause.NEVER_PUBLISHED  # never visible
    assert t.exited(5) == 1
    assert [int(cat.state[p]) for p in pages] == [PageState.FREE] * 2
    assert [int(cat.gen[p]) for p in pages] == [g + 1 for g in gens]
    assert lease.lease_id and t.quarantined() == frozenset()
    # the control: a client that disconnects with nothing reserved is not quarantined
    assert t.disconnect(8) == 0 and 8 in t.quarantined()  # 8 holds a reservation
    assert t.disconnect(9) == 0 and 9 not in t.quarantined()


def test_stats_name_the_tier_and_sum_the_tenants():
    t = tier(pages=4)
    publish(t, hashes(2))
    publish(t, hashes(1), tenant="b", ns=NS_B)
    st = t.stats()
    assert st["gpu_tier_committed_pages"] == 3 and st["gpu_tier_num_pages"] == 8
    assert all(k.startswith("gpu_tier_") for k in st)
    t.acquire(3, "default", NS, hashes(1, start=4000), 0.0)
    assert t.stats()["gpu_tier_miss_never_published"] == 1


# -- fall-through --------------------------------------------------------------------------------

def _tier_holding(held: set[bytes], cause: MissCause = MissCause.NEVER_PUBLISHED):
    def run(hs):
        n = 0
        for h in hs:
            if h not in held:
                return n, cause
            n += 1
        return n, None
    return run


def test_fall_through_asks_the_gpu_tier_first_where_each_run_stops():
    hs = hashes(8)
    gpu = _tier_holding({hs[0], hs[1], hs[4], hs[5]}, MissCause.EVICTED)
    host = _tier_holding({hs[2], hs[3], hs[4], hs[6]})
    net = _tier_holding({hs[7]})
    out = fall_through(hs, [("gpu", gpu), ("host", host), ("net", net)])
    # the host pool serves the whole run it holds from block 2 (4 included); at block 5 the GPU
    # tier is asked first again
    assert out.segments == (("gpu", 0, 2), ("host", 2, 5), ("gpu", 5, 6), ("host", 6, 7), ("net", 7, 8))
    assert out.served == 8 and out.miss is None


def test_fall_through_stops_at_the_first_block_no_tier_holds_with_the_informative_cause():
    hs = hashes(4)
    gpu = _tier_holding({hs[0]}, MissCause.EVICTED)  # demoted from the GPU ...
    host = _tier_holding(set())  # ... and evicted from the host pool since (never_published to it here)
    out = fall_through(hs, [("gpu", gpu), ("host", host)])
    assert out.segments == (("gpu", 0, 1),) and out.served == 1 and out.miss == MissCause.EVICTED
    out = fall_through(hs, [("gpu", _tier_holding(set())), ("host", _tier_holding(set(), MissCause.INCOMPATIBLE))])
    assert out.served == 0 and out.miss == MissCause.INCOMPATIBLE
    out = fall_through(hs, [("gpu", _tier_holding(set())), ("host", _tier_holding(set()))])
    assert out.miss == MissCause.NEVER_PUBLISHED
    with pytest.raises(InvalidRequest):
        fall_through(hs, [("liar", lambda h: (len(h) + 1, None))])


def test_fall_through_serves_what_a_seeded_layout_of_tiers_holds(test_seed):
    rng = random.Random(f"{test_seed}:fall-through")
    for _ in range(200):
        n = rng.randint(1, 24)
        hs = hashes(n, start=rng.randint(0, 10**6))
        holders = [{h for h in hs if rng.random() < 0.4} for _ in range(3)]
        out = fall_through(hs, [(name, _tier_holding(h)) for name, h in zip("abc", holders)])
        # the oracle: the longest prefix every block of which some tier holds, each block served
        # by the first tier in order that holds the run from where the previous one stopped
        want = next((i for i, h in enumerate(hs) if not any(h in s for s in holders)), n)
        assert out.served == want and (out.miss is None) == (want == n)
        covered = [i for _, a, b in out.segments for i in range(a, b)]
        assert covered == list(range(want))
        for name, a, b in out.segments:
            assert all(hs[i] in holders["abc".index(name)] for i in range(a, b))
