"""Tenants apart, in the catalog and in the data plane: each tenant has its own segment
(handed over as a descriptor for a single-use ticket), its own quota of pages and
eviction, its own ids and stats; the pool-wide operations are an admin's."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from kvgate.harness.system.pool import thread_pool
from kvpool.pool.arena import Arena
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.errors import ArenaError, InvalidRequest, MissCause, Unauthenticated
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.config import PoolConfig

PAGE = 4096


def ns(tenant: str) -> Namespace:
    return Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64, tenant=tenant)


def client(d, tenant: str, **kw) -> PoolClient:  # noqa: ANN001
    return PoolClient(f"unix:{d.unix_path}", tenant, f"tok-{tenant}", **kw)


def payload(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(n)]


def hashes(start: int, n: int) -> list[bytes]:
    return block_hashes(range(start * 16, (start + n) * 16), 16)


def trade(path: str, ticket: bytes) -> tuple[bytes, list[int]]:
    """What the attach socket answers to `ticket`: (answer byte, descriptors: the private
    segment's, the pages')."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(ticket)
        answer, fds, _, _ = socket.recv_fds(s, 1, 4)
    return answer, fds


@pytest.fixture
def two_tenants():
    d = thread_pool(page_size=PAGE, num_pages=16, tenants={"a": "tok-a", "b": "tok-b"})
    yield d
    d.stop_thread()


def test_each_tenant_maps_its_own_segment_and_no_byte_of_another(two_tenants):
    d = two_tenants
    secret = payload(3, seed=1)
    with client(d, "a") as a, client(d, "b") as b:
        assert a.arena is not None and b.arena is not None
        assert a.arena.instance != b.arena.instance
        assert a.arena.num_pages == b.arena.num_pages == 8  # 16 pages shared evenly: each its own half
        assert publish(a, ns("a"), hashes(0, 3), secret).committed == 3
        # Nowhere in what b has mapped is there a byte string of a's pages.
        mine = bytes(b.arena._bytes) + bytes(b.arena._private)  # the pages and the private state
        assert all(blk[:256].tobytes() not in mine for blk in secret)
        # b may scribble over all of its segment: a's pages are elsewhere and load byte-exact.
        b.arena.pages_region[:] = 0xA5
        out = [np.zeros(PAGE, np.uint8) for _ in range(3)]
        res = load(a, ns("a"), hashes(0, 3), out.__getitem__)
        assert res.loaded == 3 and res.miss is None
        assert all(np.array_equal(x, y) for x, y in zip(out, secret))
        assert b.lookup(ns("b"), hashes(0, 3)).miss.cause == MissCause.NEVER_PUBLISHED  # not even "incompatible"


def test_a_ticket_buys_one_descriptor_of_its_own_tenant_only(two_tenants):
    d = two_tenants
    with client(d, "a", zero_copy=False) as a, client(d, "b") as b:
        assert a.arena is None and b.arena is not None
        path, ticket = a.hello.arena, a.hello.ticket
        assert trade(path, os.urandom(16)) == (b"\x01", [])  # a forged ticket: nothing
        answer, fds = trade(path, ticket)
        assert answer == b"\x00" and len(fds) == 2
        assert trade(path, ticket) == (b"\x01", [])  # used once: never again
        arena = Arena.from_fds(fds[0], fds[1], "a, by hand")
        try:
            assert arena.instance == a.hello.arena_instance != b.arena.instance
        finally:
            arena.close()


def test_a_ticket_expires_with_the_hello_timeout():
    d = thread_pool(page_size=PAGE, num_pages=4, tenants={"a": "tok-a"}, hello_timeout_s=0.3, reap_interval_s=0.05)
    try:
        with client(d, "a", zero_copy=False) as a:
            time.sleep(0.6)
            assert trade(a.hello.arena, a.hello.ticket) == (b"\x01", [])
    finally:
        d.stop_thread()


def test_a_handed_segment_is_sealed_against_resizing(two_tenants):
    with client(two_tenants, "a", zero_copy=False) as a:
        _, fds = trade(a.hello.arena, a.hello.ticket)
        try:
            for fd in fds:  # the private segment and the pages
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 4096)  # would fault the daemon's next access to the pages past it
        finally:
            for fd in fds:
                os.close(fd)
    # And a client refuses segments that are not sealed (their other mappers could shrink them).
    with client(two_tenants, "b", zero_copy=False) as b:
        _, (private, pages) = trade(b.hello.arena, b.hello.ticket)
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, Arena.total_size(PAGE, 2))
    with pytest.raises(ArenaError, match="not sealed"):
        Arena.from_fds(private, fd, "unsealed pages")
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, Arena.private_size(2))
    with pytest.raises(ArenaError, match="not sealed"):
        Arena.from_fds(fd, pages, "unsealed private segment")


@pytest.fixture
def two_tenants_unscrubbed():
    """Two tenants, no scrub at rest: the pass at rest visits b's one page every round
    (scrub_interval_s), which is b's own activity and would move b's stats on a slow host."""
    d = thread_pool(page_size=PAGE, num_pages=16, tenants={"a": "tok-a", "b": "tok-b"},
                    scrub_rest_pages_per_round=0)
    yield d
    d.stop_thread()


def test_a_tenant_cannot_evict_another_or_see_its_activity(two_tenants_unscrubbed):
    d = two_tenants_unscrubbed
    with client(d, "a") as a, client(d, "b") as b:
        assert publish(b, ns("b"), hashes(100, 1), payload(1, 2)).committed == 1
        before = b.stats()
        first = b.reserve(ns("b"), hashes(101, 1), [PAGE])
        b.abort(first.reservation_id)
        before = b.stats()
        assert publish(a, ns("a"), hashes(0, 3), payload(3, 3)).committed == 3
        for i in range(6):  # a goes far past its own quota of 8: it evicts its own pages only
            publish(a, ns("a"), hashes(10 + 4 * i, 4), payload(4, 10 + i))
        a_lease = a.acquire(ns("a"), hashes(10 + 4 * 5, 4))
        assert a_lease.lease_id
        assert b.stats() == before  # nothing of a's publishing, evicting or leasing shows in b's stats
        again = b.reserve(ns("b"), hashes(101, 1), [PAGE])
        assert again.reservation_id == first.reservation_id + 1  # ids are b's own: a's traffic moved none
        b.abort(again.reservation_id)
        assert b.lookup(ns("b"), hashes(100, 1)).miss is None  # b's page survived a's pressure
        assert a.stats()["evictions"] > 0 and b.stats()["evictions"] == 0
        assert a.stats()["num_pages"] == b.stats()["num_pages"] == 8
        a.release(a_lease.lease_id)


def test_pool_wide_operations_are_an_admins():
    d = thread_pool(page_size=PAGE, num_pages=16, tenants={"a": "tok-a", "b": "tok-b", "ops": "tok-ops"},
                    admins=frozenset({"ops"}), quotas={"a": 10})
    try:
        with client(d, "ops") as ops, client(d, "a") as a, client(d, "b") as b:
            assert a.arena.num_pages == 10 and b.arena.num_pages == 3 and ops.arena.num_pages == 3
            assert publish(a, ns("a"), hashes(0, 2), payload(2, 4)).committed == 2
            for c in (a, b):
                with pytest.raises(Unauthenticated, match="pool-wide"):
                    c.set_capacity(0)
                with pytest.raises(Unauthenticated, match="pool-wide"):
                    c.metrics_text()
            assert a.lookup(ns("a"), hashes(0, 2)).miss is None  # the refused squeezes evicted nothing
            pool = ops.stats()
            assert pool["num_pages"] == 16 and pool["committed_pages"] == 2 and pool["tenants"] == 3
            text = ops.metrics_text()
            assert 'kvpool_tenant_pages{state="committed",tenant="a"} 2.0' in text
            assert ops.set_capacity(1, tenant="a") == 1  # an admin squeezes a's segment
            assert a.stats()["capacity_pages"] == 1 and b.stats()["capacity_pages"] == 3
            with pytest.raises(InvalidRequest, match="no such tenant"):
                ops.set_capacity(1, tenant="nobody")
    finally:
        d.stop_thread()
    single = thread_pool(page_size=PAGE, num_pages=16, tenants={"solo": "tok-solo"})
    try:
        with client(single, "solo") as solo:
            assert solo.arena.num_pages == 16
            assert solo.set_capacity(16) == 0 and "free_pages" in solo.stats() and solo.metrics_text()
    finally:
        single.stop_thread()


@pytest.mark.parametrize("quotas, match", [({"x": 4}, "does not have"), ({"a": 0}, "positive"),
                                           ({"a": 16}, "less than one page")])
def test_quotas_that_do_not_fit_are_refused(quotas, match):
    config = PoolConfig(num_pages=16, tenants={"a": "1", "b": "2"}, quotas=quotas)
    with pytest.raises(InvalidRequest, match=match):
        config.tenant_pages()


NOCAPS = ["setpriv", "--securebits", "+noroot", "--bounding-set", "-all", "--inh-caps", "-all", "--"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops every capability with setpriv (util-linux), which needs root")
@pytest.mark.parametrize("dumpable", [False, True], ids=["daemon", "control-dumpable"])
def test_another_tenants_process_of_the_same_user_cannot_reach_a_segment(tmp_path, dumpable):
    """The daemon and tenant b's process run as one user, without capabilities (as two
    processes of an unprivileged service user would). b authenticates as itself and then
    looks for tenant a's bytes: in its own segment, by name in /dev/shm, through the
    daemon's /proc/PID/fd and /proc/PID/mem. The control serves with --dumpable: the
    daemon's descriptors are open to its user again, and b must find a's bytes there."""
    run_dir = tmp_path / "pool"
    run_dir.mkdir()
    cmd = [*NOCAPS, sys.executable, "-m", "kvpool", "serve", "--run-dir", str(run_dir), "--name",
           f"breach-{os.getpid()}-{int(dumpable)}", "--page-size", str(PAGE), "--pages", "16", "--tcp", "none",
           "--tenant", "a=tok-a", "--tenant", "b=tok-b", *(["--dumpable"] if dumpable else [])]
    daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "pool.log", "wb"))
    try:
        deadline = time.monotonic() + 20
        while not (run_dir / "address.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        secret = np.random.default_rng(7).integers(0, 256, PAGE, dtype=np.uint8)
        with PoolClient(f"unix:{run_dir / 'pool.sock'}", "a", "tok-a") as a:
            assert publish(a, ns("a"), hashes(0, 1), [secret]).committed == 1
            out = subprocess.run([*NOCAPS, sys.executable, "-m", "suites.pool.breach", str(run_dir),
                                  secret[:64].tobytes().hex(), str(daemon.pid), "b", "tok-b"],
                                 capture_output=True, text=True, timeout=60, check=True)
        report = json.loads(out.stdout)
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert all(stat.S_IMODE((run_dir / s).stat().st_mode) == 0o600 for s in ("pool.sock", "attach.sock"))
    finally:
        daemon.terminate()
        daemon.wait(20)
    tries = {t["try"]: t["answer"] for t in report["attempts"]}
    if dumpable:
        assert report["found"], f"negative control NOT caught: b did not find a's bytes: {report}"
        return
    assert not report["found"], report
    assert tries["a segment by name in /dev/shm"] == "none exists", report
    # The daemon's descriptors are listed or not (by the user's own file modes), never opened:
    # each refused (or closed between the listing and the attempt: a connection that ended).
    through_fd = [answer for t, answer in tries.items() if t.startswith(("open ", "readlink "))]
    listed = tries.get(f"list /proc/{daemon.pid}/fd", "listed")
    assert listed.startswith("PermissionError") or (
        any(a.startswith("PermissionError") for a in through_fd)
        and all(a.startswith(("PermissionError", "FileNotFoundError")) for a in through_fd)), report
    assert tries[f"/proc/{daemon.pid}/mem"].startswith("PermissionError"), report


def test_idle_attach_connections_do_not_keep_a_client_from_its_segment():
    d = thread_pool(page_size=PAGE, num_pages=8, tenants={"a": "tok-a"}, max_unauthenticated=4, hello_timeout_s=30)
    idle = []
    try:
        for _ in range(3 * d.config.max_unauthenticated):  # each says nothing and stays
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(d.attach_path))
            idle.append(s)
        time.sleep(0.2)
        with client(d, "a") as a:
            assert a.arena is not None, a.attach_error  # the oldest idle ones were closed for it
        closed = 0
        for s in idle:
            s.settimeout(2)
            try:
                closed += s.recv(1) == b""
            except TimeoutError:
                pass
        assert closed >= 2 * d.config.max_unauthenticated, closed
    finally:
        for s in idle:
            s.close()
        d.stop_thread()


def test_a_tenant_cannot_use_another_tenants_namespace(two_tenants):
    d = two_tenants
    with client(d, "a") as a, client(d, "b") as b:
        assert publish(a, ns("a"), hashes(0, 1), payload(1, 9)).committed == 1
        for op in (lambda: b.lookup(ns("a"), hashes(0, 1)), lambda: b.acquire(ns("a"), hashes(0, 1)),
                   lambda: b.evict(ns("a"), hashes(0, 1)), lambda: b.reserve(ns("a"), hashes(5, 1), [PAGE])):
            with pytest.raises(Unauthenticated, match="session of tenant 'b' cannot use namespace of tenant 'a'"):
                op()
        assert a.lookup(ns("a"), hashes(0, 1)).miss is None  # b's attempts changed nothing of a's
