"""The catalog's per-lease work done for all of a lease's pages at once (kvpool.pool.catalog:
_touch_all, the leases' counts, the release's generation check and unpin), against the same work
one page at a time: the LRU order after a lease equals the order touching its pages in turn
leaves, a page named twice included; a lease's pages are counted once per naming and freed once
when dropped under it; a release reports exactly the pages reused under it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.pool.catalog import Catalog, CatalogConfig, PageState
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.records import SlotStatus

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
D = b"d" * 16


def _lru(cat: Catalog) -> list[int]:
    out, page, seen = [], cat._head, set()  # noqa: SLF001 - the order itself is under test
    while page >= 0:
        assert page not in seen, "a cycle in the LRU list"
        seen.add(page)
        out.append(page)
        page = cat._next[page]  # noqa: SLF001
    back, page = [], cat._tail  # noqa: SLF001
    while page >= 0:
        assert len(back) <= len(out), "a cycle in the LRU list read backwards"
        back.append(page)
        page = cat._prev[page]  # noqa: SLF001
    assert back[::-1] == out, "the list read backwards differs"
    return out


def _committed(n: int) -> tuple[Catalog, list[bytes]]:
    cat = Catalog(CatalogConfig(num_pages=n + 4, page_size=1024))
    hs = block_hashes(list(range(16 * n)), 16)
    res = cat.reserve(1, "default", NS, hs, [100] * n, 0.0)
    assert all(s.status == SlotStatus.RESERVED for s in res.slots)
    cat.commit(res.reservation_id, [D] * n)
    return cat, hs


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 12), picks=st.lists(st.integers(0, 11), max_size=20), data=st.data())
def test_touching_a_leases_pages_at_once_leaves_the_order_touching_them_in_turn_leaves(n, picks, data):
    cat, hs = _committed(n)
    pages = cat.lookup("default", NS, hs).hits.pages
    # some history first: touches of random pages, one at a time
    for i in data.draw(st.lists(st.integers(0, n - 1), max_size=10)):
        cat._touch(pages[i])  # noqa: SLF001
    want = Catalog.__new__(Catalog)
    want.__dict__.update({k: (list(v) if isinstance(v, list) else v) for k, v in cat.__dict__.items()})
    batch = [pages[i % n] for i in picks]
    for p in batch:
        want._touch(p)  # noqa: SLF001
    cat._touch_all(batch)  # noqa: SLF001
    assert _lru(cat) == _lru(want)
    assert cat._linked == want._linked  # noqa: SLF001


def test_a_page_named_twice_is_leased_twice_and_freed_once_when_dropped_under_the_lease():
    cat, hs = _committed(3)
    page = cat.lookup("default", NS, hs[:1]).hits.pages[0]
    got = cat.acquire(7, "default", NS, [hs[0], hs[1], hs[0]], 1.0)
    assert got.hits.pages == [page, cat.lookup("default", NS, hs[1:2]).hits.pages[0], page]
    assert int(cat.leases_on[page]) == 2
    assert cat.discard(page, got.hits.generations[0]) is True  # corrupt: dropped under the lease, freed when it ends
    assert int(cat.state[page]) == PageState.DROPPED
    gen = int(cat.gen[page])
    free_before = len(cat._free)  # noqa: SLF001
    stale = cat.release(got.lease_id).stale
    assert stale == ()  # dropped, not yet reused: its generation still the lease's
    assert int(cat.leases_on[page]) == 0 and int(cat.state[page]) == PageState.FREE
    assert int(cat.gen[page]) == gen + 1 and len(cat._free) == free_before + 1  # noqa: SLF001


def test_a_release_names_exactly_the_pages_reused_under_its_lease():
    cat, hs = _committed(4)
    got = cat.acquire(7, "default", NS, hs, 1.0)
    pages = got.hits.pages
    for p in (pages[1], pages[3]):  # the generation moved, as a reuse moves it
        cat.gen[p] += 1
    assert cat.release(got.lease_id).stale == (pages[1], pages[3])
