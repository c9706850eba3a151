"""A load verifies what arrived in GPU memory, not the pool's shared page: a page whose
shared copy changes after the load started (after any host read of it) and before the
DMA reads it is refused as corrupt and never installed, on both copy paths, for pages
of either digest kind and engines of either store kind. The fault is at the data: a
stream-ordered write of other bytes into the registered shared page, enqueued on the
engine's copy stream behind a delay (torch.cuda._sleep), so it lands after load() began
and before the engine's copy. The control (kvgate.faults.gpu_controls.HostReadEngine) checks
the shared page as read by the host when the load starts, the check loads had before;
it installs the changed bytes as loaded, and the byte check sees them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgate.faults.gpu_controls import HostReadEngine, delay_stream  # noqa: E402
from kvpool.client.transfer import publish  # noqa: E402
from kvpool.pool.digest import DigestKind  # noqa: E402
from kvpool.errors import MissCause  # noqa: E402
from kvpool.gpu.config import CopyPath  # noqa: E402
from kvpool.gpu.transfer import TransferEngine  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, fill, make_kv, namespace, read_pages  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

CUDA = torch.device("cuda")
KINDS = [(DigestKind.SKETCH, DigestKind.XXH3), (DigestKind.SKETCH, DigestKind.SKETCH),
         (DigestKind.XXH3, DigestKind.XXH3), (DigestKind.XXH3, DigestKind.SKETCH)]


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("engine_kind,page_kind", KINDS, ids=[f"engine-{e}-pages-{p}" for e, p in KINDS])
@pytest.mark.parametrize("engine_cls,checks", [(TransferEngine, True), (HostReadEngine, False)],
                         ids=["engine", "control-host-read"])
def test_a_page_changed_between_the_host_read_and_the_dma_is_refused(engine_cls, checks, engine_kind, page_kind,
                                                                      path, client, delay_cycles, test_seed, tag):
    geom = GEOMETRIES["flash-128k"]
    ns = namespace(geom, f"{tag}{engine_cls.__name__}{engine_kind}{page_kind}{path.value}")
    rng = np.random.default_rng(test_seed)
    k = 10
    pages = rng.integers(0, 256, (k, geom.page_bytes), dtype=np.uint8)
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * k), 16)
    assert publish(client, ns, hashes, list(pages), kind=page_kind).committed == k
    warm_hashes = block_hashes(range(base + 10**6, base + 10**6 + 16), 16)
    assert publish(client, ns, warm_hashes, [pages[0]], kind=page_kind).committed == 1
    hits = client.lookup(ns, hashes).hits
    assert [h.kind for h in hits] == [page_kind] * k
    bad = int(rng.integers(1, k - 1))
    changed = pages[bad].copy()
    at = rng.choice(geom.page_bytes, size=8, replace=False)
    changed[at] ^= rng.integers(1, 256, size=8, dtype=np.uint8)  # every chosen byte differs
    changed_dev = torch.from_numpy(changed).to(CUDA)
    layers = make_kv(geom, CUDA)
    old = fill(layers, geom.block_dim, rng, geom.page_bytes)
    blocks = [int(b) for b in rng.permutation(geom.num_blocks - 1)[:k]]  # the last block: the warm-up's
    torch.cuda.synchronize()
    with engine_cls(client, ns, layers, geom.config(path, digest=engine_kind)) as engine:
        shared = engine._region[hits[bad].page * engine._page_size:][: geom.page_bytes]  # the registered page
        # Warm-up: every kernel and copy of a load runs once before the delay (a first
        # launch can serialize streams and run the write before load() started).
        warm = engine.load([int(geom.num_blocks - 1)], warm_hashes)
        engine.wait_for_load(warm)
        torch.cuda.synchronize()
        engine.drain()
        delay_stream(engine.load_stream, delay_cycles)
        with torch.cuda.stream(engine.load_stream):  # lands after load() starts, before the load's copies
            shared.copy_(changed_dev, non_blocking=True)
        h = engine.load(blocks, hashes)
        engine.wait_for_load(h)
        got = read_pages(layers, geom.block_dim, blocks).cpu().numpy()
        (outcome,) = engine.drain()
    landed = np.array_equal(np.asarray(client.arena.page(hits[bad].page, geom.page_bytes)), changed)
    assert landed, "the fault did not change the shared page: the test proves nothing"
    assert np.array_equal(got[:bad], pages[:bad]), "the pages before the changed one load byte-exact"
    if checks:
        assert h.miss is not None, f"the changed page was installed as verified: {h}"
        assert (h.loaded, h.miss.index, h.miss.cause) == (bad, bad, MissCause.CORRUPT), h
        assert outcome.loaded == bad and outcome.miss.cause == MissCause.CORRUPT, outcome
        assert h.failed_block_ids == tuple(blocks[bad:])
        assert np.array_equal(got[bad:], old[blocks[bad:]]), "the changed page and the later ones are not installed"
    else:
        assert h.loaded == k, f"the control refused the page: {h}"
        assert np.array_equal(got[bad], changed), "negative control NOT caught: the changed page was not " \
            "installed as loaded"

