"""A lookup that finds its first missing block's publish in flight waits for it (within a
bound) instead of answering never_published: the daemon over real sockets.

Timing: bounds are generous (WAIT seconds) and each test asserts order (the answer came
after the commit was sent) or "well before the bound", never a small wall time."""

import concurrent.futures
import os
import re
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from kvgate.harness.system.pool import DEFAULT_TENANT, thread_pool, unique_name
from kvpool.pool import protocol as P
from kvpool.pool.arena import processes_mapping, segment_label
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.pool.digest import page_digest
from kvpool.errors import InvalidRequest, MissCause
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import PoolDaemon

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGE = 4096
WAIT = 10.0  # the wait bound the tests ask for: far longer than anything should take


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(n)]


def hashes(n, start=0):
    return block_hashes(range(start * 16, (start + n) * 16), 16)


def client(d, tenant=DEFAULT_TENANT, token="tok", **kw):
    return PoolClient(f"unix:{d.unix_path}", tenant, token, **kw)


def reserve_written(c, ns, hs, seed=0):
    """Phase one of a publish and its page bytes, no commit: (reservation, digests)."""
    blocks = data(len(hs), seed)
    res = c.reserve(ns, hs, [PAGE] * len(hs))
    assert res.reservation_id
    for i, block in enumerate(blocks):
        c.write_page(res, i, block)
    return res, [page_digest(b) for b in blocks]


def wait_until(pred, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))


class Waiter:
    """A lookup in another thread; `.done_at` is when its answer arrived."""

    def __init__(self, c, ns, hs, wait_s=WAIT):
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self.started = time.monotonic()
        self.done_at = None

        def run():
            out = c.lookup(ns, hs, wait_pending_s=wait_s)
            self.done_at = time.monotonic()
            return out

        self._future = self._pool.submit(run)

    def done(self):
        return self._future.done()

    def result(self, timeout=2 * WAIT):
        try:
            return self._future.result(timeout)
        finally:
            self._pool.shutdown(wait=False)


def parked(stats_client, n=1):
    wait_until(lambda: stats_client.stats()["lookup_waiting"] == n, f"{n} lookup(s) parked on a pending publish")


@pytest.fixture
def daemon():
    # No periodic reaping: a waiter must be woken by the event that closes its publish.
    d = thread_pool(page_size=PAGE, num_pages=32, max_lookup_wait_s=60.0, reap_interval_s=3600.0)
    yield d
    d.stop_thread()
    assert os.getpid() not in processes_mapping(segment_label(d.config.name, ""))


def test_a_lookup_waits_for_the_pending_commit_and_then_hits_every_block(daemon):
    hs = hashes(3)
    with client(daemon, name="producer") as prod, client(daemon, name="consumer") as cons, client(daemon) as obs:
        res, digests = reserve_written(prod, NS, hs)
        w = Waiter(cons, NS, hs)
        parked(obs)
        assert not w.done()
        committed_at = time.monotonic()
        assert prod.commit(res.reservation_id, digests).committed == 3
        found = w.result()
        assert found.miss is None and len(found.hits) == 3
        assert w.done_at >= committed_at
        assert w.done_at - w.started < WAIT  # woken by the commit, not by the bound
        stats = obs.stats()
        assert (stats["lookup_waits"], stats["lookup_waiting"], stats["miss_in_flight"]) == (1, 0, 0)
        assert stats["lookup_wait_us"] > 0
        text = obs.metrics_text()
        assert metric(text, 'kvpool_lookup_waits_total{result="settled"}') == 1.0
        assert metric(text, "kvpool_lookup_wait_seconds_count") == 1.0


def test_a_wait_follows_a_chain_pending_in_two_publishes(daemon):
    hs = hashes(4)
    with client(daemon) as a, client(daemon) as b, client(daemon) as cons, client(daemon) as obs:
        res_a, dig_a = reserve_written(a, NS, hs[:2], seed=1)
        res_b, dig_b = reserve_written(b, NS, hs[2:], seed=2)
        w = Waiter(cons, NS, hs)
        parked(obs)
        a.commit(res_a.reservation_id, dig_a)
        time.sleep(0.1)  # give a waiter that answered after the first commit time to do so
        b_committed_at = time.monotonic()
        b.commit(res_b.reservation_id, dig_b)
        found = w.result()
        assert found.miss is None and len(found.hits) == 4
        assert w.done_at >= b_committed_at
        assert obs.stats()["lookup_waits"] == 1


def test_a_wait_that_runs_out_answers_in_flight_at_the_pending_block_and_is_counted(daemon):
    hs = hashes(3)
    with client(daemon) as prod, client(daemon) as cons:
        publish(prod, NS, hs[:1], data(1))
        res, _ = reserve_written(prod, NS, hs[1:])
        t0 = time.monotonic()
        found = cons.lookup(NS, hs, wait_pending_s=0.3)
        assert time.monotonic() - t0 >= 0.27  # it did wait (the daemon's timer may fire a little early: asyncio runs a handle due within its clock resolution)
        assert len(found.hits) == 1 and (found.miss.index, found.miss.cause) == (1, MissCause.IN_FLIGHT)
        stats = cons.stats()
        assert stats["miss_in_flight"] == 1 and stats["lookup_waits"] == 1
        assert stats["miss_never_published"] == 0
        text = cons.metrics_text()
        assert metric(text, 'kvpool_misses_total{cause="in_flight"}') == 1.0
        assert metric(text, 'kvpool_lookup_waits_total{result="in_flight"}') == 1.0
        prod.abort(res.reservation_id)


def test_the_daemon_caps_the_wait_and_the_client_timeout_allows_for_it():
    """The daemon answers at its own cap (1.5 s) though the client asked for 30 s, and a
    client whose socket timeout (1 s: its connect and hello fit it on a loaded machine) is
    shorter than the wait still gets the answer."""
    d = thread_pool(page_size=PAGE, num_pages=8, max_lookup_wait_s=1.5)
    try:
        hs = hashes(2)
        with client(d) as prod, client(d, timeout_s=1.0) as cons:
            reserve_written(prod, NS, hs)
            t0 = time.monotonic()
            found = cons.lookup(NS, hs, wait_pending_s=30.0)
            assert (found.miss.index, found.miss.cause) == (0, MissCause.IN_FLIGHT)
            assert time.monotonic() - t0 < 15.0
            found = cons.lookup(NS, hs, wait_pending_s=1.25)  # below the cap, over the socket timeout
            assert found.miss.cause == MissCause.IN_FLIGHT
            with pytest.raises(InvalidRequest):
                cons.lookup(NS, hs, wait_pending_s=-1.0)
    finally:
        d.stop_thread()


@pytest.mark.parametrize("how", ["abort", "disconnect", "rejected"])
def test_a_publish_that_does_not_commit_wakes_the_waiter_with_the_normal_cause(daemon, how):
    hs = hashes(3)
    with client(daemon) as base, client(daemon) as cons, client(daemon) as obs:
        publish(base, NS, hs[:1], data(1))
        prod = client(daemon)
        res, digests = reserve_written(prod, NS, hs[1:])
        w = Waiter(cons, NS, hs)
        parked(obs)
        closed_at = time.monotonic()
        if how == "abort":
            prod.abort(res.reservation_id)
        elif how == "disconnect":
            prod.close()
        else:  # the daemon's verify finds other bytes than the digests claim: nothing visible
            assert prod.commit(res.reservation_id, [b"\0" * 16] * 2).rejected == (0, 1)
        found = w.result()
        assert len(found.hits) == 1 and (found.miss.index, found.miss.cause) == (1, MissCause.NEVER_PUBLISHED)
        assert w.done_at >= closed_at
        assert w.done_at - w.started < WAIT / 2  # woken, well before the bound
        stats = obs.stats()
        assert (stats["lookup_waits"], stats["miss_in_flight"]) == (1, 0)
        prod.close()


def test_a_reservation_reaped_at_its_ttl_wakes_the_waiter():
    d = thread_pool(page_size=PAGE, num_pages=8, max_lookup_wait_s=60.0, reservation_ttl_s=0.5,
                    reap_interval_s=0.05)
    try:
        hs = hashes(2)
        with client(d) as prod, client(d) as cons:
            reserve_written(prod, NS, hs)  # never committed; the connection stays open
            w = Waiter(cons, NS, hs)
            found = w.result()
            assert (found.miss.index, found.miss.cause) == (0, MissCause.NEVER_PUBLISHED)
            assert w.done_at - w.started < WAIT / 2
            assert prod.stats()["expired_reservations"] == 1
    finally:
        d.stop_thread()


def test_an_aborted_republish_of_an_evicted_block_answers_evicted(daemon):
    hs = hashes(2)
    with client(daemon) as prod, client(daemon) as cons, client(daemon) as obs:
        publish(prod, NS, hs, data(2))
        prod.evict(NS, hs[1:])
        res, _ = reserve_written(prod, NS, hs[1:])
        w = Waiter(cons, NS, hs)
        parked(obs)
        prod.abort(res.reservation_id)
        found = w.result()
        assert len(found.hits) == 1 and (found.miss.index, found.miss.cause) == (1, MissCause.EVICTED)


def test_another_tenants_or_namespaces_pending_publish_never_makes_a_lookup_wait():
    name = unique_name("kvgt")
    config = PoolConfig(name=name, page_size=PAGE, num_pages=16, run_dir=Path(tempfile.mkdtemp(prefix=f"{name}-")),
                        tenants={DEFAULT_TENANT: "tok", "other": "tok2"}, max_lookup_wait_s=60.0,
                        admins=frozenset({DEFAULT_TENANT}))  # it reads the pool-wide wait counts
    d = PoolDaemon(config).start_thread()
    try:
        hs = hashes(2)
        with client(d, "other", "tok2") as theirs, client(d) as mine, client(d) as cons:
            reserve_written(theirs, NS.replace(tenant="other"), hs)  # the same tokens
            reserve_written(mine, NS.replace(model_revision="r2"), hs)  # same tenant, other namespace
            t0 = time.monotonic()
            found = cons.lookup(NS, hs, wait_pending_s=WAIT)
            assert (found.miss.index, found.miss.cause) == (0, MissCause.NEVER_PUBLISHED)
            assert time.monotonic() - t0 < WAIT / 2
            stats = cons.stats()
            assert (stats["lookup_waits"], stats["miss_in_flight"]) == (0, 0)
    finally:
        d.stop_thread()


def test_wait_zero_answers_at_once_as_before(daemon):
    hs = hashes(2)
    with client(daemon) as prod, client(daemon) as cons:
        res, digests = reserve_written(prod, NS, hs)
        found = cons.lookup(NS, hs)
        assert (found.miss.index, found.miss.cause) == (0, MissCause.NEVER_PUBLISHED)
        assert cons.lookup(NS, hs, wait_pending_s=0.0).miss.cause == MissCause.NEVER_PUBLISHED
        assert cons.stats()["lookup_waits"] == 0
        prod.commit(res.reservation_id, digests)
        assert cons.lookup(NS, hs).miss is None


def test_the_daemon_serves_other_requests_while_a_lookup_waits(daemon):
    hs = hashes(2)
    with client(daemon) as prod, client(daemon) as cons, client(daemon) as other:
        res, digests = reserve_written(prod, NS, hs)
        w = Waiter(cons, NS, hs)
        parked(other)  # a stats request answered while the lookup is parked
        other.ping()
        others = hashes(2, start=100)
        assert publish(other, NS, others, data(2, seed=3)).committed == 2
        assert other.lookup(NS, others).miss is None
        assert not w.done()  # all of that was served while the lookup was still waiting
        prod.commit(res.reservation_id, digests)
        assert w.result().miss is None


def raw_session(d):
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.unix_path))
    s.settimeout(2 * WAIT)
    s.sendall(P.encode_request(1, P.Hello(DEFAULT_TENANT, "tok")))
    assert isinstance(read_reply(s)[1], P.HelloOk)
    return s


def read_reply(s):
    n = P.LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))[0]
    return P.decode_reply(s.recv(n, socket.MSG_WAITALL))


def test_a_waiting_lookup_whose_client_goes_away_is_dropped(daemon):
    hs = hashes(2)
    with client(daemon) as prod, client(daemon) as obs:
        res, digests = reserve_written(prod, NS, hs)
        s = raw_session(daemon)
        s.sendall(P.encode_request(2, P.Lookup(NS, hs, wait_pending_ms=60_000)))
        parked(obs)
        s.close()
        parked(obs, 0)  # long before the bound
        assert metric(obs.metrics_text(), 'kvpool_lookup_waits_total{result="abandoned"}') == 1.0
        prod.commit(res.reservation_id, digests)
        assert obs.lookup(NS, hs).miss is None


def test_frames_pipelined_behind_a_waiting_lookup_are_answered_after_it_in_order(daemon):
    hs = hashes(2)
    with client(daemon) as prod, client(daemon) as obs:
        res, digests = reserve_written(prod, NS, hs)
        s = raw_session(daemon)
        s.sendall(P.encode_request(2, P.Lookup(NS, hs, wait_pending_ms=round(WAIT * 1000)))
                  + P.encode_request(3, P.Ping()) + P.encode_request(4, P.Lookup(NS, hs)))
        parked(obs)
        prod.commit(res.reservation_id, digests)
        first, second, third = read_reply(s), read_reply(s), read_reply(s)
        s.close()
        assert first[0] == 2 and isinstance(first[1], P.LookupOk) and first[1].miss is None
        assert first[1].hits.pages == third[1].hits.pages and len(first[1].hits) == 2
        assert second[0] == 3 and isinstance(second[1], P.Pong)
        assert third[0] == 4 and third[1].miss is None


def test_waiters_on_one_publish_wake_together_and_one_running_out_leaves_the_others_parked(daemon):
    hs = hashes(2)
    with client(daemon) as prod, client(daemon) as a, client(daemon) as b, client(daemon) as short, \
            client(daemon) as obs:
        res, digests = reserve_written(prod, NS, hs)
        wa, wb = Waiter(a, NS, hs), Waiter(b, NS, hs)
        parked(obs, 2)
        gone = short.lookup(NS, hs, wait_pending_s=0.2)  # parks beside them, runs out, unparks
        assert gone.miss.cause == MissCause.IN_FLIGHT
        assert obs.stats()["lookup_waiting"] == 2
        committed_at = time.monotonic()
        prod.commit(res.reservation_id, digests)
        for w in (wa, wb):
            found = w.result()
            assert found.miss is None and len(found.hits) == 2
            assert committed_at <= w.done_at < w.started + WAIT
        stats = obs.stats()
        assert (stats["lookup_waits"], stats["miss_in_flight"], stats["lookup_waiting"]) == (3, 1, 0)


# -- what the waits leave behind, read from the daemon itself (kvpool.pool.lookup_wait) --------

def tenant_pool(d):
    return d.pools[DEFAULT_TENANT]


def test_a_lookup_is_parked_on_its_own_reservation_and_only_that_reservations_close_wakes_it(daemon):
    """The waiter's future sits under the pending publish's reservation id; another publish
    of the tenant closing (a commit) neither wakes it nor makes it park again."""
    hs, others = hashes(2), hashes(2, start=50)
    tp = tenant_pool(daemon)
    with client(daemon) as prod, client(daemon) as other, client(daemon) as cons, client(daemon) as obs:
        res, digests = reserve_written(prod, NS, hs)
        res_other, dig_other = reserve_written(other, NS, others, seed=4)
        w = Waiter(cons, NS, hs)
        parked(obs)
        assert list(tp.parked) == [res.reservation_id] and len(tp.parked[res.reservation_id]) == 1
        fut = tp.parked[res.reservation_id][0]
        assert other.commit(res_other.reservation_id, dig_other).committed == 2
        time.sleep(0.2)  # a waiter woken by that commit would have looked up and parked again by now
        assert list(tp.parked) == [res.reservation_id] and tp.parked[res.reservation_id] == [fut]
        assert not fut.done() and not w.done()
        prod.commit(res.reservation_id, digests)
        assert w.result().miss is None
        assert tp.parked == {}


@pytest.mark.parametrize("how", ["runs_out", "client_goes_away"])
def test_a_wait_that_ends_without_its_publish_closing_leaves_nothing_parked(daemon, how):
    """A waiter that runs out of its bound, or whose client disconnects, takes its future
    out of the reservation's list (and the emptied list out of the map): nothing is left to
    grow with every such wait."""
    hs = hashes(2)
    tp = tenant_pool(daemon)
    with client(daemon) as prod, client(daemon) as obs:
        res, digests = reserve_written(prod, NS, hs)
        with client(daemon) as stays:  # a waiter parked beside it all along: its list stays
            w = Waiter(stays, NS, hs)
            parked(obs)
            if how == "runs_out":
                with client(daemon) as cons:
                    assert cons.lookup(NS, hs, wait_pending_s=0.2).miss.cause == MissCause.IN_FLIGHT
            else:
                s = raw_session(daemon)
                s.sendall(P.encode_request(2, P.Lookup(NS, hs, wait_pending_ms=60_000)))
                parked(obs, 2)
                s.close()
            parked(obs, 1)
            assert list(tp.parked) == [res.reservation_id] and len(tp.parked[res.reservation_id]) == 1
            prod.commit(res.reservation_id, digests)
            assert w.result().miss is None
        res2, _ = reserve_written(prod, NS, hashes(1, start=80), seed=5)
        with client(daemon) as cons:  # alone on its reservation: the map is emptied
            assert cons.lookup(NS, hashes(1, start=80), wait_pending_s=0.2).miss.cause == MissCause.IN_FLIGHT
        assert tp.parked == {}
        prod.abort(res2.reservation_id)


def test_a_session_is_no_longer_marked_waiting_once_its_lookup_answered(daemon):
    """session.waiting keeps the connection reading while a lookup is parked, and tells a
    disconnect to cancel the parked lookup: once the lookup has answered, it is off, so a
    later op's task is neither read past nor cancelled as a parked lookup."""
    hs = hashes(2)
    with client(daemon) as prod, client(daemon) as cons, client(daemon) as obs:
        res, _ = reserve_written(prod, NS, hs)
        assert cons.lookup(NS, hs, wait_pending_s=0.1).miss.cause == MissCause.IN_FLIGHT
        assert daemon._clients and not any(conn.session.waiting for conn in daemon._clients.values())
        prod.abort(res.reservation_id)


def test_the_wait_time_counted_is_the_time_waited_summed_over_the_waits(daemon):
    hs = hashes(2)
    with client(daemon) as prod, client(daemon) as cons:
        res, _ = reserve_written(prod, NS, hs)
        t0 = time.monotonic()
        for _ in range(2):
            assert cons.lookup(NS, hs, wait_pending_s=0.2).miss.cause == MissCause.IN_FLIGHT
        elapsed = time.monotonic() - t0
        waited_us = cons.stats()["lookup_wait_us"]
        # each wait lasts its bound (0.2 s, on the loop's clock: 0.39 allows its rounding), the
        # two are summed, and they count no more than the time the test saw pass (plus 50 ms
        # for the loop clock's own granularity: a wait can read a millisecond over it)
        assert 0.39e6 <= waited_us <= (elapsed + 0.05) * 1e6, (waited_us, elapsed)
        text = cons.metrics_text()
        assert metric(text, "kvpool_lookup_wait_seconds_count") == 2.0
        assert 0.39 <= metric(text, "kvpool_lookup_wait_seconds_sum") <= elapsed + 0.05
        prod.abort(res.reservation_id)
