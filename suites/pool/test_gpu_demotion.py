"""The GPU tier's demotion to a real host pool, without a GPU: the keeper's buffer is a host
stand-in (memfd), the host pool a PoolDaemon on a thread. Under pressure the least recently
used pages move to the host pool under their keys and digests and leave the GPU tier; a lookup
falls through to them; a page a loader takes during its copy stays; a host pool that cannot
take them leaves them on the GPU; a bad copy is caught by the digest every load checks."""

import contextlib

import numpy as np
import pytest

from kvgate.harness.scenarios import gpu_tier as procs
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.errors import MissCause
from kvpool.gpu.keeper import GpuKeeper, memfd_allocation
from kvpool.gpu.tier import GpuTierConfig, fall_through
from kvpool.gpu.tier_map import TierMap
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.pool.keys import Namespace, block_hashes

PAGE = 64 * 1024
NS = Namespace("m", "r1", "tok", "bfloat16", "cuda", 16, 2, 2, 64)
CHAIN = block_hashes(range(8 * 16), 16)  # one prefix of 8 blocks


@contextlib.contextmanager
def host_pool(**config):
    """A host pool daemon on a thread (PoolConfig fields in `config`) and the keeper's client of it."""
    d = thread_pool(page_size=PAGE, num_pages=32, **config)
    c = PoolClient(f"unix:{d.unix_path}", "default", "tok", name="keeper")
    try:
        yield c
    finally:
        c.close()
        d.stop_thread()


@pytest.fixture
def host():
    with host_pool() as c:
        yield c


@pytest.fixture
def keeper(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    with GpuKeeper(GpuTierConfig(page_size=PAGE, pages={"default": 8}, low_free=0.25, high_free=0.5), run_dir,
                   memfd_allocation, clock=procs.ManualClock()) as k:
        yield k


def fill_tier(keeper, seed):
    """The 8 blocks of CHAIN published into the GPU tier (oldest first) through a replica's
    mapping, with their kv-sketch-1 digests; the mapping serves the keeper's reads."""
    tier = TierMap.attach(keeper.attach_path, keeper.mint_ticket("default"))
    pages = {}
    for i, h in enumerate(CHAIN):
        res = keeper.tier.reserve(1, "default", NS, [h], [PAGE], 0.0)
        page = res.slots[0].page
        data = procs.page_bytes(seed, i, PAGE)
        tier.page_view(page)[:] = data.tobytes()
        keeper.tier.commit(1, "default", res.reservation_id, [page_digest(data, DigestKind.SKETCH)])
        pages[h] = (page, data)
    return tier, pages


def reader(tier):
    def read_page(page, dst):
        dst[:] = np.frombuffer(tier.page_view(page), np.uint8)[: dst.size]
    return read_page


def host_bytes(host, h):
    lease = host.acquire(NS, [h])
    assert lease.lease_id, lease.miss
    try:
        return np.array(host.read_page(lease, 0), dtype=np.uint8).reshape(-1), lease.hits[0].digest
    finally:
        host.release(lease.lease_id)


def runs(keeper, host):
    def gpu(hs):
        found = keeper.tier.lookup("default", NS, hs)
        return len(found.hits), None if found.miss is None else found.miss.cause

    def pool(hs):
        found = host.lookup(NS, hs)
        return len(found.hits), None if found.miss is None else found.miss.cause

    return [("gpu", gpu), ("host", pool)]


def test_pressure_demotes_the_least_recent_pages_and_a_lookup_falls_through_to_them(keeper, host, test_seed):
    # the keeper reads the pages itself (its allocation's read), not through the replica's mapping
    tier, pages = fill_tier(keeper, test_seed)
    keeper.tier.release(2, "default", keeper.tier.acquire(2, "default", NS, CHAIN[:2], 0.0).lease_id)  # 0, 1 used
    assert keeper.demote("default", host, 0.0) == {"demoted": 4, "kept": 0, "failed": 0}
    for h in CHAIN[2:6]:  # the four least recent: now in the host pool, byte for byte, same digest
        data, digest = host_bytes(host, h)
        assert np.array_equal(data, pages[h][1]) and digest == page_digest(pages[h][1], DigestKind.SKETCH)
        assert keeper.tier.lookup("default", NS, [h]).miss.cause == MissCause.EVICTED
    for h in CHAIN[:2] + CHAIN[6:]:
        assert host.lookup(NS, [h]).miss.cause == MissCause.NEVER_PUBLISHED  # not demoted: on the GPU only
    out = fall_through(CHAIN, runs(keeper, host))
    assert out.segments == (("gpu", 0, 2), ("host", 2, 6), ("gpu", 6, 8)) and out.miss is None
    assert keeper.demote("default", host, 0.0) == {"demoted": 0, "kept": 0, "failed": 0}  # 50 % free
    st = keeper.tier.stats()
    assert st["gpu_tier_demoted_pages"] == 4 and st["gpu_tier_free_pages"] == 4
    tier.close()


def test_a_page_leased_during_its_copy_stays_in_both_tiers(keeper, host, test_seed):
    tier, pages = fill_tier(keeper, test_seed)
    raced = []

    def racing_read(page, dst):
        if not raced:  # a loader takes the first victim while the keeper copies it
            raced.append(keeper.tier.acquire(9, "default", NS, [CHAIN[0]], 0.0))
        reader(tier)(page, dst)

    assert keeper.demote("default", host, 0.0, racing_read) == {"demoted": 3, "kept": 1, "failed": 0}
    assert len(keeper.tier.lookup("default", NS, [CHAIN[0]]).hits) == 1  # kept: hot again
    assert host.lookup(NS, [CHAIN[0]]).miss is None  # and in the host pool too: never in neither
    keeper.tier.release(9, "default", raced[0].lease_id)
    tier.close()


def test_a_host_pool_that_cannot_take_them_leaves_them_on_the_gpu(keeper, test_seed):
    d = thread_pool(page_size=PAGE, num_pages=4)
    full = PoolClient(f"unix:{d.unix_path}", "default", "tok", name="keeper")
    try:
        other = NS.replace(model_revision="other")
        filler = block_hashes(range(10**6, 10**6 + 16 * 4), 16)
        res = full.reserve(other, filler, [PAGE] * 4)
        full.commit(res.reservation_id, [page_digest(bytes(PAGE))] * 4)
        assert full.acquire(other, filler).lease_id  # every page of it leased: nothing can be evicted
        tier, _ = fill_tier(keeper, test_seed)
        out = keeper.demote("default", full, 0.0)
        assert out == {"demoted": 0, "kept": 0, "failed": 4}
        st = keeper.tier.stats("default")
        assert st["gpu_tier_committed_pages"] == 8 and st["gpu_tier_demotion_failed"] == 4  # none dropped
        assert st["gpu_tier_demoting_pages"] == 0  # every pin released
        assert fall_through(CHAIN, runs(keeper, full)).segments == (("gpu", 0, 8),)
        tier.close()
    finally:
        full.close()
        d.stop_thread()


def test_a_bad_demotion_copy_is_caught_by_the_digest_a_load_checks(keeper, test_seed):
    # the host pool's scrub at rest is off: it checks the same digests and would drop the torn
    # pages from the pool at a moment this test does not control (before the lookups that find
    # them, or between them and the loads); the loads' check is the one under test here
    with host_pool(scrub_pages_per_round=0, scrub_rest_pages_per_round=0) as host:
        tier, pages = fill_tier(keeper, test_seed)
        good = reader(tier)

        def torn_read(page, dst):  # the negative control: the copy loses its second half
            good(page, dst)
            dst[dst.size // 2:] = 0

        for read_page, intact in ((good, True), (torn_read, False)):
            before = set(h for h in CHAIN if host.lookup(NS, [h]).miss is None)
            keeper.demote("default", host, 0.0, read_page)
            moved = [h for h in CHAIN if host.lookup(NS, [h]).miss is None and h not in before]
            assert moved
            for h in moved:
                data, digest = host_bytes(host, h)
                assert (page_digest(data, DigestKind.SKETCH) == digest) is intact
            # refill the GPU tier's freed pages for the next round
            for i in range(len(moved)):
                first = 9000 + 100 * len(before) + 16 * i
                h = block_hashes(range(first, first + 16), 16)[0]
                r = keeper.tier.reserve(1, "default", NS, [h], [PAGE], 0.0)
                keeper.tier.commit(1, "default", r.reservation_id, [page_digest(bytes(PAGE), DigestKind.SKETCH)])
        tier.close()
