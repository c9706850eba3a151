"""The catalog's per-page loops stay in the catalog: releasing a lease and asking whether a
page still holds a commit run no Python code of another module per page. Judged by counting
calls (a profile hook), not by a clock.

What it guards: a page's state compared as a numpy element with a PageState member (numpy
probes the member for its array protocols through the enum's Python code, ~7 us a page) made
the daemon's release of a 1,024-page lease cost 5-9 ms of its event loop instead of ~1 ms.
The negative control runs that comparison itself and the oracle must count it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

import kvpool.pool.catalog as catalog_module
from kvpool.pool.catalog import Catalog, CatalogConfig, PageState
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.records import SlotStatus

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGES = 512
CATALOG_FILE = catalog_module.__file__


def calls_outside_catalog(fn: Callable[[], object]) -> int:
    """Python-level calls into code outside kvpool/pool/catalog.py while `fn` runs."""
    count = 0

    def hook(frame, event, arg) -> None:
        nonlocal count
        if event == "call" and frame.f_code.co_filename != CATALOG_FILE:
            count += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _catalog_with_lease() -> tuple[Catalog, int, list[tuple[int, int]]]:
    cat = Catalog(CatalogConfig(num_pages=PAGES, page_size=1024))
    hs = block_hashes(list(range(16 * PAGES)), 16)
    res = cat.reserve(1, NS.tenant, NS, hs, [100] * PAGES, 0.0)
    assert all(s.status == SlotStatus.RESERVED for s in res.slots)
    cat.commit(res.reservation_id, [b"d" * 16] * PAGES)
    lease = cat.acquire(2, NS.tenant, NS, hs, 0.0)
    assert len(lease.hits) == PAGES
    return cat, lease.lease_id, [(h.page, h.generation) for h in lease.hits]


def test_the_oracle_counts_a_numpy_element_compared_with_a_page_state() -> None:
    states = np.zeros(PAGES, dtype=np.uint8)

    def slow() -> None:
        for p in range(PAGES):
            _ = states[p] == PageState.DROPPED

    assert calls_outside_catalog(slow) >= PAGES


def test_a_release_runs_nothing_outside_the_catalog_per_page() -> None:
    cat, lease_id, _ = _catalog_with_lease()
    calls = calls_outside_catalog(lambda: cat.release(lease_id))
    assert calls < PAGES // 8, f"releasing a lease of {PAGES} pages made {calls} calls outside the catalog"
    assert cat.stats()["leased_pages"] == 0


def test_a_release_frees_a_page_dropped_under_it() -> None:
    cat, lease_id, held = _catalog_with_lease()
    page, gen = held[3]
    assert cat.discard(page, gen) is not None
    assert int(cat.state[page]) == PageState.DROPPED
    assert cat.release(lease_id).stale == ()
    assert int(cat.state[page]) == PageState.FREE
    assert int(cat.gen[page]) == gen + 1


def test_committed_as_runs_nothing_outside_the_catalog() -> None:
    cat, _, held = _catalog_with_lease()

    def ask() -> None:
        for page, gen in held:
            assert cat.committed_as(page, gen) is not None
            assert cat.committed_as(page, gen + 1) is None

    calls = calls_outside_catalog(ask)
    assert calls < PAGES // 8, f"{2 * PAGES} questions made {calls} calls outside the catalog"
