"""CudaCopier, the connector's copier interface on the GPU engine, driven the way the
worker drives it: store at wait_for_save and reuse the blocks at once, load at
start_load_kv, wait before reading; misses reported in `.failed`."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvgate.faults.gpu_controls import delay_stream  # noqa: E402
from kvpool.connector.copier import CopyRun  # noqa: E402
from kvpool.connector.gpu_copier import CudaCopier  # noqa: E402
from kvpool.gpu.config import CopyPath  # noqa: E402
from kvpool.connector.history import HistoryWriter  # noqa: E402
from kvpool.pool.keys import block_hashes  # noqa: E402
from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, fill, make_kv, namespace, read_pages, write_pages  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]


@pytest.mark.parametrize("path", [CopyPath.TORCH, CopyPath.DRIVER])
def test_copier_round_trip_like_the_connector(path, client, delay_cycles, test_seed, tag, tmp_path):
    geom = GEOMETRIES["flash-128k"]
    ns = namespace(geom, tag)
    rng = np.random.default_rng(test_seed)
    history = HistoryWriter(str(tmp_path), "gpu", "worker")
    a, b = make_kv(geom, torch.device("cuda")), make_kv(geom, torch.device("cuda"))
    old = fill(a, geom.block_dim, rng, geom.page_bytes)
    reuse = torch.from_numpy(rng.integers(0, 256, (8, geom.page_bytes), dtype=np.uint8)).cuda()
    torch.cuda.synchronize()
    base = int(rng.integers(1 << 28))
    hashes = block_hashes(range(base, base + 16 * 10), 16)
    src_blocks = [int(x) for x in rng.permutation(geom.num_blocks)[:8]]
    dst_blocks = [int(x) for x in rng.permutation(geom.num_blocks)[:10]]
    producer = CudaCopier(client, history, config=geom.config(path))
    producer.register(a, ns=ns, block_dim=geom.block_dim)
    consumer = CudaCopier(client, history, config=geom.config(path))
    consumer.register(b, ns=ns, block_dim=geom.block_dim)
    try:
        for reader in producer.engine.store_read_streams:
            delay_stream(reader, delay_cycles)
        stored = producer.store(ns, CopyRun("r1", "t", 0, src_blocks + [0, 1], hashes), keep=list(range(8)))
        write_pages(a, geom.block_dim, src_blocks, reuse)  # the engine reuses the blocks right away
        producer.wait([stored], 60)
        assert stored.result().committed == 8, stored.result()
        loading = consumer.load(ns, CopyRun("r2", "t", 0, dst_blocks, hashes), 30)
        assert consumer.failed == set(dst_blocks[8:])
        consumer.wait([loading], 60)
        got = read_pages(b, geom.block_dim, dst_blocks[:8]).cpu().numpy()
        assert consumer.take_failed() == set(dst_blocks[8:]) and not consumer.failed
    finally:
        producer.close()
        consumer.close()
    assert np.array_equal(got, old[src_blocks]), "the consumer must read the producer's bytes as they were at store()"
