"""The GPU tier's handout over a real Unix socket, without a GPU: the keeper (kvpool.gpu.keeper)
with host stand-in buffers (memfds, the same protocol and descriptors as VMM exports), a
replica's TierMap in this process and in another one, single-use tickets, tenants apart, the
keeper's sealed private state, and typed errors for every malformed request (the keeper keeps
serving) and every malformed answer (the client maps nothing and leaks no descriptor)."""

import multiprocessing as mp
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from kvpool.errors import TransportError, UntrustedPool
from kvpool.gpu import handout as H
from kvpool.gpu.handout import HandleKind, HandoutRefused, MalformedHandout, TierDescriptor, fetch_handout
from kvpool.gpu.keeper import GpuKeeper, memfd_allocation
from kvpool.gpu.tier import GpuTierConfig
from kvpool.gpu.tier_map import TierMap
from kvpool.pool.keys import Namespace, block_hashes
from kvgate.harness.scenarios import gpu_tier as procs

PAGE = 64 * 1024
NS = Namespace("m", "r1", "tok", "bfloat16", "cuda", 16, 2, 2, 64)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


TTL = 2.0  # the tickets' validity, by the keeper's clock (a ManualClock: it moves when a test says)


@pytest.fixture
def clock():
    return procs.ManualClock()


@pytest.fixture
def keeper(tmp_path, clock):
    """A keeper whose tickets expire only when the test advances `clock`, and whose handout
    timeout is the production one: a replica starved on a loaded host still gets its buffer
    (the silent peer's timeout has a keeper of its own)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    k = GpuKeeper(GpuTierConfig(page_size=PAGE, pages={"default": 8, "b": 4}), run_dir, memfd_allocation,
                  ticket_ttl_s=TTL, clock=clock)
    with k:
        yield k


def test_a_replica_maps_its_tenants_buffer_and_the_keepers_state(keeper):
    before = open_fds()
    with TierMap.attach(keeper.attach_path, keeper.mint_ticket("default")) as tier:
        desc = tier.descriptor
        assert (desc.kind, desc.page_size, desc.num_pages, desc.instance) == \
            (HandleKind.MEMFD, PAGE, 8, keeper.instance)
        assert desc.size % desc.granularity == 0 and not tier.same_gpu
        # the generations the replica reads are the tier's catalog's, as the keeper changes them
        res = keeper.tier.reserve(1, "default", NS, block_hashes(range(32), 16), [PAGE] * 2, 0.0)
        pages = [s.page for s in res.slots]
        assert [tier.generation(p) for p in pages] == [0, 0]
        keeper.tier.abort(1, "default", res.reservation_id)
        assert [tier.generation(p) for p in pages] == [1, 1]
        assert tier.keeper_age_s() < 5.0
        tier.page_view(7)[:4] = b"last"
        with pytest.raises(H.HandoutError):
            tier.page_view(8)
    assert keeper.served(1) == {"ok": 1}  # its connection closed: the keeper shares this process
    assert open_fds() == before  # every descriptor received was closed
    assert keeper.peer_of(os.getpid()) == "default"


def test_the_private_state_cannot_be_written_by_a_replica(keeper):
    desc, fds = fetch_handout(str(keeper.attach_path), keeper.mint_ticket("default"))
    try:
        import mmap
        with pytest.raises(PermissionError):
            mmap.mmap(fds[1], desc.private_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fds[1], b"\xff" * 8, H.GENERATIONS_OFF)
        with pytest.raises(PermissionError):
            os.ftruncate(fds[0], desc.size // 2)  # nor shrink the buffer under the others
    finally:
        for fd in fds:
            os.close(fd)


def test_two_processes_share_the_buffer_and_tenants_are_apart(keeper, test_seed):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=procs.host_worker, args=(child, str(keeper.attach_path), keeper.mint_ticket("default")))
    p.start()
    child.close()  # the worker's end is the worker's alone: if it dies, recv() raises EOFError
    try:
        parent.send(("fill", [0, 3, 7], test_seed))
        assert parent.recv() == ("ok",)
        with TierMap.attach(keeper.attach_path, keeper.mint_ticket("default")) as mine:
            for pg in (0, 3, 7):
                assert bytes(mine.page_view(pg)) == procs.page_bytes(test_seed, pg, PAGE).tobytes()
            mine.page_view(3)[:] = procs.page_bytes(test_seed + 1, 3, PAGE).tobytes()
        parent.send(("check", [3], test_seed + 1))
        assert parent.recv() == ("ok", 0)
        parent.send(("check", [3], test_seed))  # the control: the oracle sees other bytes
        assert parent.recv()[1] > 0
        with TierMap.attach(keeper.attach_path, keeper.mint_ticket("b")) as other:
            assert other.descriptor.num_pages == 4
            assert not np.frombuffer(other.page_view(0), np.uint8).any()  # tenant b's own buffer
        parent.send(("exit",))
        assert parent.recv() == ("ok",)
    finally:
        parent.close()
        p.join()  # it exits at "exit", or at EOF on its pipe
    assert p.exitcode == 0
    p.close()


def test_tickets_are_single_use_expire_and_name_a_tenant(keeper, clock):
    ticket = keeper.mint_ticket("default")
    TierMap.attach(keeper.attach_path, ticket).close()
    keeper.served(1)
    before = open_fds()
    with pytest.raises(HandoutRefused):
        TierMap.attach(keeper.attach_path, ticket)
    with pytest.raises(HandoutRefused):
        fetch_handout(str(keeper.attach_path), os.urandom(16))
    late = keeper.mint_ticket("default")
    clock.advance(TTL)  # `late` expires now, TTL after its minting
    fresh = keeper.mint_ticket("default")
    with pytest.raises(HandoutRefused):
        fetch_handout(str(keeper.attach_path), late)
    clock.advance(TTL / 2)
    _, fds = fetch_handout(str(keeper.attach_path), fresh)  # the control: a ticket within its TTL
    for fd in fds:
        os.close(fd)
    with pytest.raises(H.HandoutError):
        keeper.mint_ticket("nobody")
    with pytest.raises(H.HandoutError):
        fetch_handout(str(keeper.attach_path), b"short")
    assert keeper.served(5) == {"ok": 2, "refused": 3}
    assert open_fds() == before


def _raw(keeper, payload: bytes, close_write: bool = True) -> bytes:
    """What the keeper answers `payload`, read until it closes the connection (it always does:
    after its answer, or at once, or at its handout timeout)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(keeper.attach_path))
        s.sendall(payload)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        data, fds, _, _ = socket.recv_fds(s, 1024, 4)
        for fd in fds:
            os.close(fd)
        return data + (b"|fds" if fds else b"")


def test_malformed_requests_get_nothing_and_the_keeper_keeps_serving(keeper):
    ticket = keeper.mint_ticket("default")
    assert _raw(keeper, b"GARBAGE" + bytes(17)) == b""  # bad magic
    assert _raw(keeper, H.REQUEST.pack(H.MAGIC, H.VERSION, 0, ticket)[:10]) == b""  # truncated
    wrong = _raw(keeper, H.REQUEST.pack(H.MAGIC, H.VERSION + 1, 0, ticket))
    assert H.ANSWER.unpack(wrong)[2] == H.Status.WRONG_VERSION
    assert keeper.served(3) == {"malformed": 2, "wrong_version": 1}
    # the ticket was never spent on any of them: it still works
    with TierMap.attach(keeper.attach_path, ticket) as tier:
        assert tier.descriptor.num_pages == 8


def test_a_silent_peer_is_cut_at_the_handout_timeout(tmp_path, clock):
    # a keeper of its own: a short handout timeout, and no other peer that could be cut by it
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    with GpuKeeper(GpuTierConfig(page_size=PAGE, pages={"default": 2}), run_dir, memfd_allocation,
                   handout_timeout_s=0.2, clock=clock) as impatient:
        assert _raw(impatient, b"", close_write=False) == b""  # closed by the keeper, nothing sent
        assert impatient.served(1) == {"timeout": 1}


class FakeKeeper:
    """A listener that answers one connection with whatever the test says."""

    def __init__(self, path, answer: bytes, fds=()):
        self.path = str(path)
        self.received = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(2)
        self.thread = threading.Thread(target=self._one, args=(answer, list(fds)), daemon=True)
        self.thread.start()

    def _one(self, answer, fds):
        conn, _ = self.sock.accept()
        with conn:
            try:
                self.received = conn.recv(64)  # the request, or b"" when the client closed
            except OSError:
                return
            if fds:
                socket.send_fds(conn, [answer], fds)
            elif answer:
                conn.sendall(answer)

    def close(self):
        # a connection of its own that closes at once: what the thread accepts (and reads EOF
        # from) where the test's client never connected, queued behind the client's otherwise
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
            wake.connect(self.path)
        self.thread.join()
        self.sock.close()


def _memfd(size, seals=True, future_write=True):
    import fcntl
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, H.SIZE_SEALS | (H.F_SEAL_FUTURE_WRITE if future_write else 0))
    return fd


def _desc(**kw):
    base = dict(instance=b"i" * 16, device_uuid=bytes(16), kind=HandleKind.MEMFD, size=PAGE * 4, page_size=PAGE,
                num_pages=4, granularity=4096, private_size=H.private_size(4))
    base.update(kw)
    return TierDescriptor(**base)


def _ok(desc_bytes: bytes) -> bytes:
    return H.ANSWER.pack(H.MAGIC, H.VERSION, H.Status.OK, len(desc_bytes)) + desc_bytes


@pytest.mark.parametrize("case", ["bad_magic", "refused_with_fd", "short_header", "body_length", "unknown_status",
                                  "one_fd", "three_fds", "bad_geometry", "unknown_kind", "unsealed_private",
                                  "private_of_another"])
def test_a_malformed_answer_raises_typed_and_leaks_no_descriptor(tmp_path, case):
    before = open_fds()
    desc = _desc()
    buf = _memfd(desc.size)
    priv = _memfd(desc.private_size, seals=case != "unsealed_private")
    extra = _memfd(4096)
    answer, fds, error = _ok(desc.pack()), [buf, priv], MalformedHandout
    if case == "bad_magic":
        answer = b"XXXX" + answer[4:]
    elif case == "refused_with_fd":
        answer, error = H.ANSWER.pack(H.MAGIC, H.VERSION, H.Status.REFUSED, 0), HandoutRefused
    elif case == "short_header":
        answer = answer[:5]
    elif case == "body_length":
        answer = H.ANSWER.pack(H.MAGIC, H.VERSION, H.Status.OK, 7) + desc.pack()
    elif case == "unknown_status":
        answer = H.ANSWER.pack(H.MAGIC, H.VERSION, 9, 0)
    elif case == "one_fd":
        fds = [buf]
    elif case == "three_fds":
        fds = [buf, priv, extra]
    elif case == "bad_geometry":
        answer = _ok(struct.pack("<16s16sIIQQQQQ", b"i" * 16, bytes(16), 2, 0, PAGE, PAGE, 4, 4096,
                                 H.private_size(4)))  # 4 pages in one page's bytes
    elif case == "unknown_kind":
        answer = _ok(struct.pack("<16s16sIIQQQQQ", b"i" * 16, bytes(16), 77, 0, PAGE * 4, PAGE, 4, 4096,
                                 H.private_size(4)))
    elif case == "private_of_another":  # sealed, right size, but not this keeper's header
        pass
    path = tmp_path / "fake.sock"
    fake = FakeKeeper(path, answer, fds)
    try:
        with pytest.raises(error):
            TierMap.attach(path, b"t" * 16)
    finally:
        fake.close()
        for fd in (buf, priv, extra):
            os.close(fd)
    assert open_fds() == before
    assert fake.received[:4] == H.MAGIC


def test_an_untrusted_listener_is_sent_nothing(tmp_path):
    path = tmp_path / "fake.sock"
    fake = FakeKeeper(path, b"")
    try:
        with pytest.raises(UntrustedPool):
            fetch_handout(str(path), b"t" * 16, timeout_s=1.0, trusted_uids={os.geteuid() + 12345})
    finally:
        fake.close()
    assert fake.received == b""  # not the ticket, not a byte


def test_no_keeper_there_is_a_transport_error(tmp_path):
    with pytest.raises(TransportError):
        fetch_handout(str(tmp_path / "none.sock"), b"t" * 16, timeout_s=1.0)
    silent = tmp_path / "silent.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(silent))
    s.listen(1)
    try:
        with pytest.raises(TransportError, match="did not answer"):
            fetch_handout(str(silent), b"t" * 16, timeout_s=0.3)
    finally:
        s.close()


def test_a_stopped_keeper_leaves_mapped_replicas_their_bytes(tmp_path, clock):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    k = GpuKeeper(GpuTierConfig(page_size=PAGE, pages={"default": 2}), run_dir, memfd_allocation, clock=clock).start()
    tier = TierMap.attach(k.attach_path, k.mint_ticket("default"))
    tier.page_view(1)[:3] = b"abc"
    k.stop()
    assert not k.attach_path.exists()
    assert bytes(tier.page_view(1)[:3]) == b"abc"  # the memory lives while a mapping holds it
    time.sleep(0.3)
    assert tier.keeper_age_s() >= 0.2  # but the keeper's heartbeat stopped
    tier.close()


def test_a_crashed_producers_quarantine_ends_when_its_process_exits_not_before(keeper):
    import subprocess
    import sys

    from kvpool.pool.catalog import PageState
    from kvpool.pool.records import SlotStatus

    replica = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        keeper.register_client(5, replica.pid)  # at its hello, while it runs
        res = keeper.tier.reserve(5, "default", NS, block_hashes(range(64), 16), [PAGE] * 4, 0.0)
        pages = [s.page for s in res.slots if s.status == SlotStatus.RESERVED]
        cat = keeper.tier.catalogs["default"]
        assert keeper.client_gone(5)  # its connection ended: quarantined
        time.sleep(0.2)
        assert keeper.reap_exited() == []  # alive: its copies may still write
        assert [int(cat.state[p]) for p in pages] == [PageState.RESERVED] * 4
        replica.kill()
        replica.wait(10)
        assert keeper.reap_exited() == [5]
        assert [int(cat.state[p]) for p in pages] == [PageState.FREE] * 4
        assert keeper.tier.quarantined() == frozenset()
    finally:
        replica.kill()
        replica.wait(10)
    # a process gone before it was registered ends its quarantine at the next reap
    keeper.register_client(6, replica.pid)  # reaped above: no such process now
    keeper.tier.reserve(6, "default", NS, block_hashes(range(1000, 1016), 16), [PAGE], 0.0)
    assert keeper.client_gone(6) and keeper.reap_exited() == [6]
    # a client with nothing reserved is not quarantined, and its pidfd is closed
    keeper.register_client(7, os.getpid())
    assert not keeper.client_gone(7) and 7 not in keeper._pidfds


def test_tickets_never_redeemed_expire_from_the_table(keeper, clock):
    for _ in range(50):  # a peer looping hellos that never attach
        keeper.mint_ticket("default")
    assert len(keeper._tickets) == 50
    clock.advance(TTL)
    keeper.mint_ticket("default")  # minting prunes what expired
    assert len(keeper._tickets) == 1


def test_a_quarantine_whose_reservations_all_expired_ends_and_closes_its_pidfd(keeper):
    """A live replica that reserved and hung up, whose reservations the TTL then took, holds
    nothing: its quarantine ends and its pidfd is closed at the next reap, though its process
    runs on (a peer looping reserve-and-hang-up cannot pile up descriptors)."""
    keeper.register_client(8, os.getpid())  # alive for the whole test
    keeper.tier.reserve(8, "default", NS, block_hashes(range(2000, 2016), 16), [PAGE], 0.0)
    assert keeper.client_gone(8)
    assert keeper.reap_exited() == []  # reserved and alive: held
    assert 8 in keeper._pidfds
    keeper.tier.reap(10**9)  # the TTL ran out
    assert keeper.reap_exited() == [8]
    assert 8 not in keeper._pidfds and keeper.tier.quarantined() == frozenset()
