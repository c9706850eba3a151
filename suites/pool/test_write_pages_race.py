"""The daemon's write into a reservation (WritePages: a client that does not map the segment sends
its bytes, and the daemon copies them in its thread pool) outlives nothing it was given: while
that write waits in the queue its reservation may go (its TTL passes: the connection reads no
renewal while a request of it is pending; its client goes), and its pages then stay reserved
until the write has ended (kvpool.pool.catalog.Catalog.begin_write / end_write). Freed at once,
the page could be reserved and committed by another client and then overwritten by the late
write.

The interleaving is forced, not hoped for: the daemon's thread pool holds A's write until the
test lets it go; the pool's grants live by a ManualClock the test moves past A's TTL, and a whole
reaper round runs before B publishes. Oracle: B's committed block loads byte-exact, B's bytes.
Control (kvgate.faults.race_controls.FreedUnderWriteCatalog: the pages freed at once): B
reserves A's page while A's write waits, A's write lands in B's committed page, and B's load of
its own block is refused corrupt, caught by the oracle."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np
import pytest

from kvgate.faults.race_controls import FreedUnderWriteCatalog
from kvgate.harness.system.pool import DEFAULT_TENANT, ManualClock, thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.errors import InvalidRequest
from kvpool.pool.catalog import Catalog
from kvpool.pool.keys import Namespace, block_hashes

PAGE = 4096
TTL_S = 30.0
NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


class HeldPool(cf.Executor):
    """The daemon's thread pool, whose next page write (its job `write`, kvpool.pool.handlers)
    after `hold()` waits for `go`; every other job runs as it comes."""

    def __init__(self, inner: cf.Executor):
        self.inner, self.armed = inner, False
        self.held, self.go = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.armed = True

    def submit(self, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        if not self.armed or getattr(fn, "__name__", "") != "write":
            return self.inner.submit(fn, *args, **kwargs)
        self.armed = False

        def later():  # noqa: ANN202
            self.held.set()
            if not self.go.wait(30):
                raise TimeoutError("the test never let the held job go")
            return fn(*args, **kwargs)
        return self.inner.submit(later)

    def shutdown(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        self.go.set()
        self.inner.shutdown(*args, **kwargs)


def run(catalog: type[Catalog]) -> dict:
    clock = ManualClock()
    d = thread_pool(page_size=PAGE, num_pages=1, reservation_ttl_s=TTL_S, reap_interval_s=0.01, clock=clock,
                    scrub_rest_pages_per_round=0, catalog_factory=catalog)
    out: dict = {}
    try:
        held = d._executor = HeldPool(d._executor)  # noqa: SLF001 - the interleaving is the test's
        ha, hb = block_hashes(range(32), 16)
        mine = np.random.default_rng(5).integers(0, 256, PAGE, dtype=np.uint8)
        with PoolClient(f"unix:{d.unix_path}", DEFAULT_TENANT, "tok", name="A", zero_copy=False) as a, \
                PoolClient(f"unix:{d.unix_path}", DEFAULT_TENANT, "tok", name="B") as b:
            res = a.reserve(NS, [ha], [PAGE])
            held.hold()
            writer = cf.ThreadPoolExecutor(1).submit(a.write_page, res, 0, b"\xaa" * PAGE)
            assert held.held.wait(30), "A's write never reached the daemon's thread pool"
            clock.advance(TTL_S + 1)  # A's reservation expires while its write waits
            clock.settle(d)
            again = b.reserve(NS, [ha], [PAGE])  # A's block itself: free to publish again, not pending
            out["a_block_while_writing"] = again.slots[0].status.value
            if again.reservation_id:
                b.abort(again.reservation_id)
            out["b_while_writing"] = publish(b, NS, [hb], [mine]).committed
            held.go.set()
            writer.result(30)  # A's write has run (into its own page, or into B's)
            with pytest.raises(InvalidRequest, match="not open"):
                a.commit(res.reservation_id, [b"\x00" * 16])
            out["b_after"] = publish(b, NS, [hb], [mine]).committed if not out["b_while_writing"] else 0
            got = np.zeros(PAGE, np.uint8)
            r = load(b, NS, [hb], lambda i: got)
            out.update(loaded=r.loaded, cause=None if r.miss is None else r.miss.cause.value,
                       exact=bool(r.loaded == 1 and np.array_equal(got, mine)),
                       used=d.pools[DEFAULT_TENANT].catalog.used_pages())
    finally:
        d.stop_thread()
    return out


def test_a_reservation_gone_while_the_daemon_writes_into_it_keeps_its_page_until_the_write_ends():
    out = run(Catalog)
    assert out["b_while_writing"] == 0  # the only page is still A's: its write is to run
    assert out["a_block_while_writing"] == "no_capacity", out  # not pending: A's reservation is gone
    assert out["b_after"] == 1  # freed once the write ended
    assert out["exact"] is True and out["used"] == 1, out  # the oracle: B's block is B's bytes


def test_control_a_page_freed_under_the_write_is_caught_by_the_byte_exact_oracle():
    out = run(FreedUnderWriteCatalog)
    assert out["b_while_writing"] == 1  # B took A's page while A's write waited
    assert out["exact"] is False and out["cause"] == "corrupt", out  # caught: A's bytes in B's page
