"""The daemon over real sockets and shared memory: auth, framing, limits, lifecycle."""

import os
import socket
import time

import numpy as np
import pytest

from kvgate.harness.system.pool import PoolProcess, thread_pool
from kvpool.pool import protocol as P
from kvpool.pool.arena import processes_mapping, segment_label
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.errors import Busy, ErrorCode, InvalidRequest, MissCause, Unauthenticated
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


def blocks(n, size=4096, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def collect(n, size=4096):
    out = [np.zeros(size, np.uint8) for _ in range(n)]
    return out, out.__getitem__


@pytest.fixture
def daemon():
    # no pass at rest: a page corrupted here is met by its loader, not dropped by the scrub first
    d = thread_pool(page_size=4096, num_pages=16, scrub_rest_pages_per_round=0)
    yield d
    d.stop_thread()
    assert os.getpid() not in processes_mapping(segment_label(d.config.name, ""))


def client(d, **kw):
    return PoolClient(f"unix:{d.unix_path}", "default", "tok", **kw)


def raw(d):
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.unix_path))
    s.settimeout(5)
    return s


def ask(s, data):
    s.sendall(data)
    n = P.LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))[0]
    return P.decode_reply(s.recv(n, socket.MSG_WAITALL))


def test_bad_token_and_ops_before_hello_are_refused(daemon):
    with pytest.raises(Unauthenticated):
        PoolClient(f"unix:{daemon.unix_path}", "default", "wrong")
    with pytest.raises(Unauthenticated):
        PoolClient(f"unix:{daemon.unix_path}", "nobody", "tok")
    s = raw(daemon)
    _, reply = ask(s, P.encode_request(1, P.Stats()))
    assert reply.code == ErrorCode.UNAUTHENTICATED
    _, reply = ask(s, P.encode_request(2, P.Hello("default", "tok")))
    assert isinstance(reply, P.HelloOk)


def test_a_session_cannot_use_another_tenants_namespace(daemon):
    with client(daemon) as c, pytest.raises(Unauthenticated):
        c.lookup(NS.replace(tenant="other"), block_hashes(range(16), 16))


def test_publish_and_load_are_byte_exact_over_shm_and_over_tcp(daemon):
    hs = block_hashes(range(16 * 5), 16)
    data = blocks(5)
    with client(daemon) as c:
        assert c.arena is not None
        assert publish(c, NS, hs, data).committed == 5
        out, sink = collect(5)
        res = load(c, NS, hs, sink)
        assert (res.loaded, res.miss) == (5, None)
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
    with PoolClient(f"tcp:127.0.0.1:{daemon.tcp_port}", "default", "tok", zero_copy=False) as r:
        assert r.arena is None
        out, sink = collect(5)
        assert load(r, NS, hs, sink).loaded == 5
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        hs2 = block_hashes(range(1000, 1000 + 32), 16)
        assert publish(r, NS, hs2, blocks(2, seed=1)).committed == 2
        out, sink = collect(2)
        assert load(r, NS, hs2, sink).loaded == 2
        assert all(np.array_equal(a, b) for a, b in zip(out, blocks(2, seed=1)))


def test_a_page_whose_bytes_differ_from_the_claimed_digest_is_never_visible(daemon):
    hs = block_hashes(range(32), 16)
    with client(daemon) as c:
        res = c.reserve(NS, hs, [4096, 4096])
        c.write_page(res, 0, blocks(1)[0])
        c.write_page(res, 1, blocks(1, seed=5)[0])
        from kvpool.pool.digest import page_digest
        out = c.commit(res.reservation_id, [page_digest(blocks(1)[0]), page_digest(blocks(1)[0])])
        assert out.committed == 1 and out.rejected == (1,)
        found = c.lookup(NS, hs)
        assert len(found.hits) == 1 and found.miss.cause == MissCause.NEVER_PUBLISHED
        assert c.stats()["free_pages"] == 15


def test_corruption_after_commit_is_caught_by_the_loader(daemon):
    hs = block_hashes(range(48), 16)
    with client(daemon) as c:
        publish(c, NS, hs, blocks(3))
        page = c.lookup(NS, hs).hits[1].page
        c.arena.page(page)[100] ^= 0xFF  # a stray write into a committed page
        out, sink = collect(3)
        res = load(c, NS, hs, sink)
        assert res.loaded == 1 and res.miss.cause == MissCause.CORRUPT and res.miss.index == 1


def test_connection_drop_reclaims_reservations_and_leases(daemon):
    hs = block_hashes(range(32), 16)
    with client(daemon) as c:
        publish(c, NS, hs, blocks(2))
        c2 = client(daemon)
        c2.acquire(NS, hs)
        c2.reserve(NS, block_hashes(range(500, 548), 16), [4096] * 3)
        s = c.stats()
        assert s["leased_pages"] == 2 and s["reserved_pages"] == 3
        c2.close()
        for _ in range(100):
            s = c.stats()
            if s["leased_pages"] == 0 and s["reserved_pages"] == 0:
                break
        assert s["leased_pages"] == 0 and s["reserved_pages"] == 0 and s["free_pages"] == 14


def test_oversized_frame_closes_only_that_connection(daemon):
    with client(daemon) as good:
        s = raw(daemon)
        s.sendall(P.LENGTH.pack(daemon.config.frame_limit + 1))
        n = P.LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))[0]
        _, reply = P.decode_reply(s.recv(n, socket.MSG_WAITALL))
        assert reply.code == ErrorCode.OVERSIZED
        assert s.recv(1) == b""  # closed
        good.ping()


def test_too_many_clients_is_busy_and_others_keep_working():
    d = thread_pool(page_size=4096, num_pages=4, max_clients=2)
    try:
        a, b = client(d), client(d)
        with pytest.raises(Busy):
            client(d)
        a.ping()
        b.close()
        c = None
        deadline = time.monotonic() + 10.0  # the daemon notices the closed connection (a loaded machine: later)
        while c is None and time.monotonic() < deadline:
            try:
                c = client(d)
            except Busy:
                time.sleep(0.02)
        assert c is not None
        c.close()
        a.close()
    finally:
        d.stop_thread()


def test_a_busy_answer_on_reconnect_ends_the_load_as_throttled_not_as_an_exception():
    """The loader reconnects (its idle connection was closed) into a daemon at max_clients:
    the BUSY answer must end the load as one miss cause. Raised, it would surface from the
    copier's wait on vLLM's hot path and end the replica."""
    import time

    d = thread_pool(page_size=4096, num_pages=8, max_clients=2)
    try:
        a = client(d)
        hashes = block_hashes(list(range(32)), 16)
        assert publish(a, NS, hashes, [np.zeros(4096, np.uint8)] * 2).committed == 2
        loader = client(d)
        loader._drop_socket()  # its connection is gone (e.g. the daemon dropped an idle peer)
        squatter = None
        deadline = time.monotonic() + 10.0  # the daemon notices the closed connection, then the slot is taken
        while squatter is None and time.monotonic() < deadline:
            try:
                squatter = client(d)
            except Busy:
                time.sleep(0.02)
        assert squatter is not None
        out = np.zeros((2, 4096), np.uint8)
        res = load(loader, NS, hashes, out.__getitem__)
        assert res.loaded == 0 and res.miss.cause == MissCause.THROTTLED, res
        squatter.close()
        a.close()
    finally:
        d.stop_thread()


def test_requests_against_unknown_ids_get_typed_errors(daemon):
    with client(daemon) as c:
        with pytest.raises(InvalidRequest):
            c.commit(12345, [])
        with pytest.raises(InvalidRequest):
            c.abort(12345)
        from kvpool.errors import LeaseLost
        with pytest.raises(LeaseLost):
            c.release(999)
        c.ping()


def test_metrics_count_hits_misses_and_evictions(daemon):
    hs = block_hashes(range(32), 16)
    with client(daemon) as c:
        publish(c, NS, hs, blocks(2))
        out, sink = collect(2)
        load(c, NS, hs, sink)
        c.evict(NS, hs[1:])
        load(c, NS, hs, sink)
        text = c.metrics_text()
    assert 'kvpool_hits_total{kind="remote"} 2.0' in text
    assert 'kvpool_misses_total{cause="evicted"} 1.0' in text
    assert "kvpool_evictions_total 1.0" in text
    assert "kvpool_bytes_written_total 8192.0" in text


def test_process_daemon_graceful_stop_frees_shared_memory(tmp_path):
    pool = PoolProcess.start(page_size=4096, num_pages=8, run_dir=tmp_path)
    try:
        with pool.client() as c:
            publish(c, NS, block_hashes(range(16), 16), blocks(1))
            mapping = processes_mapping(segment_label(pool.name, ""))
            assert set(mapping) == {pool.proc.pid, os.getpid()}, mapping  # the daemon and this client
        assert pool.stop() == 0
        assert not processes_mapping(segment_label(pool.name, ""))
        assert not any((tmp_path / f).exists() for f in ("pid", "pool.sock", "attach.sock"))
    finally:
        pool.cleanup()


def test_restart_after_a_crash_starts_clean_and_says_so(tmp_path):
    pool = PoolProcess.start(page_size=4096, num_pages=8, run_dir=tmp_path)
    try:
        hs = block_hashes(range(16), 16)
        with pool.client() as c:
            publish(c, NS, hs, blocks(1))
            assert not c.hello.restarted_after_crash
        pool.kill()
        assert not processes_mapping(segment_label(pool.name, "")), "a crashed daemon leaves no segment"
        pool.restart()
        assert pool.address["restarted_after_crash"]
        assert "did not shut down cleanly" in pool.address["recovery_note"]
        with pool.client() as c:
            assert c.hello.restarted_after_crash
            assert c.lookup(NS, hs).miss.cause == MissCause.NEVER_PUBLISHED
            assert c.stats()["free_pages"] == 8
        assert "starting with an empty pool" in pool.log_path.read_text()
        assert pool.stop() == 0
    finally:
        pool.cleanup()


def test_a_second_daemon_with_a_live_owner_refuses(tmp_path):
    pool = PoolProcess.start(page_size=4096, num_pages=4, run_dir=tmp_path)
    try:
        with pytest.raises(RuntimeError, match="served by live pid"):
            PoolProcess.start(page_size=4096, num_pages=4, run_dir=tmp_path, name=pool.name, timeout=10)
        with pool.client() as c:
            c.ping()
    finally:
        pool.cleanup()


def test_client_reconnects_after_the_daemon_restarts(tmp_path):
    pool = PoolProcess.start(page_size=4096, num_pages=8, run_dir=tmp_path)
    try:
        c = pool.client()
        old_instance = c.arena.instance
        pool.kill()
        from kvpool.errors import TransportError
        with pytest.raises(TransportError):
            c.ping()  # the daemon is down: a typed error, not a hang
        pool.restart()
        # the first request after the restart goes through on a fresh connection
        hs = block_hashes(range(16), 16)
        assert c.lookup(NS, hs).miss.cause == MissCause.NEVER_PUBLISHED
        assert c.arena.instance != old_instance
        assert publish(c, NS, hs, blocks(1)).committed == 1
        c.close()
    finally:
        pool.cleanup()


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_a_stale_connection_is_replaced_transparently_for_every_request(tmp_path, tcp):
    """Each request kind, first after a restart on a connection that went stale. Over
    TCP a send to a closed peer succeeds and only the reply fails, so the client must
    notice the hang-up before it sends (an acquire is not safe to resend)."""
    from kvgate.harness.system.cluster import free_port

    pool = PoolProcess.start(page_size=4096, num_pages=8, run_dir=tmp_path,
                             extra_args=("--tcp", f"127.0.0.1:{free_port()}"))
    try:
        hs = block_hashes(range(16), 16)
        for op in ("lookup", "reserve", "acquire", "stats"):
            c = pool.client(tcp=tcp)
            pool.kill()
            pool.restart()
            if op == "lookup":
                c.lookup(NS, hs)
            elif op == "reserve":
                assert c.reserve(NS, hs, [4096]).reservation_id
            elif op == "acquire":
                assert c.acquire(NS, hs).miss.cause == MissCause.NEVER_PUBLISHED
            else:
                assert c.stats()["num_pages"] == 8
            c.close()
    finally:
        pool.cleanup()


@pytest.mark.parametrize("seed", [3, 11, 1234567])
def test_a_load_fault_with_a_probability_fires_where_the_schedule_says(tmp_path, seed):
    """kvgate.faults.backend armed BUGGIFY-style: the loads before the schedule's first firing pass
    the armed site untouched, the one it names ends corrupt (the bit flipped in the arena,
    the loader's digest catching it, and its report making the daemon, which finds the
    page corrupt at rest too, drop it), and the next load stops there as evicted."""
    import json

    from kvgate.faults.backend import FaultyBackend
    from kvgate.faults.schedule import draw_schedule
    from kvpool.connector.history import HistoryWriter

    sched = draw_schedule(seed)
    spec, first = sched.spec("corrupt"), sched.first_firing("corrupt")
    d = thread_pool(page_size=4096, num_pages=16)
    try:
        hashes = block_hashes(list(range(48)), 16)
        pages = [np.full(4096, i, np.uint8) for i in range(3)]
        with client(d) as c:
            assert publish(c, NS, hashes, pages).committed == 3
        control = tmp_path / "faults.json"
        control.write_text(json.dumps({"load": {"kind": "corrupt", "block": 1, "seed": 5, "p": spec.probability,
                                                "schedule_seed": seed}}))
        faulty = FaultyBackend(client(d), control, HistoryWriter(tmp_path / "h", "r", "worker"))
        outcomes = []
        for _ in range(first + 2):
            out = np.zeros((3, 4096), np.uint8)
            res = load(faulty, NS, hashes, out.__getitem__)
            outcomes.append(res.miss.cause if res.miss else None)
            if res.miss is None:
                assert all(np.array_equal(o, p) for o, p in zip(out, pages))
        assert outcomes[:first] == [None] * first and outcomes[first] == MissCause.CORRUPT, outcomes
        assert outcomes[first + 1] == MissCause.EVICTED  # times=1: no fault; the reported page left the pool
        faulty.close()
    finally:
        d.stop_thread()


def test_a_probe_with_a_freshness_bound_trusts_only_a_beating_daemon():
    """The heartbeat in the segment: a running daemon beats, so a bounded probe answers; a
    stopped one (SIGSTOP: its socket still accepts) stops beating, and the same probe says
    None (ask the daemon) within the bound, without a round trip; resumed, it answers again."""
    import signal
    import time

    pool = PoolProcess.start(page_size=4096, num_pages=16)
    try:
        with pool.client() as c:
            hs = block_hashes(range(16 * 4), 16)
            assert publish(c, NS, hs, blocks(4)).committed == 4
            deadline = time.monotonic() + 10  # a beat within 0.2 s of a probe: the daemon's next one
            while (answer := c.probe(NS, hs, fresh_s=0.2)) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert answer == 4
            os.kill(pool.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(0.3)
                t0 = time.perf_counter()
                assert c.probe(NS, hs, fresh_s=0.2) is None
                # told by the segment, not by a round trip (which waits out the client's timeout on a
                # stopped daemon): bounded well under that timeout, not by a wall-clock figure
                assert time.perf_counter() - t0 < c.timeout_s / 2
                assert c.probe(NS, hs) == 4  # unbounded, the index alone still answers
            finally:
                os.kill(pool.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10
            while (answer := c.probe(NS, hs, fresh_s=0.2)) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert answer == 4
            # killed: its session is closed at once, whatever the heartbeat's age
            os.kill(pool.proc.pid, signal.SIGKILL)
            pool.proc.wait(10)
            assert c.probe(NS, hs, fresh_s=60.0) is None and c.probe(NS, hs) == 4
    finally:
        pool.stop()
        pool.cleanup()


def test_a_daemon_without_a_heartbeat_is_never_probed_with_a_bound():
    pool = PoolProcess.start(page_size=4096, num_pages=16, extra_args=("--heartbeat-s", "0"))
    try:
        with pool.client() as c:
            hs = block_hashes(range(16 * 2), 16)
            assert publish(c, NS, hs, blocks(2)).committed == 2
            assert c.probe(NS, hs) == 2 and c.probe(NS, hs, fresh_s=10.0) is None
    finally:
        pool.stop()
        pool.cleanup()


def test_the_daemon_serves_its_metrics_over_http():
    """--metrics: a Prometheus endpoint an operator scrapes; its gauges are taken at the
    scrape (the pages a publish committed are there at once)."""
    import json
    import urllib.request

    pool = PoolProcess.start(page_size=4096, num_pages=16, extra_args=("--metrics", "127.0.0.1:0"))
    try:
        addr = json.loads((pool.run_dir / "address.json").read_text())["metrics"]
        with pool.client() as c:
            hs = block_hashes(range(16 * 3), 16)
            assert publish(c, NS, hs, blocks(3)).committed == 3
            c.lookup(NS, hs)
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'kvpool_pages{state="committed"} 3.0' in text
        assert "kvpool_bytes_written_total 12288.0" in text
        assert 'kvpool_requests_total{op="lookup",result="ok"} 1.0' in text
    finally:
        pool.stop()
        pool.cleanup()


def test_an_admin_sets_load_limits_at_run_time(daemon):
    """SetLimits: the next acquire past the new limit is throttled; a lease held before is
    kept; lifted, loads run again. A tenant that is not an admin may not."""
    hs = block_hashes(range(16 * 2), 16)
    with client(daemon) as c, client(daemon) as other:
        assert publish(c, NS, hs, blocks(2)).committed == 2
        held = c.acquire(NS, hs[:1])
        assert c.set_load_limits(per_client=0, total=1) == (0, 0)
        second = other.acquire(NS, hs[1:])
        assert not second.hits and second.miss.cause == MissCause.THROTTLED
        c.release(held.lease_id)
        again = other.acquire(NS, hs[1:])
        assert len(again.hits) == 1
        other.release(again.lease_id)
        assert c.set_load_limits(0, 0) == (0, 1)
        with pytest.raises(InvalidRequest):
            c.set_load_limits(-1, 0)
