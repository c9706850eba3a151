"""The consumer's side of the live stream faults (kvgate.faults.gpu_live): the load delay and
the control that drops the edges ordering the engine's reads after a load, on the copier the
live replicas run (ControlledCudaCopier), driven as the worker drives it: a synchronous
load waited for on the engine's stream, an asynchronous one reported settled before the
engine reads."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgate.faults.gpu_live import ControlledCudaCopier  # noqa: E402
from kvgate.harness.scenarios.gpu_live import reads_edges  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, fill, make_kv, namespace, read_pages  # noqa: E402
from kvpool.connector.copier import CopyRun  # noqa: E402
from kvpool.connector.gpu_copier import CudaCopier  # noqa: E402
from kvpool.connector.history import HistoryWriter, read_history  # noqa: E402
from kvpool.gpu.config import CopyPath  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fault_stream_delay,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

DELAY_MS = 300
BLOCKS = 8


def _published(client, geom, ns, rng, history):
    """8 blocks published by a producer; their bytes and hashes."""
    src = make_kv(geom, torch.device("cuda"))
    pages = fill(src, geom.block_dim, rng, geom.page_bytes)
    torch.cuda.synchronize()
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * BLOCKS), 16)
    ids = [int(x) for x in rng.permutation(geom.num_blocks)[:BLOCKS]]
    producer = CudaCopier(client, history, config=geom.config(CopyPath.TORCH))
    producer.register(src, ns=ns, block_dim=geom.block_dim)
    try:
        stored = producer.store(ns, CopyRun("p", "p", 0, ids, hashes), keep=list(range(BLOCKS)))
        producer.wait([stored], 60)
        assert stored.result().committed == BLOCKS, stored.result()
    finally:
        producer.close()
    return pages[ids], hashes


def _consume(client, tmp_path, test_seed, tag, spec: dict, mode: str):
    """The consumer loads the 8 blocks with `spec` armed in its control file and reads them
    as the engine would: synchronous, right after wait() enqueued its stream wait;
    asynchronous, once load_settled() said so (then wait(), as the worker's finished_receiving
    does). Returns (what the engine read, the producer's bytes, the consumer's history)."""
    geom = GEOMETRIES["flash-128k"]
    ns = namespace(geom, tag)
    rng = np.random.default_rng(test_seed)
    history = HistoryWriter(str(tmp_path / "history"), "gpu", "worker")
    want, hashes = _published(client, geom, ns, rng, history)
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"gpu": spec}))
    dst = make_kv(geom, torch.device("cuda"))
    fill(dst, geom.block_dim, rng, geom.page_bytes)  # the blocks hold other bytes before the load
    torch.cuda.synchronize()
    ids = [int(x) for x in rng.permutation(geom.num_blocks)[:BLOCKS]]
    out = read_pages(dst, geom.block_dim, ids)  # allocated before any stream is held back (read_pages)
    consumer = ControlledCudaCopier(client, history, control=control, config=geom.config(CopyPath.TORCH))
    consumer.register(dst, ns=ns, block_dim=geom.block_dim)
    try:
        loading = consumer.load(ns, CopyRun("c", "c", 0, ids, hashes), 30)
        if mode == "async":
            deadline = time.monotonic() + 30
            while not consumer.load_settled(loading):
                assert time.monotonic() < deadline, "the load never settled"
                time.sleep(0.001)
        consumer.wait([loading], 60)
        seen = read_pages(dst, geom.block_dim, ids, out).cpu().numpy()  # the engine's read, on its stream
        torch.cuda.synchronize()
        after = read_pages(dst, geom.block_dim, ids).cpu().numpy()
    finally:
        consumer.close()
    deadline = time.monotonic() + 10  # the engine's own thread records the delayed writes over
    while not [r for r in read_history(tmp_path / "history") if r["ev"] == "load_delay_done"]:
        assert time.monotonic() < deadline, "the delayed load's writes were never recorded over"
        time.sleep(0.01)
    return seen, after, want, read_history(tmp_path / "history")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_delayed_load_is_read_only_once_written(mode, client, test_seed, tag, tmp_path):
    seen, after, want, history = _consume(client, tmp_path, test_seed, tag, {"load_delay_ms": DELAY_MS}, mode)
    delays = [r for r in history if r["ev"] == "fault" and r["kind"] == "load_delay"]
    assert len(delays) == 1 and delays[0]["blocks"] == delays[0]["loaded"] == BLOCKS, delays
    assert delays[0]["direct"] is False  # host pages: the staged install
    assert np.array_equal(seen, want), "the engine read loaded blocks before the delayed load wrote them"
    assert np.array_equal(after, want)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_control_reads_before_the_delayed_load_are_caught(mode, client, test_seed, tag, tmp_path):
    spec = {"load_delay_ms": DELAY_MS, "control": "unordered", "drop": reads_edges(mode)}
    seen, after, want, history = _consume(client, tmp_path, test_seed, tag, spec, mode)
    dropped = {r["edge"] for r in history if r["ev"] == "fault" and r["kind"] == "gpu_control"}
    assert dropped == set(reads_edges(mode)), dropped
    assert np.array_equal(after, want), "the load itself must still land (the control drops an order, not a copy)"
    assert not np.array_equal(seen, want), "the engine read the blocks before the load wrote them: control not caught"


def test_one_dropped_edge_of_an_asynchronous_load_is_covered_by_the_other(client, test_seed, tag, tmp_path):
    """Asynchronous loads have two edges before the engine reads (reads_edges): dropping
    either alone keeps the reads behind the writes; the live control drops both."""
    for edge in ("read_after_load", "release_after_copy"):
        seen, _, want, _ = _consume(client, tmp_path / edge, test_seed, f"{tag}-{edge}",
                                    {"load_delay_ms": DELAY_MS, "control": "unordered", "drop": edge}, "async")
        assert np.array_equal(seen, want), f"dropping {edge} alone let the engine read early"
