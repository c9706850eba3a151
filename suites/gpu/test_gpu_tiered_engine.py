"""The GPU engine over a keeper's tier in device memory and a host pool together
(kvpool.gpu.tiered_engine.TieredEngine on a kvpool.gpu.tiered.TieredBackend): `kvpool keeper
--backing vmm` in its own process, a pool daemon in this one, an engine per member.

  a load split between the members   the tier holds the first blocks, the host pool the rest:
                                     every block installed byte-exact, the first from device
                                     pages, the rest from host pages
  a flipped tier page                the tier's load stops there (corrupt) and the host pool fills
                                     the block and those after it: every block byte-exact (with
                                     the direct install, after the tier's write of the flipped
                                     page into that block). Control: the tier member's engine a
                                     BlindLoadEngine, the flipped page installed as good, caught
                                     by the byte-exact oracle
  a page named outside the mapping   a lease's or a reservation's page before or past the tier's
                                     pages: ArenaError before any copy, nothing installed, the
                                     reservation aborted (the driver path addresses pages unchecked)
  a store past the tier's room       a keeper of 4 pages (nothing demoted: no host pool of its
                                     own): 4 blocks committed in the tier, the other 4 spilled to
                                     the host pool; loaded back through the composite byte-exact,
                                     and the host pool holds exactly the spilled ones
The ordering control of the fall-through (UnorderedTieredEngine) is run on a model of the
device in suites/unit/test_tiered_engine.py: on the GPU the direct install's writes of a chunk
are complete before its load returns (the host waits for each chunk's check), so dropping the
composite's wait does not expose it here.

Run: pytest suites/gpu/test_gpu_tiered_engine.py -m gpu
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgate.faults.gpu_controls import BlindLoadEngine  # noqa: E402
from kvgate.harness.scenarios.gpu_tier_engine import DRAIN_S, TierSide  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import fill, make_kv, namespace, read_pages  # noqa: E402
from kvgate.harness.system.pool import thread_pool  # noqa: E402
from kvpool.client.pool_client import PoolClient  # noqa: E402
from kvpool.client.transfer import publish  # noqa: E402
from kvpool.errors import ArenaError, MissCause  # noqa: E402
from kvpool.gpu.config import CopyPath  # noqa: E402
from kvpool.gpu.tiered import TieredBackend  # noqa: E402
from kvpool.gpu.tiered_engine import TieredEngine  # noqa: E402
from kvpool.gpu.transfer import TransferEngine  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402
from kvpool.pool.records import Hits, Slot  # noqa: E402

from .test_gpu_tier_engine import GEOM, TOKEN, WAYS, VmmKeeper, _device  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

K = 8


def _keeper(tmp_path_factory, pages: int):  # noqa: ANN001, ANN202
    run_dir = tmp_path_factory.mktemp("tiered-engine") / "k"
    run_dir.mkdir(mode=0o700)
    k = VmmKeeper(run_dir, _device().index, pages)
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture(scope="module")
def keeper(tmp_path_factory):
    yield from _keeper(tmp_path_factory, 1024)


@pytest.fixture(scope="module")
def small_keeper(tmp_path_factory):  # 4 pages, nothing demoted: a store of 8 blocks spills 4
    yield from _keeper(tmp_path_factory, 4)


@pytest.fixture
def host_pool():
    d = thread_pool(page_size=GEOM.page_bytes, num_pages=256, token=TOKEN)
    try:
        yield d
    finally:
        d.stop_thread()


class Members:
    """A producer's session of the tier, and the consumer's composite (its own session of the
    tier, and a client of the host pool that maps its segment)."""

    def __init__(self, keeper, pool):  # noqa: ANN001
        dev = _device()
        self.producer = TierSide(keeper.run_dir, "default", TOKEN, "producer", dev)
        self.consumer = TierSide(keeper.run_dir, "default", TOKEN, "consumer", dev)
        self.host = PoolClient(f"unix:{pool.unix_path}", "default", TOKEN, name="consumer-host")
        self.backend = TieredBackend([("gpu", self.consumer.backend), ("host", self.host)])
        self.device = dev

    def close(self) -> None:
        self.producer.close()
        self.backend.close()  # the consumer's tier session and the host client


@pytest.fixture
def members(keeper, host_pool):
    m = Members(keeper, host_pool)
    try:
        yield m
    finally:
        m.close()


def _pages(seed: int, tag: str):  # noqa: ANN202
    rng = np.random.default_rng([seed, 29])
    pages = rng.integers(0, 256, (K, GEOM.page_bytes), dtype=np.uint8)
    base = int(rng.integers(1 << 28))
    return rng, namespace(GEOM, tag), pages, block_hashes(range(base, base + 16 * K), 16)


def _load(m: Members, ns, hashes, path: CopyPath, direct: bool, rng, build=TransferEngine):  # noqa: ANN001, ANN202
    layers = make_kv(GEOM, m.device)
    fill(layers, GEOM.block_dim, rng, GEOM.page_bytes)
    blocks = [int(b) for b in rng.permutation(GEOM.num_blocks)[:K]]
    torch.cuda.synchronize()
    with TieredEngine(m.backend, ns, layers, GEOM.config(path, install_direct=direct), build=build) as engine:
        h = engine.load(blocks, hashes)
        engine.wait_for_load(h)
        got = read_pages(layers, GEOM.block_dim, blocks).cpu().numpy()
        engine.drain(DRAIN_S)
        members = [engine.names[k] for k, _, p in h.parts if p.loaded]
    return h, got, members


def _wrong(got: np.ndarray, want: np.ndarray, n: int) -> list[int]:
    return [i for i in range(n) if not np.array_equal(got[i], want[i])]


@pytest.mark.parametrize("path,direct", WAYS)
def test_a_load_split_between_the_tier_and_the_host_pool_is_byte_exact(path, direct, members, test_seed, tag):
    rng, ns, pages, hashes = _pages(test_seed, f"{tag}-split-{path.value}-{direct}")
    assert members.producer.publish(ns, hashes[:3], pages[:3]) == 3
    assert publish(members.host, ns, hashes[3:], list(pages[3:])).committed == K - 3
    h, got, served = _load(members, ns, hashes, path, direct, rng)
    assert (h.loaded, h.miss) == (K, None) and served == ["gpu", "host"]
    assert _wrong(got, pages, K) == []


@pytest.mark.fault_corrupt
@pytest.mark.parametrize("path,direct", WAYS)
def test_a_flipped_tier_page_is_filled_from_the_host_pool_and_the_blind_control_is_caught(
        path, direct, members, test_seed, tag):
    rng, ns, pages, hashes = _pages(test_seed, f"{tag}-flip-{path.value}-{direct}")
    bad = 3
    assert members.producer.publish(ns, hashes, pages) == K
    members.producer.flip(ns, hashes, bad, int(rng.integers(GEOM.page_bytes)), int(rng.integers(1, 256)))
    assert publish(members.host, ns, hashes[bad:], list(pages[bad:])).committed == K - bad
    h, got, served = _load(members, ns, hashes, path, direct, rng)
    assert (h.loaded, h.miss) == (K, None) and served == ["gpu", "host"], h
    assert _wrong(got, pages, K) == []

    def blind_tier(member, ns, layers, config):  # noqa: ANN001, ANN202
        cls = BlindLoadEngine if member is members.consumer.backend else TransferEngine
        return cls(member, ns, layers, config)

    h, got, served = _load(members, ns, hashes, path, direct, rng, build=blind_tier)
    assert h.loaded == K and served == ["gpu"]  # the control installs the flipped page as good
    assert _wrong(got, pages, K) == [bad], "negative control NOT caught by the byte-exact oracle"


def test_a_store_past_the_tiers_room_spills_to_the_host_pool(small_keeper, host_pool, test_seed, tag):
    m = Members(small_keeper, host_pool)
    try:
        rng, ns, pages, hashes = _pages(test_seed, f"{tag}-spill")
        layers = make_kv(GEOM, m.device)
        fill(layers, GEOM.block_dim, rng, GEOM.page_bytes)
        blocks = [int(b) for b in rng.permutation(GEOM.num_blocks)[:K]]
        want = read_pages(layers, GEOM.block_dim, blocks).cpu().numpy()
        with TieredEngine(m.backend, ns, layers, GEOM.config(CopyPath.TORCH)) as engine:
            o = engine.store(blocks, hashes).result.result(DRAIN_S)
            engine.drain(DRAIN_S)
        assert (o.committed, o.no_capacity, o.errors) == (K, 0, ()), o
        on_host = len(m.host.lookup(ns, hashes[4:]).hits)
        assert len(m.producer.backend.lookup(ns, hashes).hits) == 4 and on_host == 4
        assert m.host.lookup(ns, hashes[:1]).miss.cause == MissCause.NEVER_PUBLISHED  # the tier took the first 4
        h, got, served = _load(m, ns, hashes, CopyPath.TORCH, False, rng)
        assert (h.loaded, served) == (K, ["gpu", "host"]) and _wrong(got, want, K) == []
    finally:
        m.close()


class Misnamed:
    """A backend whose leases and reservations name a page outside the mapping (a pool that lies,
    or a bug): the engine addresses page * page_size unchecked on the driver path."""

    def __init__(self, inner, page: int):  # noqa: ANN001
        self.inner, self.page = inner, page

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def acquire(self, ns, hashes):  # noqa: ANN001, ANN201
        got = self.inner.acquire(ns, hashes)
        h = got.hits
        return dataclasses.replace(got, hits=Hits([self.page, *h.pages[1:]], h.generations, h.lengths, h.digests,
                                                  h.kinds))

    def reserve(self, ns, hashes, lengths, boundary=None):  # noqa: ANN001, ANN201
        got = self.inner.reserve(ns, hashes, lengths, boundary)
        first = got.slots[0]
        return dataclasses.replace(got, slots=(Slot(first.status, self.page, first.generation), *got.slots[1:]))


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("where", ["before", "past"])
def test_a_page_named_outside_the_mapping_is_refused_before_any_copy(path, where, members, test_seed, tag):
    rng, ns, pages, hashes = _pages(test_seed, f"{tag}-bounds-{path.value}-{where}")
    assert members.producer.publish(ns, hashes, pages) == K
    tier = members.consumer.backend
    page = -1 if where == "before" else tier.arena.num_pages
    layers = make_kv(GEOM, members.device)
    fill(layers, GEOM.block_dim, rng, GEOM.page_bytes)
    blocks = [int(b) for b in rng.permutation(GEOM.num_blocks)[:K]]
    before = read_pages(layers, GEOM.block_dim, blocks).cpu().numpy()
    with TransferEngine(Misnamed(tier, page), ns, layers, GEOM.config(path)) as engine:
        with pytest.raises(ArenaError, match="outside"):
            engine.load(blocks, hashes)
        with pytest.raises(ArenaError, match="outside"):
            engine.store(blocks, block_hashes(range(1 << 29, (1 << 29) + 16 * K), 16))
        engine.drain(DRAIN_S)
    assert np.array_equal(read_pages(layers, GEOM.block_dim, blocks).cpu().numpy(), before)  # nothing installed
    assert not tier.lookup(ns, block_hashes(range(1 << 29, (1 << 29) + 16 * K), 16)).hits  # the reservation aborted
