"""A load's check is ordered after its copy on the check stream: a staging buffer still
holding the same pages from an earlier load, and a copy held back, must not let the
check pass on the old rows while the copy brings in other bytes (here: the shared page
changed after the earlier load). The control drops that edge
(kvgate.faults.gpu_controls.UnorderedTransferEngine, OrderingEdge.CHECK_AFTER_COPY): its check
reads the old rows, and the other bytes are installed as loaded, which the byte check
sees."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgate.faults.gpu_controls import UnorderedTransferEngine, delay_stream  # noqa: E402
from kvpool.client.transfer import publish  # noqa: E402
from kvpool.pool.digest import DigestKind  # noqa: E402
from kvpool.errors import MissCause  # noqa: E402
from kvpool.gpu.config import CopyPath, OrderingEdge  # noqa: E402
from kvpool.gpu.transfer import TransferEngine  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, fill, make_kv, namespace, read_pages  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fault_stream_delay,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

CUDA = torch.device("cuda")


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("kind", [DigestKind.XXH3, DigestKind.SKETCH])
@pytest.mark.parametrize("drop", [None, OrderingEdge.CHECK_AFTER_COPY], ids=["engine", "control-check-before-copy"])
def test_the_check_reads_the_staged_rows_after_the_copy(drop, kind, path, client, delay_cycles, test_seed, tag):
    geom = GEOMETRIES["flash-128k"]
    ns = namespace(geom, f"{tag}{drop}{kind}{path.value}")
    rng = np.random.default_rng(test_seed)
    k = 10
    pages = rng.integers(0, 256, (k, geom.page_bytes), dtype=np.uint8)
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * k), 16)
    assert publish(client, ns, hashes, list(pages), kind=kind).committed == k
    layers = make_kv(geom, CUDA)
    old = fill(layers, geom.block_dim, rng, geom.page_bytes)
    order = [int(b) for b in rng.permutation(geom.num_blocks)]
    first, blocks = order[:k], order[k : 2 * k]
    bad = int(rng.integers(1, k - 1))
    torch.cuda.synchronize()
    cfg = geom.config(path, digest=kind)
    engine = TransferEngine(client, ns, layers, cfg) if drop is None else \
        UnorderedTransferEngine(client, ns, layers, cfg, drop=drop)
    with engine:
        # The first load fills the staging buffer with these pages, in this order (its check
        # is held back, so even the control's unordered check reads them after its copy).
        delay_stream(engine.load_check_stream, delay_cycles)
        h1 = engine.load(first, hashes)
        engine.wait_for_load(h1)
        torch.cuda.synchronize()
        engine.drain()
        assert h1.loaded == k, h1
        held = client.acquire(ns, hashes)  # leased: the pool's scrub cannot drop the page the load must meet
        page = np.asarray(client.arena.page(held.hits[bad].page, geom.page_bytes))
        page[int(rng.integers(geom.page_bytes))] ^= 0xFF  # the shared page changes before this load
        changed = page.copy()
        delay_stream(engine.load_stream, delay_cycles)  # the copy is late
        h = engine.load(blocks, hashes)
        engine.wait_for_load(h)
        got = read_pages(layers, geom.block_dim, blocks).cpu().numpy()
        engine.drain()
        dropped = getattr(engine, "dropped", 0)
    client.release(held.lease_id)
    assert np.array_equal(got[:bad], pages[:bad]), "the pages before the changed one load byte-exact"
    if drop is None:
        assert h.miss is not None, f"the changed page was installed as verified: {h}"
        assert (h.loaded, h.miss.index, h.miss.cause) == (bad, bad, MissCause.CORRUPT), h
        assert np.array_equal(got[bad:], old[blocks[bad:]]), "the changed page and the later ones are not installed"
    else:
        assert dropped > 0, "the control never reached its edge"
        assert h.loaded == k, f"the control refused the page: {h}"
        assert np.array_equal(got[bad], changed), "negative control NOT caught: the changed page was not " \
            "installed as loaded"
