"""kvpool.pool.copy.prefault: every page of a host array resident and writable afterwards, its
bytes unchanged. Residency is read from mincore(2) over the array's pages; the control is
the same fresh array without prefault, whose untouched pages are not resident."""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest

from kvpool.pool.copy import prefault

PAGE = mmap.PAGESIZE


def _fresh(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8)


def _resident(arr: np.ndarray) -> int:
    """Pages of `arr` (page-aligned) resident now, by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    n = arr.size // PAGE
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(n * PAGE), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("fault", [True, False])
def test_prefault_makes_every_page_resident_and_keeps_the_bytes(fault):
    pages = 512
    m, arr = _fresh(pages * PAGE)
    try:
        assert _resident(arr) == 0
        if fault:
            assert prefault(arr) in ("populate", "touch")
            assert _resident(arr) == pages
            assert not arr.any()  # a fresh mapping reads zeros, and still does
        else:  # the control: nothing faults the pages in
            assert _resident(arr) == 0
    finally:
        del arr
        m.close()


def test_prefault_keeps_written_bytes_and_takes_any_alignment():
    data = np.random.default_rng(7).integers(0, 256, 5 * PAGE + 123, dtype=np.uint8)
    view = data[17:]  # not page-aligned at either end
    before = view.copy()
    assert prefault(view) in ("populate", "touch")
    assert np.array_equal(view, before)
    assert prefault(np.zeros(0, dtype=np.uint8)) == "none"
