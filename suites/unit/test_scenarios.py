"""The scenario catalog (fixtures/scenarios, harness.scenarios): every file is valid, every
fault kind has a scenario, every fault scenario but the slow link has a negative
control, and malformed files are refused with a typed error."""

import json

import pytest

from faults.schedule import KINDS
from harness.scenarios.catalog import Scenario, ScenarioError, find, load_catalog
from harness.scenarios.live import RUNNERS


def test_the_catalog_loads_and_covers_every_fault_kind():
    catalog = load_catalog()
    assert {sc.fault for sc in catalog if sc.fault} == set(KINDS)
    assert all(sc.runner in RUNNERS for sc in catalog)


def test_every_fault_scenario_has_a_negative_control_but_the_ones_that_say_why_not():
    without = sorted(sc.name for sc in load_catalog() if sc.fault and sc.control is None)
    # transport-slow: a slow link has no wrong answer to catch, only its bound to keep.
    assert without == ["transport-slow"]


def test_find_names_the_catalog_when_a_scenario_is_missing():
    with pytest.raises(ScenarioError, match="cross-replica-hit"):
        find("no-such-scenario")


@pytest.mark.parametrize("doc, match", [
    ({"name": "x", "runner": "nope"}, "runner"),
    ({"name": "x", "runner": "partial_hit", "fault": "gremlins"}, "fault"),
    ({"name": "x", "runner": "partial_hit", "replicas": ["Z"]}, "replicas"),
    ({"name": "x", "runner": "partial_hit", "colour": "red"}, "unknown fields"),
    ({"name": "y", "runner": "partial_hit"}, "file name"),
])
def test_a_malformed_scenario_file_is_refused(tmp_path, doc, match):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ScenarioError, match=match):
        Scenario.from_file(path)
