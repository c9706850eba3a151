"""Renewal of reservations and leases: the catalog's rules (time driven through `now`) and the
waiting loop that renews (kvpool.client.keepalive), each rule's oracle run against the known-bad
catalogs of kvgate.faults.renew_controls, which it must catch.

  renewal_violations(catalog_class)   the rules a catalog breaks, by name:
      own          the client's own open reservation and lease move to now + TTL and outlive
                   their first deadline (a reap past it keeps them, the commit succeeds)
      not_yours    another client's renew is refused NOT_YOURS and leaves the grant as it was
                   (the reaper takes it at its own deadline)
      expired      a grant past its deadline, reaped or not, is refused EXPIRED and stays
                   expired (the reaper frees it; its commit is refused)
      max_age      renewals never take a grant past its grant + the maximum age
      unknown      an id never granted, or committed, is refused UNKNOWN
"""

from __future__ import annotations

import threading

import pytest

from kvgate.faults.renew_controls import AgelessRenewCatalog, OwnerBlindRenewCatalog, ResurrectingRenewCatalog
from kvpool.client.keepalive import Keepalive, LaneGrants, wait_renewing
from kvpool.errors import InvalidRequest, LeaseLost, PoolTimeout, RenewRefused, TransportError
from kvpool.pool.catalog import Catalog, CatalogConfig
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.records import RenewRefusal, RenewResult, Renewal, SlotStatus

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
D = b"d" * 16
TTL, LEASE_TTL, MAX_S = 30.0, 60.0, 100.0


def hashes(n, start=0):
    return block_hashes(list(range(start, start + 16 * n)), 16)


def make(cls=Catalog):
    return cls(CatalogConfig(num_pages=16, page_size=1024, reservation_ttl_s=TTL, lease_ttl_s=LEASE_TTL,
                             reservation_max_s=MAX_S, lease_max_s=MAX_S))


def reserve(cat, client, hs, now):
    return cat.reserve(client, "default", NS, hs, [100] * len(hs), now).reservation_id


def lease(cat, client, hs, now):
    res = cat.reserve(9, "default", NS, hs, [100] * len(hs), now)
    cat.commit(res.reservation_id, [D] * len(hs))
    return cat.acquire(client, "default", NS, hs, now).lease_id


def _own(cls) -> bool:
    cat = make(cls)
    rid, lid = reserve(cat, 1, hashes(2), 0.0), lease(cat, 1, hashes(2, 10), 0.0)
    got = cat.renew(1, [rid], 20.0, [lid])
    if got.reservations != (Renewal(rid, TTL),) or got.leases != (Renewal(lid, LEASE_TTL),):
        return False
    cat.reap(45.0)  # past the first deadlines (30, 60 for the lease: renewed to 50, 80)
    return cat.commit(rid, [D, D]).committed == 2 and not cat.release(lid).stale


def _not_yours(cls) -> bool:
    cat = make(cls)
    rid, lid = reserve(cat, 1, hashes(2), 0.0), lease(cat, 1, hashes(2, 10), 0.0)
    got = cat.renew(2, [rid], 20.0, [lid])
    if [r.refused for r in (*got.reservations, *got.leases)] != [RenewRefusal.NOT_YOURS] * 2:
        return False
    if cat.reap(30.0) != (1, 0):  # the reservation expires at its own deadline, untouched by the other's renew
        return False
    return cat.reap(60.0) == (0, 1)  # and the lease at its own


def _expired(cls) -> bool:
    cat = make(cls)
    rid, lid = reserve(cat, 1, hashes(2), 0.0), lease(cat, 1, hashes(2, 10), 0.0)
    late = cat.renew(1, [rid], 30.0, [])  # at its deadline, the reaper not there yet
    if late.reservations[0].refused is not RenewRefusal.EXPIRED:
        return False
    if cat.reap(30.0) != (1, 0):  # it stays expired: the reaper frees it
        return False
    after = cat.renew(1, [rid], 31.0, [])
    lease_late = cat.renew(1, [], 61.0, [lid])
    if after.reservations[0].refused is not RenewRefusal.EXPIRED or \
            lease_late.leases[0].refused is not RenewRefusal.EXPIRED:
        return False
    with pytest.raises(InvalidRequest):
        cat.commit(rid, [D, D])
    cat.reap(61.0)
    with pytest.raises(LeaseLost):
        cat.release(lid)
    return True


def _max_age(cls) -> bool:
    cat = make(cls)
    rid = reserve(cat, 1, hashes(2), 0.0)
    t, last = 0.0, None
    while t < 2 * MAX_S:
        t += TTL / 3
        last = cat.renew(1, [rid], t, []).reservations[0]
        if last.refused is not None:
            break
        if t + last.ttl_s > MAX_S + 1e-9:
            return False
        cat.reap(t)
    cat.reap(t)
    return last.refused is RenewRefusal.EXPIRED and t <= MAX_S + TTL / 3 and cat.stats()["open_reservations"] == 0


def _unknown(cls) -> bool:
    cat = make(cls)
    rid = reserve(cat, 1, hashes(2), 0.0)
    cat.commit(rid, [D, D])
    got = cat.renew(1, [rid, 12345], 1.0, [777])
    return [r.refused for r in (*got.reservations, *got.leases)] == [RenewRefusal.UNKNOWN] * 3


RULES = {"own": _own, "not_yours": _not_yours, "expired": _expired, "max_age": _max_age, "unknown": _unknown}


def renewal_violations(cls) -> list[str]:
    return [name for name, rule in RULES.items() if not rule(cls)]


def test_the_catalog_keeps_every_renewal_rule():
    assert renewal_violations(Catalog) == []


@pytest.mark.parametrize(("control", "rule"), [
    (OwnerBlindRenewCatalog, "not_yours"),
    (ResurrectingRenewCatalog, "expired"),
    (AgelessRenewCatalog, "max_age"),
])
def test_each_known_bad_renewal_is_caught_by_its_rule(control, rule):
    assert rule in renewal_violations(control)


def test_renewals_are_counted():
    cat = make()
    rid = reserve(cat, 1, hashes(1), 0.0)
    cat.renew(1, [rid, 99], 1.0, [])
    assert cat.stats()["renewals"] == 1 and cat.stats()["renewals_refused"] == 1


# -- the waiting loop --------------------------------------------------------------------------
class Scripted:
    """wait(timeout) answering from a script of booleans (True: done); records the timeouts."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.asked: list[float | None] = []

    def __call__(self, timeout_s):
        self.asked.append(timeout_s)
        return True if timeout_s is None else self.answers.pop(0)


def test_wait_renewing_renews_after_each_bounded_wait_that_did_not_end():
    wait, renewals = Scripted([False, False, False, True]), []
    assert wait_renewing(wait, lambda: renewals.append(1), 0.25) is None
    assert wait.asked == [0.25] * 4 and len(renewals) == 3


def test_wait_renewing_does_not_renew_a_wait_that_ends_at_once():
    renewals = []
    assert wait_renewing(Scripted([True]), lambda: renewals.append(1), 1.0) is None
    assert renewals == []


def test_a_refused_renewal_ends_the_renewals_not_the_wait_and_is_returned():
    wait, renewals = Scripted([False, False]), []

    def renew():
        renewals.append(1)
        if len(renewals) == 2:
            raise RenewRefused("expired")

    err = wait_renewing(wait, renew, 0.1)
    assert isinstance(err, RenewRefused)
    assert wait.asked == [0.1, 0.1, None] and len(renewals) == 2  # then waited to the end, unbounded


class FakeLane:
    def __init__(self, ttl_s=0.0, lease_ttl_s=0.0, refuse=None, fail=False):
        self.reservation_ttl_s, self.lease_ttl_s = ttl_s, lease_ttl_s
        self.refuse, self.fail, self.calls = refuse, fail, []

    def renew(self, reservations=(), leases=()):
        self.calls.append((tuple(reservations), tuple(leases)))
        if self.fail:
            raise TransportError("connection reset")
        answer = lambda i: Renewal(i, 0.0, self.refuse) if self.refuse else Renewal(i, 1.0)  # noqa: E731
        return RenewResult(tuple(map(answer, reservations)), tuple(map(answer, leases)))


def test_keepalive_renews_every_third_of_the_shorter_ttl_and_only_where_the_pool_advertised_one():
    assert Keepalive.of(FakeLane(0.0), reservations=(1,)) is None  # a daemon before Renew
    assert Keepalive.of(object(), reservations=(1,)) is None  # a backend without renew()
    assert Keepalive.of(FakeLane(3.0), leases=(1,)) is None  # no lease TTL advertised
    assert Keepalive.of(FakeLane(3.0)) is None  # nothing held
    assert Keepalive.of(FakeLane(3.0), reservations=(1,)).every_s == pytest.approx(1.0)
    assert Keepalive.of(FakeLane(3.0, 1.5), reservations=(1,), leases=(2,)).every_s == pytest.approx(0.5)


def test_keepalive_raises_a_typed_refusal_naming_the_grant():
    lane = FakeLane(3.0, refuse=RenewRefusal.NOT_YOURS)
    with pytest.raises(RenewRefused, match=r"reservation 7 \(not_yours\)"):
        Keepalive.of(lane, reservations=(7,)).renew()
    lane = FakeLane(3.0, fail=True)  # a failed connection: the grant went with it
    assert isinstance(Keepalive.of(lane, reservations=(7,)).hold(Scripted([False])), TransportError)


def test_the_gpu_event_wait_renews_until_the_event_completes_without_cuda():
    """kvpool.gpu.events.await_event, the wait of a store's commit and a load's release, with a
    stand-in for a CUDA event (query() only): renewed while not done, none after. The stand-in
    completes once its lane was asked to renew a given number of times, whatever the machine's
    speed (a timer, on a loaded machine, could fire before the first renewal)."""
    pytest.importorskip("torch")
    from kvpool.gpu.events import await_event

    class Event:
        def __init__(self, lane: FakeLane, after: int):
            self.lane, self.after = lane, after

        def query(self):
            return len(self.lane.calls) >= self.after

    lane = FakeLane(0.03)
    ev = Event(lane, 3)
    assert await_event(ev, 1e-3, Keepalive.of(lane, reservations=(5,))) is None
    n = len(lane.calls)  # 3, or more where the poller was slow to see the third
    assert ev.query() and n >= 3 and set(lane.calls) == {((5,), ())}
    assert await_event(ev, 1e-3, Keepalive.of(lane, reservations=(5,))) is None and len(lane.calls) == n

    refusing = FakeLane(0.03, refuse=RenewRefusal.EXPIRED)
    ev2 = Event(refusing, 2)  # completes only after a renewal past the refused one: none comes
    done = threading.Timer(0.3, lambda: setattr(ev2, "after", 1))
    done.start()
    err = await_event(ev2, 1e-3, Keepalive.of(refusing, reservations=(5,)))
    done.join()
    assert isinstance(err, RenewRefused) and ev2.query()  # returned only once the event completed
    assert len(refusing.calls) == 1


def test_a_renewal_that_timed_out_is_tried_again_and_the_grant_is_kept():
    wait, renewals = Scripted([False, False, True]), []

    def renew():
        renewals.append(1)
        if len(renewals) == 1:
            raise PoolTimeout("the client's lock stayed busy")

    assert wait_renewing(wait, renew, 0.1) is None  # control: the test above, where a refusal ends it
    assert len(renewals) == 2 and wait.asked == [0.1, 0.1, 0.1]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_lane_renews_each_open_reservation_once_due_and_drops_those_refused():
    lane, clock = FakeLane(ttl_s=3.0), Clock()
    grants = LaneGrants(lane, clock)
    grants.opened(1)
    grants.opened(2)
    hold = grants.keepalive(1)
    steps = []

    def wait(timeout_s):
        steps.append(timeout_s)
        if timeout_s is None:
            return True
        clock.t += timeout_s
        return len(steps) >= 3

    assert hold.hold(wait) is None
    assert steps == [0.5, 0.5, 0.5]  # checked every sixth of the TTL
    assert lane.calls == [((1, 2), ())]  # both renewed once a third of the TTL had passed, in one frame
    grants.closed(1)
    lane.refuse = RenewRefusal.EXPIRED
    clock.t += 1.0
    assert grants.renew_due(own=1) is None  # 2's refusal is 2's: its own commit fails
    assert grants.open_ids() == []
    assert LaneGrants(FakeLane(ttl_s=0.0)).keepalive(1) is None  # no TTL advertised: nothing to renew


def test_a_lane_returns_the_refusal_of_its_own_reservation_after_the_wait():
    lane, clock = FakeLane(ttl_s=3.0, refuse=RenewRefusal.NOT_YOURS), Clock()
    grants = LaneGrants(lane, clock)
    grants.opened(7)
    clock.t += 1.0
    asked = []

    def wait(timeout_s):
        asked.append(timeout_s)
        return True

    err = grants.keepalive(7).hold(wait)
    assert isinstance(err, RenewRefused) and "7" in str(err) and asked == [None]
