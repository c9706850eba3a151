"""Two processes, each with its own CUDA context, share the registered pool arena: one
stores through the GPU engine (torch path) under a stream delay, the other loads through
it (raw-pointer path); every byte equals the seed's. The negative control is the same
exchange with the producer's store-after-write dependency dropped: the consumer must see
stale pages."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

torch = pytest.importorskip("torch")

from kvpool.gpu.config import OrderingEdge  # noqa: E402
from kvgate.harness.scenarios import gpu_two_process as procs  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.fault_stream_delay,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the gpu suite needs one"),
]


def exchange(gpu_pool, seed, tag, drop, delay_cycles, out_dir):  # noqa: ANN001, ANN201
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=procs.producer, args=(gpu_pool.unix, gpu_pool.token, seed, tag, drop, delay_cycles,
                                                 str(out_dir)))
    p.start()
    p.join(180)
    assert p.exitcode == 0, f"producer exited with {p.exitcode}"
    c = ctx.Process(target=procs.consumer, args=(gpu_pool.unix, gpu_pool.token, seed, tag, str(out_dir)))
    c.start()
    c.join(180)
    assert c.exitcode == 0, f"consumer exited with {c.exitcode}"
    return (json.loads((out_dir / "producer.json").read_text()), json.loads((out_dir / "consumer.json").read_text()))


def test_two_processes_exchange_through_the_registered_arena(gpu_pool, delay_cycles, test_seed, tag, tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "control").mkdir()
    prod, cons = exchange(gpu_pool, test_seed, tag, None, delay_cycles, tmp_path / "ok")
    assert prod["committed"] == procs.BLOCKS and prod["host_memory"] == "registered", prod
    assert cons["loaded"] == procs.BLOCKS and cons["differing"] == 0 and cons["released"], cons
    assert cons["host_memory"] == "registered", cons
    prod, cons = exchange(gpu_pool, test_seed + 1, tag + "c", OrderingEdge.STORE_AFTER_WRITE.value, delay_cycles,
                          tmp_path / "control")
    assert prod["committed"] == procs.BLOCKS, prod
    assert cons["loaded"] == procs.BLOCKS and cons["differing"] > 0, \
        f"negative control NOT caught: the consumer saw no stale page ({cons})"
