"""The catalog: two-phase publish, leases, eviction, ghosts, admission, limits."""


import pytest

from kvpool.pool.catalog import AdmissionPolicy, Catalog, CatalogConfig, LoadLimits, PageState
from kvpool.pool.records import EvictOutcome, SlotStatus
from kvpool.errors import InvalidRequest, LeaseLost, MissCause
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
D = b"d" * 16


def hashes(n, start=0):
    return block_hashes(list(range(start, start + 16 * n)), 16)


def make(num_pages=8, **kw):
    return Catalog(CatalogConfig(num_pages=num_pages, page_size=1024, **kw))


def put(cat, hs, client=1, ns=NS, now=0.0, **kw):
    res = cat.reserve(client, ns.tenant, ns, hs, [100] * len(hs), now, **kw)
    if res.reservation_id:
        n = sum(s.status == SlotStatus.RESERVED for s in res.slots)
        cat.commit(res.reservation_id, [D] * n)
    return res


def test_reserved_pages_are_invisible_until_commit():
    cat = make()
    hs = hashes(3)
    res = cat.reserve(1, "default", NS, hs, [100] * 3, 0.0)
    assert [s.status for s in res.slots] == [SlotStatus.RESERVED] * 3
    assert cat.lookup("default", NS, hs).miss.cause == MissCause.NEVER_PUBLISHED
    # a second publisher of the same blocks is told they are in flight
    again = cat.reserve(2, "default", NS, hs, [100] * 3, 0.0)
    assert [s.status for s in again.slots] == [SlotStatus.PENDING] * 3
    cat.commit(res.reservation_id, [D] * 3)
    found = cat.lookup("default", NS, hs)
    assert found.miss is None and len(found.hits) == 3
    assert [h.digest for h in found.hits] == [D] * 3


def test_abort_and_rejected_digests_free_pages_and_bump_generations():
    cat = make(num_pages=4)
    hs = hashes(3)
    res = cat.reserve(1, "default", NS, hs, [100] * 3, 0.0)
    pages = [s.page for s in res.slots]
    gens = [int(cat.gen[p]) for p in pages]
    assert cat.abort(res.reservation_id) == 3
    assert [int(cat.gen[p]) for p in pages] == [g + 1 for g in gens]
    assert cat.stats()["free_pages"] == 4
    res = cat.reserve(1, "default", NS, hs, [100] * 3, 0.0)
    out = cat.commit(res.reservation_id, [D, None, D])
    assert out.committed == 2 and out.rejected == (1,)
    found = cat.lookup("default", NS, hs)
    assert len(found.hits) == 1 and found.miss.index == 1
    with pytest.raises(InvalidRequest):
        cat.commit(res.reservation_id, [D])


def test_abandoned_publish_is_reaped_and_a_dropped_client_releases_everything():
    cat = make(num_pages=4, reservation_ttl_s=5.0, lease_ttl_s=5.0)
    cat.reserve(1, "default", NS, hashes(2), [100] * 2, now=0.0)
    assert cat.reap(now=4.9) == (0, 0)
    assert cat.reap(now=5.0) == (1, 0)
    assert cat.stats()["free_pages"] == 4
    put(cat, hashes(2))
    lease = cat.acquire(7, "default", NS, hashes(2), now=0.0)
    cat.reserve(7, "default", NS, hashes(1, start=999), [100], now=0.0)
    assert cat.drop_client(7) == (1, 1)
    assert cat.stats()["leased_pages"] == 0
    with pytest.raises(LeaseLost):
        cat.release(lease.lease_id)


def test_leased_pages_are_never_evicted():
    cat = make(num_pages=2)
    a, b = hashes(1), hashes(1, start=100)
    put(cat, a)
    put(cat, b)
    lease = cat.acquire(1, "default", NS, a, 0.0)
    assert cat.evict("default", NS, a) == [EvictOutcome.LEASED]
    # a new publish must evict b (unleased), not a
    put(cat, hashes(1, start=200))
    assert cat.lookup("default", NS, a).miss is None
    assert cat.lookup("default", NS, b).miss.cause == MissCause.EVICTED
    # with everything leased or reserved, a publish gets NO_CAPACITY, nothing is evicted
    lease2 = cat.acquire(1, "default", NS, hashes(1, start=200), 0.0)
    res = cat.reserve(1, "default", NS, hashes(1, start=300), [100], 0.0)
    assert res.slots[0].status == SlotStatus.NO_CAPACITY
    assert cat.release(lease.lease_id).stale == ()
    assert cat.release(lease2.lease_id).stale == ()


def test_lru_order_and_touch_on_acquire():
    cat = make(num_pages=3)
    blocks = [hashes(1, start=100 * i) for i in range(3)]
    for b in blocks:
        put(cat, b)
    cat.release(cat.acquire(1, "default", NS, blocks[0], 0.0).lease_id)  # 0 is now most recent
    put(cat, hashes(1, start=900))
    assert cat.lookup("default", NS, blocks[1]).miss.cause == MissCause.EVICTED
    assert cat.lookup("default", NS, blocks[0]).miss is None
    assert cat.lookup("default", NS, blocks[2]).miss is None


def test_capacity_squeeze_evicts_lru_down_to_the_limit():
    cat = make(num_pages=4)
    blocks = [hashes(1, start=100 * i) for i in range(4)]
    for b in blocks:
        put(cat, b)
    assert cat.set_capacity(2) == 2
    assert [cat.lookup("default", NS, b).miss is None for b in blocks] == [False, False, True, True]
    res = put(cat, hashes(1, start=999))
    assert res.slots[0].status == SlotStatus.RESERVED
    assert cat.stats()["committed_pages"] == 2
    with pytest.raises(InvalidRequest):
        cat.set_capacity(5)


def test_ghosts_are_bounded():
    cat = make(num_pages=1, ghost_capacity=1)
    a, b, c = (hashes(1, start=100 * i) for i in range(3))
    put(cat, a)
    put(cat, b)  # evicts a
    put(cat, c)  # evicts b; a's ghost falls out
    assert cat.lookup("default", NS, a).miss.cause == MissCause.NEVER_PUBLISHED
    assert cat.lookup("default", NS, b).miss.cause == MissCause.EVICTED


def test_incompatible_names_the_field_and_namespaces_coexist():
    cat = make()
    hs = hashes(2)
    put(cat, hs)
    other = NS.replace(model_revision="r2")
    miss = cat.lookup("default", other, hs).miss
    assert miss.cause == MissCause.INCOMPATIBLE and miss.fields == ("model_revision",)
    put(cat, hs, ns=other)
    assert cat.lookup("default", other, hs).miss is None
    assert cat.lookup("default", NS, hs).miss is None
    cat.evict("default", other, hs)
    assert cat.lookup("default", other, hs).miss.cause == MissCause.EVICTED
    assert cat.lookup("default", NS, hs).miss is None


def test_a_tenant_never_sees_another_tenants_blocks():
    cat = make()
    hs = hashes(2)
    put(cat, hs)
    t2 = NS.replace(tenant="t2")
    assert cat.lookup("t2", t2, hs).miss.cause == MissCause.NEVER_PUBLISHED
    cat.evict("default", NS, hs)
    assert cat.lookup("t2", t2, hs).miss.cause == MissCause.NEVER_PUBLISHED
    with pytest.raises(InvalidRequest):
        cat.reserve(1, "t2", NS, hs, [100, 100], 0.0)


def test_admission_boundary_min_blocks_and_second_hit():
    cat = make(admission=AdmissionPolicy(min_blocks=2))
    hs = hashes(4)
    res = cat.reserve(1, "default", NS, hs, [100] * 4, 0.0, boundary=3)
    assert [s.status for s in res.slots] == [SlotStatus.RESERVED] * 3 + [SlotStatus.NOT_ADMITTED]
    cat.abort(res.reservation_id)
    res = cat.reserve(1, "default", NS, hs, [100] * 4, 0.0, boundary=1)
    assert res.reservation_id == 0 and {s.status for s in res.slots} == {SlotStatus.NOT_ADMITTED}
    cat2 = make(admission=AdmissionPolicy(second_hit=True))
    first = cat2.reserve(1, "default", NS, hs[:2], [100] * 2, 0.0)
    assert {s.status for s in first.slots} == {SlotStatus.NOT_ADMITTED}
    second = cat2.reserve(2, "default", NS, hs[:2], [100] * 2, 0.0)
    assert {s.status for s in second.slots} == {SlotStatus.RESERVED}


def test_load_limits_throttle_per_client_and_in_total():
    cat = make(limits=LoadLimits(per_client=1, total=2))
    hs = hashes(2)
    put(cat, hs)
    l1 = cat.acquire(1, "default", NS, hs, 0.0)
    assert l1.lease_id
    t = cat.acquire(1, "default", NS, hs, 0.0)
    assert t.lease_id == 0 and t.miss.cause == MissCause.THROTTLED
    l2 = cat.acquire(2, "default", NS, hs, 0.0)
    assert l2.lease_id
    t = cat.acquire(3, "default", NS, hs, 0.0)
    assert t.miss.cause == MissCause.THROTTLED
    cat.release(l1.lease_id)
    assert cat.acquire(3, "default", NS, hs, 0.0).lease_id
    assert cat.stats()["miss_throttled"] == 2
    # nothing to load is not throttling: the real cause is reported
    assert cat.acquire(9, "default", NS, hashes(1, start=5000), 0.0).miss.cause == MissCause.NEVER_PUBLISHED


def test_release_detects_a_generation_that_moved():
    cat = make()
    hs = hashes(1)
    put(cat, hs)
    lease = cat.acquire(1, "default", NS, hs, 0.0)
    page = lease.hits[0].page
    cat.gen[page] += 1  # what a buggy free under a lease would do
    assert cat.release(lease.lease_id).stale == (page,)


def test_reserve_validates_sizes():
    cat = make()
    with pytest.raises(InvalidRequest):
        cat.reserve(1, "default", NS, hashes(1), [2048], 0.0)
    with pytest.raises(InvalidRequest):
        cat.reserve(1, "default", NS, hashes(2), [100], 0.0)
    assert cat.state.max() == PageState.FREE


def test_lookup_names_the_open_reservation_of_its_first_missing_block():
    cat = make()
    hs = hashes(3)
    put(cat, hs[:1])
    res = cat.reserve(1, "default", NS, hs[1:], [100] * 2, 0.0)
    found = cat.lookup("default", NS, hs)
    assert len(found.hits) == 1 and found.miss.index == 1
    assert found.miss.cause == MissCause.NEVER_PUBLISHED  # the cause itself is unchanged
    assert found.pending == res.reservation_id and cat.reservation_open(res.reservation_id)
    cat.commit(res.reservation_id, [D] * 2)
    found = cat.lookup("default", NS, hs)
    assert found.miss is None and found.pending == 0 and not cat.reservation_open(res.reservation_id)


def test_lookup_reports_no_pending_once_the_publish_is_aborted_reaped_or_dropped():
    cat = make(reservation_ttl_s=5.0)
    hs = hashes(2)
    for close in ("abort", "reap", "drop", "reject"):
        res = cat.reserve(7, "default", NS, hs, [100] * 2, 0.0)
        assert cat.lookup("default", NS, hs).pending == res.reservation_id
        if close == "abort":
            cat.abort(res.reservation_id)
        elif close == "reap":
            cat.reap(now=5.0)
        elif close == "drop":
            cat.drop_client(7)
        else:
            cat.commit(res.reservation_id, [None, None])  # the daemon's verify failed
        found = cat.lookup("default", NS, hs)
        assert (found.miss.index, found.miss.cause, found.pending) == (0, MissCause.NEVER_PUBLISHED, 0), close
        assert not cat.reservation_open(res.reservation_id)


def test_a_later_block_pending_is_not_the_first_miss():
    cat = make()
    hs = hashes(3)
    cat.reserve(1, "default", NS, hs[2:], [100], 0.0)  # block 2 in flight, block 1 never published
    found = cat.lookup("default", NS, hs)
    assert found.miss.index == 0 and found.pending == 0


def test_pending_is_only_seen_by_the_same_tenant_and_namespace():
    cat = make()
    hs = hashes(2)
    other_tenant = NS.replace(tenant="t2")
    other_ns = NS.replace(model_revision="r2")
    cat.reserve(1, "t2", other_tenant, hs, [100] * 2, 0.0)
    cat.reserve(1, "default", other_ns, hs, [100] * 2, 0.0)
    assert cat.lookup("default", NS, hs).pending == 0
    mine = cat.reserve(2, "default", NS, hs, [100] * 2, 0.0)
    assert cat.lookup("default", NS, hs).pending == mine.reservation_id
    assert cat.lookup("t2", other_tenant, hs).pending not in (0, mine.reservation_id)


def test_an_evicted_block_that_is_pending_again_keeps_its_cause():
    cat = make()
    hs = hashes(1)
    put(cat, hs)
    cat.evict("default", NS, hs)
    res = cat.reserve(1, "default", NS, hs, [100], 0.0)
    found = cat.lookup("default", NS, hs)
    assert found.miss.cause == MissCause.EVICTED and found.pending == res.reservation_id


def test_count_miss_shows_in_stats():
    cat = make()
    cat.count_miss(MissCause.IN_FLIGHT)
    assert cat.stats()["miss_in_flight"] == 1


def test_a_namespace_reset_takes_out_what_was_published_under_it_at_once_and_nothing_else():
    """reset_namespace (an Evict of the one key NAMESPACE_RESET): the namespace's committed
    blocks leave the pool (an unleased page freed at once; a leased one out of the index now,
    freed at its release), its open publish commits nothing, another namespace keeps its
    blocks, and a publish reserved after the reset is visible."""
    from kvpool.pool.keys import NAMESPACE_RESET

    cat = make(num_pages=16)
    other = NS.replace(model_revision="r2")
    a, b, c = hashes(2), hashes(2, start=100), hashes(2, start=200)
    put(cat, a)
    put(cat, b)
    put(cat, a, ns=other)
    lease = cat.acquire(1, "default", NS, b, 0.0)
    open_res = cat.reserve(2, "default", NS, c, [100] * 2, 0.0)
    out = cat.evict("default", NS, [NAMESPACE_RESET])
    assert sorted(out) == sorted([EvictOutcome.EVICTED] * 2 + [EvictOutcome.DROPPED] * 2
                                 + [EvictOutcome.CANCELLED] * 2), out
    for hs in (a, b):
        assert cat.lookup("default", NS, hs).miss.index == 0
        assert cat.acquire(3, "default", NS, hs, 0.0).lease_id == 0
    assert cat.lookup("default", other, a).miss is None  # another namespace is untouched
    assert cat.stats()["dropped_pages"] == 2
    cat.release(lease.lease_id)  # the loader that held b before the reset lets go: freed
    assert cat.stats()["dropped_pages"] == 0
    done = cat.commit(open_res.reservation_id, [D] * 2)  # published from before the reset
    assert done.committed == 0 and done.rejected == (0, 1)
    assert cat.lookup("default", NS, c).miss.index == 0
    put(cat, a)  # after the reset: a new block
    assert cat.lookup("default", NS, a).miss is None
    assert cat.stats()["committed_pages"] == 4 and cat.stats()["namespace_resets"] == 1
    assert cat.evict("default", NS.replace(model_id="unknown"), [NAMESPACE_RESET]) == []
