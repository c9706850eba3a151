"""Worker processes of the two-process test (started with the `spawn` method: each has
its own CUDA context and maps the pool's arena itself).

  producer(...)   seeded KV blocks, a stream delay before the KV write, engine.store;
                  `drop` names an ordering edge to skip (the negative control).
  consumer(...)   engine.load of the producer's hashes into its own KV tensors, read them
                  after wait_for_load, compare with a fresh regeneration from the seed.
Each writes a JSON result into `out_dir`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvgate.harness.scenarios.gpu_transfer import GEOMETRIES, namespace

GEOMETRY = "nfirst-512k"
BLOCKS = 24


def _plan(seed: int):  # noqa: ANN202
    from kvpool.pool.keys import block_hashes

    geom = GEOMETRIES[GEOMETRY]
    rng = np.random.default_rng([seed, 2])
    pages = rng.integers(0, 256, (BLOCKS, geom.page_bytes), dtype=np.uint8)
    src_blocks = [int(b) for b in rng.permutation(geom.num_blocks)[:BLOCKS]]
    dst_blocks = [int(b) for b in rng.permutation(geom.num_blocks)[:BLOCKS]]
    base = int(rng.integers(1 << 28))
    return geom, pages, src_blocks, dst_blocks, block_hashes(range(base, base + 16 * BLOCKS), 16)


def producer(address: str, token: str, seed: int, tag: str, drop: str | None, delay_cycles: int,
             out_dir: str) -> None:
    import torch

    from kvgate.faults.gpu_controls import UnorderedTransferEngine, delay_stream
    from kvpool.client.pool_client import PoolClient
    from kvpool.gpu.config import CopyPath
    from kvpool.gpu.transfer import TransferEngine
    from kvpool.pool.keys import block_hashes
    from kvgate.harness.scenarios.gpu_transfer import fill, make_kv, write_blocks

    geom, pages, src_blocks, _, hashes = _plan(seed)
    client = PoolClient(address, "default", token, name="producer")
    device = torch.device("cuda")
    layers = make_kv(geom, device)
    old = fill(layers, geom.block_dim, np.random.default_rng([seed, 3]), geom.page_bytes)  # what a stale read sees
    new = torch.from_numpy(pages).to(device)
    idx = torch.tensor(src_blocks, dtype=torch.int64, device=device)
    spare = next(b for b in range(geom.num_blocks) if b not in src_blocks)
    torch.cuda.synchronize()
    cfg = geom.config(CopyPath.TORCH)
    ns = namespace(geom, tag)
    engine = (TransferEngine(client, ns, layers, cfg) if drop is None
              else UnorderedTransferEngine(client, ns, layers, cfg, drop=drop))
    # warm-up (synchronized): a fresh process's first launches load their kernels, which
    # can serialize streams and hide the race
    write_blocks(layers, geom.block_dim, torch.tensor([spare], device=device),
                 torch.from_numpy(old[spare : spare + 1]).to(device))
    engine.store([spare], block_hashes(range(1 << 30, (1 << 30) + 16), 16))
    torch.cuda.synchronize()
    engine.drain()
    delay_stream(torch.cuda.current_stream(), delay_cycles)
    write_blocks(layers, geom.block_dim, idx, new)
    engine.store(src_blocks, hashes)
    outcomes = engine.drain()
    engine.close()
    client.close()
    result = {"committed": sum(o.committed for o in outcomes), "host_memory": engine.capabilities.host_memory.value,
              "device": torch.cuda.get_device_name()}
    Path(out_dir, "producer.json").write_text(json.dumps(result))


def consumer(address: str, token: str, seed: int, tag: str, out_dir: str) -> None:
    import torch

    from kvpool.client.pool_client import PoolClient
    from kvpool.gpu.config import CopyPath
    from kvpool.gpu.transfer import TransferEngine
    from kvgate.harness.scenarios.gpu_transfer import make_kv, read_pages

    geom, pages, _, dst_blocks, hashes = _plan(seed)
    client = PoolClient(address, "default", token, name="consumer")
    layers = make_kv(geom, torch.device("cuda"))
    torch.cuda.synchronize()
    engine = TransferEngine(client, namespace(geom, tag), layers, geom.config(CopyPath.DRIVER))
    h = engine.load(dst_blocks, hashes)
    engine.wait_for_load(h)
    got = read_pages(layers, geom.block_dim, dst_blocks[: h.loaded]).cpu().numpy()
    outcomes = engine.drain()
    engine.close()
    client.close()
    differing = int(np.count_nonzero((got != pages[: h.loaded]).any(axis=1))) if h.loaded else 0
    result = {"loaded": h.loaded, "differing": differing, "released": all(not o.stale for o in outcomes),
              "host_memory": engine.capabilities.host_memory.value}
    Path(out_dir, "consumer.json").write_text(json.dumps(result))
