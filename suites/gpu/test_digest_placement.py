"""Each place a digest is checked on the GPU engine's paths, tested with bytes that differ
exactly where that check looks, and nowhere else:

  staging against cache   a load's check (the GPU's sketch of the staged row, or the staged
        row read back and hashed on the host) against the committed digest: one byte of
        one staged row differs after the copy (kvgate.faults.gpu_controls.StagedFlipEngine),
        the pooled page is intact. At the page's first byte, its last (in the padded last
        sketch row: this geometry's pages are 1.5 sketch rows) and a seeded one; both copy
        paths, pages of either kind. The engine must refuse that page and install none
        after it; the control checks the cache instead (HostReadEngine, the check loads had
        before), installs the differing byte, and the byte check finds it there.
  cache against source    a kv-sketch-1 store's digest is taken over its source (the staged
        rows it copies on the torch path, the blocks gathered apart from the raw-pointer
        copies on the driver path); the pool trusts it at commit and its scrub re-takes it
        at rest. One byte of one page differs from the source after the copy, before the
        commit (FlipAtCommitLane): the scrub must drop that page. The control re-takes the
        digest over the page as it landed (PageDigestLane): the scrub passes it and the byte
        check finds the differing byte in the pool.
  cache against the host's digest   an xxh3-128 store digests the page as copied and the
        pool re-verifies it at commit: one byte changed between the two is rejected, never
        visible. (An xxh3-128 store has no check against its source: a copy that delivers
        other bytes is digested as delivered. The matrix's byte-exact oracle is what checks
        those stores against their blocks.)
"""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgate.faults.gpu_controls import FlipAtCommitLane, HostReadEngine, PageDigestLane, engine_class  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import Geometry, fill, make_kv, namespace, read_pages, scrubbed  # noqa: E402
from kvpool.client.transfer import publish  # noqa: E402
from kvpool.errors import MissCause  # noqa: E402
from kvpool.gpu.config import CopyPath  # noqa: E402
from kvpool.gpu.transfer import TransferEngine  # noqa: E402
from kvpool.pool.digest import SKETCH_ROW, DigestKind, page_digest  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fault_corrupt,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]

CUDA = torch.device("cuda")
# vLLM's blocks-first layout, pages of 24 KiB: one and a half sketch rows (the staged row is
# padded with zeros to two); 12 KiB per layer, one contiguous run (the driver path's minimum is 512 bytes)
ODD = Geometry("nfirst-24k", 2, ("N", 2, 16, 3, 64), "bfloat16", 64, chunk_pages=4)
K = 8


def test_the_geometry_has_a_partial_sketch_row():
    assert ODD.page_bytes % SKETCH_ROW and ODD.page_bytes > SKETCH_ROW


def _offset(where: str, rng: np.random.Generator) -> int:
    if where == "first":
        return 0
    if where == "last":
        return ODD.page_bytes - 1
    return int(rng.integers(ODD.page_bytes))


def _hashes(rng: np.random.Generator, k: int) -> list[bytes]:
    base = int(rng.integers(1 << 28))
    return block_hashes(range(base, base + 16 * k), 16)


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("kind", [DigestKind.SKETCH, DigestKind.XXH3])
@pytest.mark.parametrize("where", ["first", "last", "seeded"])
@pytest.mark.parametrize("host_read", [False, True], ids=["engine", "control-host-read"])
def test_the_load_check_looks_at_the_staged_rows(host_read, where, kind, path, client, test_seed, tag):
    ns = namespace(ODD, f"{tag}")
    rng = np.random.default_rng(test_seed)
    pages = rng.integers(0, 256, (K, ODD.page_bytes), dtype=np.uint8)
    hashes, warm_hashes = _hashes(rng, K), _hashes(rng, 1)
    assert publish(client, ns, hashes, list(pages), kind=kind).committed == K
    assert publish(client, ns, warm_hashes, [pages[0]], kind=kind).committed == 1
    bad = int(rng.integers(1, K - 1))
    offset, mask = _offset(where, rng), int(rng.integers(1, 256))
    layers = make_kv(ODD, CUDA)
    old = fill(layers, ODD.block_dim, rng, ODD.page_bytes)
    blocks = [int(b) for b in rng.permutation(ODD.num_blocks - 1)[:K]]  # the last block: the warm-up's
    torch.cuda.synchronize()
    cls = engine_class(HostReadEngine if host_read else TransferEngine, staged_flip=True)
    with cls(client, ns, layers, ODD.config(path, digest=kind)) as engine:
        warm = engine.load([ODD.num_blocks - 1], warm_hashes)
        engine.wait_for_load(warm)
        torch.cuda.synchronize()
        engine.drain(60)
        engine.arm_flip(bad, offset, mask)
        h = engine.load(blocks, hashes)
        engine.wait_for_load(h)
        got = read_pages(layers, ODD.block_dim, blocks).cpu().numpy()
        engine.drain(60)
        flipped = engine.flipped
    assert flipped == 1, "the staged byte was never changed: the test proves nothing"
    held = client.acquire(ns, hashes)  # the pooled page is as committed: only what arrived differed
    try:
        assert len(held.hits) == K, "a page intact in the pool was dropped"
        page = np.array(client.arena.page(held.hits[bad].page, ODD.page_bytes))
        assert np.array_equal(page, pages[bad]) and page_digest(page, kind) == held.hits[bad].digest
    finally:
        client.release(held.lease_id)
    assert np.array_equal(got[:bad], pages[:bad]), "the pages before the changed one load byte-exact"
    if not host_read:
        assert h.miss is not None, f"a staged row differing at byte {offset} passed the {kind} check: {h}"
        assert (h.loaded, h.miss.index, h.miss.cause) == (bad, bad, MissCause.CORRUPT), h
        assert np.array_equal(got[bad:], old[blocks[bad:]]), "the refused page and the later ones are not installed"
    else:
        assert h.loaded == K, f"the control refused the page: {h}"
        assert list(np.flatnonzero(got[bad] != pages[bad])) == [offset], \
            "negative control NOT caught: the byte that differed in staging is not the one installed"


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
@pytest.mark.parametrize("control", [False, True], ids=["engine", "control-page-digest"])
def test_a_sketched_store_is_checked_against_its_source(control, path, client, test_seed, tag):
    ns = namespace(ODD, f"{tag}")
    rng = np.random.default_rng(test_seed)
    src = make_kv(ODD, CUDA)
    host = fill(src, ODD.block_dim, rng, ODD.page_bytes)
    blocks = [int(b) for b in rng.permutation(ODD.num_blocks)[:K]]
    hashes = _hashes(rng, K)
    bad = int(rng.integers(1, K - 1))
    offset, mask = int(rng.integers(ODD.page_bytes)), int(rng.integers(1, 256))
    flips = {hashes[bad]: (offset, mask)}
    lanes = [FlipAtCommitLane(PageDigestLane(client) if control else client, flips)]
    torch.cuda.synchronize()
    before = scrubbed(client)
    with TransferEngine(client, ns, src, ODD.config(path, digest=DigestKind.SKETCH), lanes=lanes) as engine:
        engine.store(blocks, hashes)
        (out,) = engine.drain(60)
    assert not flips, "the page never differed from its source: the test proves nothing"
    assert out.committed == K and out.rejected == 0, out  # committed on trust
    after = scrubbed(client)
    found = client.lookup(ns, hashes).hits
    corrupt = after["scrub_corrupt"] - before["scrub_corrupt"]
    if not control:
        assert corrupt == 1, f"the scrub did not drop the page that differs from its source: {before} -> {after}"
        assert len(found) == bad, f"the lookup still finds {len(found)} pages, the differing one at {bad}"
    else:
        assert corrupt == 0 and len(found) == K, (before, after, len(found))
        page = np.asarray(client.arena.page(found[bad].page, ODD.page_bytes))
        assert list(np.flatnonzero(page != host[blocks[bad]])) == [offset], \
            "negative control NOT caught: the pooled page does not hold the byte that differs from its source"
    for i in range(min(bad, len(found))):
        assert np.array_equal(np.asarray(client.arena.page(found[i].page, ODD.page_bytes)), host[blocks[i]])


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
def test_an_xxh3_store_is_reverified_against_the_page_at_commit(path, client, test_seed, tag):
    ns = namespace(ODD, f"{tag}")
    rng = np.random.default_rng(test_seed)
    src = make_kv(ODD, CUDA)
    host = fill(src, ODD.block_dim, rng, ODD.page_bytes)
    blocks = [int(b) for b in rng.permutation(ODD.num_blocks)[:K]]
    hashes = _hashes(rng, K)
    bad = int(rng.integers(K))
    flips = {hashes[bad]: (int(rng.integers(ODD.page_bytes)), int(rng.integers(1, 256)))}
    torch.cuda.synchronize()
    cfg = ODD.config(path, digest=DigestKind.XXH3, commit_blocks=K)
    with TransferEngine(client, ns, src, cfg, lanes=[FlipAtCommitLane(client, flips)]) as engine:
        engine.store(blocks, hashes)
        (out,) = engine.drain(60)
    assert not flips, "the page never changed: the test proves nothing"
    assert out.rejected == 1 and out.committed == K - 1, out
    found = client.lookup(ns, hashes)
    assert len(found.hits) == bad, "the rejected page is visible"
    for i, hit in enumerate(found.hits):
        assert np.array_equal(np.asarray(client.arena.page(hit.page, ODD.page_bytes)), host[blocks[i]])
