"""A keeper's tier and the host pool as one backend (kvpool.gpu.tiered.TieredBackend), in real
processes: the keeper from its command (`python -m kvpool keeper --backing memfd`, the Keeper of
test_gpu_keeper_restart.py), the pool daemon from `python -m kvpool serve` (PoolProcess), the
composite and the producers in this process. Loads are the generic one (kvpool.client.transfer),
publishes too (to a member alone, or through the composite). Faults where the data is: the
keeper killed (SIGKILL), a bit of a committed host-pool page flipped in the pool's segment.

  guard                                oracle                               control
  fall-through                         loaded-block count and miss cause:   FirstTierOnlyBackend: the
                                       blocks only the host pool holds      run ends at the tier's
                                       load (all of them, or the tier's     miss (never_published;
                                       run and then the host's, in one      transport_error with the
                                       load); a dead keeper's lookups are   keeper dead)
                                       transport_error, the host serves
  block i read by the member that      byte-exact: every installed page     FirstMemberReadBackend:
  granted it                           equals its producer's bytes (also    the host's blocks read out
                                       with a digest-blind copy)            of the tier's lease
  a member's failed release does not   the host pool's evict of the         ShortCircuitReleaseBackend:
  skip the others (keeper killed       load's host blocks: EVICTED (not     the dead keeper's release
  under a lease)                       LEASED)                              error leaves the host lease
  an acquire that fails midway leaks   the same                             LeakyAcquireBackend
  no lease
  each page checked with its member's  a flipped bit in a host page is a    the digest-blind copy of the
  digest kind (tier: kv-sketch-1,      corrupt miss at its index, the       same lease installs it; the
  host: xxh3-128)                      blocks before it byte-exact; the     byte-exact oracle names it
                                       report reaches the host pool (the
                                       page is dropped: `evicted` next)
  a keeper not up when the composite   a publish after the keeper answers   NeverJoinsBackend: the
  is built joins once it answers       lands in the tier; the tier serves   late member left out for
  (the host pool serves meanwhile)     it to the composite's load           good
Plus: with the host pool killed too, no member answers and the lookup raises (the host pool's
TransportError, the tier's noted), as with one backend; a publish through the composite places in the tier what fits and the rest (the tier's
NO_CAPACITY) in the host pool, with kv-sketch-1 digests the host pool takes; all of it loads
byte-exact; renewal of a composite lease.
What is not checked here: device memory (`--backing vmm`), demotion under the composite (the
keeper's own, suites/pool/test_gpu_demotion.py), the connector on it (suites/connector/test_tiered_connector.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.faults.tiered_controls import (
    FirstMemberReadBackend,
    FirstTierOnlyBackend,
    LeakyAcquireBackend,
    NeverJoinsBackend,
    ShortCircuitReleaseBackend,
)
from kvgate.harness.scenarios import gpu_keeper_wire as W
from kvgate.harness.system.pool import PoolProcess
from kvpool.client import transfer
from kvpool.client.pool_client import PoolClient
from kvpool.errors import MissCause, TransportError
from kvpool.gpu.tier_backend import TierBackend
from kvpool.gpu.tier_client import TierLink
from kvpool.gpu.tiered import TieredBackend
from kvpool.pool.digest import DigestKind
from kvpool.pool.records import EvictOutcome

from .test_gpu_keeper_restart import PAGE, Keeper

N = 6  # blocks of a prompt
TIER_HOLDS = 3  # in the split tests: blocks 0..2 in the tier, 3..5 in the host pool only


@pytest.fixture
def keeper(tmp_path):
    run_dir = tmp_path / "k"
    run_dir.mkdir(mode=0o700)
    k = Keeper(run_dir, "--pages", "16")
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture
def pool(tmp_path):
    run_dir = tmp_path / "pool"
    run_dir.mkdir(mode=0o700)
    # no scrub pass at rest: a page flipped here is met by its loader, not dropped by the scrub first
    p = PoolProcess.start(page_size=PAGE, num_pages=32, run_dir=run_dir, token="host-token",
                          extra_args=("--scrub-rest-pages", "0"))
    try:
        yield p
    finally:
        p.cleanup()


def tier_of(keeper: Keeper, name: str) -> TierBackend:
    return TierBackend(TierLink(keeper.run_dir, "default", "tok", name=name, timeout_s=10.0).connect())


def composite(keeper: Keeper, pool: PoolProcess, name: str, cls: type[TieredBackend] = TieredBackend,
              host: PoolClient | None = None) -> TieredBackend:
    return cls([("gpu", tier_of(keeper, f"{name}/gpu")), ("host", host or pool.client(name=f"{name}/host"))])


def blocks(seed: int, n: int = N) -> list[np.ndarray]:
    return [W.page_bytes(seed, i, PAGE) for i in range(n)]


def keys_for(seed: int, n: int = N) -> list[bytes]:
    return W.KEYS(n, base=seed % 10_000 * 10)


def split_publish(keeper: Keeper, pool: PoolProcess, keys: list[bytes], src: list[np.ndarray]) -> None:
    """Blocks 0..TIER_HOLDS-1 into the tier (kv-sketch-1), the rest into the host pool only (xxh3)."""
    p = tier_of(keeper, "P")
    try:
        assert transfer.publish(p, W.NS, keys[:TIER_HOLDS], src[:TIER_HOLDS], kind=DigestKind.SKETCH).committed \
            == TIER_HOLDS
    finally:
        p.close()
    with pool.client(name="P-host") as h:
        assert transfer.publish(h, W.NS, keys[TIER_HOLDS:], src[TIER_HOLDS:]).committed == N - TIER_HOLDS


def load_into(b: TieredBackend, keys: list[bytes]) -> tuple[transfer.LoadResult, np.ndarray]:
    dest = np.zeros((len(keys), PAGE), dtype=np.uint8)
    return transfer.load(b, W.NS, keys, lambda i: dest[i]), dest


def digest_blind_copy(b: TieredBackend, keys: list[bytes]) -> tuple[int, np.ndarray]:
    """The lease, copy and release of transfer.load without its digest check: what the byte-exact
    oracle alone sees."""
    dest = np.zeros((len(keys), PAGE), dtype=np.uint8)
    acq = b.acquire(W.NS, keys)
    try:
        for i in range(len(acq.hits)):
            dest[i] = b.read_page(acq, i)
    finally:
        if acq.lease_id:
            b.release(acq.lease_id)
    return len(acq.hits), dest


def differing(dest: np.ndarray, src: list[np.ndarray], n: int) -> list[int]:
    return [i for i in range(n) if not np.array_equal(dest[i], src[i])]


# -- fall-through ------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,checked", [(TieredBackend, True), (FirstTierOnlyBackend, False)],
                         ids=["tiered", "control-first-tier-only"])
def test_blocks_only_the_host_pool_holds_load_through_the_composite_byte_exact(keeper, pool, test_seed, cls,
                                                                                 checked):
    keys, src = keys_for(test_seed), blocks(test_seed)
    with pool.client(name="P-host") as h:
        assert transfer.publish(h, W.NS, keys, src).committed == N
    c = composite(keeper, pool, "C", cls)
    try:
        got, dest = load_into(c, keys)
        looked = c.lookup(W.NS, keys + keys_for(test_seed + 1, 1))
    finally:
        c.close()
    if not checked:  # the run ends at the tier's miss: the count and the cause oracle see it
        assert (got.loaded, got.miss.cause if got.miss else None) == (0, MissCause.NEVER_PUBLISHED), \
            f"negative control NOT caught by the loaded-count / miss-cause oracle: {got}"
        return
    assert (got.loaded, got.miss) == (N, None), got
    assert differing(dest, src, N) == []  # byte-exact
    assert len(looked.hits) == N and (looked.miss.index, looked.miss.cause) == (N, MissCause.NEVER_PUBLISHED)
    assert all(looked.hits.kind(i) == DigestKind.XXH3 for i in range(N))  # the host pool's own kind


@pytest.mark.parametrize("cls,checked", [(TieredBackend, True), (FirstMemberReadBackend, False)],
                         ids=["tiered", "control-first-member-read"])
def test_a_prompt_split_between_the_tier_and_the_host_pool_loads_in_one_load_byte_exact(keeper, pool, test_seed,
                                                                                         cls, checked):
    keys, src = keys_for(test_seed), blocks(test_seed)
    split_publish(keeper, pool, keys, src)
    c = composite(keeper, pool, "C", cls)
    try:
        looked = c.lookup(W.NS, keys)
        got, dest = load_into(c, keys)
        blind_loaded, blind = digest_blind_copy(c, keys)
        counts = (c.stats()["tiered_gpu_blocks"], c.stats()["tiered_host_blocks"])
    finally:
        c.close()
    # the segments, tier then host, and each page's digest kind its member's
    assert len(looked.hits) == N and looked.miss is None
    assert [looked.hits.kind(i) for i in range(N)] == [DigestKind.SKETCH] * TIER_HOLDS + \
        [DigestKind.XXH3] * (N - TIER_HOLDS)
    assert counts == (2 * TIER_HOLDS, 2 * (N - TIER_HOLDS))  # two acquires: the load's and the blind copy's
    wrong = differing(blind, src, blind_loaded)
    if not checked:  # the byte-exact oracle names exactly the host pool's blocks
        assert blind_loaded == N and wrong == list(range(TIER_HOLDS, N)), \
            f"negative control NOT caught by the byte-exact oracle: {wrong}"
        assert got.loaded == TIER_HOLDS and got.miss.cause == MissCause.CORRUPT  # and the load's own check
        return
    assert (got.loaded, got.miss) == (N, None), got
    assert differing(dest, src, N) == [] and wrong == []  # byte-exact, in the load and in the blind copy


@pytest.mark.fault_pool_restart
@pytest.mark.parametrize("cls,checked", [(TieredBackend, True), (FirstTierOnlyBackend, False)],
                         ids=["tiered", "control-first-tier-only"])
def test_a_killed_keeper_is_a_transport_error_and_the_host_pool_still_serves(keeper, pool, test_seed, cls,
                                                                            checked):
    keys, src = keys_for(test_seed), blocks(test_seed)
    split_publish(keeper, pool, keys, src)
    with pool.client(name="P-host") as h:  # the host pool holds the tier's blocks too (as after a demotion)
        assert transfer.publish(h, W.NS, keys[:TIER_HOLDS], src[:TIER_HOLDS]).committed == TIER_HOLDS
    c = composite(keeper, pool, "C", cls)
    try:
        assert len(c.lookup(W.NS, keys).hits) == (N if checked else TIER_HOLDS)  # the keeper alive
        keeper.kill()
        with pytest.raises(TransportError):
            c.members[0].lookup(W.NS, keys)  # the tier alone: unreachable
        errors_before = c.stats()["tiered_gpu_errors"]
        looked = c.lookup(W.NS, keys + keys_for(test_seed + 1, 1))
        got, dest = load_into(c, keys)
        stats = c.stats()
        if checked:
            pool.kill()  # now no member answers: the error is raised, as with one backend (the host pool's)
            with pytest.raises(TransportError) as raised:
                c.lookup(W.NS, keys)
            none_left, _ = load_into(c, keys)
    finally:
        c.close()
    if not checked:
        assert (got.loaded, got.miss.cause if got.miss else None) == (0, MissCause.TRANSPORT_ERROR), \
            f"negative control NOT caught by the loaded-count / miss-cause oracle: {got}"
        return
    assert any("could not be reached" in note for note in raised.value.__notes__)  # the tier's error noted
    assert (none_left.loaded, none_left.miss.cause) == (0, MissCause.TRANSPORT_ERROR) and none_left.error
    assert stats["tiered_gpu_errors"] >= errors_before + 2  # its lookups and acquires failed, and fell through
    # every block from the host pool; the one nobody holds misses as the dead tier's transport_error
    assert len(looked.hits) == N and (looked.miss.index, looked.miss.cause) == (N, MissCause.TRANSPORT_ERROR)
    assert [looked.hits.kind(i) for i in range(N)] == [DigestKind.XXH3] * N
    assert (got.loaded, got.miss) == (N, None), got
    assert differing(dest, src, N) == []


# -- nothing leased is left behind -------------------------------------------------------------

def host_outcomes(pool: PoolProcess, keys: list[bytes]) -> list[EvictOutcome]:
    """What the host pool answers an evict of `keys`: LEASED while a lease holds them."""
    with pool.client(name="admin") as a:
        return list(a.evict(W.NS, keys))


@pytest.mark.fault_pool_restart
@pytest.mark.parametrize("cls,checked", [(TieredBackend, True), (ShortCircuitReleaseBackend, False)],
                         ids=["tiered", "control-short-circuit-release"])
def test_a_dead_keepers_release_error_surfaces_and_the_host_lease_is_released(keeper, pool, test_seed, cls,
                                                                             checked):
    keys, src = keys_for(test_seed), blocks(test_seed)
    split_publish(keeper, pool, keys, src)
    c = composite(keeper, pool, "C", cls)
    try:
        lease = c.acquire(W.NS, keys)
        assert len(lease.hits) == N
        keeper.kill()
        with pytest.raises(TransportError):  # the tier's release: typed, raised
            c.release(lease.lease_id)
        outcomes = host_outcomes(pool, keys[TIER_HOLDS:])
    finally:
        c.close()
    if not checked:
        assert EvictOutcome.LEASED in outcomes, f"negative control NOT caught: the host answered {outcomes}"
        return
    assert outcomes == [EvictOutcome.EVICTED] * (N - TIER_HOLDS), outcomes


class BrokenAfterTier(PoolClient):
    """A host member whose acquire fails with an error that is not the pool's (a bug), after the
    tier has leased its run."""

    def acquire(self, ns, hashes):  # noqa: ANN001, ANN201
        leased = super().acquire(ns, hashes)
        self.held = leased.lease_id  # leased, and then the failure
        raise RuntimeError("the host member failed after its lease")


@pytest.mark.parametrize("cls,checked", [(TieredBackend, True), (LeakyAcquireBackend, False)],
                         ids=["tiered", "control-leaky-acquire"])
def test_an_acquire_that_fails_midway_releases_what_it_leased(keeper, pool, test_seed, cls, checked):
    keys, src = keys_for(test_seed), blocks(test_seed)
    split_publish(keeper, pool, keys, src)
    host = BrokenAfterTier(pool.unix, "default", pool.token, name="C/host")
    c = composite(keeper, pool, "C", cls, host=host)
    try:
        with pytest.raises(RuntimeError):
            c.acquire(W.NS, keys)
        host.release(host.held)  # the broken member's own lease, which no composite ever held
        tier_leases = dict(c.members[0]._leases)  # noqa: SLF001 - the tier's open leases
    finally:
        c.close()
    if not checked:
        assert tier_leases, "negative control NOT caught: the tier's lease was released"
        return
    assert tier_leases == {}


# -- corruption under the composite ------------------------------------------------------------

@pytest.mark.fault_corrupt
def test_a_flipped_bit_in_a_host_page_is_a_corrupt_miss_at_its_index_and_the_blind_copy_is_caught(keeper, pool,
                                                                                                   test_seed):
    keys, src = keys_for(test_seed), blocks(test_seed)
    split_publish(keeper, pool, keys, src)
    bad = TIER_HOLDS + test_seed % (N - TIER_HOLDS)
    with pool.client(name="fault") as f:
        lease = f.acquire(W.NS, keys[bad:bad + 1])
        page = lease.hits.pages[0]
        f.release(lease.lease_id)
        assert f.arena is not None
        f.arena.page(page, PAGE)[(test_seed * 7919) % PAGE] ^= 1 << (test_seed % 8)  # the fault, at rest
    c = composite(keeper, pool, "C")
    try:
        # control first (the checked load's report drops the page): the copy without the check
        # installs the flipped page; the byte-exact oracle names it
        blind_loaded, blind = digest_blind_copy(c, keys)
        assert blind_loaded == N and differing(blind, src, N) == [bad], "the byte-exact oracle missed the flip"
        got, dest = load_into(c, keys)
        assert (got.loaded, got.miss.index, got.miss.cause) == (bad, bad, MissCause.CORRUPT), got
        assert differing(dest, src, bad) == []  # what was installed is exact
        # the report went to the host pool, which dropped the page: the block misses as evicted now
        after = c.lookup(W.NS, keys)
        assert (len(after.hits), after.miss.cause) == (bad, MissCause.EVICTED), after
    finally:
        c.close()


# -- publish and renewal -----------------------------------------------------------------------

def test_a_publish_through_the_composite_places_what_the_tier_cannot_in_the_host_pool(tmp_path, pool, test_seed):
    run_dir = tmp_path / "small"
    run_dir.mkdir(mode=0o700)
    small = Keeper(run_dir, "--pages", "4")  # room for 4 of the 6 blocks, and no host pool to demote to
    keys, src = keys_for(test_seed), blocks(test_seed)
    c = composite(small, pool, "C")
    try:
        assert c.digest_kind == DigestKind.SKETCH and c.page_size == PAGE
        out = transfer.publish(c, W.NS, keys, src, kind=c.digest_kind)
        assert (out.committed, out.no_capacity, out.rejected) == (N, 0, 0), out
        tier_run = len(c.members[0].lookup(W.NS, keys).hits)
        host = c.members[1].lookup(W.NS, keys[tier_run:])
        assert tier_run == 4 and len(host.hits) == N - 4 and host.miss is None
        assert all(host.hits.kind(i) == DigestKind.SKETCH for i in range(N - 4))  # the host pool took kv-sketch-1
        assert c.members[1].lookup(W.NS, keys[:1]).miss.cause == MissCause.NEVER_PUBLISHED  # placed once
        got, dest = load_into(c, keys)
        assert (got.loaded, got.miss) == (N, None) and differing(dest, src, N) == []

        lease = c.acquire(W.NS, keys)
        renewed = c.renew([], [lease.lease_id, 987654]).leases
        assert [(r.id, r.refused) for r in renewed] == [(lease.lease_id, None), (987654, "unknown")], renewed
        assert 0 < renewed[0].ttl_s <= min(c.members[0].lease_ttl_s, c.members[1].lease_ttl_s)
        c.release(lease.lease_id)
        assert host_outcomes(pool, keys[4:]) == [EvictOutcome.EVICTED] * (N - 4)  # released
    finally:
        c.close()
        small.stop()


# -- a keeper that starts after the composite ----------------------------------------------------

@pytest.mark.fault_pool_restart
@pytest.mark.parametrize("cls,checked", [(TieredBackend, True), (NeverJoinsBackend, False)],
                         ids=["tiered", "control-never-joins"])
def test_a_keeper_started_after_the_composite_joins_it(tmp_path, pool, test_seed, cls, checked):
    run_dir = tmp_path / "late"
    run_dir.mkdir(mode=0o700)
    b = cls([("gpu", TierBackend(TierLink(run_dir, "default", "tok", name="late/gpu", timeout_s=10.0))),
             ("host", pool.client(name="late/host"))])
    keeper = None
    try:
        keys, src = keys_for(test_seed), blocks(test_seed)
        before = transfer.publish(b, W.NS, keys[:2], src[:2], kind=DigestKind.SKETCH)  # no keeper: the host pool
        assert before.committed == 2 and b.stats()["tiered_gpu_errors"] >= 1
        keeper = Keeper(run_dir, "--pages", "16")
        after = transfer.publish(b, W.NS, keys[2:], src[2:], kind=DigestKind.SKETCH)
        assert after.committed == N - 2
        got, dest = load_into(b, keys)
        assert got.loaded == N and differing(dest, src, N) == []  # byte-exact, from wherever it lies
        p = tier_of(keeper, "check")
        try:
            in_tier = len(p.lookup(W.NS, keys[2:]).hits)
        finally:
            p.close()
        stats = b.stats()
        if checked:
            assert in_tier == N - 2 and stats["tiered_gpu_blocks"] == N - 2 and stats["tiered_host_blocks"] == 2
        else:  # caught: the keeper that came up is never used
            assert in_tier == 0 and stats["tiered_gpu_blocks"] == 0
    finally:
        b.close()
        if keeper is not None:
            keeper.stop()
