"""The transport nemesis (kvgate.faults.proxy) between a real PoolClient and a real daemon.

For each fault kind: the client's operation ends with the typed error or load miss
cause the client promises, the daemon's accounting is what it was before (no lease or
reservation outlives the broken connection), and after heal the same operation is
byte-exact. Every drawn choice (pages, block where a fault strikes, flipped bit,
truncation length) comes from the per-test seed. Timing is never asserted: a stall is
60 s against a 1 s client timeout, and the slow link is checked by its accounting.
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvgate.faults.proxy import FaultProxy, LinkFault, parse_control
from kvgate.harness.system.proxy import ProxyProcess
from kvgate.faults.transport_controls import TrustingLoader
from kvgate.harness.system.pool import DEFAULT_TENANT, PoolProcess
from kvpool.pool import protocol as P
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.errors import ErrorCode, MissCause, PoolTimeout, TransportError
from kvpool.connector.history import HistoryWriter, read_history
from kvpool.pool.keys import Namespace, block_hashes

pytestmark = pytest.mark.timeout(60)

PAGE = 4096
BLOCKS = 6
NS = Namespace("proxy-suite", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
ACCOUNTS = ("committed_pages", "free_pages", "reserved_pages", "leased_pages", "open_leases",
            "open_reservations", "entries")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = PoolProcess.start(page_size=PAGE, num_pages=512, run_dir=tmp_path_factory.mktemp("pool"))
    try:
        yield p
        assert p.stop() == 0
    finally:
        p.cleanup()


@pytest.fixture
def direct(pool):
    """A client that bypasses the proxy: the daemon's own view of its accounting."""
    with pool.client(name="direct") as c:
        yield c


@pytest.fixture
def sockdir():
    d = Path(tempfile.mkdtemp(prefix="kvpx-"))  # short: Unix socket paths are limited to 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def proxies(pool, sockdir, tmp_path, test_seed):
    made: list[FaultProxy] = []

    def make(listen: str = "tcp", *, remote: bool | None = None, seed: int | None = None) -> FaultProxy:
        n = len(made)
        address = f"unix:{sockdir}/proxy-{n}.sock" if listen == "unix" else "tcp:127.0.0.1:0"
        history = HistoryWriter(tmp_path / "history", f"proxy{n}", "proxy")
        proxy = FaultProxy(pool.unix, address, tmp_path / f"control-{n}.json",
                           test_seed if seed is None else seed, history, remote=remote)
        made.append(proxy.start())
        return proxy

    yield make
    for proxy in made:
        proxy.stop()  # raises if the proxy failed internally
        proxy.history.close()


class Prefix:
    """BLOCKS seeded pages under seeded hashes, unique to one test."""

    def __init__(self, seed: int, tag: str = ""):
        rng = random.Random(f"{seed}:prefix:{tag}")
        base = rng.randrange(1 << 31)
        self.hashes = block_hashes([base + i for i in range(16 * BLOCKS)], 16)
        gen = np.random.default_rng([rng.randrange(1 << 32), 7])
        self.data = [gen.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(BLOCKS)]

    def sink(self):
        out = [np.zeros(PAGE, np.uint8) for _ in range(BLOCKS)]
        return out, out.__getitem__

    def exact(self, out, upto: int = BLOCKS) -> bool:
        return all(np.array_equal(a, b) for a, b in zip(out[:upto], self.data[:upto]))


def client(pool, proxy: FaultProxy, **kw) -> PoolClient:
    return PoolClient(proxy.address, DEFAULT_TENANT, pool.token, name="via-proxy", **kw)


def accounts(c: PoolClient) -> dict[str, int]:
    stats = c.stats()
    return {k: stats[k] for k in ACCOUNTS}


def assert_settles(direct: PoolClient, before: dict[str, int], timeout: float = 15.0) -> None:
    """The daemon drops a broken connection's leases and reservations when it sees the
    close; wait (generously) for that, then demand exactly the accounting of before."""
    deadline = time.monotonic() + timeout
    now = accounts(direct)
    while now != before and time.monotonic() < deadline:
        time.sleep(0.02)
        now = accounts(direct)
    assert now == before, {k: (before[k], now[k]) for k in ACCOUNTS if before[k] != now[k]}


def published(pool, direct, seed: int, tag: str = "") -> tuple[Prefix, dict[str, int]]:
    prefix = Prefix(seed, tag)
    assert publish(direct, NS, prefix.hashes, prefix.data).committed == BLOCKS
    return prefix, accounts(direct)


def healed_load_is_exact(c: PoolClient, proxy: FaultProxy, prefix: Prefix) -> None:
    proxy.heal()
    fired = proxy.fired()
    out, sink = prefix.sink()
    res = load(c, NS, prefix.hashes, sink)
    assert (res.loaded, res.miss) == (BLOCKS, None)
    assert prefix.exact(out)
    assert proxy.fired() == fired, "a healed proxy fired"


# -- a healthy proxy ------------------------------------------------------------------------
@pytest.mark.parametrize("listen,remote", [("unix", False), ("unix", True), ("tcp", None)])
def test_a_healthy_proxy_is_transparent(pool, direct, proxies, test_seed, listen, remote):
    proxy = proxies(listen, remote=remote)
    assert proxy.remote == (listen == "tcp" or bool(remote))
    with client(pool, proxy) as c:
        assert (c.arena is None) == proxy.remote  # remote: page bytes travel as frames
        prefix = Prefix(test_seed)
        assert publish(c, NS, prefix.hashes, prefix.data).committed == BLOCKS
        out, sink = prefix.sink()
        assert load(c, NS, prefix.hashes, sink).loaded == BLOCKS
        assert prefix.exact(out)
        assert direct.lookup(NS, prefix.hashes).miss is None
    stats = proxy.stats()
    assert stats["request_frames"] == stats["reply_frames"] > 0
    assert stats["hello_rewritten"] == (1 if proxy.remote else 0)
    if proxy.remote:  # every page crossed twice: a write request and a pages_ok reply
        assert stats["request_bytes"] > BLOCKS * PAGE and stats["reply_bytes"] > BLOCKS * PAGE
    else:
        assert stats["request_bytes"] + stats["reply_bytes"] < BLOCKS * PAGE
    assert not any(proxy.fired().values())


# -- reset ----------------------------------------------------------------------------------
@pytest.mark.parametrize("listen,op", [("unix", "acquire"), ("tcp", "acquire"), ("tcp", "read")])
def test_reset_under_a_load_is_a_transport_error(pool, direct, proxies, test_seed, listen, op):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies(listen)
    at = random.Random(f"{test_seed}:at").randrange(BLOCKS) if op == "read" else 0
    with client(pool, proxy) as c:
        proxy.configure({"reset": {"ops": [op], "direction": "reply", "after": at}})
        out, sink = prefix.sink()
        res = load(c, NS, prefix.hashes, sink)
        assert res.loaded == at and res.miss.cause == MissCause.TRANSPORT_ERROR and res.miss.index == at
        assert prefix.exact(out, at)
        assert proxy.fired()["reset"] == 1
        (record,) = proxy.records()
        assert (record["kind"], record["op"], record["direction"]) == ("reset", op, "reply")
        assert record["rst"] == (listen == "tcp")
        assert_settles(direct, before)  # the lease the daemon granted went with the connection
        if op == "acquire":  # acquire is not idempotent: the client reports, never resends
            with pytest.raises(TransportError) as err:
                c.acquire(NS, prefix.hashes)
            if listen == "tcp":  # SO_LINGER 0: the client saw an RST, not an orderly close
                assert isinstance(err.value.__cause__, ConnectionResetError)
            assert proxy.fired()["reset"] == 2
            assert_settles(direct, before)
        healed_load_is_exact(c, proxy, prefix)
    assert_settles(direct, before)


@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_reset_of_an_idempotent_request_is_resent_once_on_a_fresh_connection(pool, direct, proxies, test_seed, listen):
    """The client's promise: a request safe to repeat (ping, lookup, stats, metrics) that
    failed with no reply byte on a reused connection is sent once more, and only once."""
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies(listen)
    with client(pool, proxy) as c:
        proxy.configure({"reset": {"ops": ["lookup"], "times": 1}})
        connections = proxy.stats()["connections"]
        assert c.lookup(NS, prefix.hashes).miss is None  # the resend went through
        assert proxy.fired()["reset"] == 1 and proxy.stats()["connections"] == connections + 1
        proxy.configure({"reset": {"ops": ["lookup"]}})
        with pytest.raises(TransportError):
            c.lookup(NS, prefix.hashes)
        assert proxy.fired()["reset"] == 3  # the original and exactly one resend
        assert [r["op"] for r in proxy.records()] == ["lookup"] * 3
        proxy.heal()
        assert c.lookup(NS, prefix.hashes).miss is None
    assert_settles(direct, before)


# -- stall and dropped replies: timeouts ----------------------------------------------------
@pytest.mark.parametrize("direction", ["request", "reply"])
def test_stall_is_a_timeout(pool, direct, proxies, test_seed, direction):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies("unix")
    with client(pool, proxy, timeout_s=1.0) as c:
        proxy.configure({"stall": {"ops": ["acquire"], "direction": direction, "seconds": 60}})
        out, sink = prefix.sink()
        res = load(c, NS, prefix.hashes, sink)
        assert res.loaded == 0 and res.miss.cause == MissCause.TIMEOUT
        assert proxy.fired()["stall"] == 1
        # the timed-out client dropped its connection: the proxy ends the stall and the
        # link, and a lease granted behind the stalled reply goes with it
        assert_settles(direct, before)
        with pytest.raises(PoolTimeout):
            c.acquire(NS, prefix.hashes)
        assert_settles(direct, before)
        c.timeout_s = 30.0  # the next connection, after heal, has no reason to be quick
        healed_load_is_exact(c, proxy, prefix)


def test_heal_releases_a_stalled_frame(pool, direct, proxies, test_seed):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies("tcp")
    with client(pool, proxy, timeout_s=50.0) as c:
        proxy.configure({"stall": {"ops": ["lookup"], "direction": "reply", "seconds": 60}})
        result: list[object] = []
        worker = threading.Thread(target=lambda: result.append(c.lookup(NS, prefix.hashes)))
        worker.start()
        deadline = time.monotonic() + 20
        while proxy.fired()["stall"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.fired()["stall"] == 1
        proxy.heal()
        worker.join(30)
        assert not worker.is_alive() and result[0].miss is None  # the held reply went out
    assert_settles(direct, before)


def test_an_unreachable_daemon_is_a_transport_error(pool, sockdir, tmp_path, test_seed):
    proxy = FaultProxy(f"unix:{sockdir}/nobody.sock", f"unix:{sockdir}/p.sock", tmp_path / "c.json", test_seed).start()
    try:
        with pytest.raises(TransportError):
            PoolClient(proxy.address, DEFAULT_TENANT, pool.token)
        assert proxy.stats()["upstream_failures"] == 1
    finally:
        proxy.stop()


def test_a_dropped_reply_is_a_timeout_at_its_block(pool, direct, proxies, test_seed):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies("tcp")
    at = random.Random(f"{test_seed}:at").randrange(BLOCKS)
    with client(pool, proxy, timeout_s=1.0) as c:
        proxy.configure({"drop_reply": {"ops": ["read"], "after": at, "times": 1}})
        out, sink = prefix.sink()
        res = load(c, NS, prefix.hashes, sink)
        assert res.loaded == at and res.miss.cause == MissCause.TIMEOUT and res.miss.index == at
        assert prefix.exact(out, at)
        (record,) = proxy.records()
        assert (record["op"], record["reply"], record["direction"]) == ("read", "pages_ok", "reply")
        assert record["frame_bytes"] > PAGE
        assert_settles(direct, before)
        c.timeout_s = 30.0
        healed_load_is_exact(c, proxy, prefix)


# -- truncate -------------------------------------------------------------------------------
@pytest.mark.parametrize("listen,direction", [("unix", "request"), ("tcp", "reply")])
def test_a_truncated_frame_is_a_transport_error_never_a_hang(pool, direct, proxies, test_seed, listen, direction):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies(listen, remote=True)
    at = random.Random(f"{test_seed}:at").randrange(BLOCKS)
    with client(pool, proxy) as c:
        proxy.configure({"truncate": {"ops": ["read"], "direction": direction, "after": at}})
        out, sink = prefix.sink()
        res = load(c, NS, prefix.hashes, sink)
        assert res.loaded == at and res.miss.cause == MissCause.TRANSPORT_ERROR and res.miss.index == at
        assert prefix.exact(out, at)
        (record,) = proxy.records()
        assert record["direction"] == direction and 1 <= record["forwarded_bytes"] < record["frame_bytes"]
        assert_settles(direct, before)
        healed_load_is_exact(c, proxy, prefix)


def test_a_truncated_lookup_reply_is_resent_only_when_no_reply_byte_arrived(pool, direct, proxies, test_seed):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies("tcp")
    with client(pool, proxy) as c:
        proxy.configure({"truncate": {"ops": ["lookup"], "direction": "reply"}})
        with pytest.raises(TransportError):
            c.lookup(NS, prefix.hashes)
        records = proxy.records()
        # fewer than 4 bytes: the length prefix never arrived, so the client resent it once
        expected = 2 if records[0]["forwarded_bytes"] < P.LENGTH.size else 1
        assert len(records) == proxy.fired()["truncate"] == expected
        proxy.heal()
        assert c.lookup(NS, prefix.hashes).miss is None
    assert_settles(direct, before)


def test_a_truncated_publish_leaves_no_reservation_and_nothing_visible(pool, direct, proxies, test_seed):
    before = accounts(direct)
    prefix = Prefix(test_seed)
    proxy = proxies("tcp")
    at = random.Random(f"{test_seed}:at").randrange(BLOCKS)
    with client(pool, proxy) as c:
        proxy.configure({"truncate": {"ops": ["write"], "direction": "request", "after": at}})
        with pytest.raises(TransportError):
            publish(c, NS, prefix.hashes, prefix.data)
        assert proxy.fired()["truncate"] == 1
        assert_settles(direct, before)
        assert direct.lookup(NS, prefix.hashes).miss.index == 0
        proxy.heal()
        assert publish(c, NS, prefix.hashes, prefix.data).committed == BLOCKS
        healed_load_is_exact(c, proxy, prefix)


# -- bitflip --------------------------------------------------------------------------------
@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_a_flipped_bit_in_a_page_is_corrupt_and_never_counted_as_loaded(pool, direct, proxies, tmp_path,
                                                                         test_seed, listen):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies(listen, remote=True)
    at = random.Random(f"{test_seed}:at").randrange(BLOCKS)
    with client(pool, proxy) as c:
        proxy.configure({"bitflip": {"ops": ["read"], "after": at, "times": 1}})
        out, sink = prefix.sink()
        res = load(c, NS, prefix.hashes, sink)
        assert res.loaded == at and res.miss.cause == MissCause.CORRUPT and res.miss.index == at
        assert prefix.exact(out, at)
        (record,) = proxy.records()
        assert (record["op"], record["reply"], record["page"], record["page_bytes"]) == ("read", "pages_ok", 0, PAGE)
        assert_settles(direct, before)
        healed_load_is_exact(c, proxy, prefix)
    faults = [r for r in read_history(tmp_path / "history") if r["ev"] == "fault"]
    assert len(faults) == 1
    assert {"kind", "direction", "op", "frame_bytes", "heal"} <= set(faults[0])
    assert faults[0]["kind"] == "bitflip" and faults[0]["heal"]


def test_a_flipped_bit_in_a_published_page_is_rejected_by_the_daemon(pool, direct, proxies, test_seed):
    before = accounts(direct)
    prefix = Prefix(test_seed)
    proxy = proxies("tcp")
    at = random.Random(f"{test_seed}:at").randrange(BLOCKS)
    with client(pool, proxy) as c:
        proxy.configure({"bitflip": {"ops": ["write"], "after": at, "times": 1}})
        res = publish(c, NS, prefix.hashes, prefix.data)
        assert (res.committed, res.rejected) == (BLOCKS - 1, 1)
        assert proxy.records()[0]["direction"] == "request"
        found = direct.lookup(NS, prefix.hashes)  # the flipped page never became visible
        assert len(found.hits) == at and found.miss.index == at
        assert accounts(direct)["committed_pages"] == before["committed_pages"] + BLOCKS - 1
        proxy.heal()
        assert publish(c, NS, prefix.hashes, prefix.data).committed == 1
        healed_load_is_exact(c, proxy, prefix)


def test_negative_control_a_trusting_loader_installs_the_flipped_bit(pool, direct, proxies, test_seed):
    """Without the digest check the flipped page is installed as good: the byte-exact
    comparison must catch it, at the block and bit the proxy says it flipped."""
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies("tcp")
    at = random.Random(f"{test_seed}:at").randrange(BLOCKS)
    with client(pool, proxy) as c:
        proxy.configure({"bitflip": {"ops": ["read"], "after": at, "times": 1}})
        out, sink = prefix.sink()
        res = TrustingLoader().load(c, NS, prefix.hashes, sink)
        assert (res.loaded, res.miss) == (BLOCKS, None)  # the control believes every page
        caught = [i for i in range(BLOCKS) if not np.array_equal(out[i], prefix.data[i])]
        assert caught == [at], "the byte-exact check missed the control's corrupted page"
        (record,) = proxy.records()
        diff = np.flatnonzero(out[at] != prefix.data[at])
        assert diff.tolist() == [record["byte"]]
        assert int(out[at][record["byte"]] ^ prefix.data[at][record["byte"]]) == 1 << record["bit"]
        healed_load_is_exact(c, proxy, prefix)
    assert_settles(direct, before)


def test_without_remote_a_local_client_copies_through_shm_and_bitflip_has_no_page_to_flip(
        pool, direct, proxies, test_seed):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies("unix", remote=False)
    with client(pool, proxy) as c:
        assert c.arena is not None
        proxy.configure({"bitflip": {}})
        out, sink = prefix.sink()
        assert load(c, NS, prefix.hashes, sink).loaded == BLOCKS and prefix.exact(out)
        assert proxy.fired()["bitflip"] == 0
    assert_settles(direct, before)


# -- slow -----------------------------------------------------------------------------------
@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_a_slow_link_is_exact_and_its_throttle_is_accounted(pool, direct, proxies, test_seed, listen):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies(listen, remote=True)
    rate, latency = 2_000_000, 0.002
    with client(pool, proxy) as c:
        proxy.configure({"slow": {"ops": ["read"], "direction": "reply", "bytes_per_s": rate, "latency_s": latency}})
        out, sink = prefix.sink()
        res = load(c, NS, prefix.hashes, sink)
        assert (res.loaded, res.miss) == (BLOCKS, None) and prefix.exact(out)
        records = proxy.records()
        stats = proxy.stats()
        assert proxy.fired()["slow"] == stats["slow_frames"] == len(records) == BLOCKS  # one pages_ok per block
        assert all(r["reply"] == "pages_ok" and r["frame_bytes"] > PAGE for r in records)
        assert stats["slow_bytes"] == sum(r["frame_bytes"] for r in records)
        assert stats["slow_delay_s"] == pytest.approx(BLOCKS * latency + stats["slow_bytes"] / rate)
        healed_load_is_exact(c, proxy, prefix)
    assert_settles(direct, before)


def test_the_schedule_decides_which_frames_fire(pool, direct, proxies, test_seed):
    """BUGGIFY-style: with schedule_seed, the n-th matching frame fires exactly where
    kvgate.faults.schedule.fires says, and the frames before pass untouched (a slow link slows
    only the schedule's frames; a reset strikes at the schedule's first firing)."""
    from kvgate.faults.schedule import fires

    prefix, before = published(pool, direct, test_seed)
    proxy = proxies("tcp", remote=True)
    p = 0.5
    want = [n for n in range(BLOCKS) if fires(test_seed, "slow_link", n, p)]
    with client(pool, proxy) as c:
        proxy.configure({"slow": {"ops": ["read"], "direction": "reply", "latency_s": 0.001, "p": p,
                                  "schedule_seed": test_seed, "schedule_kind": "slow_link"}})
        out, sink = prefix.sink()
        res = load(c, NS, prefix.hashes, sink)
        assert (res.loaded, res.miss) == (BLOCKS, None) and prefix.exact(out)
        assert proxy.fired()["slow"] == len(want)
        first = next((n for n in range(BLOCKS) if fires(test_seed, "conn_reset", n, p)), None)
        proxy.configure({"reset": {"ops": ["read"], "direction": "reply", "times": 1, "p": p,
                                   "schedule_seed": test_seed, "schedule_kind": "conn_reset"}})
        out, sink = prefix.sink()
        res = load(c, NS, prefix.hashes, sink)
        if first is None:
            assert res.loaded == BLOCKS and proxy.fired()["reset"] == 0
        else:
            assert res.loaded == first and res.miss.cause == MissCause.TRANSPORT_ERROR
            assert prefix.exact(out, first)
        healed_load_is_exact(c, proxy, prefix)
    assert_settles(direct, before)


# -- seed, control file, framing ------------------------------------------------------------
def test_the_same_seed_draws_the_same_faults(pool, direct, proxies, test_seed):
    prefix, before = published(pool, direct, test_seed)
    runs = []
    for _ in range(2):
        proxy = proxies("tcp", seed=test_seed)
        with client(pool, proxy) as c:
            proxy.configure({"bitflip": {"ops": ["read"], "p": 0.5},
                             "truncate": {"ops": ["read"], "direction": "reply", "p": 0.2}})
            results = []
            for _ in range(6):
                out, sink = prefix.sink()
                r = load(c, NS, prefix.hashes, sink)
                results.append((r.loaded, r.miss and r.miss.cause))
            runs.append((results, [{k: v for k, v in r.items() if k != "conn"} for r in proxy.records()]))
    assert runs[0] == runs[1]
    assert runs[0][1], "p=0.5 over six loads drew no fault at all"
    assert_settles(direct, before)


def test_the_control_file_is_validated_and_rewritten_at_runtime(pool, direct, proxies, test_seed):
    prefix, before = published(pool, direct, test_seed)
    proxy = proxies("tcp")
    for bad in ({"netem": {}}, {"reset": {"ops": ["lookups"]}}, {"stall": {"bytes": 3}}, {"slow": {}},
                {"drop_reply": {"direction": "request"}}, {"bitflip": {"p": 1.5}}):
        with pytest.raises(ValueError):
            proxy.configure(bad)
    assert parse_control({"stall": {"ops": ["read"], "seconds": 2}}) == {
        "stall": LinkFault("stall", ops=frozenset({"read"}), seconds=2)}
    with client(pool, proxy) as c:
        proxy.configure({"bitflip": {"ops": ["read"]}})
        proxy.control_file.write_text("{not json")  # an unparsable rewrite keeps the faults in force
        out, sink = prefix.sink()
        assert load(c, NS, prefix.hashes, sink).miss.cause == MissCause.CORRUPT
        assert proxy.control_error is not None
        proxy.control_file.write_text("{}")  # a plain rewrite heals as well, picked up within ms
        deadline = time.monotonic() + 10
        while proxy.control_error is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.control_error is None
        out, sink = prefix.sink()
        assert load(c, NS, prefix.hashes, sink).loaded == BLOCKS and prefix.exact(out)
        proxy.control_file.unlink()  # no file: no faults
        assert load(c, NS, prefix.hashes, sink).loaded == BLOCKS
    assert_settles(direct, before)


def test_an_oversized_frame_passes_through_and_the_daemon_refuses_it(proxies):
    proxy = proxies("unix")
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(proxy.address.removeprefix("unix:"))
    s.sendall(P.LENGTH.pack(P.DEFAULT_MAX_FRAME + 1) + b"x" * 64)
    n = P.LENGTH.unpack(s.recv(4, socket.MSG_WAITALL))[0]
    reply = P.decode_reply(s.recv(n, socket.MSG_WAITALL))[1]
    assert reply.code == ErrorCode.OVERSIZED
    assert s.recv(1) == b""  # the daemon closed it; the proxy followed
    s.close()
    proxy.check()


def test_the_proxy_as_a_process(pool, direct, sockdir, tmp_path, test_seed):
    """`python -m kvgate.faults.proxy`, as a live replica's connector would be pointed at it."""
    prefix, before = published(pool, direct, test_seed)
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"bitflip": {"ops": ["read"]}}))
    proc = ProxyProcess.start(pool.unix, f"unix:{sockdir}/cli.sock", control, test_seed,
                              history_dir=tmp_path / "history", remote=True)
    try:
        with PoolClient(proc.address, DEFAULT_TENANT, pool.token) as c:
            assert c.arena is None
            out, sink = prefix.sink()
            res = load(c, NS, prefix.hashes, sink)
            assert res.loaded == 0 and res.miss.cause == MissCause.CORRUPT
            proc.heal()
            deadline = time.monotonic() + 10  # the process polls its control file every 10 ms
            while time.monotonic() < deadline:  # loads until one runs healed
                out, sink = prefix.sink()
                res = load(c, NS, prefix.hashes, sink)
                if res.loaded == BLOCKS:
                    break
            assert res.loaded == BLOCKS and prefix.exact(out)
        final = proc.stop()
    finally:
        proc.kill()
    assert final["fired"]["bitflip"] >= 1 and final["stats"]["hello_rewritten"] == 1
    faults = [r for r in read_history(tmp_path / "history") if r["ev"] == "fault"]
    assert [f["kind"] for f in faults] == ["bitflip"] * final["fired"]["bitflip"]
    assert_settles(direct, before)
