"""Tenants and the pool-wide operations: a tenant's Stats counts only its own pages; its
SetCapacity and Metrics are refused unless it is an admin (by default the only tenant of
a single-tenant pool); another tenant's blocks stay invisible to its lookups."""

from __future__ import annotations

import numpy as np
import pytest

from harness.system.pool import thread_pool
from kvpool.client import PoolClient, publish
from kvpool.errors import MissCause, Unauthenticated
from kvpool.keys import Namespace, block_hashes


def ns(tenant: str) -> Namespace:
    return Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64, tenant=tenant)


def client(d, tenant: str) -> PoolClient:  # noqa: ANN001
    return PoolClient(f"unix:{d.unix_path}", tenant, f"tok-{tenant}")


@pytest.fixture
def two_tenants():
    d = thread_pool(page_size=4096, num_pages=16, tenants={"a": "tok-a", "b": "tok-b"})
    yield d
    d.stop_thread()


def test_a_tenant_sees_only_its_own_pages_and_no_pool_wide_operation(two_tenants):
    d = two_tenants
    hs = block_hashes(range(48), 16)
    with client(d, "a") as a, client(d, "b") as b:
        assert publish(a, ns("a"), hs, [np.zeros(4096, np.uint8)] * 3).committed == 3
        assert b.lookup(ns("b"), hs).miss.cause == MissCause.NEVER_PUBLISHED  # not even "incompatible"
        assert b.stats() == {"tenant_committed_pages": 0, "tenant_reserved_pages": 0, "tenant_leased_pages": 0}
        assert a.stats()["tenant_committed_pages"] == 3 and "free_pages" not in a.stats()
        for c in (a, b):
            with pytest.raises(Unauthenticated, match="pool-wide"):
                c.set_capacity(0)
            with pytest.raises(Unauthenticated, match="pool-wide"):
                c.metrics_text()
        assert a.lookup(ns("a"), hs).miss is None  # nothing was evicted by the refused squeeze


def test_a_named_admin_may_and_the_single_tenant_of_a_pool_is_one():
    d = thread_pool(page_size=4096, num_pages=16, tenants={"a": "tok-a", "ops": "tok-ops"}, admins=frozenset({"ops"}))
    try:
        with client(d, "ops") as ops, client(d, "a") as a:
            assert ops.set_capacity(16) == 0 and "free_pages" in ops.stats()
            with pytest.raises(Unauthenticated):
                a.set_capacity(16)
    finally:
        d.stop_thread()
    single = thread_pool(page_size=4096, num_pages=16, tenants={"solo": "tok-solo"})
    try:
        with client(single, "solo") as solo:
            assert solo.set_capacity(16) == 0 and "free_pages" in solo.stats() and solo.metrics_text()
    finally:
        single.stop_thread()
