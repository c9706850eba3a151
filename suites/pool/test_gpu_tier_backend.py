"""A keeper's tier as a pool backend (kvpool.gpu.tier_backend.TierBackend): the generic publish
and load (kvpool.client.transfer) through `python -m kvpool keeper --backing memfd` in its own
process, two links in this process (a producer's and a consumer's, each its own session and
mapping). Faults where the data is: a bit of a committed page flipped in the keeper's buffer.

  guard                                  oracle                              control
  the load's digest check (kv-sketch-1)  the consumer installs only pages    the same lease and copies
                                         equal to the producer's bytes; a    without the check: the
                                         flipped page is a corrupt miss at   flipped page is installed
                                         its index, the ones before it       and the byte-exact oracle
                                         loaded byte-exact                   names it
The connector's copy engine (HostCopier) on the backend its settings make of `keeper:RUN_DIR`,
under the stream-delay fault of the store: the bytes of save time land in the tier, and the
early-completion control (the store said done before its copy ran) is caught by the byte-exact
oracle in another copier's load of all four blocks.
A lease held across a keeper's restart: its release is refused and the new instance's lease of
the same keeper id stays its holder's (the backend's ids are its own); control KeeperIdTierBackend,
caught by the new lease's release.
Plus: a commit of another digest kind is refused by the keeper and the reservation aborted
(nothing visible); renewal through the backend; evict and device pages refused as typed errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.faults.keeper_controls import KeeperIdTierBackend
from kvgate.harness.scenarios import gpu_keeper_wire as W
from kvpool.client import transfer
from kvpool.errors import InvalidRequest, LeaseLost, MissCause
from kvpool.gpu.tier_backend import TierBackend
from kvpool.gpu.tier_client import TierLink
from kvpool.pool.digest import DigestKind

from .lanes import hold
from .test_gpu_keeper_restart import PAGE, Keeper

BLOCKS = 6


def blocks(seed: int, n: int = BLOCKS) -> list[np.ndarray]:
    return [W.page_bytes(seed, i, PAGE) for i in range(n)]


@pytest.fixture
def keeper(tmp_path):
    run_dir = tmp_path / "k"
    run_dir.mkdir(mode=0o700)
    k = Keeper(run_dir, "--pages", "16")
    try:
        yield run_dir
    finally:
        k.stop()


def backend(run_dir, name: str) -> TierBackend:  # noqa: ANN001
    return TierBackend(TierLink(run_dir, "default", "tok", name=name, timeout_s=10.0).connect())


def load_into(b: TierBackend, keys: list[bytes]) -> tuple[transfer.LoadResult, np.ndarray]:
    dest = np.zeros((len(keys), PAGE), dtype=np.uint8)
    return transfer.load(b, W.NS, keys, lambda i: dest[i]), dest


def test_blocks_published_through_the_keeper_load_byte_exact_in_another_session(keeper, test_seed):
    p, c = backend(keeper, "P"), backend(keeper, "C")
    try:
        keys, src = W.KEYS(BLOCKS), blocks(test_seed)
        out = transfer.publish(p, W.NS, keys, src, kind=DigestKind.SKETCH)
        assert (out.offered, out.committed, out.rejected) == (BLOCKS, BLOCKS, 0)
        got, dest = load_into(c, keys)
        assert got.loaded == BLOCKS and got.miss is None, got
        assert all(np.array_equal(dest[i], src[i]) for i in range(BLOCKS))  # byte-exact
        assert c.lookup(W.NS, keys).hits and not c._leases  # the lease was released  # noqa: SLF001
    finally:
        p.close()
        c.close()


def trusting_load(b: TierBackend, keys: list[bytes]) -> tuple[int, np.ndarray]:
    """The control: the same lease, copy and release as transfer.load, without its digest check."""
    dest = np.zeros((len(keys), PAGE), dtype=np.uint8)
    acq = b.acquire(W.NS, keys)
    try:
        for i in range(len(acq.hits)):
            dest[i] = b.read_page(acq, i)
    finally:
        b.release(acq.lease_id)
    return len(acq.hits), dest


def test_a_flipped_bit_in_the_tier_is_a_corrupt_miss_and_the_unchecked_control_is_caught(keeper, test_seed):
    p, c = backend(keeper, "P"), backend(keeper, "C")
    try:
        keys, src = W.KEYS(BLOCKS), blocks(test_seed)
        transfer.publish(p, W.NS, keys, src, kind=DigestKind.SKETCH)
        bad = test_seed % BLOCKS
        lease = c.link.acquire(W.NS, keys)
        where = lease.result.hits.pages[bad]
        c.link.release(lease)
        mapped = np.frombuffer(p.link.client.tier.page_view(where), dtype=np.uint8)
        mapped[(test_seed * 7919) % PAGE] ^= 1 << (test_seed % 8)  # the fault, in the keeper's buffer
        got, dest = load_into(c, keys)
        assert got.loaded == bad and got.miss is not None and got.miss.cause == MissCause.CORRUPT, got
        assert all(np.array_equal(dest[i], src[i]) for i in range(bad))  # what was installed is exact

        # control: the load without its digest check installs every page; the byte-exact oracle
        # (installed against the producer's bytes) sees the flipped one
        loaded, dest2 = trusting_load(c, keys)
        differ = [i for i in range(loaded) if not np.array_equal(dest2[i], src[i])]
        assert loaded == BLOCKS and differ == [bad], "the byte-exact oracle missed the flipped page"
    finally:
        p.close()
        c.close()


def test_another_digest_kind_is_refused_and_nothing_becomes_visible(keeper, test_seed):
    p = backend(keeper, "P")
    try:
        keys = W.KEYS(2, base=500)
        with pytest.raises(InvalidRequest):
            transfer.publish(p, W.NS, keys, blocks(test_seed, 2), kind=DigestKind.XXH3)
        assert len(p.lookup(W.NS, keys).hits) == 0 and not p._reservations  # aborted  # noqa: SLF001
        res = p.reserve(W.NS, keys, [PAGE] * 2)
        got = p.renew([res.reservation_id], [])
        assert [(r.id, r.refused) for r in got.reservations] == [(res.reservation_id, None)]
        assert got.reservations[0].ttl_s > 0 and p.reservation_ttl_s > 0
        p.abort(res.reservation_id)
        with pytest.raises(InvalidRequest):
            p.evict(W.NS, keys)
    finally:
        p.close()


def test_device_pages_are_refused_to_the_host_path():
    class DeviceLink:
        client = object()

        def page_view(self, grant, index):  # noqa: ANN001, ANN201
            return object()  # what a CudaArray is to the host: not a buffer

    b = TierBackend(DeviceLink())
    with pytest.raises(InvalidRequest, match="device memory"):
        b._host_view(object(), 0)  # noqa: SLF001


# -- the connector's copy engine through the keeper ----------------------------------------------

def copier(run_dir, tmp_path, name: str, spec: dict | None = None):  # noqa: ANN001, ANN201
    """The connector's HostCopier on the backend its settings make of a keeper: address
    (connect_backend), wrapped in the stream-delay fault (and its control) when `spec` says."""
    import json

    from kvgate.faults.copier import FaultyCopier
    from kvpool.connector.copier import HostCopier
    from kvpool.connector.history import HistoryWriter
    from kvpool.connector.settings import ConnectorSettings, connect_backend

    settings = ConnectorSettings.from_extra({"pool": f"keeper:{run_dir}", "token": "tok", "replica": name})
    history = HistoryWriter(tmp_path / "history", name, "worker")
    backend = connect_backend(settings, "worker", history)
    assert isinstance(backend, TierBackend) and backend.digest_kind == DigestKind.SKETCH
    inner = HostCopier(backend, history)
    if spec is None:
        return inner
    control = tmp_path / f"faults-{name}.json"
    control.write_text(json.dumps({"copier": spec}))
    return FaultyCopier(inner, control, history)


LAYERS, ENGINE_BLOCKS = 2, 8
BLOCK_BYTES = PAGE // LAYERS  # a page = one block of both layers


def engine(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (ENGINE_BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)]


def page_of(layers: list[np.ndarray], block: int) -> bytes:
    return np.concatenate([layer[block] for layer in layers]).tobytes()


def store_then_reuse(run_dir, tmp_path, seed: int, spec: dict,  # noqa: ANN001
                     held: bool = False) -> tuple[list[bytes], list[bytes]]:
    """Store blocks 0..3 through the keeper with the copy delayed (and, if `held`, queued
    behind a held lane, released after the reuse); as soon as the copier says the store is
    done the engine reuses the blocks; then another copier loads them. Returns (the pages at
    save time, the pages loaded)."""
    from kvpool.connector.copier import CopyRun

    keys = W.KEYS(4, base=seed % 10_000 * 10)
    p = copier(run_dir, tmp_path, "P", spec)
    src = engine(seed)
    p.register(src)
    produced = [page_of(src, b) for b in range(4)]
    release = hold(p, "store") if held else None
    p.wait([p.store(W.NS, CopyRun("p", "p", 0, [0, 1, 2, 3], keys), range(4))], timeout_s=30)
    for layer in src:  # the blocks are freed and another request's prefill writes them
        layer[:4] = np.random.default_rng(seed + 1).integers(0, 256, layer[:4].shape, dtype=np.uint8)
    if release is not None:
        release.set()
    p.close()  # its lanes drained: a late copy has landed by now
    c = copier(run_dir, tmp_path, "C")
    dst = engine(seed + 7)
    c.register(dst)
    c.wait([c.load(W.NS, CopyRun("c", "c", 0, [4, 5, 6, 7], keys), deadline_s=10)], 30)
    c.close()
    return produced, [page_of(dst, b) for b in (4, 5, 6, 7)]


def test_the_connectors_copier_stores_through_the_keeper_the_bytes_of_save_time_under_a_delay(keeper, tmp_path,
                                                                                               test_seed):
    produced, loaded = store_then_reuse(keeper, tmp_path, test_seed, {"store_delay_ms": 300})
    assert loaded == produced  # byte-exact: the delayed copy was done before the store said so


def test_the_early_completion_control_through_the_keeper_is_caught(keeper, tmp_path, test_seed):
    from kvpool.connector.history import read_history

    produced, loaded = store_then_reuse(keeper, tmp_path, test_seed,
                                        {"store_delay_ms": 300, "control": "early_completion"}, held=True)
    loads = [r for r in read_history(tmp_path / "history") if r["ev"] == "load" and r.get("replica") == "C"]
    assert loads and loads[-1]["loaded"] == 4, loads  # C loaded all four: what it got is what the tier holds
    assert loaded != produced, "the byte-exact oracle missed a store that completed before its copy"


@pytest.mark.fault_pool_restart
@pytest.mark.parametrize("backend_cls,checked", [(TierBackend, True), (KeeperIdTierBackend, False)],
                         ids=["backend", "control-keeper-ids"])
def test_a_lease_held_across_a_keeper_restart_never_names_the_new_instances_lease(tmp_path, test_seed,
                                                                                     backend_cls, checked):
    """C holds a lease of instance 1 across the keeper's restart (a load whose copies still run)
    and then takes a lease of instance 2 that the keeper numbers as the first (ids restart at
    1). The old lease's release must be refused (WrongInstance) and the new lease must stay
    C's until its own release; both renew under the backend's ids. Control
    (KeeperIdTierBackend): the two share one id, the old release ends the new lease under its
    holder, whose own release is then LeaseLost."""
    run_dir = tmp_path / "k"
    run_dir.mkdir(mode=0o700)
    k1, k2 = Keeper(run_dir, "--pages", "16"), None
    p = backend(run_dir, "P")
    c = backend_cls(TierLink(run_dir, "default", "tok", name="C", timeout_s=10.0).connect())
    keys, src = W.KEYS(3, base=test_seed % 1000), blocks(test_seed, 3)
    try:
        assert transfer.publish(p, W.NS, keys, src, kind=DigestKind.SKETCH).committed == 3
        old = c.acquire(W.NS, keys)
        old_keeper_id = c._leases[old.lease_id].lease_id  # noqa: SLF001
        k1.kill()
        k2 = Keeper(run_dir, "--pages", "16", before=k1.address.instance)
        assert len(c.lookup(W.NS, keys).hits) == 0  # reconnected: an empty tier
        assert transfer.publish(p, W.NS, keys, src, kind=DigestKind.SKETCH).committed == 3
        new = c.acquire(W.NS, keys)
        assert len(new.hits) == 3
        assert c._leases[new.lease_id].lease_id == old_keeper_id  # noqa: SLF001 - the keeper counts from 1 again
        renewed = c.renew([], [new.lease_id]).leases
        try:
            c.release(old.lease_id)
            old_release = "released"
        except LeaseLost as exc:
            old_release = type(exc).__name__
        try:
            c.release(new.lease_id)
            new_release = "released"
        except LeaseLost as exc:
            new_release = type(exc).__name__
    finally:
        p.close()
        c.close()
        k1.stop()
        if k2 is not None:
            k2.stop()
    if checked:
        assert old.lease_id != new.lease_id
        assert [(r.id, r.refused) for r in renewed] == [(new.lease_id, None)], renewed
        assert (old_release, new_release) == ("WrongInstance", "released"), (old_release, new_release)
    else:
        assert (old_release, new_release) == ("released", "LeaseLost"), \
            f"negative control NOT caught: the old lease's release gave {old_release}, the new one's {new_release}"
