"""Renewal over the wire, on a real daemon with a short TTL and a fast reaper: a publish whose
copy completes long after its reservation's TTL (a GPU store's copies queued behind long
forwards) commits and is served byte-exact when its waiting side renews, and, without the
renewals (the negative control: the same wait), its commit is refused and a reader finds its
blocks `never_published`, which the oracle catches. A renew of another session's reservation
is refused and leaves it intact (control: OwnerBlindRenewCatalog, caught). A lane that
commits its units one after another renews the units still queued while it waits for the
first: the second unit's publish, reserved with the first, lands (control: each wait renewing
only its own unit, as a per-unit keepalive does: the queued unit's commit is refused, caught
by the reader's oracle).

The wait is kvpool.gpu.events.await_event, the one a store's lane runs, with a stand-in for
the CUDA event whose query() turns true when the "copy" (a thread writing the reserved pages
after a delay) is done. The pool's grants live by a ManualClock that the copy thread moves: 5 x
TTL in steps of TTL/6, each step waiting for the waiting side's next renewal (when it renews)
and for a whole round of the reaper. So a grant expires exactly when no renewal covered it, and
never because the machine was slow to run a renewal (real-time margins failed that way on a
loaded CI machine). TTL 0.5 s, renewals every 1/6 s of real time, the reaper every 20 ms.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from kvgate.faults.renew_controls import OwnerBlindRenewCatalog
from kvgate.harness.system.pool import DEFAULT_TENANT, ManualClock, thread_pool
from kvpool.client.keepalive import Keepalive, LaneGrants
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load
from kvpool.errors import InvalidRequest, MissCause, PoolError
from kvpool.pool.catalog import Catalog
from kvpool.pool.digest import page_digest
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.records import RenewRefusal

pytest.importorskip("torch")
from kvpool.gpu.events import await_event  # noqa: E402 - after the skip

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
TTL_S = 0.5
HOLD_S = 5 * TTL_S
PAGE = 4096


def daemon(catalog=Catalog, clock=None):  # noqa: ANN001
    return thread_pool(page_size=PAGE, num_pages=16, reservation_ttl_s=TTL_S, reap_interval_s=0.02,
                       scrub_rest_pages_per_round=0, catalog_factory=catalog, clock=clock)


def client(d, name=""):
    return PoolClient(f"unix:{d.unix_path}", "default", "tok", name=name)


class CopyEvent:
    """A stand-in for a store's CUDA event: done once the copy thread wrote every page."""

    def __init__(self):
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()


def renewals(d) -> int:  # noqa: ANN001
    counters = d.pools[DEFAULT_TENANT].catalog.counters
    return counters["renewals"] + counters["renewals_refused"]


def pool_time_passes(d, clock: ManualClock, seconds: float, renewed: bool) -> None:  # noqa: ANN001
    """The forward the copies are queued behind: the pool's clock moves `seconds` in steps of
    TTL/6; after each step, the next renewal (when the waiting side renews) and a whole round
    of the reaper."""
    for _ in range(round(seconds / (TTL_S / 6))):
        seen = renewals(d)
        clock.advance(TTL_S / 6)
        give_up = time.monotonic() + 30
        while renewed and renewals(d) == seen:
            if time.monotonic() > give_up:
                raise TimeoutError("the waiting side sent no renewal in 30 s")
            time.sleep(0.005)
        clock.settle(d)


def held_publish(d, clock: ManualClock, c: PoolClient, hashes, pages, renew: bool) -> dict:  # noqa: ANN001
    """Reserve, let a copy write the pages HOLD_S later, wait for it as a store's lane does
    (renewing, or not), then commit: what happened."""
    res = c.reserve(NS, hashes, [PAGE] * len(hashes))
    event = CopyEvent()

    def copy() -> None:
        pool_time_passes(d, clock, HOLD_S, renew)
        for i, data in enumerate(pages):
            c.reserved_view(res, i)[:PAGE] = data
        event.done.set()

    t0 = clock()
    threading.Thread(target=copy, daemon=True).start()
    keepalive = Keepalive.of(c, reservations=(res.reservation_id,)) if renew else None
    refused = await_event(event, 1e-3, keepalive)
    waited = clock() - t0  # pool time
    if refused is not None:
        return {"waited": waited, "error": f"renew: {refused}", "committed": 0}
    try:
        out = c.commit(res.reservation_id, [page_digest(p) for p in pages])
    except PoolError as exc:
        return {"waited": waited, "error": f"{type(exc).__name__}: {exc}", "committed": 0, "exc": exc}
    return {"waited": waited, "error": "", "committed": out.committed}


def served_byte_exact(reader: PoolClient, hashes, pages) -> tuple[bool, MissCause | None]:
    """The oracle: a reader loads every block, byte for byte what was published."""
    out = [np.zeros(PAGE, np.uint8) for _ in pages]
    got = load(reader, NS, hashes, out.__getitem__)
    exact = got.loaded == len(pages) and all(np.array_equal(a, b) for a, b in zip(out, pages))
    return exact, (got.miss.cause if got.miss is not None else None)


def _blocks(seed: int, n: int = 3):
    hashes = block_hashes(list(range(seed * 1000, seed * 1000 + 16 * n)), 16)
    pages = [np.random.default_rng(seed * 10 + i).integers(0, 256, PAGE, dtype=np.uint8) for i in range(n)]
    return hashes, pages


def test_a_publish_held_past_the_ttl_with_renewals_commits_and_is_served_byte_exact():
    clock = ManualClock()
    d = daemon(clock=clock)
    try:
        with client(d, "writer") as w, client(d, "reader") as r:
            assert w.reservation_ttl_s == TTL_S  # advertised at hello
            hashes, pages = _blocks(1)
            outcome = held_publish(d, clock, w, hashes, pages, renew=True)
            assert outcome["waited"] >= HOLD_S - 1e-6 > 2 * TTL_S  # the grant outlived several TTLs
            assert outcome["error"] == "" and outcome["committed"] == 3, outcome
            assert served_byte_exact(r, hashes, pages) == (True, None)
            stats = w.stats()
            assert stats["renewals"] >= 3 and stats["expired_reservations"] == 0, stats
    finally:
        d.stop_thread()


def test_control_the_same_wait_without_renewals_loses_the_publish_and_the_oracle_catches_it():
    clock = ManualClock()
    d = daemon(clock=clock)
    try:
        with client(d, "writer") as w, client(d, "reader") as r:
            hashes, pages = _blocks(2)
            outcome = held_publish(d, clock, w, hashes, pages, renew=False)
            assert outcome["committed"] == 0 and isinstance(outcome.get("exc"), InvalidRequest), outcome
            exact, cause = served_byte_exact(r, hashes, pages)
            assert not exact and cause is MissCause.NEVER_PUBLISHED  # caught: the seed003 run5 signature
            assert w.stats()["expired_reservations"] == 1
    finally:
        d.stop_thread()


def _renew_of_another_session(catalog) -> tuple[RenewRefusal | None, dict]:  # noqa: ANN001
    """Session B renews A's open reservation every third of a TTL while A idles for HOLD_S
    without renewing, then A commits: (B's answer, A's commit outcome). The pool's time is a
    ManualClock that only this test moves, and the reaper runs a whole round after each step:
    whether A's grant outlives its TTL is decided by the renewals alone, never by how late the
    machine schedules B (a starved B on a loaded machine let the grant expire in the control)."""
    clock = ManualClock()
    d = daemon(catalog, clock)
    try:
        with client(d, "a") as a, client(d, "b") as b:
            hashes, pages = _blocks(3)
            res = a.reserve(NS, hashes, [PAGE] * 3)
            for i, data in enumerate(pages):
                a.reserved_view(res, i)[:PAGE] = data
            answers = []
            for _ in range(round(HOLD_S / (TTL_S / 3))):  # B keeps "renewing" A's publish
                clock.advance(TTL_S / 3)
                answers.append(b.renew([res.reservation_id]).reservations[0].refused)
                clock.settle(d)
            try:
                committed = a.commit(res.reservation_id, [page_digest(p) for p in pages]).committed
            except InvalidRequest:
                committed = 0
            return (answers[0] if len(set(answers)) == 1 else None), {"committed": committed,
                                                                     "stats": a.stats()}
    finally:
        d.stop_thread()


def test_a_renew_of_another_sessions_reservation_is_refused_and_leaves_it_intact():
    answer, a = _renew_of_another_session(Catalog)
    assert answer is RenewRefusal.NOT_YOURS
    # intact: not extended by B (A's own TTL reclaimed it), not aborted early by B either
    assert a["committed"] == 0 and a["stats"]["expired_reservations"] == 1 and a["stats"]["renewals"] == 0


def test_control_an_owner_blind_renewal_is_caught():
    answer, a = _renew_of_another_session(OwnerBlindRenewCatalog)
    assert answer is None  # B's renewals were granted
    assert a["committed"] == 3  # A's abandoned publish outlived its TTL on B's word: what the test refuses


def test_renew_of_an_unknown_or_committed_id_is_refused_and_a_frame_names_each_id_once():
    d = daemon()
    try:
        with client(d) as c:
            hashes, pages = _blocks(4, 1)
            res = c.reserve(NS, hashes, [PAGE])
            c.reserved_view(res, 0)[:PAGE] = pages[0]
            c.commit(res.reservation_id, [page_digest(pages[0])])
            got = c.renew([res.reservation_id, 424242], [77])
            assert [x.refused for x in (*got.reservations, *got.leases)] == [RenewRefusal.UNKNOWN] * 3
            with pytest.raises(InvalidRequest):
                c.renew([5, 5])
            c.ping()  # the daemon serves on
    finally:
        d.stop_thread()


def lane_publish(d, clock: ManualClock, c: PoolClient, units, lane_wide: bool) -> list[dict]:  # noqa: ANN001
    """Two units reserved at once on one connection, their copies done HOLD_S later (queued
    behind one forward), committed one after the other on one thread as a store's lane does;
    `lane_wide`: LaneGrants (every open reservation renewed), else a Keepalive per unit."""
    grants = LaneGrants(c)
    reserved = []
    for hashes, pages in units:
        res = c.reserve(NS, hashes, [PAGE] * len(hashes))
        grants.opened(res.reservation_id)
        reserved.append(res)
    event = CopyEvent()

    def copy() -> None:
        pool_time_passes(d, clock, HOLD_S, renewed=True)  # the first unit's wait renews, either way
        for res, (_, pages) in zip(reserved, units):
            for i, data in enumerate(pages):
                c.reserved_view(res, i)[:PAGE] = data
        event.done.set()

    threading.Thread(target=copy, daemon=True).start()
    out = []
    for res, (_, pages) in zip(reserved, units):
        own = res.reservation_id
        keepalive = grants.keepalive(own) if lane_wide else Keepalive.of(c, reservations=(own,))
        refused = await_event(event, 1e-3, keepalive)
        try:
            if refused is not None:
                raise refused
            committed = c.commit(own, [page_digest(p) for p in pages]).committed
            grants.closed(own)
            out.append({"committed": committed, "error": ""})
        except PoolError as exc:
            grants.closed(own)
            out.append({"committed": 0, "error": f"{type(exc).__name__}: {exc}"})
    return out


def test_a_lane_renews_the_units_queued_behind_the_one_it_waits_for():
    clock = ManualClock()
    d = daemon(clock=clock)
    try:
        with client(d, "writer") as w, client(d, "reader") as r:
            units = [_blocks(5), _blocks(6)]
            outcome = lane_publish(d, clock, w, units, lane_wide=True)
            assert [o["committed"] for o in outcome] == [3, 3], outcome
            for hashes, pages in units:
                assert served_byte_exact(r, hashes, pages) == (True, None)
            assert w.stats()["expired_reservations"] == 0
    finally:
        d.stop_thread()


def test_control_per_unit_renewal_loses_the_queued_unit_and_the_oracle_catches_it():
    clock = ManualClock()
    d = daemon(clock=clock)
    try:
        with client(d, "writer") as w, client(d, "reader") as r:
            units = [_blocks(7), _blocks(8)]
            outcome = lane_publish(d, clock, w, units, lane_wide=False)
            assert outcome[0]["committed"] == 3 and outcome[1]["committed"] == 0, outcome
            assert served_byte_exact(r, *units[0]) == (True, None)
            exact, cause = served_byte_exact(r, *units[1])
            assert not exact and cause is MissCause.NEVER_PUBLISHED  # caught: the queued unit's blocks
    finally:
        d.stop_thread()


def test_a_pool_clock_far_ahead_of_the_real_one_leaves_the_attach_tickets_alone():
    """Attach tickets (the hello's handout of the segment) are a wait of the real clock: a
    ManualClock thousands of seconds ahead must not reap them (it did, racing each client's
    attach: clients came up with no arena mapped, a reserved_view of None). A ticket issued
    as a hello issues it survives a whole reaper round; a client still attaches."""
    clock = ManualClock(start=time.monotonic() + 10_000.0)
    d = daemon(clock=clock)
    try:
        async def issue() -> bytes:  # on the daemon's loop, as a hello issues it
            return d._ticket(DEFAULT_TENANT)

        issued = asyncio.run_coroutine_threadsafe(issue(), d._loop).result(10)
        clock.settle(d)
        clock.settle(d)  # two whole rounds after the ticket was issued
        assert issued in d._tickets, "the reaper took an attach ticket by the pool's clock"
        with client(d, "c") as c:
            assert c.arena is not None
    finally:
        d.stop_thread()
