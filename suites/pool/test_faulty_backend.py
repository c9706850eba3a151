"""The pool-client fault injector's evict fault records a firing only when it evicted
something: a load with no block k to lose, or whose blocks from k on are leased by
another load, is left as it is (and says so), so the miss-cause oracle never expects
`evicted` from a load the fault could not touch."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvgate.faults.backend import FaultyBackend
from kvgate.harness.checkers.history import read_history
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.errors import MissCause
from kvpool.connector.history import HistoryWriter
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGE = 4096


@pytest.fixture
def pool():
    d = thread_pool(page_size=PAGE, num_pages=32)
    yield d
    d.stop_thread()


def run(pool, tmp_path, block: int, hold: bool = False):  # noqa: ANN001, ANN201
    hashes = block_hashes(range(48), 16)
    blocks = [np.full(PAGE, i, np.uint8) for i in range(3)]
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"load": {"kind": "evict", "block": block}}))
    history = HistoryWriter(tmp_path / "h", "r", "worker")
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok") as c, \
            PoolClient(f"unix:{pool.unix_path}", "default", "tok") as other:
        assert publish(c, NS, hashes, blocks).committed == 3
        held = other.acquire(NS, hashes) if hold else None  # another load holds them
        out = [np.zeros(PAGE, np.uint8) for _ in range(3)]
        res = load(FaultyBackend(c, control, history), NS, hashes, out.__getitem__)
        if held is not None:
            other.release(held.lease_id)
    recs = read_history(tmp_path / "h")
    return res, [r for r in recs if r["ev"] == "fault"], [r for r in recs if r["ev"] == "fault_skipped"]


def test_an_evict_that_evicts_is_recorded_and_the_load_ends_evicted(pool, tmp_path):
    res, fired, skipped = run(pool, tmp_path, block=1)
    assert (res.loaded, res.miss.cause) == (1, MissCause.EVICTED)
    assert [(f["block"], f["evicted"]) for f in fired] == [(1, 2)] and skipped == []


def test_a_load_without_block_k_is_not_touched(pool, tmp_path):
    res, fired, skipped = run(pool, tmp_path, block=3)
    assert res.loaded == 3 and res.miss is None and fired == [] and skipped == []


def test_blocks_leased_by_another_load_are_not_evicted_nor_counted(pool, tmp_path):
    res, fired, skipped = run(pool, tmp_path, block=0, hold=True)
    assert res.loaded == 3 and res.miss is None and fired == []
    assert [s["reason"] for s in skipped] == ["nothing evicted"]


def test_the_wrapper_has_a_probe_only_where_the_backend_it_wraps_has_one(pool, tmp_path):
    """The connector asks the backend for a same-host probe with getattr(backend, "probe",
    None): a GPU tier's backend has none, and the wrapper around it must not answer with one
    that raises AttributeError out of the scheduler (a live replica's engine died of it)."""
    control = tmp_path / "faults.json"
    control.write_text("{}")
    history = HistoryWriter(tmp_path / "h", "r", "worker")

    class NoProbe:  # the GPU tier's backend (kvpool.gpu.tier_backend.TierBackend) has no probe
        page_size = PAGE

    assert getattr(FaultyBackend(NoProbe(), control, history), "probe", None) is None
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok") as c:
        probe = FaultyBackend(c, control, history).probe
        assert probe is not None and probe(NS, block_hashes(range(48), 16), 5.0) in (None, 0)
