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
Plus: a commit of another digest kind is refused by the keeper and the reservation aborted
(nothing visible); renewal through the backend; evict and device pages refused as typed errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.harness.scenarios import gpu_keeper_wire as W
from kvpool.client import transfer
from kvpool.errors import InvalidRequest, MissCause
from kvpool.gpu.tier_backend import TierBackend
from kvpool.gpu.tier_client import TierLink
from kvpool.pool.digest import DigestKind

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
