"""The conformance matrix on live replicas: the connector-agnostic scenarios pass on
kvpool with their controls caught (preemption with its late-store control included) (so they can pass, and their oracles see the defect
each control plants), and on vLLM's ExampleConnector the harness finds what that
connector does not do (it serves KV across cache salts), judges what it does (a
cross-replica hit, control caught) and marks what does not apply to it (a partial hit)
"n/a" with the reason. The lifecycle scenarios (a reset after a weight update, prompt
log-probabilities over a held prefix, an adapter reloaded under its name) pass on kvpool with
their controls caught, one test each.

The replicas are started once per connector configuration (a module fixture runs every scenario
the tests judge in one matrix run, as `kvgate conformance` does), and each test judges its
cells: starting a pool and replicas costs two or three minutes on two cores, a scenario tens of
seconds. A failing cell prints its replay command (one scenario, its seed)."""

import pytest

from kvgate.harness.conformance.gate import run_connector
from kvgate.harness.plugin import derive_seed

# The first test of a configuration runs its whole matrix (the module fixture: replicas started
# once, each scenario with its controls, the armed replicas restarted after each): past the
# suites' 600 s default on two cores.
pytestmark = [pytest.mark.live, pytest.mark.timeout(3600)]

# Every scenario a test below judges on kvpool with its default settings, in one run; the
# lifecycle scenarios last (reset_external loads other weights in place and back).
KVPOOL = ["cross_replica_hit", "partial_hit", "salt_isolation", "load_failure_recompute", "preempt_during_store",
          "exact_boundaries", "same_key_race", "accounting", "prompt_logprobs_warm", "adapter_reload_same_name",
          "reset_external"]
KVPOOL_ASYNC = ["cross_replica_hit", "load_failure_recompute", "shared_blocks_one_fails", "exact_boundaries"]


def _row(tmp_path_factory, kv_seed, name, extra, scenarios):
    key = f"{name}{'-async' if extra else ''}"
    row = run_connector(name, extra, derive_seed(kv_seed, f"suites/conformance:{key}"),
                        tmp_path_factory.mktemp(key), scenarios)
    assert "unavailable" not in row, row["unavailable"]
    return row["cells"]


@pytest.fixture(scope="module")
def kvpool_cells(tmp_path_factory, kv_seed):
    return _row(tmp_path_factory, kv_seed, "kvpool", None, KVPOOL)


@pytest.fixture(scope="module")
def kvpool_async_cells(tmp_path_factory, kv_seed):
    return _row(tmp_path_factory, kv_seed, "kvpool", {"load_mode": "async"}, KVPOOL_ASYNC)


def test_kvpool_passes_the_connector_agnostic_scenarios_and_each_control_is_caught(kvpool_cells):
    scenarios = ["cross_replica_hit", "partial_hit", "salt_isolation", "load_failure_recompute", "preempt_during_store"]
    cells = kvpool_cells
    for name in scenarios:
        assert cells[name]["status"] == "pass", (name, cells[name].get("reason"), cells[name].get("replay"))
    for name in ("cross_replica_hit", "load_failure_recompute", "preempt_during_store"):
        assert cells[name]["control"]["caught"], cells[name]["control"]
    assert cells["preempt_during_store"]["evidence"]["preemptions"] > 0
    assert cells["salt_isolation"]["evidence"]["positive_control_installed"] > 0


def test_kvpool_asynchronous_loads_recover_from_a_failed_load_and_each_control_is_caught(kvpool_async_cells):
    """load_mode async (the default where vLLM schedules asynchronously, as on CUDA): the
    request waits while its load runs, a broken page is reported failed no later than the
    load is reported finished, and the recompute gives A's output to the last bit."""
    scenarios = ["cross_replica_hit", "load_failure_recompute", "shared_blocks_one_fails"]
    cells = kvpool_async_cells
    for name in scenarios:
        assert cells[name]["status"] == "pass", (name, cells[name].get("reason"), cells[name].get("replay"))
    for name in ("cross_replica_hit", "load_failure_recompute"):
        assert cells[name]["control"]["caught"], cells[name]["control"]
    claimed = cells["load_failure_recompute"]["evidence"]["claimed"]
    assert claimed["load_async"] is True and claimed["external_tokens"] > 0, claimed
    assert cells["load_failure_recompute"]["evidence"]["reported_failed"] > 0


def test_example_connector_hit_judged_salt_leak_found_partial_hit_not_applicable(tmp_path, test_seed):
    scenarios = ["cross_replica_hit", "salt_isolation", "partial_hit"]
    cells = run_connector("example", None, test_seed, tmp_path / "example", scenarios)["cells"]
    hit = cells["cross_replica_hit"]
    assert hit["status"] == "pass" and hit["control"]["caught"], hit
    leak = cells["salt_isolation"]
    assert leak["status"] == "fail" and leak["evidence"]["leaked"] > 0, leak
    assert "kvgate gate --connector example --scenario salt_isolation --seed" in leak["replay"]
    na = cells["partial_hit"]
    assert na["status"] == "n/a" and "whole prompt" in na["reason"]


def test_kvpool_exact_boundaries_full_hits_give_the_cold_output_and_claim_one_more_is_caught(kvpool_cells):
    """Prompts of exactly 11 blocks and of exactly the prefill chunk, one token below and one
    above: B's full hit equals A's prefix hit to the last bit and A's cold run in its tokens;
    a connector that claims one token past what it loads at an exact block multiple is
    caught by the output oracle."""
    cells = kvpool_cells
    cell = cells["exact_boundaries"]
    assert cell["status"] == "pass", (cell.get("reason"), cell.get("replay"))
    assert cell["control"]["caught"] and cell["control"]["oracle"] == "output", cell["control"]
    cases = cell["evidence"]["cases"]
    assert set(cases) == {f"{u}{d}" for u in ("block", "prefill_chunk") for d in ("-1", "", "+1")}
    assert all(case["claimed"] > 0 and case["installed"] > 0 for case in cases.values()), cases


def test_kvpool_same_key_race_one_copy_nothing_leaked_and_visible_at_reserve_is_caught(kvpool_cells):
    """A and B publish one prefix at once, their publishes taking turns in the seeded order
    at the pool client: the second's lookup mid-publish finds nothing and its offer is told
    'pending', one byte-exact copy is stored, nothing is left reserved or leased, both
    outputs equal a cold run. A pool whose catalog shows a reserved page at once (the second
    publisher told 'exists' while the page holds nothing) is caught by the visibility check."""
    cells = kvpool_cells
    cell = cells["same_key_race"]
    assert cell["status"] == "pass", (cell.get("reason"), cell.get("replay"))
    controls = {c["name"]: c for c in cell["controls"]}
    assert all(c["caught"] for c in controls.values()), controls
    assert controls["visible_at_reserve"]["why"].startswith("nothing of an open publish is visible"), controls
    assert controls["pending_leak"]["why"].startswith("no reservation, lease or page is left behind"), controls
    ev = cell["evidence"]
    assert ev["witness"]["visible"] == 0 and ev["second_reserve"]["slots"] == {"pending": ev["prompt_blocks"]}, ev
    assert ev["pool_after"]["reserved_pages"] == 0 and ev["pool_after"]["open_reservations"] == 0, ev


def test_kvpool_accounting_conserves_claims_loads_and_vllm_metrics_and_over_reporting_is_caught(kvpool_cells):
    """B's full hit, partial hit, miss and local hit: each claim is covered by exactly its
    byte-exact installed blocks, the claims are vLLM's external hits, the rest is what vLLM
    computed, and kvpool's own load counters count the installed blocks. A connector that
    claims tokens it does not load, and one that counts its loads twice, are each caught by
    the conservation oracle."""
    cells = kvpool_cells
    cell = cells["accounting"]
    assert cell["status"] == "pass", (cell.get("reason"), cell.get("replay"))
    controls = {c["name"]: c for c in cell["controls"]}
    assert set(controls) == {"claim_past_loaded", "double_count_stats"}, controls
    assert all(c["caught"] and c["why"].startswith("conservation") for c in controls.values()), controls
    assert "own stats" in controls["double_count_stats"]["why"], controls
    ev = cell["evidence"]
    assert ev["claimed"] > 0 and ev["own"]["blocks"] == ev["verified_blocks"] > 0, ev
    assert ev["vllm"]["external_hits"] == ev["claimed"], ev


def test_kvpool_asynchronous_loads_at_exact_boundaries_and_the_control_is_caught(kvpool_async_cells):
    """load_mode async: every boundary prompt loads asynchronously (at an exact block multiple
    kvpool leaves the last block to compute, as its synchronous loads do), each full hit equals
    A's prefix hit, and the control's one token past the load is caught."""
    cells = kvpool_async_cells
    cell = cells["exact_boundaries"]
    assert cell["status"] == "pass", (cell.get("reason"), cell.get("replay"))
    assert cell["control"]["caught"], cell["control"]
    assert all(case["load_async"] for case in cell["evidence"]["cases"].values()), cell["evidence"]["cases"]


def test_kvpool_reset_external_drops_what_was_published_before_it_and_a_deaf_reset_is_caught(kvpool_cells):
    """reset_external: after a weight update (r2 loaded in place on A and B) and A's
    POST /reset_prefix_cache?reset_external=true, neither replica hits KV published before
    the reset and each output is its cold run's on r2; the positive control shares after
    it; a connector whose reset answers None (deaf_reset) is caught by the output."""
    cell = kvpool_cells["reset_external"]
    assert cell["status"] == "pass", (cell.get("reason"), cell.get("evidence"), cell.get("replay"))
    assert cell["control"]["caught"], cell["control"]
    ev = cell["evidence"]
    assert ev["reset"]["success"] and ev["positive_control_installed"] > 0, ev
    assert all(s["claimed_tokens"] == 0 and s["installed"] == 0 for s in ev["after_reset"].values()), ev


def test_kvpool_prompt_logprobs_over_a_held_prefix_are_full_and_a_connector_that_loads_anyway_is_caught(
        kvpool_cells):
    """prompt_logprobs_warm: B asked for prompt_logprobs over a prompt A stored gets the full
    list, equal to its cold run's, and kvpool claims nothing for it (skip_reading_prefix_cache);
    the load_despite_skip control (the flag cleared, as on a vLLM before #57269) is caught by
    the list's length."""
    cell = kvpool_cells["prompt_logprobs_warm"]
    assert cell["status"] == "pass", (cell.get("reason"), cell.get("evidence"), cell.get("replay"))
    assert cell["control"]["caught"], cell["control"]
    ev = cell["evidence"]
    assert ev["claimed"]["external_tokens"] == 0 and ev["installed"] == 0 and ev["producer_blocks"] > 0, ev
    assert ev["warm_computed"] == ev["prompt_tokens"] - 1, ev


def test_kvpool_keys_an_adapter_by_its_content_and_a_connector_keyed_by_name_is_caught(kvpool_cells):
    """adapter_reload_same_name: an adapter folder rewritten with other weights and loaded
    again under the same name (on another replica, then in place) hits nothing of the
    previous weights, F's output is its cold run's, the same weights share across replicas;
    a connector that sees adapters by name alone (adapter_by_name) is caught by the output."""
    cell = kvpool_cells["adapter_reload_same_name"]
    assert cell["status"] == "pass", (cell.get("reason"), cell.get("evidence"), cell.get("replay"))
    assert cell["control"]["caught"], cell["control"]
    assert cell["evidence"]["positive_control_installed"] > 0, cell["evidence"]
