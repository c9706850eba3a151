"""A keeper's tier as the GPU engine's arena (kvpool.gpu.tier_backend.TierArena, TierBackend.arena,
kvpool.gpu.region), through `python -m kvpool keeper --backing memfd` in its own process: the
bookkeeping the engine relies on, without a GPU (host memfds stand in for the device buffer; the
engine itself runs on a GPU: suites/gpu/test_gpu_tier_engine.py).

  the region's addresses    a block written where the engine writes it (page i at byte i x page
                            size of the arena's range) under a reservation, committed with its
                            kv-sketch-1 digest, loads byte-exact in another session through the
                            generic load (which reads the keeper's page views, not the region)
  sessions and instances    two sessions of one keeper: one instance, two arenas (mapped at two
                            addresses); a restart moves the engine (moved_to), the old mapping
                            kept while a lease of it is open, dropped at its release
  the restart's grant       the engine's release of a lease granted before the restart is
                            refused unsent (WrongInstance) and counted as transport_error; the
                            same backend's lease of the new instance with the same keeper id
                            stays leased (the backend's ids are its own). Control
                            (InstanceBlindTierLink): the old lease releases the new lease of
                            that id, the engine's release reports clean (its blocks would count
                            as loaded), caught by the miss-cause oracle, and the new lease's own
                            release then fails
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvgate.faults.keeper_controls import InstanceBlindTierLink
from kvgate.harness.scenarios import gpu_keeper_wire as W
from kvpool.client import transfer
from kvpool.errors import LeaseLost, MissCause
from kvpool.gpu.config import PageMemory
from kvpool.gpu.load import Loads
from kvpool.gpu.region import moved_to, page_region
from kvpool.gpu.tier_backend import TierBackend
from kvpool.gpu.tier_client import TierLink
from kvpool.pool.digest import DigestKind, page_digest

from .test_gpu_keeper_restart import PAGE, Keeper


def backend(run_dir, name: str, link_cls: type[TierLink] = TierLink) -> TierBackend:  # noqa: ANN001
    return TierBackend(link_cls(run_dir, "default", "tok", name=name, timeout_s=10.0).connect())


def blocks(seed: int, n: int) -> list[np.ndarray]:
    return [W.page_bytes(seed, i, PAGE) for i in range(n)]


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "k"
    d.mkdir(mode=0o700)
    return d


def test_blocks_written_at_the_arenas_addresses_load_byte_exact_in_another_session(run_dir, test_seed):
    k = Keeper(run_dir, "--pages", "16")
    p, c = backend(run_dir, "P"), backend(run_dir, "C")
    try:
        pa, ca = p.arena, c.arena
        assert pa.instance[:16] == ca.instance[:16] == k.address.instance  # one keeper instance ...
        assert pa.instance != ca.instance and pa.session != ca.session  # ... two sessions, two mappings
        region = page_region(pa)
        assert (region.memory, region.page_size, region.num_pages) == (PageMemory.HOST, PAGE, 16)
        keys, src = W.KEYS(4, base=test_seed % 1000), blocks(test_seed, 4)
        res = p.reserve(W.NS, keys, [PAGE] * 4)
        pages = [s.page for s in res.slots]
        for page, data in zip(pages, src):  # where the engine's copies write: page x page size in the range
            region.host[page * PAGE : (page + 1) * PAGE] = data
        digests = [page_digest(region.host[page * PAGE : (page + 1) * PAGE], DigestKind.SKETCH) for page in pages]
        assert p.commit(res.reservation_id, digests, DigestKind.SKETCH).committed == 4
        dest = np.zeros((4, PAGE), dtype=np.uint8)
        got = transfer.load(c, W.NS, keys, lambda i: dest[i])  # reads the keeper's page views, checks digests
        assert got.loaded == 4 and got.miss is None, got
        assert all(np.array_equal(dest[i], src[i]) for i in range(4))
    finally:
        p.close()
        c.close()
        k.stop()


@pytest.mark.fault_pool_restart
@pytest.mark.parametrize("link_cls,checked", [(TierLink, True), (InstanceBlindTierLink, False)],
                         ids=["link", "control-instance-blind"])
def test_a_restart_moves_the_engine_and_its_old_lease_is_a_transport_error(run_dir, test_seed, link_cls, checked):
    """C holds a lease of instance 1 across the keeper's restart (a load whose copies still run)
    and, after the restart, a lease of instance 2 with the same keeper id (the next load, on the
    same backend). The engine's release of the first must be refused unsent and count as a
    transport_error; the second must stay leased until its own release."""
    k1 = Keeper(run_dir, "--pages", "16")
    k2 = None
    p, c = backend(run_dir, "P"), backend(run_dir, "C", link_cls)
    try:
        keys, src = W.KEYS(3, base=test_seed % 1000), blocks(test_seed, 3)
        assert transfer.publish(p, W.NS, keys, src, kind=DigestKind.SKETCH).committed == 3
        before = page_region(c.arena)
        old = c.acquire(W.NS, keys)  # as the engine's load takes it; its copies read `before`
        assert len(old.hits) == 3
        for i, page in enumerate(old.hits.pages):  # the engine's source bytes: the committed blocks
            assert np.array_equal(before.host[page * PAGE : (page + 1) * PAGE], src[i])
        old_keeper_id = c._leases[old.lease_id].lease_id  # noqa: SLF001

        k1.kill()
        k2 = Keeper(run_dir, "--pages", "16", before=k1.address.instance)
        assert len(c.lookup(W.NS, keys).hits) == 0  # the link's next call reconnects: an empty tier
        after = moved_to(before, c.arena)  # what the engine's next transfer moves to
        assert after is not None and after.instance[:16] == k2.address.instance
        assert moved_to(after, c.arena) is None
        if checked:
            assert c.link.retired == 1  # the old mapping stays while the lease is open (a copy may read it)

        assert transfer.publish(p, W.NS, keys, src, kind=DigestKind.SKETCH).committed == 3
        new = c.acquire(W.NS, keys)  # the next load's lease: the keeper's first again
        assert c._leases[new.lease_id].lease_id == old_keeper_id  # noqa: SLF001 - the keeper counts from 1 again

        stale, error, cause = Loads._release(types.SimpleNamespace(backend=c), old)  # noqa: SLF001 - the engine's
        try:
            c.release(new.lease_id)
            holder = "released"
        except LeaseLost:
            holder = "LeaseLost"
        retired = c.link.retired
    finally:
        p.close()
        c.close()
        k1.stop()
        if k2 is not None:
            k2.stop()
    if checked:
        assert cause is MissCause.TRANSPORT_ERROR and "WrongInstance" in error, (stale, error, cause)
        assert holder == "released" and retired == 0, (holder, retired)
    else:
        assert cause is None and holder == "LeaseLost", \
            f"negative control NOT caught: the old lease's release gave {cause} and the new one's {holder}"
