"""The seeded fault schedule: same seed, same schedule; every draw from a named child."""

import pytest

from kvgate.faults.schedule import PROFILES, FaultSchedule, draw_schedule


def test_same_seed_same_schedule_and_json_round_trip():
    a, b = draw_schedule(42), draw_schedule(42)
    assert a == b and a.to_json() == b.to_json()
    assert FaultSchedule.from_json(a.to_json()) == a
    assert draw_schedule(43) != a


def test_each_kind_draws_from_its_own_child_generator():
    for kind in PROFILES["transport"]:
        assert draw_schedule(7, "transport").spec(kind) == draw_schedule(7, "all").spec(kind)


def test_firing_is_decided_by_the_schedule_alone():
    s = draw_schedule(9)
    seq = [s.fires("corrupt", i) for i in range(64)]
    assert seq == [draw_schedule(9).fires("corrupt", i) for i in range(64)]
    p = s.spec("corrupt").probability
    assert 0.5 <= p <= 1.0 and abs(sum(seq) / 64 - p) < 0.3


def test_inactive_sites_never_fire_and_coins_are_seeded():
    schedules = [draw_schedule(s, force_active=False) for s in range(40)]
    assert {f.active for s in schedules for f in s.faults} == {True, False}
    inactive = next(s for s in schedules if not s.faults[0].active)
    assert not any(inactive.fires(inactive.faults[0].kind, i) for i in range(32))


def test_unknown_profile_and_kind():
    with pytest.raises(ValueError):
        draw_schedule(1, "everything")
    with pytest.raises(KeyError):
        draw_schedule(1, "eviction").spec("corrupt")


def test_a_failing_runs_schedule_is_written_and_names_its_seed(tmp_path):
    """The gate writes a failing run's schedule next to its report; replay --schedule reads
    its seed back, and the schedule it names is the one that seed draws."""
    import json

    from kvgate.faults.schedule import FaultSchedule, draw_schedule
    from kvgate.harness.gate import write_schedule

    path = write_schedule(tmp_path, "load-corrupt", 123456789)
    doc = json.loads(path.read_text())
    assert doc["scenario"] == "load-corrupt" and doc["seed"] == 123456789
    del doc["scenario"]
    assert FaultSchedule.from_json(json.dumps(doc)) == draw_schedule(123456789)


def test_the_injector_fires_on_the_load_the_schedule_draws():
    """kvgate.faults.backend decides each opportunity with the schedule's own draw."""
    from kvgate.faults.schedule import draw_schedule, fires

    for seed in range(50):
        sched = draw_schedule(seed)
        spec = sched.spec("corrupt")
        first = sched.first_firing("corrupt")
        decisions = [fires(seed, "corrupt", n, spec.probability) for n in range(16)]
        assert first == (decisions.index(True) if True in decisions else None)


def test_a_pinned_schedule_file_replays_its_edited_parameters_for_every_profile(tmp_path):
    """`kvgate replay --schedule FILE` pins the file: an edited block or probability is what
    the runners draw, under the profile each of them asks for; other seeds are untouched."""
    import dataclasses

    from kvgate.faults import schedule as S

    seed = 987654321
    drawn = S.draw_schedule(seed)
    edited = S.FaultSchedule(seed, drawn.profile, tuple(
        dataclasses.replace(f, params={**f.params, "block": 5}, probability=1.0) if f.kind == "evict" else f
        for f in drawn.faults))
    try:
        S.pin(edited)
        assert S.draw_schedule(seed, "eviction").spec("evict").params["block"] == 5
        assert S.draw_schedule(seed, "eviction").spec("evict").probability == 1.0
        assert S.draw_schedule(seed).spec("corrupt") == drawn.spec("corrupt")
        bad = S.FaultSchedule(seed, "all", (dataclasses.replace(drawn.faults[0], probability=2.0),))
        with pytest.raises(ValueError, match="probability"):
            S.pin(bad)
    finally:
        S._PINNED.clear()
    assert S.draw_schedule(seed, "eviction").spec("evict") == drawn.spec("evict")
