"""No pool content and no pool failure raises out of a vLLM hook.

  the restart-under-probe race   a thread restarts the pool daemon again and again, and
                                 after each restart makes the shared client reconnect (as
                                 the scheduler's lookup thread does: the socket dropped,
                                 the segment swapped), while the scheduler thread probes
                                 without pause. The probe never raises and never claims a
                                 run that only a daemon stopped before the probe began
                                 held. Its negative control (kvgate.faults.hook_controls: the
                                 probe without its snapshot) is caught raising or claiming.
  a torn or scribbled index      whatever the index region holds, a probe raises nothing
                                 and an entry naming no page of the segment is no hit.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from types import SimpleNamespace

import numpy as np
import pytest

from kvgate.faults.hook_controls import UnguardedProbeClient
from kvgate.harness.system.pool import thread_pool, unique_name
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.connector.settings import ConnectorSettings
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.index import ENTRY, SLOTS, ShmIndex, buckets_for, ns_fingerprint

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGE = 4096
RUN = 4  # blocks a generation of the daemon publishes (a run no other generation holds)


def _tokens_of(generation: int) -> list[int]:
    return [generation * 1_000_003 + t for t in range(16 * RUN + 1)]  # RUN whole blocks and one token


def _run_of(generation: int) -> list[bytes]:
    return block_hashes(_tokens_of(generation)[: 16 * RUN], 16)


def restart_race(make, seed: int, restarts: int, *, stop_when_caught: bool = False) -> dict:  # noqa: ANN001
    """Restart a thread daemon `restarts` times; each generation g publishes its own run of
    blocks. `make(address)` gives (ns, probe, call, close): `probe(g)` is what the
    scheduler thread (this one) asks without pause, how many blocks of generation g's run
    are held (None: it cannot say); `call(g)` is a call of the lookup thread's on the same
    client, which the restarting thread makes after each restart (it reconnects: the
    socket dropped, the segment swapped). Returns what the probe did wrong: `raised`
    (exception type names), `wrong_claims` (a run claimed that only a daemon stopped before
    the probe began held), and `probes`, `hits`."""
    rng = random.Random(seed)
    name = unique_name("kvhr")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    life: dict[int, list[float]] = {}  # generation -> [published at, stopped at (inf while it runs)]
    daemon = thread_pool(page_size=PAGE, num_pages=64, name=name, run_dir=run_dir)
    address = f"unix:{daemon.unix_path}"
    ns = None

    def serve(generation: int) -> None:
        with PoolClient(address, "default", "tok") as pub:
            publish(pub, ns, _run_of(generation), [np.full(PAGE, generation % 251, np.uint8)] * RUN)
        life[generation] = [time.monotonic(), float("inf")]

    ns, probe, call, close = make(address)
    serve(0)
    found = {"raised": [], "wrong_claims": [], "probes": 0, "hits": 0}
    done = threading.Event()
    failure: list[BaseException] = []

    def restarter() -> None:
        nonlocal daemon
        try:
            for g in range(1, restarts + 1):
                if stop_when_caught and (found["raised"] or found["wrong_claims"]):
                    break
                daemon.stop_thread()
                life[g - 1][1] = time.monotonic()
                daemon = thread_pool(page_size=PAGE, num_pages=64, name=name, run_dir=run_dir)
                serve(g)
                for _ in range(3):  # the lookup thread's calls: the first reconnects and swaps the segment
                    call(g)
                    time.sleep(rng.uniform(0, 0.004))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread, re-raised there
            failure.append(exc)
        finally:
            done.set()

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads interleave at a fine grain: the race's windows are short
    thread = threading.Thread(target=restarter, name="restarter")
    thread.start()
    try:
        while not done.is_set():
            g = rng.choice(sorted(life))
            t0 = time.monotonic()
            try:
                got = probe(g)
            except Exception as exc:  # noqa: BLE001 - what the test looks for: anything raised
                found["raised"].append(f"{type(exc).__name__}: {exc}")
                continue
            finally:
                found["probes"] += 1
            if got:
                found["hits"] += 1
                if life[g][1] < t0:  # only generation g held this run, and it had stopped
                    found["wrong_claims"].append((g, got, round(t0 - life[g][1], 6)))
    finally:
        sys.setswitchinterval(old_interval)
        thread.join()
        close()
        daemon.stop_thread()
    if failure:
        raise failure[0]
    return found


def client_prober(client_class: type[PoolClient], fresh_s: float = 5.0):  # noqa: ANN201
    """The race on the pool client itself: PoolClient.probe (or a known-bad one)."""

    def make(address: str):  # noqa: ANN202
        client = client_class(address, "default", "tok", name="scheduler", timeout_s=2.0)
        return (NS, lambda g: client.probe(NS, _run_of(g), fresh_s=fresh_s),
                lambda g: client.lookup(NS, _run_of(g)), client.close)

    return make


def scheduler_prober(tmp_path: Path, control: str | None = None, pause_ms: float = 0.0):  # noqa: ANN201
    """The race through the vLLM hook: KVPoolScheduler.get_num_new_matched_tokens, a new
    request each time (each one probes), on a scheduler whose pool backend is wrapped by
    kvgate.faults.backend (with `control`, the replica's client control: "unguarded_probe")."""
    from kvgate.faults.backend import FaultyBackend
    from kvpool.connector.scheduler import KVPoolScheduler
    from kvpool.connector.settings import connect_backend

    tmp_path.mkdir(parents=True, exist_ok=True)
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"client": {"control": control, "pause_ms": pause_ms}} if control else {}))

    def factory(settings, role, history, metrics):  # noqa: ANN001, ANN202
        return FaultyBackend(connect_backend(settings, role, history, metrics), faults, history)

    def make(address: str):  # noqa: ANN202
        mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                             get_num_layers=lambda pc: 2, get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 64)
        config = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
                                 parallel_config=SimpleNamespace(tensor_parallel_size=1),
                                 device_config=SimpleNamespace(device_type="cpu"))
        settings = ConnectorSettings(pool=address, token="tok", history_dir=str(tmp_path / "h"),
                                     lookup_sync_s=0.0, lookup_poll_s=0.0)
        s = KVPoolScheduler(config, settings, factory)
        ids = itertools.count()

        def probe(g: int) -> int | None:
            rid = f"r{next(ids)}"
            request = SimpleNamespace(request_id=rid, prompt_token_ids=_tokens_of(g), num_computed_tokens=0,
                                      cache_salt=None, kv_transfer_params=None)
            tokens, _ = s.get_num_new_matched_tokens(request, 0)  # the hook
            s.request_finished(request, [])
            return None if tokens is None else tokens // 16

        return s.ns, probe, lambda g: s.backend.lookup(s.ns, _run_of(g)), lambda: s.backend.close()

    return make


def test_a_restart_under_the_probe_never_raises_nor_claims_what_the_pool_lost(test_seed):
    found = restart_race(client_prober(PoolClient), test_seed, restarts=25)
    assert found["probes"] > 1000 and found["hits"] > 0, found  # the probe ran throughout, and found runs
    assert found["raised"] == [], found["raised"][:5]
    assert found["wrong_claims"] == [], found["wrong_claims"][:5]


def test_the_unguarded_probe_is_caught_by_the_restart_race(test_seed):
    """The negative control: the probe that reads the socket and the segment one attribute
    at a time raises, or answers from the old segment beside the new session."""
    found = restart_race(client_prober(UnguardedProbeClient), test_seed, restarts=60, stop_when_caught=True)
    assert found["raised"] or found["wrong_claims"], found


def test_get_num_new_matched_tokens_survives_restarts_under_its_probe(test_seed, tmp_path):
    """The same race through the scheduler hook (its lookup thread and the restarting
    thread reconnect the client it probes); the unguarded probe plugged in through the
    replica's fault control (the live scenario's control) is caught there too."""
    found = restart_race(scheduler_prober(tmp_path), test_seed, restarts=15)
    assert found["probes"] > 100 and found["hits"] > 0, found
    assert found["raised"] == [] and found["wrong_claims"] == [], (found["raised"][:5], found["wrong_claims"][:5])
    control = restart_race(scheduler_prober(tmp_path / "control", "unguarded_probe", pause_ms=0.2), test_seed,
                           restarts=60, stop_when_caught=True)
    assert control["raised"] or control["wrong_claims"], control


def test_a_scribbled_index_raises_nothing_and_claims_no_page_outside_the_segment(test_seed):
    rng = np.random.default_rng(test_seed)
    pages = 64
    entries = np.zeros(buckets_for(pages) * SLOTS, dtype=ENTRY)
    ix = ShmIndex(entries, num_pages=pages)
    fp = ns_fingerprint(NS)
    hashes = block_hashes(range(16 * 8), 16)
    for i, h in enumerate(hashes):
        assert ix.insert(h, fp, i)
    assert ix.probe(fp, hashes) == 8
    words = entries.view(np.uint64).reshape(-1, 4)
    target = [i for i in range(len(entries)) if entries["page1"][i] == 3][0]  # block 2's entry
    words[target, 0] = (np.uint64(pages + 5) << np.uint64(32)) | np.uint64(2)  # a page past the segment
    assert ix.probe(fp, hashes) == 2
    words[target, 0] = np.uint64(2)  # even seq, page + 1 of 0: an empty entry with the block's words
    assert ix.probe(fp, hashes) == 2
    for _ in range(200):  # garbage everywhere: no exception, and no hit for a page outside it
        entries.view(np.uint8)[:] = rng.integers(0, 256, entries.nbytes, dtype=np.uint8)
        got = ix.probe(fp, hashes)
        assert 0 <= got <= len(hashes)
    with pytest.raises(ValueError):  # a region of no index's shape is refused when it is mapped, not probed
        ShmIndex(np.zeros(0, dtype=ENTRY))


# -- the worker's loads: what the pool holds or fails at is a failed load, never an exception --

import torch  # noqa: E402

from kvgate.harness.checkers.history import read_history  # noqa: E402
from kvpool.client.transfer import load  # noqa: E402
from kvpool.connector.params import BlockRun, KVPoolMetadata
from kvpool.connector.worker import KVPoolWorker  # noqa: E402
from kvpool.errors import MissCause  # noqa: E402

from suites.connector.cpu_worker import HEAD, HEADS, LAYERS, B, cpu_worker  # noqa: E402
from suites.connector.cpu_worker import PAGE as BLOCK  # noqa: E402


@pytest.fixture
def pool():
    d = thread_pool(page_size=BLOCK, num_pages=64)
    yield d
    d.stop_thread()


def _publish_with_a_short_page(pool, ns, seed: int, short: int) -> list[bytes]:  # noqa: ANN001
    """Another replica of the tenant pools blocks 0-3 under this namespace's keys, block
    `short` a page of half a block (the layout it computed with is not this one's)."""
    rng = np.random.default_rng(seed)
    hashes = block_hashes(list(rng.integers(0, 2000, 4 * B)), B)
    pages = [rng.integers(0, 256, BLOCK // 2 if i == short else BLOCK, dtype=np.uint8) for i in range(4)]
    with PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="other-layout") as c:
        assert publish(c, ns, hashes, pages).committed == 4
    return hashes


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_pooled_page_of_the_wrong_length_is_a_corrupt_miss_not_an_exception(pool, tmp_path, test_seed, mode):
    """wait_for_layer_load (a synchronous load) and get_finished (an asynchronous one) once
    raised InvalidRequest here, which ends vLLM's engine core."""
    w = cpu_worker(pool, tmp_path)
    hashes = _publish_with_a_short_page(pool, w.ns, test_seed, short=2)
    run = BlockRun("r", "t", 0, [10, 11, 12, 13], hashes)
    if mode == "sync":
        w.start_load_kv(KVPoolMetadata(loads=[run]))
        w.wait_for_load()  # the hook wait_for_layer_load
    else:
        w.start_load_kv(KVPoolMetadata(async_loads=[run]))
        deadline = time.monotonic() + 30
        while not w.finished_receiving() and time.monotonic() < deadline:  # the hook get_finished
            time.sleep(0.005)
    assert w.take_failed() == {12, 13}  # get_block_ids_with_load_errors: the short page and every block after it
    rec = [r for r in read_history(tmp_path / "h") if r["ev"] == "load"][0]
    assert rec["miss_cause"] == MissCause.CORRUPT.value and rec["loaded"] == 2 and rec["failed_block_ids"] == [12, 13]
    assert "bytes" in rec["error"], rec
    stats = w.take_stats()
    assert stats is not None and stats.data["misses"].get(MissCause.CORRUPT.value) == 1, stats.data


def test_a_restart_under_a_load_is_a_transport_error_never_the_new_segments_pages(test_seed):
    """The lease was granted in the old daemon's segment; another thread's call reconnects
    to the restarted daemon (the segment swapped) between two pages of the load. The load
    stops there as transport_error: the lease's page numbers name other pages (or none) in
    the new segment, and reading them there would install other blocks' bytes."""
    rng = np.random.default_rng(test_seed)
    hashes = block_hashes(list(rng.integers(0, 2000, 4 * B)), B)
    daemons = [thread_pool(page_size=BLOCK, num_pages=64)]
    name, run_dir, address = daemons[0].config.name, daemons[0].config.run_dir, f"unix:{daemons[0].unix_path}"
    try:
        with PoolClient(address, "default", "tok") as c:
            assert publish(c, NS, hashes, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(4)]).committed == 4

            def dest(i: int) -> np.ndarray:
                if i == 2 and len(daemons) == 1:  # between pages 1 and 2: the pool restarts, another call reconnects
                    daemons[0].stop_thread()
                    daemons.append(thread_pool(page_size=BLOCK, num_pages=64, name=name, run_dir=run_dir))
                    with PoolClient(address, "default", "tok") as p:  # the new pool holds other blocks
                        publish(p, NS, block_hashes(list(range(4 * B)), B),
                                [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(4)])
                    c.ping()
                return np.zeros(BLOCK, np.uint8)

            res = load(c, NS, hashes, dest)
    finally:
        daemons[-1].stop_thread()
    assert res.loaded == 2 and res.miss is not None and res.miss.cause == MissCause.TRANSPORT_ERROR, res
    assert "restart" in res.error, res


def test_a_preempted_requests_stores_queued_on_a_stalled_pool_do_not_end_the_step(tmp_path, test_seed):
    """start_load_kv drains a preempted request's stores before the next forward may write
    into its freed blocks. With the pool stalled (SIGSTOP) every store of the lane takes
    its client's timeout, and the drained request's store queued behind seven others once
    outlived the worker's backstop: PoolTimeout out of start_load_kv, the engine's end.
    Now the queued store is cancelled (it never reads the blocks) and the step goes on."""
    import os
    import signal

    from kvgate.harness.system.pool import PoolProcess
    from suites.connector.engine_calls import finished

    pool = PoolProcess.start(page_size=BLOCK, num_pages=64, token="tok")
    try:
        mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                             get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: HEADS,
                             get_head_size=lambda: HEAD)
        config = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=B),
                                 parallel_config=SimpleNamespace(tensor_parallel_size=1),
                                 device_config=SimpleNamespace(device_type="cpu"))
        w = KVPoolWorker(config, ConnectorSettings(pool=pool.unix, token="tok", replica="W", timeout_s=0.3,
                                                   load_deadline_s=0.3, history_dir=str(tmp_path / "h")))
        w.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(32, HEADS, B, 2 * HEAD,
                                                                                 dtype=torch.bfloat16)
                              for i in range(LAYERS)})
        rng = np.random.default_rng(test_seed)
        runs = [BlockRun(f"r{i}", f"t{i}", 0, [i], block_hashes(list(rng.integers(0, 2000, B)), B))
                for i in range(8)]
        os.kill(pool.proc.pid, signal.SIGSTOP)
        try:
            w.save(KVPoolMetadata(stores=runs))  # eight stores on the store lane, each stalls for its timeout
            t0 = time.monotonic()
            w.start_load_kv(KVPoolMetadata(drain=["r7"]))  # the last one's request was preempted
            drained_s = time.monotonic() - t0
        finally:
            os.kill(pool.proc.pid, signal.SIGCONT)
        assert drained_s < w._wait_s, drained_s
        dropped = [r for r in read_history(tmp_path / "h") if r["ev"] == "publish_dropped"]
        assert [(r["req"], r["stores"]) for r in dropped] == [("r7", 1)]
        ids = {f"r{i}" for i in range(8)}
        assert finished(w, ids) == ids  # every request is reported, r7 with its store dropped
        w.copier.close()
    finally:
        pool.cleanup()


def test_a_run_longer_than_asked_is_a_miss_not_a_claim_past_the_prompt(tmp_path, test_seed):
    """A daemon (kvgate.faults.hook_controls.OverlongCatalog) answers every lookup and acquire with
    each hit twice. The scheduler once claimed twice the blocks it asked for (tokens past
    the prompt, which vLLM's scheduler refuses by ending the engine) and the loader ran
    past its run's block ids (IndexError out of wait_for_layer_load). Both are a
    transport_error miss now: the answer does not answer the request."""
    from kvgate.faults.hook_controls import OverlongCatalog
    from kvpool.connector.scheduler import KVPoolScheduler

    daemon = thread_pool(page_size=BLOCK, num_pages=64, catalog_factory=OverlongCatalog)
    try:
        w = cpu_worker(daemon, tmp_path)
        rng = np.random.default_rng(test_seed)
        tokens = [int(t) for t in rng.integers(0, 2000, 3 * B + 1)]  # three blocks to look up, two pooled
        hashes = block_hashes(tokens[: 3 * B], B)
        with PoolClient(f"unix:{daemon.unix_path}", "default", "tok") as c:
            assert publish(c, w.ns, hashes[:2], [rng.integers(0, 256, BLOCK, dtype=np.uint8)] * 2).committed == 2
        s = KVPoolScheduler(w.vllm_config, w.settings)
        request = SimpleNamespace(request_id="q", prompt_token_ids=tokens, num_computed_tokens=0, cache_salt=None,
                                  kv_transfer_params=None)
        deadline = time.monotonic() + 30
        while (got := s.get_num_new_matched_tokens(request, 0))[0] is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert got == (0, False), got
        lookups = [r for r in read_history(tmp_path / "h") if r["ev"] == "lookup"]
        assert lookups[-1]["miss_cause"] == MissCause.TRANSPORT_ERROR.value, lookups[-1]
        w.start_load_kv(KVPoolMetadata(loads=[BlockRun("q", "t", 0, [3, 4], hashes[:2])]))
        w.wait_for_load()  # the hook wait_for_layer_load
        assert w.take_failed() == {3, 4}
        rec = [r for r in read_history(tmp_path / "h") if r["ev"] == "load"][-1]
        assert rec["miss_cause"] == MissCause.TRANSPORT_ERROR.value and "run of 4" in rec["error"], rec
        w.copier.close()
    finally:
        daemon.stop_thread()
