"""Fixtures of the gpu suite. Every module here carries
`pytestmark = [pytest.mark.gpu, skipif(no CUDA GPU)]`, so on a machine without a GPU
the suite is collected and skipped with its reason; nothing here touches CUDA before a
test runs.

  gpu_pool        a pool daemon (its own process) with 512 KiB pages, per module.
  client          a PoolClient of it (arena mapped: the engine registers it).
  cycles_per_ms   torch.cuda._sleep's rate on this GPU (measured once).
  delay_cycles    the test's stream delay, drawn from its seed (40 to 100 ms).
  engines         builds TransferEngines (or a control) and closes them after the test.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from kvgate.harness.system.pool import PoolProcess


@pytest.fixture(scope="module")
def gpu_pool(tmp_path_factory):
    from kvgate.harness.scenarios.gpu_transfer import POOL_PAGE

    # no scrub pass at rest: a page the tests corrupt at rest is met by the engine's load
    pool = PoolProcess.start(page_size=POOL_PAGE, num_pages=512, run_dir=tmp_path_factory.mktemp("gpu-pool"),
                             extra_args=("--scrub-rest-pages", "0"))
    try:
        yield pool
        assert pool.stop() == 0
    finally:
        pool.cleanup()


@pytest.fixture
def client(gpu_pool):
    c = gpu_pool.client(name="gpu-suite", timeout_s=30.0)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="session")
def cycles_per_ms() -> float:
    from kvgate.faults.gpu_controls import cycles_per_ms as measure

    return measure()


@pytest.fixture
def delay_cycles(test_seed, cycles_per_ms) -> int:
    ms = random.Random(f"{test_seed}:stream-delay").uniform(40.0, 100.0)
    return int(ms * cycles_per_ms)


@pytest.fixture
def tag(request) -> str:
    return hashlib.blake2b(request.node.nodeid.encode(), digest_size=6).hexdigest()
