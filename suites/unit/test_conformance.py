"""The conformance matrix's bookkeeping, without a live system: a scenario that needs what
a connector lacks is "n/a" with the connector's own reason (never a pass), a scenario not
in the catalog yet is "not run", a connector that cannot run here gives every cell "n/a"
with why, and the matrix names every failing cell's finding and replay command."""

import dataclasses
import json

from harness.conformance.connectors import CONNECTORS, profile
from harness.conformance.gate import STATUSES, run_cell, run_connector, write_matrix
from harness.conformance.scenarios import SCENARIOS, Ctx


def test_a_missing_capability_is_not_applicable_with_the_connectors_reason():
    ctx = Ctx(cluster=None, corpus=None, profile=CONNECTORS["example"], seed=0)
    cell = run_cell(ctx, SCENARIOS["partial_hit"], root=7)
    assert cell["status"] == "n/a"
    assert "whole prompt" in cell["reason"]
    assert cell["replay"] == "kvgate gate --connector example --scenario partial_hit --seed 7"


def test_a_scenario_not_in_the_catalog_yet_is_not_run_never_a_pass():
    ctx = Ctx(cluster=None, corpus=None, profile=CONNECTORS["kvpool"], seed=0)
    later = dataclasses.replace(SCENARIOS["cross_replica_hit"], body=None, not_run="not in the catalog yet")
    cell = run_cell(ctx, later, root=7)
    assert cell["status"] == "not run" and cell["reason"]


def test_an_unavailable_connector_gets_n_a_everywhere_and_starts_nothing(tmp_path):
    row = run_connector("no_such_module_kvgate:Connector", None, 3, tmp_path / "x")
    assert {c["status"] for c in row["cells"].values()} == {"n/a"}
    assert all("cannot import" in c["reason"] for c in row["cells"].values())
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_every_profile_declares_every_capability_the_scenarios_need():
    needed = {n for sc in SCENARIOS.values() for n in sc.needs}
    for name, prof in CONNECTORS.items():
        assert needed <= set(prof.capabilities), (name, needed - set(prof.capabilities))
    assert profile("pkg.mod:Cls", {"a": 1}).settings(None) == {"a": 1}


def test_the_matrix_reports_each_failing_cell_with_its_evidence_and_replay(tmp_path):
    cell = {"scenario": "salt_isolation", "describe": "d", "status": "fail", "reason": "B installed 9 blocks",
            "evidence": {"leaked": 9}, "replay": "kvgate gate --connector example --scenario salt_isolation --seed 1"}
    rows = [{"connector": "example", "versions": {"vllm": "0.32"}, "cells": {"salt_isolation": cell}}]
    paths = write_matrix(rows, tmp_path, 1)
    md = paths["markdown"].read_text()
    assert "**FAIL**" in md and "B installed 9 blocks" in md and cell["replay"] in md and '"leaked": 9' in md
    doc = json.loads(paths["json"].read_text())
    assert doc["rows"][0]["cells"]["salt_isolation"]["status"] in STATUSES
