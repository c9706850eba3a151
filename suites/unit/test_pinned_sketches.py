"""The GPU engine's pool of sketch buffers for stores: a returned buffer is handed out
again (the smallest that fits), a request larger than every free one allocates, and the
pool keeps at most KEEP buffers."""

import pytest

torch = pytest.importorskip("torch")
from kvpool.gpu.staging import PinnedSketches  # noqa: E402


def test_buffers_are_reused_smallest_fit_first_and_bounded():
    pool = PinnedSketches(rows=4, least=8, pin=False)
    small, big = pool.take(3), pool.take(100)
    assert small.shape == (8, 4, 16) and big.shape == (128, 4, 16)  # at least `least`, powers of two
    pool.give(big)
    pool.give(small)
    assert pool.take(2) is small  # the smallest that fits, found by identity (not by ==)
    assert pool.take(50) is big
    assert pool.take(50) is not big  # none free: a new one
    for n in range(1, 8):
        pool.give(pool.take(8 * 2**n))
        pool.give(torch.empty((8 * n, 4, 16), dtype=torch.int32))
    assert len(pool._free) == PinnedSketches.KEEP
