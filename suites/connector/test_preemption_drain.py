"""A preempted request's stores are over before the next forward may write its freed blocks.
vLLM 0.32 and 0.34 call start_load_kv after the forward in a step without a synchronous load,
and handle_preemptions before every forward: the drain is in handle_preemptions. (Through
vLLM 0.34's own scheduler and plumbing, with a forward writing the freed block:
suites/compat/test_vllm034.py.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvgate.harness.system.pool import thread_pool
from kvpool.connector import vllm_compat as compat
from kvpool.connector.facade import KVPoolConnector
from kvpool.connector.params import BlockRun, KVPoolMetadata
from kvpool.connector.settings import connect_backend
from kvpool.pool.keys import block_hashes

B, LAYERS, HEADS, HEAD = 16, 2, 2, 64
PAGE = LAYERS * HEADS * B * 2 * HEAD * 2


class GatedReserve:
    """The worker's pool client: its first reserve waits `hold_s` (the store has started and
    has not read its blocks yet)."""

    def __init__(self, inner, hold_s: float):  # noqa: ANN001
        self._inner, self._hold_s = inner, hold_s
        self.entered = threading.Event()

    def reserve(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        if not self.entered.is_set():
            self.entered.set()
            threading.Event().wait(self._hold_s)
        return self._inner.reserve(*args, **kwargs)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._inner, name)


class NoPreemptionDrain(KVPoolConnector):
    """The negative control: kvpool before, draining in start_load_kv alone."""

    def handle_preemptions(self, kv_connector_metadata):  # noqa: ANN001, ANN201
        return None


@pytest.fixture
def pool():
    d = thread_pool(page_size=PAGE, num_pages=16)
    yield d
    d.stop_thread()


def _worker(cls, pool, tmp_path):  # noqa: ANN001, ANN202
    gates: list[GatedReserve] = []

    def factory(settings, role, history, metrics):  # noqa: ANN001, ANN202
        gates.append(GatedReserve(connect_backend(settings, role, history, metrics), hold_s=1.0))
        return gates[-1]

    extra = {"pool": f"unix:{pool.unix_path}", "token": "tok", "replica": "W", "history_dir": str(tmp_path / "h")}
    mc = SimpleNamespace(model=str(tmp_path), revision="r1", tokenizer=str(tmp_path), dtype="torch.bfloat16",
                         get_num_layers=lambda pc: LAYERS, get_num_kv_heads=lambda pc: HEADS,
                         get_head_size=lambda: HEAD)
    config = SimpleNamespace(model_config=mc, cache_config=SimpleNamespace(cache_dtype="auto", block_size=B),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1),
                             device_config=SimpleNamespace(device_type="cpu"),
                             kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))
    c = cls(config, compat.KVConnectorRole.WORKER, None, extra=extra, backend_factory=factory)
    c.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(8, HEADS, B, 2 * HEAD, dtype=torch.bfloat16)
                          for i in range(LAYERS)})
    return c, gates[-1]


def _store_then_preempt(cls, pool, tmp_path) -> tuple[bool, float]:  # noqa: ANN001
    """Step 1 stores request r's block; r is preempted; step 2's handle_preemptions runs
    before its forward. Returns whether r's store was over when it returned, and how long
    it took."""
    c, gate = _worker(cls, pool, tmp_path)
    hashes = block_hashes(list(range(B)), B)
    c.bind_connector_metadata(KVPoolMetadata(stores=[BlockRun("r", "t", 0, [3], hashes)]))
    c.wait_for_save()
    c.clear_connector_metadata()
    assert gate.entered.wait(30.0)  # r's store has started
    t0 = time.monotonic()
    c.handle_preemptions(KVPoolMetadata(drain=["r"]))  # vLLM: before the forward, every step
    took = time.monotonic() - t0
    done = all(f.done() for f in c.worker._sending.get("r", []))
    c.shutdown()
    return done, took


def test_handle_preemptions_ends_a_preempted_requests_store_before_the_forward(pool, tmp_path):
    done, took = _store_then_preempt(KVPoolConnector, pool, tmp_path)
    assert done and took > 0.5  # it waited for the store, which the gate held ~1 s


def test_control_without_the_drain_the_store_is_still_running_at_the_forward(pool, tmp_path):
    done, _ = _store_then_preempt(NoPreemptionDrain, pool, tmp_path)
    assert not done
