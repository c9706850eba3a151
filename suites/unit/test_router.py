"""The workload router: sticky, alternating and seeded random choices."""

import pytest

from kvgate.harness.workload.router import Router


def test_sticky_keeps_a_session_on_one_replica_and_spreads_sessions():
    r = Router("sticky", ["A", "B"], seed=1)
    assert {r.pick("s1", t) for t in range(6)} == {"A"}
    assert {r.pick("s2", t) for t in range(6)} == {"B"}


def test_alternating_switches_replica_every_turn():
    r = Router("alternating", ["A", "B"], seed=1)
    assert [r.pick("s1", t) for t in range(6)] == ["A", "B", "A", "B", "A", "B"]
    assert [r.pick("s2", t) for t in range(3)] == ["B", "A", "B"]


def test_random_is_replayed_by_its_seed():
    a = Router("random", ["A", "B"], seed=7)
    b = Router("random", ["A", "B"], seed=7)
    c = Router("random", ["A", "B"], seed=8)
    seq = [a.pick("s", t) for t in range(32)]
    assert seq == [b.pick("s", t) for t in range(32)]
    assert seq != [c.pick("s", t) for t in range(32)]
    assert set(seq) == {"A", "B"}


def test_unknown_router_kind():
    with pytest.raises(ValueError):
        Router("round-robin", ["A"], seed=0)
