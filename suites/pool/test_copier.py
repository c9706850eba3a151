"""The worker's copy engine (kvpool.connector.copier) against a real daemon, with the stream-delay
fault (kvgate.faults.copier) and its negative control (kvgate.faults.controls.EarlyCompletionCopier).

The engine's side is played by the test: KV "layers" are numpy arrays; after the copier
says a store is done the test reuses the blocks (writes other bytes), and after it says
a load is done the test reads them, as attention would."""

import json
import random
import threading

import numpy as np
import pytest

from kvgate.faults.copier import FaultyCopier
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.connector.copier import LANE_THREADS, CopyRun, HostCopier

from .lanes import hold
from kvpool.pool.digest import page_digest
from kvpool.connector.history import HistoryWriter, read_history
from kvpool.pool.keys import Namespace, block_hashes

pytestmark = pytest.mark.fault_stream_delay

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
LAYERS, BLOCKS, BLOCK_BYTES = 2, 8, 2048  # a page = one block of both layers: 4096 bytes


@pytest.fixture
def daemon():
    d = thread_pool(page_size=LAYERS * BLOCK_BYTES, num_pages=32)
    yield d
    d.stop_thread()


def engine(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)]


def copier_for(d, tmp_path, control=None):
    history = HistoryWriter(tmp_path / "history", "r", "worker")
    inner = HostCopier(PoolClient(f"unix:{d.unix_path}", "default", "tok"), history)
    if control is None:
        return inner, history
    return FaultyCopier(inner, control, history), history


def keys(seed, n=4):
    rng = random.Random(seed)
    return block_hashes([rng.randrange(2048) for _ in range(16 * n)], 16)


def pool_pages(d, hashes):
    with PoolClient(f"unix:{d.unix_path}", "default", "tok") as c:
        found = c.lookup(NS, hashes)
    return [ref.digest for ref in found.hits]


def page_of(layers, block):
    return page_digest(np.concatenate([layer[block] for layer in layers]))


def drain(copier):
    """Wait until the copier's lanes ran what was queued before this call: one barrier job
    per thread of a lane can only all run once every thread has finished its earlier job."""
    if not hasattr(copier, "inner"):
        return
    for lane, threads in LANE_THREADS.items():
        barrier = threading.Barrier(threads)
        jobs = [copier.inner.submit(lambda b=barrier: b.wait(timeout=30), lane) for _ in range(threads)]
        for job in jobs:
            job.result(timeout=30)


def store_then_reuse(d, tmp_path, seed, spec, held=False):
    """Store blocks 0..3 with the copy delayed (and, if `held`, queued behind a held lane);
    as soon as the copier reports the store done, the engine reuses the blocks, then the
    lane is released. Returns (digests at save time, pool digests)."""
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"copier": spec}))
    copier, _ = copier_for(d, tmp_path, control)
    layers = engine(seed)
    copier.register(layers)
    hashes = keys(seed)
    run = CopyRun("req", "t", 0, [0, 1, 2, 3], hashes)
    produced = [page_of(layers, b) for b in run.block_ids]
    release = hold(copier, "store") if held else None
    copier.wait([copier.store(NS, run, range(4))], timeout_s=30)
    for layer in layers:  # the blocks are freed and another request's prefill writes them
        layer[:4] = np.random.default_rng(seed + 1).integers(0, 256, layer[:4].shape, dtype=np.uint8)
    if release is not None:
        release.set()
    drain(copier)
    copier.close()
    return produced, pool_pages(d, hashes)


def test_a_delayed_store_publishes_the_bytes_of_save_time(daemon, tmp_path, test_seed):
    produced, pooled = store_then_reuse(daemon, tmp_path, test_seed, {"store_delay_ms": 300})
    assert pooled == produced


def test_control_early_completion_store_is_caught(daemon, tmp_path, test_seed):
    produced, pooled = store_then_reuse(daemon, tmp_path, test_seed,
                                        {"store_delay_ms": 300, "control": "early_completion"}, held=True)
    assert len(pooled) == 4  # the pool accepted them: its digest covers what was copied
    assert pooled != produced, "the early-completion copier published the bytes of save time: control not caught"


def load_then_read(d, tmp_path, seed, spec, held=False):
    """Publish 4 blocks from one engine, then load them into another with the copy
    delayed (and, if `held`, queued behind a held lane); read the blocks as soon as the
    copier says the load is done, then release the lane."""
    producer, _ = copier_for(d, tmp_path)
    src = engine(seed)
    producer.register(src)
    hashes = keys(seed)
    producer.wait([producer.store(NS, CopyRun("p", "p", 0, [0, 1, 2, 3], hashes), range(4))], 30)
    producer.close()
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"copier": spec}))
    consumer, history = copier_for(d, tmp_path, control)
    dst = engine(seed + 7)
    consumer.register(dst)
    run = CopyRun("c", "c", 0, [4, 5, 6, 7], hashes)
    release = hold(consumer, "load") if held else None
    consumer.wait([consumer.load(NS, run, deadline_s=10)], 30)
    seen = [page_of(dst, b) for b in run.block_ids]  # attention reads now
    if release is not None:
        release.set()
    drain(consumer)
    consumer.close()
    return seen, pool_pages(d, hashes), read_history(tmp_path / "history")


def test_a_delayed_load_is_complete_before_the_engine_reads(daemon, tmp_path, test_seed):
    seen, pooled, history = load_then_read(daemon, tmp_path, test_seed, {"load_delay_ms": 300})
    assert seen == pooled
    fault = [r for r in history if r["ev"] == "fault"]
    assert fault and fault[0]["kind"] == "stream_delay" and fault[0]["delay_ms"] == 300


def test_control_early_completion_load_is_caught(daemon, tmp_path, test_seed):
    seen, pooled, history = load_then_read(daemon, tmp_path, test_seed,
                                           {"load_delay_ms": 300, "control": "early_completion"}, held=True)
    loads = [r for r in history if r["ev"] == "load"]
    assert loads and loads[-1]["loaded"] == 4  # the copy itself succeeded, later
    assert seen != pooled, "the engine read loaded blocks before the copy: control not caught"


def test_the_delay_heals_after_its_count(daemon, tmp_path, test_seed):
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"copier": {"store_delay_ms": 50, "times": 2}}))
    copier, _ = copier_for(daemon, tmp_path, control)
    layers = engine(test_seed)
    copier.register(layers)
    for i in range(4):
        run = CopyRun(f"r{i}", "t", 0, [i], keys(test_seed + i, 1))
        copier.wait([copier.store(NS, run, [0])], 30)
    copier.close()
    fired = [r for r in read_history(tmp_path / "history") if r["ev"] == "fault"]
    assert [r["req"] for r in fired] == ["r0", "r1"]


def test_an_unknown_copier_control_is_an_error(daemon, tmp_path):
    from kvgate.faults.control import ControlFileError

    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"copier": {"control": "optimistic"}}))
    copier, _ = copier_for(daemon, tmp_path, control)
    with pytest.raises(ControlFileError, match="optimistic"):
        copier.store(NS, CopyRun("r", "t", 0, [0], keys(1, 1)), [0])
    copier.close()
