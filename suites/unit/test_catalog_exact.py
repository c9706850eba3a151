"""The catalog's answers to the letter: every counter and stat after a known history, the
pin (one page by id), the LRU listing, the scrub's cursor across its wrap, the segment's
index kept in step, the bookkeeping a grant leaves behind, and each refusal naming what it
refused."""

import numpy as np
import pytest

from kvpool.errors import InvalidRequest, LeaseLost, MissCause
from kvpool.pool.catalog import (AdmissionPolicy, Catalog, CatalogConfig, LoadLimits, LruPage,
                                 PageState)
from kvpool.pool.digest import DigestKind
from kvpool.pool.index import ENTRY, SLOTS, ShmIndex, buckets_for, ns_fingerprint
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.records import EvictOutcome, Hits, Miss, RenewRefusal, Renewal, Slot, SlotStatus

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
NS2 = Namespace("m", "r2", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
NS3 = Namespace("m", "r3", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
NS4 = Namespace("m", "r4", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
D = b"d" * 16


def hashes(n, start=0):
    return block_hashes(list(range(start, start + 16 * n)), 16)


def make(num_pages=8, **kw):
    return Catalog(CatalogConfig(num_pages=num_pages, page_size=1024, **kw))


def put(cat, hs, client=1, ns=NS, now=0.0, lengths=None, digests=None, **kw):
    res = cat.reserve(client, ns.tenant, ns, hs, lengths or [100] * len(hs), now)
    n = sum(s.status == SlotStatus.RESERVED for s in res.slots)
    if res.reservation_id:
        cat.commit(res.reservation_id, digests or [D] * n, **kw)
    return res


def page_of(cat, hs, ns=NS):
    found = cat.lookup(ns.tenant, ns, hs)
    assert found.miss is None
    return found.hits.pages[0], found.hits.generations[0]


# -- counters and stats ------------------------------------------------------------------
def test_a_fresh_catalog_counts_nothing():
    stats = make(num_pages=4).stats()
    counted = {k: v for k, v in stats.items()
               if k not in ("num_pages", "page_size", "capacity_pages", "free_pages", "effective_capacity_pages")}
    assert set(counted.values()) == {0}, counted
    assert (stats["num_pages"], stats["page_size"], stats["capacity_pages"], stats["free_pages"],
            stats["effective_capacity_pages"]) == (4, 1024, 4, 4, 4)


def test_every_counter_and_stat_after_a_known_history():
    cat = make(num_pages=8, reservation_ttl_s=5.0, lease_ttl_s=5.0)
    a, b, c = hashes(2), hashes(1, start=100), hashes(1, start=200)
    put(cat, a)  # 2 commits
    put(cat, b, lengths=[300])  # 1 commit
    for _ in range(2):  # two misses with no hit, then two hits stopping at a missing block
        assert cat.acquire(9, "default", NS, c, 0.0).hits == Hits()
    held = [cat.acquire(2, "default", NS, a + c, 0.0) for _ in range(2)]
    assert all(h.miss == Miss(2, MissCause.NEVER_PUBLISHED) for h in held)
    cat.acquire(3, "default", NS, b, 0.0)  # a third hit, of one block
    cat.count_miss(MissCause.TIMEOUT)
    cat.count_miss(MissCause.TIMEOUT)
    bad = cat.reserve(1, "default", NS, hashes(2, start=300), [100, 100], 0.0)
    cat.commit(bad.reservation_id, [None, b"short"])  # both rejected
    dropped = cat.reserve(1, "default", NS, hashes(3, start=400), [100] * 3, 0.0)
    assert cat.abort(dropped.reservation_id) == 3
    open_res = cat.reserve(4, "default", NS, hashes(1, start=500), [100], 0.0)  # stays open
    assert open_res.reservation_id
    stats = cat.stats()
    # pages: a (2, leased twice each), b (1, leased once), one reserved, four free
    assert stats == {
        "num_pages": 8, "page_size": 1024, "capacity_pages": 8, "free_pages": 4,
        "committed_pages": 3, "reserved_pages": 1, "leased_pages": 3, "leased_bytes": 100 + 100 + 300,
        "effective_capacity_pages": 8 - 1 - 3, "open_reservations": 1, "open_leases": 3, "ghosts": 0,
        "dropped_pages": 0, "entries": 3,
        "hits": 3, "hit_blocks": 5, "evictions": 0, "commits": 3, "aborted_pages": 3, "rejected_pages": 2,
        "expired_reservations": 0, "expired_leases": 0, "discarded_corrupt": 0, "scrub_cycles": 0,
        "namespace_resets": 0, "reset_pages": 0, "renewals": 0, "renewals_refused": 0,
        **{f"miss_{m.value}": 0 for m in MissCause},
        "miss_never_published": 4, "miss_timeout": 2,
    }
    # the leases end at their deadline, the open reservation at its own: both counted once each
    assert cat.reap(5.0) == (1, 3)
    cat.reserve(4, "default", NS, hashes(1, start=600), [100], 5.0)
    assert cat.reap(10.0) == (1, 0)
    # two evictions, one unleased page squeezed out afterwards
    assert cat.evict("default", NS, a) == [EvictOutcome.EVICTED] * 2
    assert cat.set_capacity(0) == 1
    stats = cat.stats()
    assert (stats["expired_reservations"], stats["expired_leases"], stats["evictions"], stats["ghosts"]) == (2, 3, 3, 3)
    assert (stats["committed_pages"], stats["leased_bytes"], stats["effective_capacity_pages"]) == (0, 0, 0)


def test_effective_capacity_is_never_negative():
    cat = make(num_pages=2)
    put(cat, hashes(2))
    cat.acquire(1, "default", NS, hashes(2), 0.0)
    cat.set_capacity(1)  # both pages leased: nothing evicted, capacity below what is held
    assert cat.stats()["effective_capacity_pages"] == 0


def test_commit_and_reset_count_each_rejected_page():
    cat = make(num_pages=8)
    first = cat.reserve(1, "default", NS, hashes(2), [100] * 2, 0.0)
    second = cat.reserve(1, "default", NS, hashes(1, start=50), [100], 0.0)
    put(cat, hashes(2, start=100))  # two committed pages under NS
    assert cat.reset_namespace("default", NS) == [EvictOutcome.EVICTED] * 2 + [EvictOutcome.CANCELLED] * 3
    assert cat.commit(first.reservation_id, [D, D]).rejected == (0, 1)
    assert cat.commit(second.reservation_id, [D]).rejected == (0,)
    stats = cat.stats()
    # 2 committed pages and 3 cancelled ones; the reset itself counted once
    assert (stats["reset_pages"], stats["namespace_resets"], stats["commits"]) == (5, 1, 2)
    cat.reset_namespace("default", NS)
    assert cat.stats()["namespace_resets"] == 2


def test_a_reset_of_an_unknown_namespace_or_tenant_does_nothing_and_counts_nothing():
    cat = make()
    put(cat, hashes(1))
    assert cat.reset_namespace("default", NS2) == []
    assert cat.reset_namespace("nobody", NS) == []
    assert cat.stats()["namespace_resets"] == 0
    assert cat.lookup("default", NS, hashes(1)).miss is None


def test_a_reset_cancels_only_the_publishes_of_its_own_namespace():
    cat = make()
    other_ns = cat.reserve(1, "default", NS2, hashes(1), [100], 0.0)
    t2 = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64, tenant="t2")
    other_tenant = cat.reserve(1, "t2", t2, hashes(1), [100], 0.0)
    mine = cat.reserve(1, "default", NS, hashes(1), [100], 0.0)
    assert cat.reset_namespace("default", NS) == [EvictOutcome.CANCELLED]
    assert cat.reset_namespace("default", NS) == []  # cancelled once, not again
    assert cat.commit(other_ns.reservation_id, [D]).committed == 1
    assert cat.commit(other_tenant.reservation_id, [D]).committed == 1
    assert cat.commit(mine.reservation_id, [D]).committed == 0


def test_discards_and_renewals_are_counted_each_time():
    cat = make(lease_ttl_s=5.0)
    put(cat, hashes(2))
    for page, gen in zip(*(lambda h: (h.pages, h.generations))(cat.lookup("default", NS, hashes(2)).hits)):
        assert cat.discard(page, gen) is True
    lease = cat.acquire(1, "default", NS, hashes(1, start=0), 0.0)
    assert lease.lease_id == 0  # both gone
    put(cat, hashes(1, start=100))
    lid = cat.acquire(1, "default", NS, hashes(1, start=100), 0.0).lease_id
    cat.renew(1, [], 1.0, [lid])
    cat.renew(1, [], 2.0, [lid])
    cat.renew(2, [], 2.0, [lid])
    cat.renew(2, [], 2.0, [lid])
    stats = cat.stats()
    assert (stats["discarded_corrupt"], stats["renewals"], stats["renewals_refused"]) == (2, 2, 2)


def test_a_tenant_sees_its_own_pages_by_state_and_an_unknown_tenant_none():
    cat = make(num_pages=8)
    t2 = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64, tenant="t2")
    t3 = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64, tenant="t3")
    put(cat, hashes(3))  # default: 3 committed, 1 of them leased twice, 1 leased once
    cat.acquire(1, "default", NS, hashes(1), 0.0)
    cat.acquire(1, "default", NS, hashes(2), 0.0)
    cat.reserve(1, "default", NS, hashes(1, start=900), [100], 0.0)  # and 1 reserved
    put(cat, hashes(1), ns=t2)  # t2: 1 committed
    cat.reserve(1, "t3", t3, hashes(2), [100] * 2, 0.0)  # t3 (tenant id 2): 2 reserved
    assert cat.tenant_stats("default") == {"tenant_committed_pages": 3, "tenant_reserved_pages": 1,
                                           "tenant_leased_pages": 2}
    assert cat.tenant_stats("t2") == {"tenant_committed_pages": 1, "tenant_reserved_pages": 0,
                                      "tenant_leased_pages": 0}
    assert cat.tenant_stats("t3") == {"tenant_committed_pages": 0, "tenant_reserved_pages": 2,
                                      "tenant_leased_pages": 0}
    assert cat.tenant_stats("nobody") == {"tenant_committed_pages": 0, "tenant_reserved_pages": 0,
                                          "tenant_leased_pages": 0}


# -- construction ------------------------------------------------------------------------
def test_construction_refuses_no_pages_and_a_generations_array_of_another_size():
    with pytest.raises(ValueError, match="num_pages must be positive, got 0"):
        make(num_pages=0)
    with pytest.raises(ValueError, match=r"generations has shape \(3,\), expected \(4,\)"):
        Catalog(CatalogConfig(num_pages=4, page_size=1024), generations=np.zeros(3, dtype=np.uint64))


def test_the_generations_array_given_is_the_one_bumped():
    gens = np.zeros(4, dtype=np.uint64)
    cat = Catalog(CatalogConfig(num_pages=4, page_size=1024), generations=gens)
    res = cat.reserve(1, "default", NS, hashes(1), [100], 0.0)
    cat.abort(res.reservation_id)
    assert int(gens[res.slots[0].page]) == 1


def test_the_per_page_arrays_have_fixed_width_types():
    # the generations are the arena's (clients read them as uint64); the others bound the
    # daemon's memory per page and are what hits and stats are read from
    cat = make(num_pages=4)
    assert {name: getattr(cat, name).dtype for name in ("gen", "state", "length", "kind", "ns_of", "tenant_of",
                                                        "leases_on")} == {
        "gen": np.uint64, "state": np.uint8, "length": np.uint32, "kind": np.uint8, "ns_of": np.int32,
        "tenant_of": np.int32, "leases_on": np.uint32}


# -- reading -----------------------------------------------------------------------------
def test_a_lookup_under_an_unknown_tenant_finds_nothing_and_interns_nothing():
    cat = make()
    put(cat, hashes(2))
    for tenant in ("stranger", "other"):
        found = cat.lookup(tenant, NS, hashes(2))
        assert found.hits == Hits() and found.miss == Miss(0, MissCause.NEVER_PUBLISHED)
        assert cat.evict(tenant, NS, hashes(1)) == [EvictOutcome.NOT_FOUND]
        assert cat.reset_namespace(tenant, NS) == []
    assert cat._tenants == {"default": 0}
    assert cat.lookup("default", NS, hashes(2)).miss is None


def test_an_incompatible_miss_names_the_block_it_stopped_at():
    cat = make()
    hs = hashes(2)
    put(cat, hs, ns=NS2)
    put(cat, hs[:1])
    found = cat.lookup("default", NS, hs)
    assert found.miss == Miss(1, MissCause.INCOMPATIBLE, ("model_revision",))
    assert len(found.hits) == 1


def test_hits_carry_each_pages_digest_kind_only_when_one_is_not_xxh3():
    cat = make()
    put(cat, hashes(2))
    assert cat.lookup("default", NS, hashes(2)).hits.kinds == b""
    put(cat, hashes(2, start=100), kind=DigestKind.SKETCH)
    assert cat.lookup("default", NS, hashes(2, start=100)).hits.kinds == bytes([DigestKind.SKETCH.code] * 2)


def test_a_block_under_three_namespaces_is_found_under_each_and_after_one_is_evicted():
    cat = make()
    hs = hashes(1)
    for ns in (NS, NS2, NS3):
        put(cat, hs, ns=ns)
    assert all(cat.lookup("default", ns, hs).miss is None for ns in (NS, NS2, NS3))
    assert cat.evict("default", NS2, hs) == [EvictOutcome.EVICTED]
    assert [cat.lookup("default", ns, hs).miss is None for ns in (NS, NS2, NS3)] == [True, False, True]
    assert cat.evict("default", NS, hs) == [EvictOutcome.EVICTED]
    assert [cat.lookup("default", ns, hs).miss is None for ns in (NS, NS2, NS3)] == [False, False, True]


def test_evict_of_a_block_not_there_or_under_an_unknown_namespace_is_not_found():
    cat = make()
    hs = hashes(1)
    for ns in (NS, NS2, NS3):  # namespace ids 0, 1, 2
        put(cat, hs, ns=ns)
    assert cat.evict("default", NS, hashes(1, start=500)) == [EvictOutcome.NOT_FOUND]
    assert cat.evict("default", NS4, hs) == [EvictOutcome.NOT_FOUND]
    assert cat.reset_namespace("default", NS4) == []
    assert all(cat.lookup("default", ns, hs).miss is None for ns in (NS, NS2, NS3))


# -- acquire, pin, release ---------------------------------------------------------------
def test_a_throttled_acquire_returns_no_hits_and_a_throttled_miss_at_block_0():
    cat = make(limits=LoadLimits(per_client=1))
    put(cat, hashes(2))
    assert cat.acquire(1, "default", NS, hashes(2), 0.0).lease_id
    out = cat.acquire(1, "default", NS, hashes(2), 0.0)
    assert (out.lease_id, out.hits, out.miss) == (0, Hits(), Miss(0, MissCause.THROTTLED))


def test_a_clients_lease_count_goes_back_to_zero_after_its_release():
    cat = make(limits=LoadLimits(per_client=2))
    put(cat, hashes(1))
    for _ in range(3):  # each time: two leases allowed, a third throttled, all released
        ids = [cat.acquire(1, "default", NS, hashes(1), 0.0).lease_id for _ in range(3)]
        assert ids[0] and ids[1] and not ids[2]
        for lid in ids[:2]:
            cat.release(lid)


def test_a_client_may_lease_exactly_its_page_cap():
    cat = make(max_leased_pages_per_client=2)
    put(cat, hashes(2))
    assert cat.acquire(1, "default", NS, hashes(2), 0.0).lease_id
    assert cat.acquire(1, "default", NS, hashes(1), 0.0).miss == Miss(0, MissCause.THROTTLED)
    assert cat.acquire(2, "default", NS, hashes(2), 0.0).lease_id


def test_release_of_a_lease_not_held_names_it():
    with pytest.raises(LeaseLost, match="lease 77 is not held"):
        make().release(77)


def test_a_pin_leases_one_committed_page_until_released():
    cat = make(lease_ttl_s=5.0)
    put(cat, hashes(2))
    page, gen = page_of(cat, hashes(1))
    assert cat.pin(5, page, gen + 1, 0.0) == 0  # not that commit
    assert cat.pin(5, 7, 0, 0.0) == 0  # a free page
    lid = cat.pin(5, page, gen, 100.0)
    assert isinstance(lid, int) and lid > 0
    assert int(cat.leases_on[page]) == 1
    assert cat.evict("default", NS, hashes(1)) == [EvictOutcome.LEASED]
    assert cat.tenant_stats("default")["tenant_leased_pages"] == 1
    assert cat.reap(104.9) == (0, 0)  # its deadline: 100 + the lease TTL
    assert cat.release(lid).stale == ()
    assert int(cat.leases_on[page]) == 0
    assert cat.stats()["open_leases"] == 0
    assert cat.evict("default", NS, hashes(1)) == [EvictOutcome.EVICTED]


def test_a_pin_expires_at_its_deadline_and_is_dropped_with_its_client():
    cat = make(lease_ttl_s=5.0)
    put(cat, hashes(2))
    p0, g0 = page_of(cat, hashes(1))
    p1, g1 = page_of(cat, hashes(2)[1:])
    first = cat.pin(5, p0, g0, 100.0)
    cat.pin(6, p1, g1, 100.0)
    assert cat.reap(105.0) == (0, 2)
    assert cat.renew(5, [], 105.0, [first]).leases == (Renewal(first, 0.0, RenewRefusal.EXPIRED),)
    cat.pin(5, p0, g0, 200.0)
    assert cat.drop_client(5) == (0, 1)
    assert cat.stats()["leased_pages"] == 0


def test_a_pin_counts_in_its_clients_leases_while_held():
    cat = make(limits=LoadLimits(per_client=1))
    put(cat, hashes(1))
    page, gen = page_of(cat, hashes(1))
    lid = cat.pin(1, page, gen, 0.0)
    assert cat.acquire(1, "default", NS, hashes(1), 0.0).miss == Miss(0, MissCause.THROTTLED)
    cat.release(lid)
    assert cat.release(cat.acquire(1, "default", NS, hashes(1), 0.0).lease_id).stale == ()

    cat = make(max_leased_pages_per_client=1)
    put(cat, hashes(1))
    page, gen = page_of(cat, hashes(1))
    lid = cat.pin(1, page, gen, 0.0)
    assert cat.acquire(1, "default", NS, hashes(1), 0.0).miss == Miss(0, MissCause.THROTTLED)
    cat.release(lid)
    assert cat.acquire(1, "default", NS, hashes(1), 0.0).lease_id


def test_renewals_stop_at_the_grants_maximum_age_from_when_it_was_granted():
    cat = make(reservation_ttl_s=5.0, lease_ttl_s=5.0, reservation_max_s=10.0, lease_max_s=10.0)
    put(cat, hashes(2))
    res = cat.reserve(1, "default", NS, hashes(1, start=100), [100], 100.0)
    lease = cat.acquire(1, "default", NS, hashes(1), 100.0)
    page, gen = page_of(cat, hashes(2)[1:])
    pinned = cat.pin(1, page, gen, 100.0)
    first = cat.renew(1, [res.reservation_id], 104.0, [lease.lease_id, pinned])
    assert [r.ttl_s for r in (*first.reservations, *first.leases)] == [5.0, 5.0, 5.0]
    out = cat.renew(1, [res.reservation_id], 108.0, [lease.lease_id, pinned])
    # now + TTL would be 113: capped at 100 + 10
    assert [r.ttl_s for r in (*out.reservations, *out.leases)] == [2.0, 2.0, 2.0]


# -- publishing --------------------------------------------------------------------------
def test_reserve_refusals_name_what_is_wrong():
    cat = make()
    with pytest.raises(InvalidRequest, match="2 hashes but 1 lengths"):
        cat.reserve(1, "default", NS, hashes(2), [100], 0.0)
    with pytest.raises(InvalidRequest, match="block of 0 bytes does not fit a page of 1024"):
        cat.reserve(1, "default", NS, hashes(1), [0], 0.0)
    with pytest.raises(InvalidRequest, match="namespace tenant 'default' is not the session's tenant 't2'"):
        cat.reserve(1, "t2", NS, hashes(1), [100], 0.0)
    assert cat.reserve(1, "default", NS, hashes(1), [1], 0.0).slots[0].status == SlotStatus.RESERVED


def test_a_reserved_slot_names_its_page_and_generation():
    cat = make(num_pages=2)
    res = cat.reserve(1, "default", NS, hashes(1), [100], 0.0)
    cat.abort(res.reservation_id)  # page 0's generation is now 1
    res = cat.reserve(1, "default", NS, hashes(2, start=10), [100] * 2, 0.0)
    assert res.slots == (Slot(SlotStatus.RESERVED, 0, 1), Slot(SlotStatus.RESERVED, 1, 0))
    assert cat.reservation_pages(res.reservation_id) == [0, 1]
    with pytest.raises(InvalidRequest, match="reservation 99 is not open"):
        cat.reservation_pages(99)


def test_a_boundary_of_0_admits_nothing():
    cat = make()
    res = cat.reserve(1, "default", NS, hashes(2), [100] * 2, 0.0, boundary=0)
    assert res.reservation_id == 0
    assert [s.status for s in res.slots] == [SlotStatus.NOT_ADMITTED] * 2


def test_an_offer_of_a_committed_block_is_exists_and_a_full_pool_still_answers_every_slot():
    cat = make(num_pages=2)
    put(cat, hashes(2))
    cat.acquire(1, "default", NS, hashes(2), 0.0)  # both pages held
    new, old = hashes(1, start=100), hashes(1)
    res = cat.reserve(1, "default", NS, new + old + new, [100] * 3, 0.0)
    assert res.reservation_id == 0
    assert [s.status for s in res.slots] == [SlotStatus.NO_CAPACITY, SlotStatus.EXISTS, SlotStatus.NO_CAPACITY]


def test_an_offer_of_a_committed_block_makes_it_recently_used():
    cat = make(num_pages=2)
    a, b = hashes(1), hashes(1, start=100)
    put(cat, a)
    put(cat, b)
    assert put(cat, a).slots == (Slot(SlotStatus.EXISTS),)  # a is now the most recent
    put(cat, hashes(1, start=200))
    assert cat.lookup("default", NS, a).miss is None
    assert cat.lookup("default", NS, b).miss.cause == MissCause.EVICTED


def test_second_hit_admission_forgets_its_oldest_offer_past_its_capacity():
    cat = make(admission=AdmissionPolicy(second_hit=True, seen_capacity=2))
    a, b, c = hashes(1), hashes(1, start=100), hashes(1, start=200)
    for hs in (a, b, c):  # first offers; a's falls out of the memory
        assert put(cat, hs).slots[0].status == SlotStatus.NOT_ADMITTED
    assert put(cat, b).slots[0].status == SlotStatus.RESERVED
    assert put(cat, a).slots[0].status == SlotStatus.NOT_ADMITTED


def test_commit_refusals_name_what_is_wrong_and_a_wrong_count_keeps_the_reservation_open():
    cat = make()
    res = cat.reserve(1, "default", NS, hashes(2), [100] * 2, 0.0)
    with pytest.raises(InvalidRequest, match="1 digests for 2 reserved pages"):
        cat.commit(res.reservation_id, [D])
    assert cat.reservation_open(res.reservation_id)
    assert cat.commit(res.reservation_id, [D, D]).committed == 2
    with pytest.raises(InvalidRequest, match=f"reservation {res.reservation_id} is not open"):
        cat.commit(res.reservation_id, [D, D])
    with pytest.raises(InvalidRequest, match="reservation 99 is not open"):
        cat.abort(99)


def test_a_commit_takes_its_digests_on_trust_only_when_told():
    cat = make()
    put(cat, hashes(2))
    assert cat.scrub_queued() == 0
    put(cat, hashes(2, start=100), scrub_first=True)
    assert cat.scrub_queued() == 2


def test_a_republished_block_leaves_its_ghost():
    cat = make()
    put(cat, hashes(1))
    cat.evict("default", NS, hashes(1))
    assert cat.stats()["ghosts"] == 1
    put(cat, hashes(1))
    assert cat.stats()["ghosts"] == 0


def test_a_freed_page_keeps_nothing_of_its_block():
    cat = make(num_pages=2)
    put(cat, hashes(1), lengths=[300], kind=DigestKind.SKETCH)
    page, _ = page_of(cat, hashes(1))
    cat.evict("default", NS, hashes(1))
    assert (int(cat.state[page]), int(cat.length[page]), int(cat.ns_of[page]), int(cat.tenant_of[page]),
            cat.key_of[page], bytes(cat.digest[page]), int(cat.kind[page])) == (
        PageState.FREE, 0, -1, -1, None, bytes(16), 0)


# -- the scrub's queue and cursor --------------------------------------------------------
def test_a_freed_or_dropped_page_leaves_the_fresh_queue():
    cat = make()
    put(cat, hashes(4), scrub_first=True)
    pages = cat.lookup("default", NS, hashes(4)).hits
    cat.acquire(1, "default", NS, hashes(4)[2:], 0.0)
    assert cat.evict("default", NS, hashes(1)) == [EvictOutcome.EVICTED]
    assert cat.discard(pages.pages[1], pages.generations[1]) is True
    assert cat.discard(pages.pages[2], pages.generations[2]) is True  # leased: DROPPED
    assert cat.scrub_fresh(8) == [(pages.pages[3], pages.generations[3])]
    assert cat.reset_namespace("default", NS) == [EvictOutcome.DROPPED]  # page 3, leased
    assert cat.scrub_queued() == 0


def test_scrub_fresh_gives_at_most_n_and_none_for_0():
    cat = make()
    put(cat, hashes(3), scrub_first=True)
    assert len(cat.scrub_fresh(2)) == 2
    assert cat.scrub_fresh(0) == []
    assert cat.scrub_fresh(-1) == []


def test_the_scrub_cycle_starts_at_page_0_and_wraps_with_its_cursor():
    cat = make(num_pages=5)
    put(cat, hashes(5))
    at = {p: g for p, g in zip(*(lambda h: (h.pages, h.generations))(cat.lookup("default", NS, hashes(5)).hits))}
    for p in (2, 4):
        assert cat.discard(p, at[p])
    cycles = lambda: cat.stats()["scrub_cycles"]  # noqa: E731
    assert cat.scrub_cycle(1) == [(0, at[0])]
    assert cat.scrub_cycle(1) == [(1, at[1])]
    assert cat.scrub_cycle(2) == [(3, at[3]), (0, at[0])] and cycles() == 1  # past the last, from page 0
    assert cat.scrub_cycle(2) == [(1, at[1]), (3, at[3])] and cycles() == 1
    assert cat.scrub_cycle(2) == [(0, at[0]), (1, at[1])] and cycles() == 2  # nothing past 3
    assert cat.scrub_cycle(3) == [(3, at[3]), (0, at[0]), (1, at[1])] and cycles() == 3
    assert cat.scrub_cycle(0) == []


def test_a_scrub_cycle_ending_on_the_last_page_starts_the_next_at_page_0():
    cat = make(num_pages=3)
    put(cat, hashes(3))
    gens = cat.lookup("default", NS, hashes(3)).hits.generations
    assert cat.scrub_cycle(3) == [(0, gens[0]), (1, gens[1]), (2, gens[2])]
    assert cat.stats()["scrub_cycles"] == 1
    assert cat.scrub_cycle(1) == [(0, gens[0])]
    assert cat.scrub_cycle(2) == [(1, gens[1]), (2, gens[2])]
    assert cat.stats()["scrub_cycles"] == 2
    assert cat.scrub_cycle(5) == [(0, gens[0]), (1, gens[1]), (2, gens[2])]  # one cycle, no page twice
    assert cat.stats()["scrub_cycles"] == 3


def test_a_scrub_cycle_whose_wrap_finds_nothing_restarts_at_page_0():
    cat = make(num_pages=4)
    put(cat, hashes(4))
    hits = cat.lookup("default", NS, hashes(4)).hits
    at = dict(zip(hits.pages, hits.generations))
    assert cat.scrub_cycle(3) == [(0, at[0]), (1, at[1]), (2, at[2])]
    for p in (0, 1, 2):
        cat.discard(p, at[p])
    assert cat.scrub_cycle(2) == [(3, at[3])]  # the wrap found nothing before page 3
    put(cat, hashes(1, start=900))  # page 0 again
    assert cat.scrub_cycle(1) == [(0, int(cat.gen[0]))]  # the next cycle begins at page 0


# -- eviction order ----------------------------------------------------------------------
def test_lru_pages_lists_the_unleased_committed_pages_least_recent_first():
    cat = make(num_pages=4)
    t2 = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64, tenant="t2")
    a, b, c = hashes(1), hashes(1, start=100), hashes(1, start=200)
    put(cat, a, lengths=[100], digests=[b"a" * 16])  # page 0
    put(cat, b, ns=t2, lengths=[200], digests=[b"b" * 16], kind=DigestKind.SKETCH)  # page 1
    put(cat, c, lengths=[300], digests=[b"c" * 16])  # page 2
    cat.release(cat.acquire(1, "default", NS, a, 0.0).lease_id)  # a is now the most recent
    cat.acquire(1, "default", NS, c, 0.0)  # c is held
    gen = [int(g) for g in cat.gen]
    assert cat.lru_pages(10) == [
        LruPage(1, gen[1], "t2", t2, b[0], 200, b"b" * 16, DigestKind.SKETCH),
        LruPage(0, gen[0], "default", NS, a[0], 100, b"a" * 16, DigestKind.XXH3),
    ]
    assert cat.lru_pages(1) == cat.lru_pages(10)[:1]
    assert cat.lru_pages(0) == []


def test_the_lru_order_survives_a_touch_of_the_page_before_page_0():
    cat = make(num_pages=3)
    a, b = hashes(1), hashes(1, start=100)
    put(cat, a)  # page 0
    put(cat, b)  # page 1
    cat.release(cat.acquire(1, "default", NS, a, 0.0).lease_id)  # order: 1, 0
    cat.release(cat.acquire(1, "default", NS, b, 0.0).lease_id)  # order: 0, 1
    assert [p.page for p in cat.lru_pages(3)] == [0, 1]


def test_a_dropped_page_freed_at_its_release_leaves_the_lru_order_whole():
    cat = make(num_pages=4)
    blocks = [hashes(1, start=100 * i) for i in range(3)]
    for hs in blocks:
        put(cat, hs)  # pages 0, 1, 2
    lease = cat.acquire(1, "default", NS, blocks[1], 0.0)
    assert cat.discard(1, lease.hits.generations[0]) is True  # DROPPED, out of the order
    assert [p.page for p in cat.lru_pages(4)] == [0, 2]
    cat.release(cat.acquire(1, "default", NS, blocks[0], 0.0).lease_id)  # order: 2, 0
    cat.release(lease.lease_id)  # page 1 freed now: its old neighbours are left as they are
    assert [p.page for p in cat.lru_pages(4)] == [2, 0]
    put(cat, hashes(1, start=900))  # page 1 again, the most recent
    assert [p.page for p in cat.lru_pages(4)] == [2, 0, 1]


def test_a_squeeze_of_one_page_evicts_one_and_a_restore_evicts_none():
    cat = make(num_pages=3)
    for i in range(3):
        put(cat, hashes(1, start=100 * i))
    assert cat.set_capacity(2) == 1
    assert cat.set_capacity(3) == 0
    assert cat.set_capacity(3) == 0
    with pytest.raises(InvalidRequest, match=r"capacity 4 outside 0\.\.3"):
        cat.set_capacity(4)


def test_ghosts_are_bounded_by_ghost_capacity_not_the_pages():
    cat = make(num_pages=4, ghost_capacity=1)
    for i in range(3):
        put(cat, hashes(1, start=100 * i))
    cat.evict("default", NS, hashes(1, start=0))
    cat.evict("default", NS, hashes(1, start=100))
    assert cat.stats()["ghosts"] == 1
    assert cat.lookup("default", NS, hashes(1, start=0)).miss.cause == MissCause.NEVER_PUBLISHED
    assert cat.lookup("default", NS, hashes(1, start=100)).miss.cause == MissCause.EVICTED


# -- limits ------------------------------------------------------------------------------
def test_set_limits_applies_to_the_next_leases_and_returns_the_old():
    cat = make()
    put(cat, hashes(1))
    assert cat.set_limits(LoadLimits(per_client=1)) == LoadLimits()
    assert cat.acquire(1, "default", NS, hashes(1), 0.0).lease_id
    assert cat.acquire(1, "default", NS, hashes(1), 0.0).miss == Miss(0, MissCause.THROTTLED)
    assert cat.set_limits(LoadLimits(total=0, per_client=0)) == LoadLimits(per_client=1)
    assert cat.acquire(1, "default", NS, hashes(1), 0.0).lease_id
    for bad in (LoadLimits(per_client=-1), LoadLimits(total=-1)):
        with pytest.raises(InvalidRequest, match="load limits must be 0 \\(none\\) or positive"):
            cat.set_limits(bad)
    assert cat.config.limits == LoadLimits()


# -- namespaces --------------------------------------------------------------------------
def test_a_forgotten_namespace_takes_its_ghosts_and_only_its_own():
    cat = make(num_pages=8, max_namespaces=2)
    a, b, c = hashes(1), hashes(1, start=100), hashes(1, start=200)
    put(cat, a)  # NS: evicted, so it holds nothing but a ghost
    cat.evict("default", NS, a)
    put(cat, b, ns=NS2)
    put(cat, c, ns=NS2)
    cat.evict("default", NS2, b)  # NS2 lives on (c) with b's ghost
    put(cat, a, ns=NS3)  # a third namespace: NS is forgotten, its id reused by NS3
    assert cat.lookup("default", NS2, b).miss.cause == MissCause.EVICTED
    cat.evict("default", NS3, a)
    put(cat, a, ns=NS)  # NS again: NS3 (empty now) is forgotten
    cat.evict("default", NS, a)
    put(cat, b, ns=NS4)  # NS is forgotten again, NS4 takes its id: a is new to it
    assert cat.lookup("default", NS4, a).miss.cause == MissCause.NEVER_PUBLISHED


# -- the segment's index ------------------------------------------------------------------
def shm(pages=8):
    return ShmIndex(np.zeros(buckets_for(pages) * SLOTS, dtype=ENTRY))


def test_the_segments_index_holds_exactly_the_committed_blocks_under_their_namespace():
    ix = shm()
    cat = Catalog(CatalogConfig(num_pages=8, page_size=1024), shm_index=ix)
    fp, fp2 = ns_fingerprint(NS), ns_fingerprint(NS2)
    hs = hashes(3)
    put(cat, hs)
    put(cat, hs[:1], ns=NS2)
    assert ix.probe(fp, hs) == 3 and ix.probe(fp2, hs) == 1
    cat.evict("default", NS, hs[1:2])
    assert ix.probe(fp, hs) == 1 and ix.probe(fp2, hs) == 1
    cat.reset_namespace("default", NS2)
    assert ix.probe(fp2, hs) == 0 and ix.probe(fp, hs) == 1


def test_a_reused_namespace_id_enters_the_segments_index_under_the_new_namespace():
    ix = shm()
    cat = Catalog(CatalogConfig(num_pages=8, page_size=1024, max_namespaces=1), shm_index=ix)
    hs = hashes(2)
    put(cat, hs)
    cat.evict("default", NS, hs)
    put(cat, hs, ns=NS2)  # NS is forgotten, NS2 takes its id
    assert ix.probe(ns_fingerprint(NS2), hs) == 2
    assert ix.probe(ns_fingerprint(NS), hs) == 0


# -- expiry and renewal -------------------------------------------------------------------
def test_expired_grants_are_remembered_up_to_expired_memory_newest_kept():
    cat = make(lease_ttl_s=1.0, expired_memory=2)
    put(cat, hashes(1))
    ids = []
    for t in range(3):
        ids.append(cat.acquire(1, "default", NS, hashes(1), float(10 * t)).lease_id)
        cat.reap(10.0 * t + 1.0)
    out = cat.renew(1, [], 100.0, ids).leases
    assert [r.refused for r in out] == [RenewRefusal.UNKNOWN, RenewRefusal.EXPIRED, RenewRefusal.EXPIRED]
    assert out[1] == Renewal(ids[1], 0.0, RenewRefusal.EXPIRED)
    other = cat.renew(2, [], 100.0, ids[1:]).leases
    assert [r.refused for r in other] == [RenewRefusal.NOT_YOURS] * 2


def test_a_pin_of_a_leased_page_adds_a_lease_and_each_release_takes_one():
    cat = make()
    put(cat, hashes(1))
    page, gen = page_of(cat, hashes(1))
    lease = cat.acquire(1, "default", NS, hashes(1), 0.0)
    pinned = cat.pin(1, page, gen, 0.0)
    assert int(cat.leases_on[page]) == 2
    cat.release(lease.lease_id)
    assert cat.evict("default", NS, hashes(1)) == [EvictOutcome.LEASED]
    cat.release(pinned)
    assert cat.stats()["open_leases"] == 0
    assert cat.evict("default", NS, hashes(1)) == [EvictOutcome.EVICTED]


def test_aborted_pages_add_up_over_aborts_and_expiries():
    cat = make(reservation_ttl_s=5.0)
    for start in (0, 100):
        res = cat.reserve(1, "default", NS, hashes(2, start=start), [100] * 2, 0.0)
        cat.abort(res.reservation_id)
    cat.reserve(1, "default", NS, hashes(1, start=200), [100], 0.0)
    cat.reap(5.0)
    assert cat.stats()["aborted_pages"] == 5
