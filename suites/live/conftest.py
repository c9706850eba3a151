"""The live cluster, started once per test session: a pool daemon and two real
`vllm serve` replicas (A on core 0 with failure policy `fail`, B on core 1 with
`recompute`), both running the audit connector around kvpool's connector."""

from pathlib import Path

import pytest

from harness.cluster import default_cluster


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from fixtures.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0, revision="r1")


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
def cluster(tiny_model, live_report_dir):
    c, specs = default_cluster(tiny_model, live_report_dir)
    with c.start(specs):
        yield c


@pytest.fixture(scope="session")
def small_replica(cluster, live_report_dir) -> str:
    """Replica "D" (a 64-block KV cache, harness.cluster.small_kv_spec), started on first
    use and kept for the session."""
    from harness.cluster import small_kv_spec

    spec = small_kv_spec(live_report_dir)
    if spec.name not in cluster.replicas:
        cluster.add_replica(spec)
    return spec.name


@pytest.fixture
def live(cluster):
    """The cluster with empty caches and no fault armed."""
    cluster.reset()
    return cluster
