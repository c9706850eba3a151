"""The connector's worker side against a real pool and real (CPU) KV tensors: a step in
which a request's load fails computes the rest of that request's prompt on the failed
blocks, so nothing that step computed for it may be published (it would be KV computed
on a wrong context, served to every later reader). The fault is at the data: one bit of a
committed page flipped in the shared arena, caught by the loader's digest."""

from __future__ import annotations

import time

import numpy as np
import pytest

from suites.connector.cpu_worker import PAGE, B, cpu_worker
from suites.connector.engine_calls import finished
from kvgate.harness.checkers.history import read_history
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.connector.params import BlockRun, KVPoolMetadata
from kvpool.connector.worker import KVPoolWorker
from kvpool.errors import MissCause
from kvpool.pool.keys import block_hashes



@pytest.fixture
def pool():
    # no scrub pass at rest: a page corrupted in prepare() is met by the worker's load
    d = thread_pool(page_size=PAGE, num_pages=64, scrub_rest_pages_per_round=0)
    yield d
    d.stop_thread()


def step(w: KVPoolWorker, hashes: list[bytes]) -> None:
    """One step of request r: blocks 0-3 loaded into engine blocks 10-13, blocks 4-7
    computed in the same step (engine blocks 14-17) and stored."""
    meta = KVPoolMetadata(loads=[BlockRun("r", "t", 0, [10, 11, 12, 13], hashes[:4])],
                          stores=[BlockRun("r", "t", 4, [14, 15, 16, 17], hashes[4:8])])
    w.start_load_kv(meta)
    w.save(meta)
    # The scheduler holds the request's blocks until the worker reports it, whether its
    # stores ran or were withheld: never reported, its blocks would never be freed.
    assert finished(w, {"r"}) == {"r"}


def prepare(pool, ns, seed: int, corrupt_block: int | None):  # noqa: ANN001, ANN202
    """A producer publishes blocks 0-3; with `corrupt_block`, one bit of that committed page
    is flipped in the arena afterwards (a stray write into a page at rest)."""
    rng = np.random.default_rng(seed)
    hashes = block_hashes(list(rng.integers(0, 2000, 8 * B)), B)
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="producer") as c:
        assert publish(c, ns, hashes[:4],
                       [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(4)]).committed == 4
        if corrupt_block is not None:
            page = c.lookup(ns, hashes[:4]).hits[corrupt_block].page
            c.arena.page(page)[int(rng.integers(PAGE))] ^= 1 << int(rng.integers(8))
    return hashes


@pytest.mark.parametrize("corrupt", [None, 2])
def test_a_step_whose_load_failed_publishes_nothing_it_computed(pool, tmp_path, test_seed, corrupt):
    w = cpu_worker(pool, tmp_path)
    hashes = prepare(pool, w.ns, test_seed, corrupt)
    step(w, hashes)
    failed = w.take_failed()
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="oracle") as c:
        found = c.lookup(w.ns, hashes[4:8])
    recs = read_history(tmp_path / "h")
    if corrupt is None:  # the positive control: a clean load, and the step's blocks are published
        assert failed == set() and len(found.hits) == 4
        return
    assert failed == {12, 13}  # the corrupt block and every block after it
    load = [r for r in recs if r["ev"] == "load"][0]
    assert load["miss_cause"] == MissCause.CORRUPT.value and load["loaded"] == 2
    assert len(found.hits) == 0 and found.miss.cause == MissCause.NEVER_PUBLISHED
    withheld = [r for r in recs if r["ev"] == "publish_withheld"]
    assert [(r["first_block"], r["blocks"]) for r in withheld] == [(4, 4)]


@pytest.mark.parametrize("corrupt", [None, 1])
def test_an_asynchronous_load_is_reported_once_installed_and_its_failures_no_later(pool, tmp_path, test_seed,
                                                                                  corrupt):
    """vLLM holds a request with an asynchronous load until get_finished names it in
    finished_recving; its failed blocks must reach get_block_ids_with_load_errors no later
    than that step (vLLM's contract): at the step the request is reported, every block is
    either installed with the producer's bytes or in the failed set."""
    w = cpu_worker(pool, tmp_path)
    hashes = prepare(pool, w.ns, test_seed, corrupt)
    w.start_load_kv(KVPoolMetadata(async_loads=[BlockRun("r", "t", 0, [20, 21, 22, 23], hashes[:4])]))
    failed: set[int] = set()
    got: set[str] = set()
    for _ in range(3000):  # the engine's steps: get_finished, then get_block_ids_with_load_errors
        got = w.finished_receiving()
        failed |= w.take_failed()
        if got:
            break
        time.sleep(0.005)
    assert got == {"r"}
    assert w.finished_receiving() == set()  # reported once
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="oracle") as c:
        pages = [bytes(c.arena.page(h.page)) for h in c.lookup(w.ns, hashes[:4]).hits]
    kv = w.copier.block_segments
    installed = [b"".join(bytes(s) for s in kv(b)) for b in (20, 21, 22, 23)]
    if corrupt is None:
        assert failed == set() and installed == pages
    else:
        assert failed == {21, 22, 23} and installed[0] == pages[0]
        load = [r for r in read_history(tmp_path / "h") if r["ev"] == "load"][0]
        assert load["miss_cause"] == MissCause.CORRUPT.value and load["loaded"] == 1
