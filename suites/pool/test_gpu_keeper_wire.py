"""The GPU keeper's control plane over real processes and sockets, without a GPU: the keeper and
its KeeperServer in one spawned process, replicas (TierClient) in others, host stand-in buffers
(memfds) in place of device memory (kvgate.harness.scenarios.gpu_keeper_wire). Each guard runs
with its negative control (kvgate.faults.keeper_controls), and the oracle that passes the real
part must catch the control:

  guard                                    oracle                            control
  commit after write (the producer's)      byte-exact pages in C             commit before the write
  typed error for a malformed frame        a MALFORMED reply, same session   FragileKeeperServer
  frame bound                              an OVERSIZED reply                UnboundedKeeperServer
  peer check (release, commit, abort)      refused, the owners' ids intact   PeerBlindKeeperServer
  quarantine of a dead producer            byte-exact pages after reuse      EagerFreeKeeper
  heartbeat staleness                      KeeperStale, transport_error,     HeartbeatBlindTierClient
                                           falls through to the host pool
  demotion by the maintenance round        the host pool holds the LRU       a server without a host pool
                                           blocks byte-exact; fall-through   (demotes nothing)

What is not checked here: device memory and CUDA ordering (suites/gpu/test_gpu_tier.py), the
connector's use of the tier (not built yet).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest

from kvgate.faults.keeper_controls import HeartbeatBlindTierClient
from kvgate.harness.scenarios import gpu_keeper_wire as W
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.errors import MissCause, PoolError
from kvpool.gpu.keeper_server import HELLO_FRAME_BYTES
from kvpool.gpu.tier import fall_through
from kvpool.gpu.tier_client import KeeperStale, TierClient
from kvpool.pool import protocol as P
from kvpool.pool.digest import DigestKind, page_digest

PAGE = 64 * 1024
TOKENS = {"default": "tok"}
CTX = mp.get_context("spawn")
START_S = 120.0  # a spawned process's start on a loaded two-core host
ANSWER_S = 30.0


class Proc:
    """A spawned worker and its pipe; its first answer is its hello."""

    def __init__(self, target, *args):  # noqa: ANN001, ANN002
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.hello = self._get(START_S)
        assert self.hello[0] == "ok", self.hello

    def _get(self, timeout: float) -> tuple:
        if not self.conn.poll(timeout):
            raise AssertionError(f"worker {self.proc.pid} did not answer within {timeout}s")
        return self.conn.recv()

    def ask(self, *cmd) -> tuple:  # noqa: ANN002
        self.conn.send(cmd)
        return self._get(ANSWER_S)

    def ok(self, *cmd) -> tuple:  # noqa: ANN002
        got = self.ask(*cmd)
        assert got[0] == "ok", got
        return got[1:]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError, AssertionError):
                os.kill(self.pid, signal.SIGCONT)  # a stopped keeper ends too
                self.ask("exit")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


@contextlib.contextmanager
def procs():
    started: list[Proc] = []

    def start(target, *args) -> Proc:  # noqa: ANN001, ANN002
        p = Proc(target, *args)
        started.append(p)
        return p
    try:
        yield start
    finally:
        for p in reversed(started):
            p.stop()


def run_dir(tmp_path, name: str) -> str:
    d = tmp_path / name
    d.mkdir(mode=0o700)
    return str(d)


def keeper(start, tmp_path, name: str, pages: int = 8, **kw) -> tuple[Proc, str]:  # noqa: ANN001
    k = start(W.keeper_process, run_dir(tmp_path, name), PAGE, {"default": pages}, TOKENS, *kw.values())
    return k, k.hello[1]


def replica(start, path: str, **kw) -> Proc:  # noqa: ANN001
    return start(W.replica_process, path, "default", "tok", *kw.values())


def until(pred, what: str, bound_s: float = 20.0) -> None:  # noqa: ANN001
    """Wait for an event the test caused (bounded; the event's order is not timing's)."""
    end = time.monotonic() + bound_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {bound_s}s")
        time.sleep(0.02)


def expected(seed: int, pages: list[int]) -> list[str]:
    return [W.blake(W.page_bytes(seed, p, PAGE)) for p in pages]


# -- publish in P, load in C -------------------------------------------------------------------

def test_a_page_published_in_one_process_loads_byte_exact_in_another(tmp_path, test_seed):
    with procs() as start:
        _, path = keeper(start, tmp_path, "k")
        p, c = replica(start, path), replica(start, path)
        assert p.hello[1] != c.hello[1]  # two sessions, two tier clients

        keys = W.KEYS(4)
        committed, pages = p.ok("publish", keys, test_seed)
        assert committed == 4
        blakes, bad, stale, miss = c.ok("load", keys)
        assert miss is None and bad == [] and stale == []
        assert blakes == expected(test_seed, pages)  # the oracle: byte-exact in C

        # control: the commit edge dropped (commit, then the write): C loads before the bytes land
        keys2, seed2 = W.KEYS(4, base=10_000), test_seed + 1
        rid, slots = p.ok("reserve", keys2)
        pages2 = [page for _, page in slots]
        digests = [page_digest(W.page_bytes(seed2, q, PAGE), DigestKind.SKETCH) for q in pages2]
        assert p.ok("commit", rid, digests) == (4,)
        blakes2, bad2, _, _ = c.ok("load", keys2)
        p.ok("write", pages2, seed2, None)
        assert blakes2 != expected(seed2, pages2), "the byte-exact oracle missed a commit before the write"
        assert bad2 == [0, 1, 2, 3]  # the loader's digest check sees it too


# -- malformed and oversized frames -----------------------------------------------------------

def _reply(sock: socket.socket) -> str:
    """The error code (or "pong") of the next reply, "hangup" at EOF, "silence" past the timeout."""
    try:
        header = sock.recv(4, socket.MSG_WAITALL)
        if len(header) < 4:
            return "hangup"
        payload = sock.recv(P.LENGTH.unpack(header)[0], socket.MSG_WAITALL)
    except TimeoutError:
        return "silence"
    except ConnectionError:
        return "hangup"
    _, reply = P.decode_reply(payload)
    return reply.code.value if isinstance(reply, P.Error) else type(reply).__name__.lower()


def _exchange(sock: socket.socket, data: bytes) -> str:
    try:
        sock.sendall(data)
    except OSError:  # the keeper closed this connection already
        return "hangup"
    return _reply(sock)


def frame_verdict(path: str) -> dict[str, str | bool]:
    """What a keeper answers to each bad frame, and whether it serves a good session after them."""
    out: dict[str, str | bool] = {}

    def session(hello: bool = True) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(3.0)
        s.connect(path)
        if hello:
            s.sendall(P.encode_request(1, P.Hello("default", "tok", "raw")))
            assert _reply(s) == "hellook"
        return s

    with session() as s:
        out["malformed"] = _exchange(s, P.frame(b"\x93\x01\x02 not an op"))
        out["wrong_version"] = _exchange(s, P.encode_request(2, P.Ping(), version=9))
        out["same_session_serves"] = _exchange(s, P.encode_request(3, P.Ping())) == "pong"
    with session() as s:
        out["oversized"] = _exchange(s, P.LENGTH.pack(P.CONTROL_FRAME_BYTES + 1))
    with session(hello=False) as s:
        out["oversized_before_hello"] = _exchange(s, P.LENGTH.pack(HELLO_FRAME_BYTES + 1))
    with TierClient(path, "default", "tok", timeout_s=10.0) as c:
        out["keeps_serving"] = c.lookup(W.NS, W.KEYS(1)).miss.cause == MissCause.NEVER_PUBLISHED
    return out


GOOD_FRAMES = {"malformed": "malformed", "wrong_version": "wrong_version", "same_session_serves": True,
               "oversized": "oversized", "oversized_before_hello": "oversized", "keeps_serving": True}


def test_bad_frames_get_typed_errors_and_the_keeper_keeps_serving(tmp_path):
    with procs() as start:
        k, path = keeper(start, tmp_path, "k")
        assert frame_verdict(path) == GOOD_FRAMES
        assert k.ok("errors")[0] == {"malformed": 1, "wrong_version": 1, "oversized": 2}

        # controls: each drops one guard, and the verdict's field for it catches it
        _, fragile = keeper(start, tmp_path, "fragile", 8, keeper="GpuKeeper", server="FragileKeeperServer")
        got = frame_verdict(fragile)
        assert got["malformed"] == "hangup" and got["malformed"] != GOOD_FRAMES["malformed"]
        _, unbounded = keeper(start, tmp_path, "unbounded", 8, keeper="GpuKeeper", server="UnboundedKeeperServer")
        got = frame_verdict(unbounded)
        assert got["oversized"] == "silence" and got["oversized"] != GOOD_FRAMES["oversized"]


# -- the peer check ---------------------------------------------------------------------------

def peer_verdict(start, path: str, seed: int) -> dict[str, object]:  # noqa: ANN001
    """P publishes a block and holds a reservation open; C holds a lease. Each tries the other's id;
    then each owner uses its own."""
    p, c = replica(start, path), replica(start, path)
    keys = W.KEYS(2)
    assert p.ok("publish", keys[:1], seed)[0] == 1
    rid, _ = p.ok("reserve", keys[1:])
    lease, _ = c.ok("acquire", keys[:1])
    assert rid and lease
    out = {"release_by_other": p.ask("release", lease)[:2], "commit_by_other": c.ask("commit", rid, [b"x" * 16])[:2],
           "abort_by_other": c.ask("abort", rid)[:2]}
    out["owner_release"] = c.ask("release", lease)[0]
    out["owner_abort"] = p.ask("abort", rid)[0]
    return out


GOOD_PEERS = {"release_by_other": ("error", "LeaseLost"), "commit_by_other": ("error", "InvalidRequest"),
              "abort_by_other": ("error", "InvalidRequest"), "owner_release": "ok", "owner_abort": "ok"}


def test_a_client_cannot_end_another_peers_lease_or_reservation(tmp_path, test_seed):
    with procs() as start:
        _, path = keeper(start, tmp_path, "k")
        assert peer_verdict(start, path, test_seed) == GOOD_PEERS
        # control: the server without the peer check lets P release C's lease (and C commit P's
        # reservation): caught, and the owners find their ids gone
        _, blind = keeper(start, tmp_path, "blind", 8, keeper="GpuKeeper", server="PeerBlindKeeperServer")
        got = peer_verdict(start, blind, test_seed)
        assert got["release_by_other"][0] == "ok" and got["owner_release"] == "error"
        assert got != GOOD_PEERS


# -- a producer killed between reserve and commit -----------------------------------------------

def crash_verdict(start, tmp_path, name: str, keeper_cls: str, seed: int) -> dict[str, object]:  # noqa: ANN001
    """A tier of one page. P reserves it, writes half of it, and its connection ends while the
    process lives on (the socket closes before a dying process's last copy lands); a survivor S
    publishes another block; P's late copy lands; P is killed; S publishes if it could not yet, and
    loads its block."""
    k, path = keeper(start, tmp_path, name, 1, keeper=keeper_cls, server="KeeperServer")
    p, s = replica(start, path), replica(start, path)
    hp, hs = W.KEYS(1), W.KEYS(1, base=50_000)
    rid, slots = p.ok("reserve", hp)
    assert rid and slots[0][0] == "reserved"
    page = slots[0][1]
    p.ok("write", [page], seed, PAGE // 2)
    p.ok("hangup")
    until(lambda: k.ok("sessions")[0] == 1, "the keeper saw P's connection end")
    st = k.ok("stats")[0]
    out: dict[str, object] = {"quarantined": st["gpu_tier_quarantined_clients"], "free": st["gpu_tier_free_pages"]}
    visible = [s.ok("lookup", hp)]
    published = s.ok("publish", hs, seed + 1)
    p.ok("write", [page], seed + 2, None)  # the late copy
    p.proc.kill()
    p.proc.join(10)
    until(lambda: k.ok("stats")[0]["gpu_tier_quarantined_clients"] == 0, "P's reservation reaped after its exit")
    out["free_after_exit"] = k.ok("stats")[0]["gpu_tier_free_pages"] if not published[0] else None
    if not published[0]:
        out["held_back"] = published[1]
        published = s.ok("publish", hs, seed + 1)
    assert published[0] == 1
    visible.append(s.ok("lookup", hp))
    blakes, bad, _, miss = s.ok("load", hs)
    out["p_visible"] = any(hits for hits, _ in visible)
    out["p_miss"] = {cause for _, cause in visible}
    out["byte_exact"] = blakes == expected(seed + 1, published[1])
    out["digest_bad"] = bad
    return out


def test_a_producer_killed_between_reserve_and_commit_leaves_no_visible_page(tmp_path, test_seed):
    with procs() as start:
        got = crash_verdict(start, tmp_path, "k", "GpuKeeper", test_seed)
        assert got == {"quarantined": 1, "free": 0, "free_after_exit": 1, "held_back": ["no_capacity"],
                       "p_visible": False, "p_miss": {"never_published"}, "byte_exact": True, "digest_bad": []}
        # control: no quarantine; the page is reused at once and P's late copy lands in S's block
        bad = crash_verdict(start, tmp_path, "eager", "EagerFreeKeeper", test_seed)
        assert bad["quarantined"] == 0 and bad["p_visible"] is False
        assert bad["byte_exact"] is False, "the byte-exact oracle missed the reuse of a dead producer's page"


# -- a stopped keeper ---------------------------------------------------------------------------

class PinnedClock:
    """CLOCK_MONOTONIC, or the value the test pins: staleness is judged from the heartbeat the
    stopped keeper left in its state segment, against a time the test sets."""

    def __init__(self) -> None:
        self.pinned: int | None = None

    def __call__(self) -> int:
        return time.monotonic_ns() if self.pinned is None else self.pinned


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


STALE_S = 5.0  # generous: a loaded host's keeper beats every 0.1 s


def stale_verdict(client: TierClient, host_run) -> dict[str, object]:  # noqa: ANN001
    """A lookup across the tiers, then a call, through `client` while the keeper is stopped."""
    causes: list[MissCause | None] = []
    gpu_run = client.run(W.NS)

    def gpu(hashes):  # noqa: ANN001, ANN202
        held, cause = gpu_run(hashes)
        causes.append(cause)
        return held, cause

    t0 = time.monotonic()
    out = fall_through(W.KEYS(2), [("gpu", gpu), ("host", host_run)])
    waited = time.monotonic() - t0
    try:
        client.lookup(W.NS, W.KEYS(2))
        error = None
    except PoolError as exc:
        error = type(exc).__name__
    return {"error": error, "gpu_cause": causes[0], "segments": out.segments, "miss": out.miss,
            "counted": client.metrics.registry.get_sample_value("kvpool_client_keeper_stale_total"),
            "refused_at_once": waited < client.timeout_s}


def test_a_stopped_keeper_makes_clients_fall_through_as_stale(tmp_path, test_seed):
    host_pool = thread_pool(page_size=PAGE, num_pages=8)
    host = PoolClient(f"unix:{host_pool.unix_path}", "default", "tok", name="host")
    try:
        res = host.reserve(W.NS, W.KEYS(2), [PAGE] * 2)
        host.commit(res.reservation_id, [page_digest(bytes(PAGE))] * 2)

        def host_run(hashes):  # noqa: ANN001, ANN202
            found = host.lookup(W.NS, hashes)
            return len(found.hits), None if found.miss is None else found.miss.cause

        with procs() as start:
            k, path = keeper(start, tmp_path, "k")
            replica(start, path).ok("publish", W.KEYS(2), test_seed)
            clock = PinnedClock()
            real = TierClient(path, "default", "tok", stale_after_s=STALE_S, timeout_s=2.0, clock_ns=clock).connect()
            blind = HeartbeatBlindTierClient(path, "default", "tok", stale_after_s=STALE_S, timeout_s=2.0,
                                             clock_ns=clock).connect()
            try:
                assert fall_through(W.KEYS(2), [("gpu", real.run(W.NS)), ("host", host_run)]).segments == \
                    (("gpu", 0, 2),)  # alive: the GPU tier serves
                os.kill(k.pid, signal.SIGSTOP)
                until(lambda: stopped(k.pid), "the keeper stopped")
                beat = real.tier.keeper_heartbeat_ns()  # frozen: the keeper cannot beat while stopped
                clock.pinned = beat + int(STALE_S * 1e9)
                assert not real.keeper_stale()  # at the bound: not yet
                clock.pinned += 1
                assert real.keeper_stale() and real.tier.keeper_heartbeat_ns() == beat

                got = stale_verdict(real, host_run)
                assert got == {"error": "KeeperStale", "gpu_cause": MissCause.TRANSPORT_ERROR,
                               "segments": (("host", 0, 2),), "miss": None, "counted": 2.0, "refused_at_once": True}
                # control: the client that never reads the heartbeat waits out its socket timeout and
                # fails as a timeout (backed off, not a transport_error fall-through): caught
                bad = stale_verdict(blind, host_run)
                assert bad["gpu_cause"] == MissCause.TIMEOUT and bad["counted"] == 0 and not bad["refused_at_once"]
                assert bad != got

                os.kill(k.pid, signal.SIGCONT)
                clock.pinned = None
                until(lambda: real.tier.keeper_heartbeat_ns() != beat, "the keeper beats again")
                assert len(real.lookup(W.NS, W.KEYS(2)).hits) == 2  # the same client: nothing was sent while stale

                k.proc.kill()  # a dead keeper: its socket fails before its heartbeat is stale
                k.proc.join(10)
                with pytest.raises(PoolError) as dead:
                    real.lookup(W.NS, W.KEYS(2))
                assert type(dead.value).__name__ == "TransportError"
                assert fall_through(W.KEYS(2), [("gpu", real.run(W.NS)), ("host", host_run)]).segments == \
                    (("host", 0, 2),)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(k.pid, signal.SIGCONT)
                real.close()
                blind.close()
    finally:
        host.close()
        host_pool.stop_thread()


def test_the_hello_binds_the_peers_process(tmp_path):
    """The session's peer is the process that connected (SO_PEERCRED / SO_PEERPIDFD), and the
    keeper's quarantine watches that process: covered end to end by the crash test; here the
    hello's answer and a bad token."""
    with procs() as start:
        _, path = keeper(start, tmp_path, "k")
        with TierClient(path, "default", "tok") as c:
            assert c.client_id >= 1 and c.hello.page_size == PAGE and c.hello.num_pages == 8
            assert c.tier.descriptor.instance == c.hello.arena_instance
        with pytest.raises(PoolError) as bad:
            TierClient(path, "default", "wrong").connect()
        assert type(bad.value).__name__ == "Unauthenticated"


# -- maintenance: demotion under pressure -----------------------------------------------------

def test_the_maintenance_round_demotes_to_the_host_pool_and_a_lookup_falls_through(tmp_path, test_seed):
    """In this process (the keeper's maintenance is a thread; the host pool a PoolDaemon on a
    thread): a replica fills the tier over the wire, one maintenance round demotes the least
    recently used pages, and the replica's lookup then falls through to the host pool for them.
    Control: a server without a host pool for the tenant demotes nothing (the oracle, the host
    pool holding the demoted blocks byte-exact, catches it)."""
    from kvgate.harness.scenarios.gpu_tier import ManualClock
    from kvpool.gpu.keeper import GpuKeeper, memfd_allocation
    from kvpool.gpu.keeper_server import KeeperServer
    from kvpool.gpu.tier import GpuTierConfig

    keys = W.KEYS(8)

    def held(host: PoolClient) -> list[int]:
        out = []
        for i, h in enumerate(keys):
            if host.lookup(W.NS, [h]).miss is None:
                lease = host.acquire(W.NS, [h])
                data = bytes(host.read_page(lease, 0))
                host.release(lease.lease_id)
                if data == W.page_bytes(test_seed, i, PAGE).tobytes():
                    out.append(i)
        return out

    def demoted(name: str, demote: bool) -> list[int]:
        """Which of the 8 published blocks the host pool holds byte-exact after one round."""
        host_pool = thread_pool(page_size=PAGE, num_pages=16)
        host = PoolClient(f"unix:{host_pool.unix_path}", "default", "tok", name="keeper")
        k = GpuKeeper(GpuTierConfig(page_size=PAGE, pages={"default": 8}, low_free=0.25, high_free=0.5),
                      run_dir(tmp_path, name), memfd_allocation, clock=ManualClock())
        try:
            with k, KeeperServer(k, TOKENS, hosts={"default": host} if demote else {}, maintenance_s=3600.0) as s:
                with TierClient(s.path, "default", "tok") as c:
                    for i, h in enumerate(keys):
                        data = W.page_bytes(test_seed, i, PAGE)
                        res = c.reserve(W.NS, [h], [PAGE])
                        c.tier.page_view(res.slots[0].page)[:] = data.tobytes()
                        c.commit(res.reservation_id, [page_digest(data, DigestKind.SKETCH)])
                    s.maintain()
                    out = held(host)

                    def host_run(hs):  # noqa: ANN001, ANN202
                        found = host.lookup(W.NS, hs)
                        return len(found.hits), None if found.miss is None else found.miss.cause
                    segs = fall_through(keys, [("gpu", c.run(W.NS)), ("host", host_run)])
                    assert segs.miss is None
                    assert segs.segments == ((("host", 0, len(out)),) if out else ()) + (("gpu", len(out), 8),)
                    return out
        finally:
            host.close()
            host_pool.stop_thread()

    assert demoted("k", True) == [0, 1, 2, 3]  # the least recently used half
    assert demoted("control", False) == [], "the oracle missed a round that demoted nothing"
