"""Live, across hosts: the catalog's multi-host scenarios (fixtures/scenarios/hosts-*) on
hosts made of network namespaces (kvgate.harness.system.hosts: replica G on h1 with h1's pool
daemon, replica H on h2 with its own, Redis, then Mooncake's master and a storage node, on a
store host), judged exactly as the gate
judges them (kvgate.harness.scenarios.runner): the scenario's checks (outputs unchanged, the
failing tier held off, served again once healed), the byte-exact, miss-cause and request
oracles, and the negative control, which must be caught. This module runs before the
default system's live suites start theirs, and stops its hosts when it is done."""

import pytest

from kvgate.harness.scenarios.catalog import load_catalog, on_hosts, store_of
from kvgate.harness.scenarios.runner import run_scenario
from kvgate.harness.system.netns import netns_unavailable
from kvgate.harness.system.stores import mooncake_binary, redis_binary
from kvgate.harness.workload.prompts import Corpus

_why_not = netns_unavailable() or (None if redis_binary() else "redis-server is not installed (make servers)")
pytestmark = [pytest.mark.live, pytest.mark.skipif(_why_not is not None, reason=f"no hosts here: {_why_not}")]


@pytest.fixture(scope="module")
def hosts(live_report_dir):
    """One hosts system at a time, for the store the scenario runs on (the scenarios come
    ordered by store: each system is started once)."""
    from kvgate.harness.system.default import start_hosts_system

    running: dict[str, object] = {}

    def system_for(store: str):  # noqa: ANN202
        if store not in running:
            for other in list(running):
                running.pop(other).stop()
            running[store] = start_hosts_system(live_report_dir, store)[0]
        return running[store]

    try:
        yield system_for
    finally:
        for system in running.values():
            system.stop()


_SCENARIOS = sorted((sc for sc in load_catalog() if on_hosts(sc)), key=lambda sc: (store_of(sc), sc.name))
_mooncake = None if mooncake_binary() else "the mooncake package is not installed"


@pytest.mark.parametrize("sc", [pytest.param(sc, id=sc.name, marks=(
    [getattr(pytest.mark, f"fault_{sc.fault}")] if sc.fault else [])
    + ([pytest.mark.skip(reason=_mooncake)] if _mooncake and store_of(sc) == "mooncake" else []))
    for sc in _SCENARIOS])
def test_scenario_across_hosts(hosts, test_seed, sc, record_property):
    system = hosts(store_of(sc))
    r = run_scenario(system, Corpus(system.model_dir), sc, test_seed)
    record_property("outcome", r.outcome)
    record_property("evidence", r.verdict.evidence.get("parts", [{}])[0].get("evidence"))
    assert r.verdict.valid is True, f"{sc.name} ({r.outcome}): {r.verdict.reason}\n  replay: {r.replay}"
    assert r.counts["silent_corruptions"] == 0 and r.counts["lost_requests"] == 0 and r.counts["misclassified"] == 0
    if sc.control is not None:  # the slow-link scenarios have none: a slow link has no wrong answer to catch
        assert r.control["caught"], f"negative control {sc.control.name} not caught: {r.control}\n  replay: {r.replay}"
