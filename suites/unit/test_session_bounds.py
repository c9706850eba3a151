"""What one client can make the catalog hold across frames is bounded: the pages its leases
pin (each lease costs memory per page until released), and the namespaces interned (each
reserve under a new namespace used to add one for good)."""

import pytest

from kvpool.pool.catalog import Catalog, CatalogConfig
from kvpool.pool.records import SlotStatus
from kvpool.errors import InvalidRequest, MissCause
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
HS = block_hashes(range(64), 16)[:4]


def _ns(i: int) -> Namespace:
    return Namespace("m", f"r{i}", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


def _committed(cat: Catalog, ns: Namespace = NS, hashes=HS, client: int = 1) -> None:  # noqa: ANN001
    res = cat.reserve(client, "default", ns, hashes, [16] * len(hashes), 0.0)
    assert cat.commit(res.reservation_id, [bytes(16)] * len(hashes)).committed == len(hashes)


def test_a_clients_leases_pin_at_most_four_times_the_pages():
    cat = Catalog(CatalogConfig(num_pages=4, page_size=16))
    _committed(cat)
    leases = [cat.acquire(7, "default", NS, HS, 0.0) for _ in range(4)]  # 16 pages pinned: the bound
    assert all(a.lease_id and len(a.hits) == 4 for a in leases)
    over = cat.acquire(7, "default", NS, HS, 0.0)
    assert over.lease_id == 0 and over.miss.cause == MissCause.THROTTLED
    assert cat.acquire(8, "default", NS, HS[:1], 0.0).lease_id  # another client is not held back
    cat.release(leases[0].lease_id)
    assert cat.acquire(7, "default", NS, HS, 0.0).lease_id  # released pins are counted out
    cat.drop_client(7)
    assert all(cat.acquire(7, "default", NS, HS, 0.0).lease_id for _ in range(4))


def test_reserves_under_ever_new_namespaces_intern_at_most_the_table():
    cat = Catalog(CatalogConfig(num_pages=4, page_size=16))
    for i in range(6000):  # each publish abandoned: nothing of its namespace stays
        res = cat.reserve(1, "default", _ns(i), HS[:1], [16], 0.0)
        cat.abort(res.reservation_id)
    assert len(cat._namespaces) <= 4096, len(cat._namespaces)  # noqa: SLF001 - 6000 before the bound
    assert len(cat._ns_ids) <= cat.config.max_namespaces == 4096  # noqa: SLF001


def test_a_full_namespace_table_forgets_the_unused_and_refuses_past_the_live():
    cat = Catalog(CatalogConfig(num_pages=8, page_size=16, max_namespaces=3))
    _committed(cat, _ns(1), HS[:1])
    _committed(cat, _ns(2), HS[1:2])
    _committed(cat, _ns(3), HS[2:3])
    assert cat.evict("default", _ns(3), HS[2:3]) == ["evicted"]  # a ghost of namespace 3
    _committed(cat, _ns(4), HS[2:3])  # namespace 3 forgotten, its id reused: no ghost carries over
    assert cat.lookup("default", _ns(4), HS[2:3]).hits
    assert cat.lookup("default", _ns(3), HS[2:3]).miss.cause == MissCause.INCOMPATIBLE
    assert cat.lookup("default", _ns(1), HS[:1]).hits and cat.lookup("default", _ns(2), HS[1:2]).hits
    with pytest.raises(InvalidRequest, match="namespaces"):
        cat.reserve(1, "default", _ns(5), HS[3:4], [16], 0.0)
    assert cat.evict("default", _ns(2), HS[1:2]) == ["evicted"]
    res = cat.reserve(1, "default", _ns(5), HS[3:4], [16], 0.0)
    assert res.slots[0].status == SlotStatus.RESERVED
