"""The transfer engine's other contracts on the GPU: corrupt pages are refused, leases
outlive the copies that read their pages (with its control, a lease released early),
the pageable fallback when registration is refused (with the controls of its two
catchable edges), capabilities, and the pool's answers passed through (exists, boundary)."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgate.faults.gpu_controls import (  # noqa: E402
    BlindLoadEngine,
    EagerReleaseEngine,
    RefusedRegistrationEngine,
    TrustingReleaseEngine,
    RefusedUnorderedEngine,
    StuckSegmentEngine,
    delay_stream,
)
from kvpool.pool.records import EvictOutcome  # noqa: E402
from kvpool.pool.digest import DigestKind  # noqa: E402
from kvpool.client.transfer import publish  # noqa: E402
from kvpool.errors import InvalidRequest, MissCause  # noqa: E402
from kvpool.gpu.config import CopyPath, HostMemory, KVLayoutError  # noqa: E402
from kvpool.gpu.layout import block_page  # noqa: E402
from kvpool.gpu.load import LoadOutcome  # noqa: E402
from kvpool.gpu.store import StoreOutcome  # noqa: E402
from kvpool.gpu.transfer import TransferEngine  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import (  # noqa: E402
    GEOMETRIES,
    Scenario,
    check_with_control,
    fill,
    make_kv,
    namespace,
    read_pages,
    scrubbed,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

CUDA = torch.device("cuda")


def _published(client, ns, geom, rng, k):  # noqa: ANN001, ANN202
    pages = rng.integers(0, 256, (k, geom.page_bytes), dtype=np.uint8)
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * k), 16)
    assert publish(client, ns, hashes, list(pages)).committed == k
    return pages, hashes


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
def test_corrupt_page_is_reported_and_never_installed(path, client, test_seed, tag):
    geom = GEOMETRIES["flash-128k"]
    ns = namespace(geom, tag)
    rng = np.random.default_rng(test_seed)
    k = 12
    pages, hashes = _published(client, ns, geom, rng, k)
    bad = int(rng.integers(1, k - 1))
    victim = client.lookup(ns, hashes).hits[bad].page
    client.arena.page(victim)[int(rng.integers(geom.page_bytes))] ^= 0xFF  # memory corruption after commit
    layers = make_kv(geom, CUDA)
    old = fill(layers, geom.block_dim, rng, geom.page_bytes)
    blocks = [int(b) for b in rng.permutation(geom.num_blocks)[:k]]
    torch.cuda.synchronize()
    with TransferEngine(client, ns, layers, geom.config(path)) as engine:
        h = engine.load(blocks, hashes)
        assert (h.loaded, h.miss.index, h.miss.cause) == (bad, bad, MissCause.CORRUPT), h
        assert h.failed_block_ids == tuple(blocks[bad:])
        engine.wait_for_load(h)
        got = read_pages(layers, geom.block_dim, blocks).cpu().numpy()
        (outcome,) = engine.drain()
    assert isinstance(outcome, LoadOutcome) and outcome.loaded == bad and outcome.miss.cause == MissCause.CORRUPT
    assert np.array_equal(got[:bad], pages[:bad]), "verified pages must be installed"
    assert np.array_equal(got[bad:], old[blocks[bad:]]), "the corrupt page and the ones after it must not be installed"


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("engine_cls,checks", [(TransferEngine, True), (BlindLoadEngine, False)],
                         ids=["engine", "control-blind-load"])
def test_a_sketched_page_corrupted_at_rest_is_refused_on_the_gpu(engine_cls, checks, path, client, test_seed, tag):
    """The engine stores blocks (digested on the GPU, kv-sketch-1, trusted at commit); one
    committed page is corrupted in the arena; another engine's load must stop there as
    corrupt (the page never installed, on either path) while the pages before it load
    byte-exact, and the engine reports it, so the daemon drops it (the next lookup stops
    there, evicted). The control takes every sketched page for verified: the corrupt page is
    installed and counted, and the byte check sees it."""
    geom = GEOMETRIES["flash-128k"]
    ns = namespace(geom, tag + engine_cls.__name__ + path.value)
    rng = np.random.default_rng(test_seed)
    k = 12
    src, dst = make_kv(geom, CUDA), make_kv(geom, CUDA)
    host = fill(src, geom.block_dim, rng, geom.page_bytes)
    old = fill(dst, geom.block_dim, rng, geom.page_bytes)
    blocks = [int(b) for b in rng.permutation(geom.num_blocks)[:k]]
    targets = [int(b) for b in rng.permutation(geom.num_blocks)[:k]]
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * k), 16)
    torch.cuda.synchronize()
    with TransferEngine(client, ns, src, geom.config(path)) as producer:
        assert producer.capabilities.digest == DigestKind.SKETCH.value and producer.capabilities.sketch_impl
        producer.store(blocks, hashes)
        (out,) = producer.drain()
    assert out.committed == k, out
    hits = client.lookup(ns, hashes).hits
    assert [h.kind for h in hits] == [DigestKind.SKETCH] * k
    scrubbed(client)  # their first scrub passed
    bad = int(rng.integers(1, k - 1))
    held = client.acquire(ns, hashes)  # while leased the scrub's cycle cannot drop the page: the load meets it
    client.arena.page(hits[bad].page)[int(rng.integers(geom.page_bytes))] ^= 0xFF  # memory corruption at rest
    with engine_cls(client, ns, dst, geom.config(path)) as consumer:
        h = consumer.load(targets, hashes)
        consumer.wait_for_load(h)
        got = read_pages(dst, geom.block_dim, targets).cpu().numpy()
        consumer.drain()
    client.release(held.lease_id)
    assert np.array_equal(got[:bad], host[blocks[:bad]]), "verified pages must be installed byte-exact"
    if checks:
        assert (h.loaded, h.miss.index, h.miss.cause) == (bad, bad, MissCause.CORRUPT), h
        assert h.failed_block_ids == tuple(targets[bad:])
        assert np.array_equal(got[bad:], old[targets[bad:]]), "the corrupt page and the later ones are not installed"
        after = client.lookup(ns, hashes)  # the engine reported it under its lease: the daemon dropped it
        assert len(after.hits) == bad and after.miss.cause == MissCause.EVICTED, after
    else:
        assert h.loaded == k, h
        assert not np.array_equal(got[bad], host[blocks[bad]]), "negative control NOT caught: the corrupt page " \
            "was installed as loaded, and the byte check did not see it"


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
def test_engines_of_either_digest_kind_exchange_pages_and_the_scrub_agrees(path, client, test_seed, tag):
    """Stores digested on the GPU pass the pool's scrub (the host reference of kv-sketch-1)
    page for page; an xxh3-128 engine's pages load in a sketch engine and the other way."""
    geom = GEOMETRIES["nfirst-16k"]
    rng = np.random.default_rng(test_seed)
    k = 9
    for store_kind, load_kind in ((DigestKind.SKETCH, DigestKind.XXH3), (DigestKind.XXH3, DigestKind.SKETCH),
                                  (DigestKind.SKETCH, DigestKind.SKETCH)):
        ns = namespace(geom, f"{tag}{store_kind}{load_kind}{path.value}")
        src, dst = make_kv(geom, CUDA), make_kv(geom, CUDA)
        host = fill(src, geom.block_dim, rng, geom.page_bytes)
        blocks = [int(b) for b in rng.permutation(geom.num_blocks)[:k]]
        targets = [int(b) for b in rng.permutation(geom.num_blocks)[:k]]
        base = int(rng.integers(1 << 28))
        hashes = block_hashes(range(base, base + 16 * k), 16)
        before = client.stats()
        torch.cuda.synchronize()
        with TransferEngine(client, ns, src, geom.config(path, digest=store_kind)) as producer:
            producer.store(blocks, hashes)
            (out,) = producer.drain()
        assert out.committed == k and out.rejected == 0, out
        with TransferEngine(client, ns, dst, geom.config(path, digest=load_kind)) as consumer:
            h = consumer.load(targets, hashes)
            consumer.wait_for_load(h)
            got = read_pages(dst, geom.block_dim, targets).cpu().numpy()
            consumer.drain()
        assert h.loaded == k and h.miss is None, (store_kind, load_kind, h)
        assert np.array_equal(got, host[blocks]), (store_kind, load_kind)
        after = scrubbed(client)  # this store's pages had their first scrub (the pool's counters are shared)
        if store_kind is DigestKind.SKETCH:
            assert after["scrubbed_pages"] - before["scrubbed_pages"] >= k, (before, after)
        assert len(client.lookup(ns, hashes).hits) == k, "the scrub dropped a page stored from the GPU"


@pytest.mark.parametrize("engine_cls,held", [(TransferEngine, True), (EagerReleaseEngine, False)],
                         ids=["engine", "control-eager-release"])
def test_lease_is_held_until_the_copy_completed(engine_cls, held, client, cycles_per_ms, test_seed, tag):
    """While a delayed load has not finished (load() returns once its copies were checked;
    its installs are held back here), its pages are leased (eviction refused). The control
    releases at once; the check must see those pages evictable."""
    geom = GEOMETRIES["nfirst-512k"]
    ns = namespace(geom, tag + engine_cls.__name__)
    rng = np.random.default_rng(test_seed)
    k = 10
    _, hashes = _published(client, ns, geom, rng, k)
    layers = make_kv(geom, CUDA)
    torch.cuda.synchronize()
    with engine_cls(client, ns, layers, geom.config(CopyPath.TORCH)) as engine:
        # A first load warms the engine up: the first one in a process may allocate (and
        # synchronize the device), which would wait out the delay before the check.
        engine.load(list(range(k)), hashes)
        engine.drain()
        delay_stream(engine.load_write_stream(), int(400 * cycles_per_ms))
        h = engine.load(list(range(k)), hashes)
        assert h.loaded == k
        time.sleep(0.1)  # the control's release worker has long run by now
        in_flight = not h._done.query()
        leased = client.stats()["leased_pages"]
        evicted = client.evict(ns, hashes[:3])
        engine.drain()
    assert in_flight, "the copy finished before the check: the delay was too short to prove anything"
    if held:
        assert leased >= k and evicted == [EvictOutcome.LEASED] * 3, (leased, evicted)
        assert client.stats()["leased_pages"] == 0, "the lease must be released once the copy completed"
        assert client.evict(ns, hashes[:3]) == [EvictOutcome.EVICTED] * 3
    else:
        assert leased == 0 and evicted == [EvictOutcome.EVICTED] * 3, \
            f"negative control NOT caught: pages stayed leased ({leased}, {evicted})"


@pytest.mark.parametrize("engine_cls,checks", [(TransferEngine, True), (TrustingReleaseEngine, False)],
                         ids=["engine", "control-trusting-release"])
def test_a_lease_lost_under_a_slow_copy_fails_every_loaded_block(engine_cls, checks, tmp_path, cycles_per_ms,
                                                                  test_seed, tag):
    """The copy is held on the transfer stream past the lease's TTL, so the daemon reaps the
    lease (its pages could be reused) before the engine releases it: the release answers
    LeaseLost, the generations cannot be checked, and every block the copy read fails (a
    timeout). The control takes the failed release for a clean one: its blocks count as
    loaded, which the check must see."""
    from kvgate.harness.scenarios.gpu_transfer import POOL_PAGE
    from kvgate.harness.system.pool import PoolProcess

    (tmp_path / "pool").mkdir()
    pool = PoolProcess.start(page_size=POOL_PAGE, num_pages=64, run_dir=tmp_path / "pool",
                             extra_args=("--lease-ttl", "0.2"))
    try:
        with pool.client(name="lease-lost", timeout_s=30.0) as client:
            geom = GEOMETRIES["nfirst-512k"]
            ns = namespace(geom, tag + engine_cls.__name__)
            rng = np.random.default_rng(test_seed)
            k = 6
            _, hashes = _published(client, ns, geom, rng, k)
            layers = make_kv(geom, CUDA)
            torch.cuda.synchronize()
            with engine_cls(client, ns, layers, geom.config(CopyPath.TORCH)) as engine:
                delay_stream(engine.load_stream, int(1500 * cycles_per_ms))  # past the TTL and a reap
                h = engine.load(list(range(k)), hashes)
                assert h.loaded == k
                (outcome,) = engine.drain()
    finally:
        pool.stop()
        pool.cleanup()
    assert any("LeaseLost" in e for e in outcome.errors), outcome
    if checks:
        assert outcome.loaded == 0 and outcome.miss.cause == MissCause.TIMEOUT and outcome.stale == tuple(range(k))
    else:
        assert outcome.loaded == k, f"negative control NOT caught: {outcome}"


@pytest.mark.fault_pool_restart
@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("engine_cls,follows", [(TransferEngine, True), (StuckSegmentEngine, False)],
                         ids=["engine", "control-stuck-segment"])
def test_the_engine_follows_its_pool_through_a_restart(engine_cls, follows, path, tmp_path, test_seed, tag):
    """The daemon is killed and restarted under a live engine; its client reconnects and
    is handed the new daemon's segment. The engine's next load and store must use that
    segment (re-registered): pages published to the new pool load byte-exact, and a
    store commits. The control keeps the old mapping: its load reads the dead pool's
    pages (refused as corrupt) and its store's pages fail the new pool's verify."""
    from kvgate.harness.scenarios.gpu_transfer import POOL_PAGE
    from kvgate.harness.system.pool import PoolProcess

    (tmp_path / "pool").mkdir()
    pool = PoolProcess.start(page_size=POOL_PAGE, num_pages=64, run_dir=tmp_path / "pool")
    try:
        with pool.client(name="restart", timeout_s=30.0) as client:
            geom = GEOMETRIES["nfirst-512k"]
            ns = namespace(geom, tag + engine_cls.__name__ + path.value)
            rng = np.random.default_rng(test_seed)
            k = 6
            layers = make_kv(geom, CUDA)
            host = fill(layers, geom.block_dim, rng, geom.page_bytes)
            torch.cuda.synchronize()
            with engine_cls(client, ns, layers, geom.config(path)) as engine:
                _, warm = _published(client, ns, geom, rng, k)
                assert engine.load(list(range(k)), warm).loaded == k  # the engine copies from the first segment
                engine.drain()
                first = client.arena.instance
                pool.kill()
                pool.restart()
                client.ping()  # reconnects: the client now maps the new daemon's segment
                assert client.arena.instance != first
                pages, hashes = _published(client, ns, geom, rng, k)
                blocks = list(range(k, 2 * k))
                h = engine.load(blocks, hashes)
                engine.wait_for_load(h)
                got = read_pages(layers, geom.block_dim, blocks).cpu().numpy()
                stored = block_hashes(range(1 << 29, (1 << 29) + 16 * k), 16)
                engine.store(list(range(2 * k, 3 * k)), stored)
                outcomes = engine.drain()
                reattached, memory = engine.reattached, engine.capabilities.host_memory
            scrub = scrubbed(client)
            visible = len(client.lookup(ns, stored).hits)
    finally:
        pool.stop()
        pool.cleanup()
    store_out = [o for o in outcomes if isinstance(o, StoreOutcome)]
    if follows:
        assert h.loaded == k and h.miss is None and np.array_equal(got, pages), h
        assert visible == k and store_out[0].committed == k, store_out
        assert scrub["scrubbed_pages"] >= k and scrub["scrub_corrupt"] == 0, scrub
        assert reattached == 1 and memory == HostMemory.REGISTERED
    else:
        assert h.loaded == 0 and h.miss.cause == MissCause.CORRUPT, f"negative control NOT caught: {h}"
        assert visible == 0 and scrub["scrub_corrupt"] == k, f"negative control NOT caught: {visible} stored " \
            f"blocks visible, scrub {scrub}"
    assert not np.array_equal(host[blocks], pages)  # what the blocks held before differs from the pages


@pytest.mark.fault_stream_delay
@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("scenario", [Scenario.STORE_RAW, Scenario.LOAD_WAR])
def test_pageable_fallback_when_registration_is_refused(scenario, path, gpu_pool, client, delay_cycles, test_seed,
                                                         tag):
    geom = GEOMETRIES["nfirst-16k"]
    ns = namespace(geom, tag)
    caps = []

    def make(layers, drop):  # noqa: ANN001, ANN202
        cfg = geom.config(path)
        engine = (RefusedRegistrationEngine(client, ns, layers, cfg) if drop is None
                  else RefusedUnorderedEngine(client, ns, layers, cfg, drop=drop))
        caps.append(engine.capabilities)
        return engine

    check_with_control(scenario, geom, make, client, ns, test_seed, delay_cycles)
    assert all(c.host_memory == HostMemory.PAGEABLE and "refused" in c.host_memory_reason for c in caps), caps
    assert not any(c.batched_copies for c in caps)


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
def test_capabilities_registered_and_batched(path, client, tag):
    geom = GEOMETRIES["flash-128k"]
    layers = make_kv(geom, CUDA)
    with TransferEngine(client, namespace(geom, tag), layers, geom.config(path)) as engine:
        caps = engine.capabilities
    print(caps)
    assert caps.host_memory == HostMemory.REGISTERED, caps
    if path == CopyPath.DRIVER:
        assert caps.batched_copies, f"cuMemcpyBatchAsync not used: {caps.batched_reason}"


def test_store_passes_the_pools_answers_through(client, test_seed, tag):
    geom = GEOMETRIES["nfirst-16k"]
    ns = namespace(geom, tag)
    rng = np.random.default_rng(test_seed)
    layers = make_kv(geom, CUDA)
    fill(layers, geom.block_dim, rng, geom.page_bytes)
    torch.cuda.synchronize()
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * 20), 16)
    with TransferEngine(client, ns, layers, geom.config(CopyPath.TORCH)) as engine:
        engine.store(range(20), hashes)
        (first,) = engine.drain()
        engine.store(range(20), hashes)
        (again,) = engine.drain()
        more = block_hashes(range(base + 10**6, base + 10**6 + 16 * 9), 16)
        engine.store(range(20, 29), more, boundary=4)
        (bounded,) = engine.drain()
        with pytest.raises(InvalidRequest):
            engine.store([1, 1], hashes[:2])
        with pytest.raises(InvalidRequest):
            engine.load([geom.num_blocks], hashes[:1])
    assert isinstance(first, StoreOutcome) and first.committed == 20 and not first.errors, first
    assert again.committed == 0 and again.exists == 20, again
    assert bounded.committed == 4 and bounded.not_admitted == 5, bounded
    for i in (0, 7, 19):  # the page order is block_page's
        page = client.arena.page(client.lookup(ns, hashes).hits[i].page, geom.page_bytes)
        assert np.array_equal(np.asarray(page), block_page(layers, geom.block_dim, i).cpu().numpy())


def test_layout_and_namespace_are_checked(client, tag):
    geom = GEOMETRIES["flash-128k"]
    layers = make_kv(geom, CUDA)
    ns = namespace(geom, tag)
    with pytest.raises(KVLayoutError):
        TransferEngine(client, ns, layers[:-1], geom.config(CopyPath.TORCH))
    with pytest.raises(KVLayoutError):
        TransferEngine(client, ns, [t.cpu() for t in layers], geom.config(CopyPath.TORCH))
    with pytest.raises(KVLayoutError):  # a block dim that is not the one of the layout: blocks disagree
        TransferEngine(client, ns, layers[:1] + [t.transpose(0, 1) for t in layers[1:]], geom.config(CopyPath.TORCH))
