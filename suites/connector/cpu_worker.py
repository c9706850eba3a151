"""A KVPoolWorker on CPU KV tensors of a small fixed geometry, without an engine, for tests
of the worker side (its loads, stores and their failures).

  B, LAYERS, HEADS, HEAD    block size, layers, KV heads, head size
  PAGE                      bytes of one block of every layer (bf16): the pool's page
  cpu_worker(pool, tmp_path) -> KVPoolWorker
        a worker of replica W on `pool` (a thread pool daemon), its 32 blocks of KV
        registered, its history under tmp_path/h.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvpool.connector.settings import ConnectorSettings
from kvpool.connector.worker import KVPoolWorker

B, LAYERS, HEADS, HEAD = 16, 2, 2, 64
PAGE = LAYERS * HEADS * B * 2 * HEAD * 2  # one block of every layer, bf16


def cpu_worker(pool, tmp_path) -> KVPoolWorker:  # noqa: ANN001
    mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: HEADS,
                         get_head_size=lambda: HEAD)
    config = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=B),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1),
                             device_config=SimpleNamespace(device_type="cpu"))
    w = KVPoolWorker(config, ConnectorSettings(pool=f"unix:{pool.unix_path}", token="tok", replica="W",
                                               history_dir=str(tmp_path / "h")))
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(32, HEADS, B, 2 * HEAD,
                                                                             dtype=torch.bfloat16)
                          for i in range(LAYERS)})
    return w
