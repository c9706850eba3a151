"""The live cluster, started once per test session: a pool daemon and two real
`vllm serve` replicas (A on core 0 with failure policy `fail`, B on core 1 with
`recompute`), both running the audit connector around kvpool's connector."""

import random
from pathlib import Path

import pytest

from harness.cluster import Cluster, ReplicaSpec

CHUNK = 2048  # max_num_batched_tokens: prompts longer than this prefill in chunks


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from fixtures.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0, revision="r1")


@pytest.fixture(scope="session")
def live_report_dir(request, tmp_path_factory) -> Path:
    return request.config.stash.get(_REPORT_KEY, None) or tmp_path_factory.mktemp("live-report")


_REPORT_KEY = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def cluster(tiny_model, live_report_dir):
    faults = {name: live_report_dir / f"faults-{name}.json" for name in ("A", "B")}
    for path in faults.values():
        path.write_text("{}")
    specs = [
        ReplicaSpec("A", core="0", policy="fail", audit=True, max_num_batched_tokens=CHUNK,
                    faults_file=str(faults["A"])),
        ReplicaSpec("B", core="1", policy="recompute", audit=True, max_num_batched_tokens=CHUNK,
                    faults_file=str(faults["B"])),
    ]
    c = Cluster(tiny_model, live_report_dir, page_size=128 * 1024, pool_pages=1024)
    c.faults = faults
    with c.start(specs):
        yield c


@pytest.fixture
def live(cluster):
    """The cluster with empty caches and no fault armed."""
    for path in cluster.faults.values():
        path.write_text("{}")
    cluster.reset()
    return cluster


@pytest.fixture
def rng(test_seed) -> random.Random:
    return random.Random(test_seed)
