"""Live: every scenario of the catalog (fixtures/scenarios) on real `vllm serve`
replicas sharing one pool (the multi-host ones: suites/live/test_cross_host.py), judged exactly as the gate judges it (kvgate.harness.scenarios):
the scenario's own checks, the byte-exact, miss-cause and request checkers over its
window of the history, and its negative control, which must be caught. A failure
prints the command that replays the scenario with the same seed."""

import pytest

from kvgate.harness.scenarios.catalog import load_catalog, on_hosts
from kvgate.harness.scenarios.runner import run_scenario
from kvgate.harness.workload.prompts import Corpus

pytestmark = pytest.mark.live


def _param(sc):
    marks = [getattr(pytest.mark, f"fault_{sc.fault}")] if sc.fault else []
    return pytest.param(sc, id=sc.name, marks=marks)


@pytest.fixture(scope="module")
def corpus(tiny_model):
    return Corpus(tiny_model)


@pytest.mark.parametrize("sc", [_param(sc) for sc in load_catalog() if not on_hosts(sc)])  # hosts: test_cross_host
def test_scenario(cluster, corpus, test_seed, sc, record_property):
    r = run_scenario(cluster, corpus, sc, test_seed)
    record_property("outcome", r.outcome)
    record_property("counts", r.counts)
    if sc.name.startswith("sessions"):
        ttft = r.verdict.evidence.get("parts", [{}])[0].get("evidence", {}).get("ttft_median_ms_cross_turns")
        record_property("ttft_median_ms_cross_turns", ttft)
    assert r.verdict.valid is True, f"{sc.name} ({r.outcome}): {r.verdict.reason}\n  replay: {r.replay}"
    assert r.counts["silent_corruptions"] == 0 and r.counts["lost_requests"] == 0 and r.counts["misclassified"] == 0
    if sc.control is not None:
        assert r.control["caught"], f"negative control {sc.control.name} not caught\n  replay: {r.replay}"
