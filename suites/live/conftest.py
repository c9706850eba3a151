"""The live system, started once per test session exactly as the gate starts it
(kvgate.harness.gate.start_system): a pool daemon and four real `vllm serve` replicas of the
tiny local model — A (policy fail) and B (recompute), C on revision r2, D with a
64-block KV cache behind the transport fault proxy — all audited."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def live_report_dir(request, tmp_path_factory, worker_id) -> Path:
    """--kv-report DIR keeps the cluster's logs and history there (one folder per xdist
    worker); by default they go to pytest's temporary directory."""
    base = request.config.getoption("--kv-report")
    if base is None:
        return tmp_path_factory.mktemp("live-report")
    path = Path(base) / f"live-{worker_id}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def system(live_report_dir):
    from kvgate.harness.system.default import start_system

    cluster, model = start_system(live_report_dir, {"A", "B", "C", "D"})
    try:
        yield cluster, model
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def cluster(system):
    return system[0]


@pytest.fixture(scope="session")
def tiny_model(system) -> Path:
    return system[1]


@pytest.fixture
def live(cluster):
    """The cluster with empty caches and no fault armed."""
    cluster.reset()
    return cluster
