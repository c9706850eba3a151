"""The publish race of the same_key_race conformance scenario, without vLLM: two clients
publish one prefix through the pool-client fault injector, taking turns in the seeded
order (kvgate.faults.barrier). On kvpool's catalog the second's lookup mid-publish finds
nothing and its offer is told 'pending', one copy is committed and nothing is left
reserved; on the visible_at_reserve catalog (the scenario's negative control) the same
race shows the open publish to the reader and tells the second publisher 'exists'. A
schedule that cannot run times out and the publish goes on unheld."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from kvgate.faults.backend import FaultyBackend
from kvgate.faults.barrier import Turns, TurnTimeout, publish_race_order
from kvgate.faults.race_controls import RACE_CATALOG_CONTROLS
from kvgate.harness.checkers.history import read_history
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.connector.history import HistoryWriter
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGE = 4096


def race(tmp_path, seed: int, catalog_factory=None):  # noqa: ANN001, ANN201
    pool = thread_pool(page_size=PAGE, num_pages=32, catalog_factory=catalog_factory)
    hashes = block_hashes(range(48), 16)
    blocks = [np.full(PAGE, i, np.uint8) for i in range(3)]
    order, plan = publish_race_order(seed, ("A", "B"))
    results = {}
    try:
        def party(me: str) -> None:
            control = tmp_path / f"faults-{me}.json"
            control.write_text(json.dumps({"publish": {"kind": "turns", "me": me, "dir": str(tmp_path / "turns"),
                                                       "parties": ["A", "B"], "order": order, "timeout_s": 10}}))
            with PoolClient(f"unix:{pool.unix_path}", "default", "tok") as c:
                backend = FaultyBackend(c, control, HistoryWriter(tmp_path / "h", me, "worker"))
                results[me] = publish(backend, NS, hashes, blocks)

        threads = [threading.Thread(target=party, args=(me,)) for me in ("A", "B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        with PoolClient(f"unix:{pool.unix_path}", "default", "tok") as c:
            stats = c.stats()
    finally:
        pool.stop_thread()
    turns = Turns(tmp_path / "turns", order, ["A", "B"])
    return plan, results, stats, turns


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_second_publisher_sees_nothing_is_told_pending_and_one_copy_is_committed(tmp_path, seed):
    plan, results, stats, turns = race(tmp_path, seed)
    first, second = plan["first"], plan["second"]
    assert turns.record(second, "witness")["visible"] == 0
    assert turns.record(second, "reserve")["slots"] == {"pending": 3}
    assert (results[first].committed, results[second].committed, results[second].pending) == (3, 0, 3)
    assert (stats["committed_pages"], stats["reserved_pages"], stats["open_reservations"]) == (3, 0, 0)
    started = [r["turn"] for r in read_history(tmp_path / "h") if r["ev"] == "fault" and r.get("job") == "start"]
    assert [t for t in started if t in turns.order] == [t for t in turns.order if not turns.record(*t.split(":"))
                                                        .get("skipped")], started


def test_both_windows_and_both_orders_come_from_the_seed():
    plans = {tuple(sorted(publish_race_order(s, ("A", "B"))[1].items())) for s in range(40)}
    assert {dict(p)["window"] for p in plans} == {"reserved", "written"}
    assert {dict(p)["first"] for p in plans} == {"A", "B"}
    assert publish_race_order(7, ("A", "B")) == publish_race_order(7, ("A", "B"))


@pytest.mark.parametrize("seed", [1, 2])
def test_the_visible_at_reserve_control_shows_the_open_publish_and_answers_exists(tmp_path, seed):
    plan, results, stats, turns = race(tmp_path, seed, RACE_CATALOG_CONTROLS["visible_at_reserve"])
    second = plan["second"]
    assert turns.record(second, "witness")["visible"] == 3
    assert turns.record(second, "reserve")["slots"] == {"exists": 3}


@pytest.mark.parametrize("seed", [1, 2])
def test_the_pending_leak_control_leaves_a_reserved_page_per_block(tmp_path, seed):
    plan, results, stats, turns = race(tmp_path, seed, RACE_CATALOG_CONTROLS["pending_leak"])
    assert turns.record(plan["second"], "reserve")["slots"] == {"pending": 3}
    assert (stats["committed_pages"], stats["reserved_pages"], stats["open_reservations"]) == (3, 3, 0)


def test_a_turn_that_cannot_run_times_out(tmp_path):
    turns = Turns(tmp_path, ["A:reserve", "B:reserve"], ["A", "B"], timeout_s=0.2)
    with pytest.raises(TurnTimeout, match="parties not arrived"):
        turns.wait("A", "reserve")  # B never arrives
    turns.arrive("B")
    assert turns.wait("A", "reserve") >= 0
    with pytest.raises(TurnTimeout, match="turns not done"):
        turns.wait("B", "reserve")  # A never marked its turn done
