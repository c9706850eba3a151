"""Before a successful hello a connection costs the daemon little, and not for long: no
client slot, a small frame limit, a deadline, a cap on how many may wait. Many idle or
slow clients do not keep an authenticated one from being served."""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvgate.harness.system.pool import thread_pool
from kvpool.pool import protocol as P
from kvpool.pool.arena import processes_mapping, segment_label
from kvpool.client.pool_client import PoolClient
from kvpool.errors import ErrorCode
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


@pytest.fixture
def daemon():
    d = thread_pool(page_size=4096, num_pages=16, max_clients=4, max_unauthenticated=8, hello_timeout_s=0.5)
    yield d
    d.stop_thread()
    assert os.getpid() not in processes_mapping(segment_label(d.config.name, ""))


def raw(d) -> socket.socket:  # noqa: ANN001
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(d.unix_path))
    s.settimeout(5)
    return s


def reply(s: socket.socket):  # noqa: ANN201
    head = s.recv(4, socket.MSG_WAITALL)
    assert len(head) == 4, "closed without a reply"
    (n,) = P.LENGTH.unpack(head)
    return P.decode_reply(s.recv(n, socket.MSG_WAITALL))[1]


def client(d, **kw) -> PoolClient:  # noqa: ANN001
    return PoolClient(f"unix:{d.unix_path}", "default", "tok", **kw)


def test_a_connection_without_a_hello_is_told_and_closed_at_its_deadline(daemon):
    t0 = time.monotonic()  # before the connect: the daemon's deadline runs from its accept
    s = raw(daemon)
    r = reply(s)
    waited = time.monotonic() - t0
    assert r.code == ErrorCode.UNAUTHENTICATED and "no successful hello" in r.message
    assert s.recv(1) == b""  # closed
    assert 0.4 <= waited < 3.0


def test_a_slow_hello_sent_byte_by_byte_is_cut_at_the_deadline(daemon):
    frame = P.encode_request(1, P.Hello("default", "tok", "slow"))
    s = raw(daemon)
    t0 = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for b in frame:  # one byte every 100 ms: the whole hello would take far past the deadline
            s.sendall(bytes([b]))
            time.sleep(0.1)
            if time.monotonic() - t0 > 3:
                break
    assert time.monotonic() - t0 < 3


def test_a_large_frame_before_the_hello_is_refused_before_its_bytes_are_read(daemon):
    s = raw(daemon)
    s.sendall(P.LENGTH.pack(daemon.config.max_hello_frame + 1))  # the prefix only: no byte of the body
    r = reply(s)
    assert r.code == ErrorCode.OVERSIZED and "before a successful hello" in r.message
    assert s.recv(1) == b""
    with client(daemon) as c:  # after a hello the daemon's own frame limit applies
        c.ping()


@pytest.fixture
def slow_hello_daemon():
    """A hello deadline (5 s) far above a loaded machine's connect and hello, so that a client
    served behind the idle connections (which wait out that deadline) is told apart from one
    merely slowed by the machine."""
    d = thread_pool(page_size=4096, num_pages=16, max_clients=4, max_unauthenticated=8, hello_timeout_s=5.0)
    yield d
    d.stop_thread()
    assert os.getpid() not in processes_mapping(segment_label(d.config.name, ""))


def test_many_idle_connections_neither_take_client_slots_nor_delay_a_client(slow_hello_daemon):
    daemon = slow_hello_daemon
    idle = []
    for _ in range(daemon.config.max_unauthenticated + 20):  # more than may wait: the oldest are closed
        try:
            idle.append(raw(daemon))
        except OSError:  # the listen backlog is full: that is refusal too
            break
    t0 = time.monotonic()
    served = []
    for i in range(daemon.config.max_clients):  # every client slot is still there
        c = client(daemon)
        c.lookup(NS, block_hashes(range(16 * i, 16 * i + 16), 16))
        served.append(c)
    assert time.monotonic() - t0 < daemon.config.hello_timeout_s / 2, \
        "authenticated clients waited behind idle connections"
    time.sleep(daemon.config.hello_timeout_s + 0.5)
    for s in idle:  # each told or closed, none still held open by the daemon
        s.settimeout(2)
        try:
            data = s.recv(65536)
        except (ConnectionResetError, TimeoutError) as exc:
            raise AssertionError(f"an idle connection still open past the deadline: {exc}") from exc
        while data:
            data = s.recv(65536)
        s.close()
    for c in served:
        c.ping()
        c.close()


def test_a_failed_hello_takes_no_slot_and_the_connection_may_retry(daemon):
    s = raw(daemon)
    s.sendall(P.encode_request(1, P.Hello("default", "wrong", "x")))
    assert reply(s).code == ErrorCode.UNAUTHENTICATED
    s.sendall(P.encode_request(2, P.Hello("default", "tok", "x")))
    assert isinstance(reply(s), P.HelloOk)
    s.close()
    clients = [client(daemon) for _ in range(daemon.config.max_clients)]
    for c in clients:
        c.ping()
        c.close()
