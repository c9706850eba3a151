"""The copier's records and failure accounting to the letter (kvpool.connector.copier): every
field of a `publish`, `load`, `tier_publish` and `tier_load` record, a load queued past its
deadline, the lanes' threads (stores in order, loads side by side), the wait's timeout and
the metrics each copy counts."""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.connector.copier import LOAD_THREADS, CopyRun, HostCopier, note_load, wait_all
from kvpool.connector.history import HistoryWriter, read_history
from kvpool.errors import MissCause, PoolTimeout
from kvpool.pool.keys import block_hashes
from kvpool.pool.metrics import ClientMetrics
from kvpool.pool.records import Miss
from kvpool.tier.record import TierPage

# the copier suite's geometry, pool and engine (one page = one block of both layers)
from suites.pool.test_copier import BLOCK_BYTES, BLOCKS, LAYERS, NS, daemon, engine  # noqa: E402, F401


def keys(start, n):
    return block_hashes(list(range(start, start + 16 * n)), 16)


def copier_for(d, tmp_path, metrics=None):
    history = HistoryWriter(tmp_path / "history", "r", "worker")
    return HostCopier(PoolClient(f"unix:{d.unix_path}", "default", "tok"), history, metrics)


def records(tmp_path, ev):
    return [r for r in read_history(tmp_path / "history") if r["ev"] == ev]


def timing_ok(rec, *names):
    """Each timing field a float of seconds (not a clock reading), rounded to microseconds."""
    for name in names:
        v = rec[name]
        assert isinstance(v, float) and 0.0 <= v < 30.0 and round(v, 6) == v, (name, v)


def test_a_publish_record_names_the_run_and_every_outcome(daemon, tmp_path):
    metrics = ClientMetrics()
    copier = copier_for(daemon, tmp_path, metrics)
    copier.register(engine(1))
    hs = keys(0, 3)
    run = CopyRun("req-1", "tag-1", 5, [0, 1, 2], hs)
    copier.wait([copier.store(NS, run, [0, 2])], 30)
    copier.wait([copier.store(NS, run, [0, 1, 2])], 30)  # two exist now, one is new
    copier.wait([copier.store(NS, CopyRun("req-2", "tag-2", 0, [3], keys(100, 1)), [0])], 30)
    copier.close()
    recs = records(tmp_path, "publish")
    fixed = [{k: v for k, v in r.items() if k not in ("t", "replica", "role", "queued_s", "seconds")} for r in recs]
    assert fixed == [
        {"ev": "publish", "req": "req-1", "tag": "tag-1", "first_block": 5, "blocks": 2, "committed": 2, "exists": 0,
         "pending": 0, "not_admitted": 0, "no_capacity": 0, "rejected": 0},
        {"ev": "publish", "req": "req-1", "tag": "tag-1", "first_block": 5, "blocks": 3, "committed": 1, "exists": 2,
         "pending": 0, "not_admitted": 0, "no_capacity": 0, "rejected": 0},
        {"ev": "publish", "req": "req-2", "tag": "tag-2", "first_block": 0, "blocks": 1, "committed": 1, "exists": 0,
         "pending": 0, "not_admitted": 0, "no_capacity": 0, "rejected": 0},
    ]
    for r in recs:
        timing_ok(r, "queued_s", "seconds")
    # the copier's metrics are the ones its copies count: 4 pages published
    assert metrics.registry.get_sample_value("kvpool_client_bytes_published_total") == 4 * LAYERS * BLOCK_BYTES


def test_a_publish_to_a_pool_gone_is_a_record_with_its_error_type(tmp_path):
    d = thread_pool(page_size=LAYERS * BLOCK_BYTES, num_pages=32)
    copier = copier_for(d, tmp_path)
    copier.register(engine(2))
    d.stop_thread()
    fut = copier.store(NS, CopyRun("req-3", "tag-3", 2, [0], keys(0, 1)), [0])
    copier.wait([fut], 30)
    copier.close()
    assert fut.result() is None  # best effort: the request itself is fine
    (rec,) = records(tmp_path, "publish")
    assert {k: rec[k] for k in ("req", "tag", "first_block", "blocks")} == {
        "req": "req-3", "tag": "tag-3", "first_block": 2, "blocks": 1}
    name, _, message = rec["error"].partition(": ")
    assert name in ("TransportError", "PoolUnavailable", "PoolTimeout") and message, rec["error"]
    assert "committed" not in rec
    timing_ok(rec, "queued_s")


def test_a_load_record_names_its_failed_blocks_and_the_miss_at_its_index_in_the_prompt(daemon, tmp_path):
    metrics = ClientMetrics()
    producer = copier_for(daemon, tmp_path)
    producer.register(engine(3))
    hs = keys(0, 3)
    producer.wait([producer.store(NS, CopyRun("p", "p", 0, [0, 1], hs[:2]), [0, 1])], 30)
    producer.close()
    copier = copier_for(daemon, tmp_path, metrics)
    copier.register(engine(4))
    copier.wait([copier.load(NS, CopyRun("req-4", "tag-4", 6, [4, 5, 6], hs), deadline_s=30)], 30)
    copier.close()
    (rec,) = records(tmp_path, "load")
    fixed = {k: v for k, v in rec.items() if k not in ("t", "replica", "role", "queued_s", "seconds")}
    assert fixed == {"ev": "load", "req": "req-4", "tag": "tag-4", "first_block": 6, "blocks": 3, "loaded": 2,
                     "failed_block_ids": [6], "miss_cause": "never_published", "miss_index": 8}
    timing_ok(rec, "queued_s", "seconds")
    assert copier.take_failed() == {6}
    assert metrics.registry.get_sample_value("kvpool_client_blocks_loaded_total") == 2


def test_a_load_queued_past_its_deadline_fails_every_block_as_a_timeout(daemon, tmp_path):
    copier = copier_for(daemon, tmp_path)
    copier.register(engine(5))
    fut = copier.load(NS, CopyRun("req-5", "tag-5", 1, [2, 3], keys(0, 2)), deadline_s=0.0)
    copier.wait([fut], 30)
    assert fut.result() is None
    copier.close()
    (rec,) = records(tmp_path, "load")
    assert {k: rec[k] for k in ("loaded", "failed_block_ids", "miss_cause", "miss_index", "error")} == {
        "loaded": 0, "failed_block_ids": [2, 3], "miss_cause": "timeout", "miss_index": 1,
        "error": "queued past its deadline"}
    assert copier.take_failed() == {2, 3}


def test_note_load_rounds_its_timings_and_cuts_a_long_error():
    written = []
    copier = SimpleNamespace(failed=set(), _failed_lock=threading.Lock(),
                             history=SimpleNamespace(write=lambda ev, **f: written.append((ev, f))))
    run = CopyRun("req-6", "tag-6", 3, [7, 8, 9], keys(0, 3))
    failed = note_load(copier, "load", run, 1, Miss(1, MissCause.CORRUPT), "x" * 500, queued_s=0.1234567891,
                       seconds=2.0000004)
    assert failed == [8, 9] and copier.failed == {8, 9}
    assert written == [("load", {"req": "req-6", "tag": "tag-6", "first_block": 3, "blocks": 3, "loaded": 1,
                                 "failed_block_ids": [8, 9], "miss_cause": "corrupt", "miss_index": 4,
                                 "error": "x" * 400, "queued_s": 0.123457, "seconds": 2.0})]
    written.clear()
    note_load(copier, "tier_load", run, 3, None)
    assert written == [("tier_load", {"req": "req-6", "tag": "tag-6", "first_block": 3, "blocks": 3, "loaded": 3,
                                      "failed_block_ids": [], "miss_cause": None, "miss_index": None})]


class ListTier:
    """A network tier in a dict: what was put, and no page to get."""

    def __init__(self, refuse=()):
        self.puts: list[tuple[bytes, bytes]] = []
        self.refuse = set(refuse)

    def put(self, ns, block_hash, page, digest, kind=None):
        if block_hash in self.refuse:
            return False
        self.puts.append((block_hash, bytes(page)))
        return True

    def get(self, ns, block_hash, max_page_bytes=None) -> TierPage | None:
        return None


def test_a_tier_publish_record_names_the_run_and_its_outcome(tmp_path):
    history = HistoryWriter(tmp_path / "history", "r", "worker")
    copier = HostCopier(None, history)
    layers = engine(6)
    copier.register(layers)
    hs = keys(0, 3)
    tier = ListTier(refuse={hs[1]})
    copier.wait([copier.tier_store(tier, NS, CopyRun("req-7", "tag-7", 4, [5, 6, 7], hs), [0, 1, 2])], 30)
    copier.close()
    assert tier.puts == [(hs[0], layers[0][5].tobytes() + layers[1][5].tobytes()),
                         (hs[2], layers[0][7].tobytes() + layers[1][7].tobytes())]
    (rec,) = records(tmp_path, "tier_publish")
    fixed = {k: v for k, v in rec.items() if k not in ("t", "replica", "role", "seconds")}
    assert fixed == {"ev": "tier_publish", "req": "req-7", "tag": "tag-7", "first_block": 4, "blocks": 3, "put": 2,
                     "refused": 1, "error": None}
    timing_ok(rec, "seconds")


def test_a_tier_load_record_has_no_error_field_and_its_deadline_counts_from_submission(tmp_path):
    history = HistoryWriter(tmp_path / "history", "r", "worker")
    copier = HostCopier(None, history)
    copier.register(engine(7))
    run = CopyRun("req-8", "tag-8", 2, [0, 1], keys(0, 2))
    copier.wait([copier.tier_load(ListTier(), NS, run, deadline_s=5.0)], 30)
    copier.wait([copier.tier_load(ListTier(), NS, run, deadline_s=0.0)], 30)
    copier.close()
    first, late = records(tmp_path, "tier_load")
    fixed = {k: v for k, v in first.items() if k not in ("t", "replica", "role", "queued_s", "seconds")}
    assert fixed == {"ev": "tier_load", "req": "req-8", "tag": "tag-8", "first_block": 2, "blocks": 2, "loaded": 0,
                     "failed_block_ids": [0, 1], "miss_cause": "never_published", "miss_index": 2}
    timing_ok(first, "queued_s", "seconds")
    assert (late["miss_cause"], late["miss_index"]) == ("timeout", 2)  # no time left: nothing asked of the tier


def test_stores_run_one_at_a_time_in_order_and_loads_side_by_side(tmp_path):
    copier = HostCopier(None, HistoryWriter(None, "r", "worker"))
    started = threading.Event()
    order: list[str] = []

    def first():
        order.append("first")
        started.wait(timeout=0.5)  # the second store must not start meanwhile
        order.append("first done")

    def second():
        started.set()
        order.append("second")

    copier.wait([copier.submit(first, "store"), copier.submit(second, "store")], 30)
    assert order == ["first", "first done", "second"]
    barrier = threading.Barrier(LOAD_THREADS)
    names: list[str] = []

    def load():
        names.append(threading.current_thread().name)
        barrier.wait(timeout=10)  # only returns once LOAD_THREADS loads run at once

    copier.wait([copier.submit(load, "load") for _ in range(LOAD_THREADS)], 30)
    assert all(n.startswith("kvpool-load") for n in names)
    copier.close()


def test_wait_names_what_is_still_running_after_its_timeout():
    copier = HostCopier(None, HistoryWriter(None, "r", "worker"))
    slow = copier.submit(lambda: time.sleep(1.0), "store")
    with pytest.raises(PoolTimeout, match=r"^1 of 1 KV copies still running after 0\.05s$"):
        copier.wait([slow], 0.05)
    with pytest.raises(PoolTimeout, match=r"^1 of 2 loads still running after 0\.05s$"):
        done = Future()
        done.set_result(None)
        wait_all([done, copier.submit(lambda: time.sleep(1.0), "store")], 0.05, "loads")
    copier.close()


def test_close_waits_for_the_copies_running():
    copier = HostCopier(None, HistoryWriter(None, "r", "worker"))
    assert copier.block_bytes == 0  # nothing registered yet
    job = copier.submit(lambda: time.sleep(0.3), "store")
    copier.close()
    assert job.done()


class SlowAcquire:
    """The pool client, with every acquire 0.3 s late (a pool slow to answer)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def acquire(self, ns, hashes):
        time.sleep(0.3)
        return self.inner.acquire(ns, hashes)


def test_a_load_is_held_to_the_deadline_left_after_its_queueing(daemon, tmp_path):
    producer = copier_for(daemon, tmp_path)
    producer.register(engine(8))
    hs = keys(0, 2)
    producer.wait([producer.store(NS, CopyRun("p", "p", 0, [0, 1], hs), [0, 1])], 30)
    producer.close()
    history = HistoryWriter(tmp_path / "history", "r", "worker")
    copier = HostCopier(SlowAcquire(PoolClient(f"unix:{daemon.unix_path}", "default", "tok")), history)
    copier.register(engine(9))
    copier.wait([copier.load(NS, CopyRun("req-9", "tag-9", 0, [2, 3], hs), deadline_s=0.2)], 30)
    copier.wait([copier.load(NS, CopyRun("req-10", "tag-10", 0, [4, 5], hs), deadline_s=5.0)], 30)
    copier.close()
    late, in_time = records(tmp_path, "load")
    assert (late["loaded"], late["miss_cause"], late["failed_block_ids"]) == (0, "timeout", [2, 3])
    assert (in_time["loaded"], in_time["miss_cause"]) == (2, None)


class DownTier(ListTier):
    """A network tier that cannot be reached."""

    def put(self, ns, block_hash, page, digest, kind=None):
        from kvpool.tier.record import TierUnavailable

        raise TierUnavailable("store down")


def test_a_tier_publish_that_cannot_reach_the_store_records_why(tmp_path):
    copier = HostCopier(None, HistoryWriter(tmp_path / "history", "r", "worker"))
    copier.register(engine(10))
    copier.wait([copier.tier_store(DownTier(), NS, CopyRun("req-11", "tag-11", 0, [0, 1], keys(0, 2)), [0, 1])], 30)
    copier.close()
    (rec,) = records(tmp_path, "tier_publish")
    assert (rec["put"], rec["refused"], rec["error"]) == (0, 0, "TierUnavailable: store down")


def test_a_store_that_raises_is_recorded_before_it_raises_and_so_is_a_tier_store(tmp_path):
    """A store job's failure that is not the pool's (here: the engine's KV released under it) is
    raised on to the worker's wait, and its `publish` record is written first (with the error):
    every queued store ends with a record, so nothing that waits for the record waits for ever.
    The same for a tier store."""
    history = HistoryWriter(tmp_path / "history", "r", "worker")
    copier = HostCopier(SimpleNamespace(), history)  # no pool is reached: the KV read fails first

    def gone(block_id):  # noqa: ANN001, ANN202
        raise RuntimeError("KV caches released")

    copier.block_segments = gone
    run = CopyRun("req-1", "tag-1", 4, [0, 1], keys(0, 2))
    for submit, ev in ((lambda: copier.store(NS, run, [0, 1]), "publish"),
                       (lambda: copier.tier_store(SimpleNamespace(), NS, run, [0, 1]), "tier_publish")):
        with pytest.raises(RuntimeError, match="KV caches released"):
            copier.wait([submit()], 30)
        (rec,) = records(tmp_path, ev)
        assert (rec["req"], rec["tag"], rec["first_block"], rec["blocks"], rec["raised"]) == ("req-1", "tag-1", 4, 2, True)
        assert rec["error"] == "RuntimeError: KV caches released"
    copier.close()
