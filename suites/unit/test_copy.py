"""Fused copy + digest across arbitrary segment boundaries."""

import numpy as np
import pytest

from kvpool.pool.copy import as_segments, copy_digest
from kvpool.pool.digest import page_digest


@pytest.mark.parametrize("src_cuts,dst_cuts,chunk", [
    ([1000], [1000], 64), ([300, 700], [1000], 128), ([1000], [1, 999], 7), ([250] * 4, [400, 600], 1000),
])
def test_copy_digest_equals_copy_then_digest(src_cuts, dst_cuts, chunk):
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, sum(src_cuts), dtype=np.uint8)
    src = np.split(data, np.cumsum(src_cuts)[:-1])
    dst = [np.zeros(n, np.uint8) for n in dst_cuts]
    digest = copy_digest(src, dst, chunk=chunk)
    assert np.array_equal(np.concatenate(dst), data)
    assert digest == page_digest(data)


def test_size_mismatch_and_non_contiguous_are_refused():
    with pytest.raises(ValueError):
        copy_digest([np.zeros(10, np.uint8)], [np.zeros(9, np.uint8)])
    with pytest.raises(ValueError):
        as_segments(np.zeros((4, 4), np.uint8)[:, 1])
    bf = np.zeros((2, 8), dtype=np.float32)
    assert as_segments(bf)[0].size == 64
