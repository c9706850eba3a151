"""Bounded work per frame: an authenticated tenant's frames against a real daemon process.

  flood          the hostile scenario's flood (kvgate.harness.scenarios.hostile.frames): every list
                 at its bound, one past it, repeated; a namespace of megabytes; a frame over
                 the limit. The daemon's RSS grows at most rss_bound_kib (8 frame limits +
                 64 MiB: 104 MiB at 64 KiB pages), every frame is refused with a typed error
                 or answered within the frame limit, and a well-behaved client is served.
  generated      Hypothesis frames (seeded from --kv-seed) of every op that carries a list:
                 lengths around each bound, repeats, indexes and slots in and out of the
                 session's lease and reservation, payloads of every size around the page;
                 the same judgement.
  control        kvgate.faults.frame_controls' daemon (the frame handling before the bounds) under
                 the same flood: caught, its RSS over the bound.
  decoder        the static bounds refuse a long list before its elements are read.
"""

from __future__ import annotations

import random
import threading
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from kvgate.harness.checkers.verdict import Checks
from kvgate.harness.scenarios.hostile.frames import (HostileSession, RssWatch, flood, judge_flood, rss_bound_kib,
                                              start_control_pool)
from kvgate.harness.system.pool import PoolProcess
from kvpool.pool import protocol as P
from kvpool.client.transfer import load, publish
from kvpool.pool.digest import page_digest
from kvpool.errors import MalformedFrame
from kvpool.pool.keys import HASH_BYTES, Namespace, block_hashes

PAGE = 64 * 1024
NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = PoolProcess.start(page_size=PAGE, num_pages=64, run_dir=tmp_path_factory.mktemp("frame-bounds"))
    try:
        yield p
        assert p.stop() == 0
    finally:
        p.cleanup()


def _well_behaved(pool: PoolProcess, seed: int) -> None:
    """A client that publishes four pages and loads them back byte-exact."""
    hs = block_hashes(range(seed % 1000, seed % 1000 + 64), 16)
    data = [np.random.default_rng(seed + i).integers(0, 256, PAGE, dtype=np.uint8) for i in range(4)]
    with pool.client() as c:
        publish(c, NS, hs, data)
        out = [np.zeros(PAGE, np.uint8) for _ in range(4)]
        assert load(c, NS, hs, out.__getitem__).loaded == 4
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        c.evict(NS, hs)


def test_flood_of_maximal_frames_stays_within_the_rss_bound(pool, test_seed):
    report = flood(pool.address["unix"], "default", pool.token, pool.proc.pid, test_seed, rounds=2)
    c = Checks()
    judge_flood(report, c)
    assert not c.failed, (c.failed, report.as_evidence())
    assert report.bound_kib == rss_bound_kib(PAGE) == 104 * 1024
    assert report.frames == 2 * 20 + 1
    _well_behaved(pool, test_seed)


def test_unbounded_daemon_is_caught_by_the_rss_bound(test_seed):
    control = start_control_pool(page_size=PAGE, num_pages=64)
    try:
        report = flood(control.address["unix"], "default", control.token, control.proc.pid, test_seed, rounds=1)
    finally:
        control.stop()
        control.cleanup()
    c = Checks()
    judge_flood(report, c)
    assert report.growth_kib > report.bound_kib, report.as_evidence()
    assert any("RSS grew" in f for f in c.failed), c.failed


# -- generated frames --------------------------------------------------------------------------
HASH_COUNTS = [0, 1, 2, P.MAX_BLOCKS_PER_FRAME, P.MAX_BLOCKS_PER_FRAME + 1]
PAGE_COUNTS = [0, 1, 2, P.MAX_PAGES_PER_FRAME, P.MAX_PAGES_PER_FRAME + 1, 4096]
SIZES = [0, 1, PAGE - 1, PAGE, PAGE + 1]

frames = st.fixed_dictionaries({
    "op": st.sampled_from(["read", "write", "lookup", "acquire", "reserve", "evict", "commit", "release", "abort"]),
    "hashes": st.sampled_from(HASH_COUNTS),
    "pages": st.sampled_from(PAGE_COUNTS),
    "repeat": st.booleans(),  # one element over and over, or distinct ones
    "own_id": st.booleans(),  # the session's lease / reservation, or another id
    "size": st.sampled_from(SIZES),
    "salt": st.integers(0, 2**32),
})


def _op(f: dict, lease: int, reservation: int, own: bytes) -> P.Request:
    rng = random.Random(f["salt"])
    n = f["hashes"]
    hashes = [own] * n if f["repeat"] else [rng.randbytes(HASH_BYTES) for _ in range(n)]
    k = f["pages"]
    idx = [0] * k if f["repeat"] else list(range(k))
    if f["op"] == "read":
        return P.ReadPages(lease if f["own_id"] else rng.randrange(10**6, 10**7), idx)
    rid = reservation if f["own_id"] else rng.randrange(10**6, 10**7)
    if f["op"] == "write":
        return P.WritePages(rid, idx, [bytes(f["size"])] * k)
    if f["op"] == "commit":
        return P.Commit(rid, [bytes(16)] * min(n, k))
    if f["op"] == "release":
        return P.Release(rng.randrange(10**6, 10**7))
    if f["op"] == "abort":
        return P.Abort(rng.randrange(10**6, 10**7))
    if f["op"] == "reserve":
        return P.Reserve(NS, hashes, [f["size"]] * n)
    return {"lookup": P.Lookup, "acquire": P.Acquire, "evict": P.Evict}[f["op"]](NS, hashes)


def test_generated_frames_get_a_typed_or_bounded_answer_and_rss_stays_bounded(pool, test_seed):
    s = HostileSession(pool.address["unix"], "default", pool.token)

    def _over_limit(frame: bytes) -> str:
        other = HostileSession(pool.address["unix"], "default", pool.token)
        try:
            try:
                other.sock.sendall(frame)
            except OSError:  # closed before the rest of it was read: the answer is already here
                pass
            return other.answer().kind
        finally:
            other.close()
    own = random.Random(test_seed).randbytes(HASH_BYTES)
    data = random.Random(test_seed + 1).randbytes(PAGE)
    res = s.ask(P.Reserve(NS, [own], [PAGE])).reply
    s.ask(P.WritePages(res.reservation_id, [0], [data]))
    assert s.ask(P.Commit(res.reservation_id, [page_digest(memoryview(data))])).reply.committed == 1
    lease = s.ask(P.Acquire(NS, [own])).reply.lease_id
    spare = s.ask(P.Reserve(NS, [random.Random(test_seed + 2).randbytes(HASH_BYTES)], [PAGE])).reply.reservation_id
    watch = RssWatch(pool.proc.pid)
    seen: dict[str, int] = {}
    t0 = time.monotonic()

    @hseed(test_seed)
    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate])  # a failing frame is reported as it is, not shrunk
    @given(f=frames)
    @example(f={"op": "read", "hashes": 0, "pages": 4096, "repeat": True, "own_id": True, "size": 0, "salt": 0})
    def one(f: dict) -> None:
        op = _op(f, lease, spare, own)
        frame = P.encode_request(1, op)
        if len(frame) - P.LENGTH.size > s.limit:  # refused at its length prefix, its connection closed
            assert _over_limit(frame) == "error:oversized", f
            return
        answer = s.send(frame)
        growth = watch.growth_kib()
        assert growth <= rss_bound_kib(PAGE), f"RSS grew {growth // 1024} MiB after {f}"
        assert answer.nbytes <= s.limit, (f, answer.kind, answer.nbytes)
        assert answer.kind != "over-limit"
        seen[answer.kind] = seen.get(answer.kind, 0) + 1
        if isinstance(answer.reply, P.AcquireOk) and answer.reply.lease_id:  # an acquire that found its block
            s.ask(P.Release(answer.reply.lease_id))
        if isinstance(answer.reply, P.ReserveOk) and answer.reply.reservation_id:
            s.ask(P.Abort(answer.reply.reservation_id))
        if isinstance(op, P.ReadPages) and len(set(op.indexes)) < len(op.indexes):
            assert answer.typed_error, (f, answer.kind)  # a repeated index is never served
        if isinstance(answer.reply, P.PagesOk):
            assert answer.reply.data == [data] * len(op.indexes), f  # [] or the leased page

    one()
    growth = watch.stop()
    assert growth <= rss_bound_kib(PAGE), (growth, seen)
    got = s.ask(P.ReadPages(lease, [0])).reply
    assert isinstance(got, P.PagesOk) and got.data == [data]
    s.ask(P.Release(lease))
    s.ask(P.Abort(spare))
    s.close()
    assert sum(v for k, v in seen.items() if k.startswith("error:")) >= 30, seen
    assert time.monotonic() - t0 < 60
    _well_behaved(pool, test_seed + 7)


# -- the decoder's static bounds ---------------------------------------------------------------
@pytest.mark.parametrize("body", [
    {"type": "read", "lease_id": 1, "indexes": [0] * (P.MAX_PAGES_PER_FRAME + 1)},
    {"type": "write", "reservation_id": 1, "slots": [0] * 17, "data": [b""] * 17},
    {"type": "lookup", "ns": NS.as_dict(), "hashes": [bytes(16)] * (P.MAX_BLOCKS_PER_FRAME + 1)},
    {"type": "lookup", "ns": NS.as_dict(), "hashes": [bytes(17)]},
    {"type": "lookup", "ns": NS.as_dict(), "hashes": [bytes(15)]},
    {"type": "reserve", "ns": NS.as_dict(), "hashes": [], "lengths": [1] * (P.MAX_BLOCKS_PER_FRAME + 1)},
    {"type": "commit", "reservation_id": 1, "digests": [bytes(17)]},
    {"type": "hello", "tenant": "t" * (P.MAX_NAME_CHARS + 1), "token": "x"},
    {"type": "hello", "tenant": "t", "token": "x" * (P.MAX_TOKEN_CHARS + 1)},
], ids=lambda b: b["type"])
def test_decoder_refuses_lists_and_strings_past_their_bound(body):
    with pytest.raises(MalformedFrame):
        P.decode_request(msgspec.msgpack.encode([P.PROTOCOL_VERSION, 1, body]))


def test_decoder_refuses_a_long_list_before_reading_its_elements():
    """Four million indexes: refused at the list's header, allocating nothing for them
    (decoding them would take over 100 MiB)."""
    import tracemalloc

    body = msgspec.msgpack.encode([P.PROTOCOL_VERSION, 1, {"type": "read", "lease_id": 1,
                                                          "indexes": list(range(4_000_000))}])
    tracemalloc.start()
    try:
        with pytest.raises(MalformedFrame):
            P.decode_request(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_frame_limit_is_stated_from_the_page_size():
    assert P.frame_limit(PAGE) == P.MAX_PAGES_PER_FRAME * PAGE + P.CONTROL_FRAME_BYTES == 5 * 2**20
    assert P.frame_limit(2**20) == 20 * 2**20


# -- the live runner's wiring, on stand-in replicas ---------------------------------------------
class _Cluster:
    """The part of kvgate.harness.system.cluster.Cluster the runner uses besides the replicas' hit."""

    def __init__(self, pool: PoolProcess):
        self.pool = pool
        self.events: list[tuple[str, dict]] = []

    def pool_for(self, replica: str) -> PoolProcess:
        return self.pool

    def nemesis(self, action: str, **fields: object) -> None:
        self.events.append((action, fields))


def _hit(*args, flood_past=None, **kwargs):  # noqa: ANN002, ANN003 - live.cross_replica_hit's stand-in
    """A passing hit that takes a while: 1 s, or (`flood_past`, an Event) until the flood beside it
    is past its first rounds, however slow the machine."""
    from types import SimpleNamespace

    if flood_past is None:
        time.sleep(1.0)
    else:
        assert flood_past.wait(120), "the flood never went past its first rounds"
    c = Checks()
    run = SimpleNamespace(token_ids=[1, 2, 3], logprobs=[-0.5, -0.25, -0.125])
    c.output("B's tokens and log-probabilities equal A's prefix hit of the same prompt", run, run)
    c.evidence["blocks"] = 23
    return c.verdict("hit")


@pytest.mark.parametrize("control", [None, "unbounded_frames"])
def test_frame_flood_runner_judges_the_flood_and_its_control(pool, test_seed, monkeypatch, control):
    from kvgate.harness.scenarios import live
    from kvgate.harness.scenarios.catalog import RUNNERS, find

    from kvgate.harness.scenarios.hostile import frames

    sc = find("hostile-frame-flood")
    past = threading.Event()
    if control is None:
        # the flood asks whether the hit is over only once its first `rounds` rounds are done: at its
        # second ask it has flooded one round more, and the hit may end (no race on the machine's speed)
        real, asks = frames.flood, []

        class _Until:
            def __init__(self, over: threading.Event):
                self.over = over

            def wait(self, timeout: float) -> bool:
                asks.append(timeout)
                if len(asks) >= 2:
                    past.set()
                return self.over.wait(timeout)

        monkeypatch.setattr(frames, "flood", lambda *a, until=None, **k: real(*a, until=_Until(until), **k))
    monkeypatch.setattr(live, "cross_replica_hit",
                        lambda *a, **k: _hit(*a, flood_past=past if control is None else None, **k))
    cluster = _Cluster(pool)
    params = {**sc.params, **(sc.control.params if control else {})}
    v = RUNNERS[sc.runner](cluster, None, test_seed, **params)
    assert [a for a, _ in cluster.events] == ["frame_flood"]
    assert v.evidence["output"] and v.evidence["cross_replica_hit"]["blocks"] == 23
    if control is None:
        assert v.valid is True, v.reason
        assert v.evidence["flood"]["growth_mib"] <= v.evidence["flood"]["bound_mib"]
        assert v.evidence["flood"]["rounds"] > sc.params["rounds"], v.evidence["flood"]  # for as long as the hit ran
        assert cluster.events[0][1]["pid"] == pool.proc.pid
    else:  # caught by the scenario's own checks, for the reason the scenario file names
        assert v.valid is False and sc.control.oracle == "scenario" and sc.control.because in v.reason, v.reason
        assert cluster.events[0][1]["pid"] != pool.proc.pid  # the control's own pool, now stopped
        assert pool.proc.poll() is None


def test_a_connection_says_hello_once(pool):
    """Each hello mints an attach ticket: a second one on an authenticated connection is refused
    (a bad token still reads as unauthenticated), and the session goes on as it was."""
    s = HostileSession(pool.address["unix"], "default", pool.token)
    try:
        assert s.ask(P.Hello("default", pool.token, "again")).kind == "error:invalid"
        assert s.ask(P.Hello("default", "wrong", "again")).kind == "error:unauthenticated"
        assert s.ask(P.Ping()).kind == "Pong"
    finally:
        s.close()


def test_a_prompt_longer_than_one_frame_is_looked_up_and_leased_in_its_first_frame(pool, test_seed):
    """A lookup or an acquire of more blocks than a frame may name (a prompt past a million
    tokens) asks for the first MAX_BLOCKS_PER_FRAME of them: the run is counted from the
    start as always, the rest recomputed; never a MALFORMED answer to a well-behaved client
    (which would read as a broken pool)."""
    base = test_seed % 1000
    hs = block_hashes(range(base * 16, (base + P.MAX_BLOCKS_PER_FRAME + 10) * 16), 16)
    data = [np.random.default_rng(test_seed + i).integers(0, 256, PAGE, dtype=np.uint8) for i in range(2)]
    with pool.client() as c:
        publish(c, NS, hs[:2], data)
        found = c.lookup(NS, hs)
        assert len(found.hits) == 2 and found.miss is not None
        lease = c.acquire(NS, hs)
        assert len(lease.hits) == 2
        c.release(lease.lease_id)
        c.evict(NS, hs[:2])
