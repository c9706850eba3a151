"""The shared-memory arena: real POSIX shared memory, across processes."""

import multiprocessing as mp

import numpy as np
import pytest

from kvgate.harness.system.pool import unique_name
from kvpool.pool.arena import Arena, ArenaExists
from kvpool.errors import ArenaError


@pytest.fixture
def arena():
    name = unique_name("kvga")
    a = Arena.create(name, page_size=4096, num_pages=8)
    yield a
    a.close()
    Arena.unlink(name)


def _child_writes(name, page, value, q):
    a = Arena.attach(name)
    a.page(page)[:] = value
    q.put((a.page_size, a.num_pages, a.generation(page)))
    a.close()


def test_a_second_process_sees_the_same_bytes_and_generations(arena):
    arena.bump_generation(3)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_writes, args=(arena.name, 3, 0xAB, q))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert q.get(timeout=5) == (4096, 8, 1)
    assert (arena.page(3) == 0xAB).all()
    assert (arena.page(2) == 0).all()
    assert Arena.exists(arena.name), "an attaching process must never unlink the segment"


def test_pages_do_not_overlap(arena):
    for i in range(arena.num_pages):
        arena.page(i)[:] = i
    for i in range(arena.num_pages):
        assert (arena.page(i) == i).all()


def test_bounds_and_names(arena):
    with pytest.raises(ArenaError):
        arena.page(8)
    with pytest.raises(ArenaError):
        arena.page(0, 4097)
    with pytest.raises(ArenaExists):
        Arena.create(arena.name, 4096, 8)
    with pytest.raises(ArenaError):
        Arena.attach(unique_name("missing"))
    with pytest.raises(ArenaError):
        Arena.create("a/b", 4096, 1)
    with pytest.raises(ArenaError):
        Arena.create(unique_name(), 100, 1)


def test_close_refuses_while_a_view_is_held(arena):
    view = arena.page(0)
    with pytest.raises(ArenaError):
        arena.close()
    del view
    arena.close()
    assert arena.closed


def test_attach_rejects_a_foreign_segment(tmp_path):
    name = unique_name("kvgf")
    for path in (f"/dev/shm/{name}", f"/dev/shm/{name}.private"):  # the pages, and where the header is
        with open(path, "wb") as f:
            f.write(b"x" * 8192)
    try:
        with pytest.raises(ArenaError, match="not a kvgate arena"):
            Arena.attach(name)
    finally:
        Arena.unlink(name)


def test_page_address_matches_the_view(arena):
    v = arena.page(5)
    assert arena.page_address(5) == v.ctypes.data
    assert arena.pages_region.size == 8 * 4096
    np.testing.assert_array_equal(arena.pages_region[5 * 4096 : 6 * 4096], v)
