"""CudaCopier on what the pool holds: pages that do not fit the engine's layout are a
failed load (a corrupt miss, recorded), never an exception out of start_load_kv, which
runs the load's enqueue on vLLM's worker thread."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgate.harness.checkers.history import read_history  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, make_kv, namespace  # noqa: E402
from kvpool.client.transfer import publish  # noqa: E402
from kvpool.connector.copier import CopyRun  # noqa: E402
from kvpool.connector.gpu_copier import CudaCopier  # noqa: E402
from kvpool.gpu.config import CopyPath  # noqa: E402
from kvpool.connector.history import HistoryWriter  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
def test_pooled_pages_of_another_length_are_a_corrupt_miss(path, client, test_seed, tag, tmp_path):
    geom = GEOMETRIES["flash-128k"]
    ns = namespace(geom, tag)
    rng = np.random.default_rng(test_seed)
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * 4), 16)
    short = [rng.integers(0, 256, geom.page_bytes // 2, dtype=np.uint8) for _ in range(4)]
    assert publish(client, ns, hashes, short).committed == 4  # another layout's pages under these keys
    history = HistoryWriter(str(tmp_path), "gpu", "worker")
    kv = make_kv(geom, torch.device("cuda"))
    copier = CudaCopier(client, history, config=geom.config(path))
    copier.register(kv, ns=ns, block_dim=geom.block_dim)
    dst = [int(x) for x in rng.permutation(geom.num_blocks)[:4]]
    try:
        loading = copier.load(ns, CopyRun("r", "t", 0, dst, hashes), 30)  # start_load_kv: it used to raise here
        copier.wait([loading], 60)  # wait_for_layer_load
        assert copier.load_settled(loading)  # get_finished
        assert copier.take_failed() == set(dst)
    finally:
        copier.close()
    rec = [r for r in read_history(tmp_path) if r["ev"] == "load"][0]
    assert rec["miss_cause"] == "corrupt" and rec["loaded"] == 0 and "KVLayoutError" in rec["error"], rec
