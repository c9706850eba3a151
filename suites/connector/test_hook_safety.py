"""No pool content and no pool failure raises out of a vLLM hook.

  the restart-under-probe race   a thread restarts the pool daemon again and again, and
                                 after each restart makes the shared client reconnect (as
                                 the scheduler's lookup thread does: the socket dropped,
                                 the segment swapped), while the scheduler thread probes
                                 without pause. The probe never raises and never claims a
                                 run that only a daemon stopped before the probe began
                                 held. Its negative control (faults.hook_controls: the
                                 probe without its snapshot) is caught raising or claiming.
  a torn or scribbled index      whatever the index region holds, a probe raises nothing
                                 and an entry naming no page of the segment is no hit.
"""

from __future__ import annotations

import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from faults.hook_controls import UnguardedProbeClient
from harness.system.pool import thread_pool, unique_name
from kvpool.client import PoolClient, publish
from kvpool.keys import Namespace, block_hashes
from kvpool.shm_index import ENTRY, SLOTS, ShmIndex, buckets_for, ns_fingerprint

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGE = 4096
RUN = 4  # blocks a generation of the daemon publishes (a run no other generation holds)


def _run_of(generation: int) -> list[bytes]:
    return block_hashes([generation * 1_000_003 + t for t in range(16 * RUN)], 16)


def restart_race(client_class: type[PoolClient], seed: int, restarts: int, *, fresh_s: float = 5.0,
                 stop_when_caught: bool = False) -> dict:
    """Restart a thread daemon `restarts` times under a client that the scheduler thread
    (this one) probes without pause while the restarting thread reconnects it. Returns what
    the probe did wrong: `raised` (exception type names), `wrong_claims` (a run claimed
    that only a daemon stopped before the probe began held), and `probes`, `hits`."""
    rng = random.Random(seed)
    name = unique_name("kvhr")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    life: dict[int, list[float]] = {}  # generation -> [published at, stopped at (inf while it runs)]
    daemon = thread_pool(page_size=PAGE, num_pages=64, name=name, run_dir=run_dir)
    address = f"unix:{daemon.unix_path}"

    def serve(generation: int) -> None:
        with PoolClient(address, "default", "tok") as pub:
            hs = _run_of(generation)
            publish(pub, NS, hs, [np.full(PAGE, generation % 251, np.uint8)] * RUN)
        life[generation] = [time.monotonic(), float("inf")]

    serve(0)
    client = client_class(address, "default", "tok", name="scheduler", timeout_s=2.0)
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
                    client.lookup(NS, _run_of(g))
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
                got = client.probe(NS, _run_of(g), fresh_s=fresh_s)
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
        client.close()
        daemon.stop_thread()
    if failure:
        raise failure[0]
    return found


def test_a_restart_under_the_probe_never_raises_nor_claims_what_the_pool_lost(test_seed):
    found = restart_race(PoolClient, test_seed, restarts=25)
    assert found["probes"] > 1000 and found["hits"] > 0, found  # the probe ran throughout, and found runs
    assert found["raised"] == [], found["raised"][:5]
    assert found["wrong_claims"] == [], found["wrong_claims"][:5]


def test_the_unguarded_probe_is_caught_by_the_restart_race(test_seed):
    """The negative control: the probe that reads the socket and the segment one attribute
    at a time raises, or answers from the old segment beside the new session."""
    found = restart_race(UnguardedProbeClient, test_seed, restarts=60, stop_when_caught=True)
    assert found["raised"] or found["wrong_claims"], found


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
