"""The daemon's private state (kvpool.pool.arena: the layout, the generations, the block index,
the heartbeat) out of a tenant's reach: its clients map it read-only and cannot write it
any other way; a tenant that scribbles every byte it can map plants nothing another
replica trusts (kvgate.harness.scenarios.hostile.scribble, the hostile scenario's attempt at pool
level); the layout before (kvgate.faults.private_controls) is caught by the same oracle."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvgate.harness.scenarios.hostile.scribble import pool_level
from kvgate.harness.system.pool import thread_pool
from kvpool.pool.arena import F_SEAL_FUTURE_WRITE, HEARTBEAT_OFF, Arena
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.pool.keys import Namespace, block_hashes

PAGE = 4096
NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


@pytest.fixture
def pool():
    d = thread_pool(page_size=PAGE, num_pages=16, heartbeat_s=0.01)
    yield d
    d.stop_thread()


def client(d, **kw) -> PoolClient:  # noqa: ANN001
    return PoolClient(f"unix:{d.unix_path}", "default", "tok", **kw)


def test_a_client_cannot_write_the_index_the_generations_or_the_heartbeat(pool):
    """Through the arena a client maps: every write to the daemon's state is refused (in
    layout 3 each of them went through, into memory the daemon and every replica trust)."""
    keys = block_hashes(range(16 * 2), 16)
    with client(pool) as a, client(pool) as b:
        assert publish(a, NS, keys, [np.full(PAGE, 7, np.uint8)] * 2).committed == 2
        daemon = pool.pools["default"].arena

        def gens() -> list[int]:
            return [daemon.generation(i) for i in range(daemon.num_pages)]

        index, before = daemon.index_entries.copy(), gens()
        with pytest.raises(ValueError, match="read-only"):
            b.arena.index_entries[:] = index[0]  # plant one entry everywhere
        with pytest.raises(ValueError, match="read-only"):
            b.arena.bump_generation(0)
        with pytest.raises(ValueError, match="read-only"):
            b.arena.beat(2**62)
        assert np.array_equal(daemon.index_entries, index) and gens() == before
        assert b.probe(NS, keys) == 2 and a.probe(NS, block_hashes(range(100, 132), 16)) == 0


def _trade(d) -> tuple[int, int]:  # noqa: ANN001
    import socket

    with client(d, zero_copy=False) as c, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(c.hello.arena)
        s.sendall(c.hello.ticket)
        answer, fds, _, _ = socket.recv_fds(s, 1, 4)
    assert answer == b"\x00" and len(fds) == 2
    return fds[0], fds[1]


def test_the_private_segment_refuses_every_other_way_to_write(pool):
    """What a client is handed: the private segment sealed F_SEAL_FUTURE_WRITE. A shared
    writable mapping, write(2), mprotect to PROT_WRITE, the descriptor reopened read-write
    through /proc: all refused by the kernel, while the daemon's own mapping writes on."""
    private, pages = _trade(pool)
    try:
        seals = fcntl.fcntl(private, fcntl.F_GET_SEALS)
        assert seals & F_SEAL_FUTURE_WRITE and seals & fcntl.F_SEAL_SEAL
        assert not fcntl.fcntl(pages, fcntl.F_GET_SEALS) & F_SEAL_FUTURE_WRITE  # clients write pages
        size = os.fstat(private).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(private, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(private, bytes(8), HEARTBEAT_OFF)
        reopened = os.open(f"/proc/self/fd/{private}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(reopened)
        ro = mmap.mmap(private, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            with pytest.raises(TypeError):
                ro[HEARTBEAT_OFF : HEARTBEAT_OFF + 8] = bytes(8)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            view = np.frombuffer(ro, dtype=np.uint8)
            assert libc.mprotect(ctypes.c_void_p(view.ctypes.data), size, mmap.PROT_READ | mmap.PROT_WRITE) == -1
            assert ctypes.get_errno() == 13  # EACCES
            beat = view[HEARTBEAT_OFF : HEARTBEAT_OFF + 8].tobytes()
            deadline = time.monotonic() + 5
            while view[HEARTBEAT_OFF : HEARTBEAT_OFF + 8].tobytes() == beat and time.monotonic() < deadline:
                time.sleep(0.01)  # the daemon beats on, through its own mapping
            assert view[HEARTBEAT_OFF : HEARTBEAT_OFF + 8].tobytes() != beat, "the heartbeat did not move"
            del view
        finally:
            ro.close()
        # Writable copies of its own (MAP_PRIVATE) are the client's business: the daemon's pages stay as they are.
        mine = mmap.mmap(private, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mine[HEARTBEAT_OFF : HEARTBEAT_OFF + 8] = bytes(8)
        mine.close()
        assert pool.pools["default"].arena.heartbeat_age_s() is not None
    finally:
        os.close(private)
        os.close(pages)


_RAW_WRITE = """
import ctypes, sys
from kvpool.client.pool_client import PoolClient
c = PoolClient(sys.argv[1], "default", "tok")
address = c.arena.index_entries.ctypes.data
print("mapped", flush=True)
ctypes.memset(address, 0x41, 32)  # below numpy: a store into the read-only page
print("wrote", flush=True)
"""


def test_a_raw_store_into_the_private_mapping_faults(pool):
    """Below every library check: a store through a raw pointer into the read-only
    mapping kills the client (SIGSEGV) and changes nothing."""
    index = pool.pools["default"].arena.index_entries.copy()
    proc = subprocess.run([sys.executable, "-c", _RAW_WRITE, f"unix:{pool.unix_path}"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert proc.stdout.split() == ["mapped"] and proc.returncode == -signal.SIGSEGV, (proc.stdout, proc.stderr)
    assert np.array_equal(pool.pools["default"].arena.index_entries, index)


def test_a_scribbling_tenant_plants_nothing_another_replica_trusts(test_seed):
    v = pool_level(test_seed)
    assert v.valid is True, v.reason
    attempts = v.evidence["attempts"]
    assert len(attempts) >= 7 and all(a["answer"].startswith("refused") for a in attempts
                                      if "pages segment" not in a["try"])


def test_the_private_state_in_the_page_segment_is_caught(test_seed):
    """The negative control: the layout before 4 (kvgate.faults.private_controls), where the
    scribbler's writes land in the index, the generations and the heartbeat."""
    v = pool_level(test_seed, arena="shared_private")
    assert v.valid is False
    for caught in ("probe never claims what the pool does not hold (blocks it never held)",
                   "the daemon's generations are the ones it wrote",
                   "B sees no heartbeat of a daemon that never beat",
                   "the tenant could not write the daemon's private state"):
        assert caught in v.reason, (caught, v.reason)


def test_a_segment_handed_as_one_descriptor_twice_is_still_mapped_apart():
    """The control's layout is a real arena: one memfd behind both descriptors, the
    private view of it read-only, the pages after it (so the control fails for its
    layout, not for a broken mapping)."""
    from kvgate.faults.private_controls import SharedPrivateArena

    daemon = SharedPrivateArena.anonymous("kvgate:test-shared", PAGE, 4)
    try:
        other = Arena.from_fds(*(os.dup(fd) for fd in daemon.handout_fds()), "kvgate:test-shared")
        try:
            other.page(3)[:] = 9
            assert (daemon.page(3) == 9).all() and not other.index_entries.flags.writeable
            daemon.bump_generation(2)
            assert other.generation(2) == 1 and other.layout.pages_off > 0
        finally:
            other.close()
    finally:
        daemon.close()
