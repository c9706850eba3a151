"""The scenario catalog (fixtures/scenarios, kvgate.harness.scenarios): every file is valid, every
fault kind has a scenario, every fault scenario but the slow link has a negative
control, and malformed files are refused with a typed error."""

import json

import pytest

from kvgate.faults.schedule import KINDS
from kvgate.harness.scenarios.catalog import Scenario, ScenarioError, find, load_catalog
from kvgate.harness.scenarios.catalog import RUNNERS


def test_the_catalog_loads_and_covers_every_fault_kind():
    catalog = load_catalog()
    assert {sc.fault for sc in catalog if sc.fault} == set(KINDS)
    assert all(sc.runner in RUNNERS for sc in catalog)


def test_every_fault_scenario_has_a_negative_control_but_the_ones_that_say_why_not():
    without = sorted(sc.name for sc in load_catalog() if sc.fault and sc.control is None)
    # transport-slow, hosts-(mooncake-)store-slow: a slow link has no wrong answer to catch, only its bound to keep.
    assert without == ["hosts-mooncake-store-slow", "hosts-store-slow", "transport-slow"]


def test_find_names_the_catalog_when_a_scenario_is_missing():
    with pytest.raises(ScenarioError, match="cross-replica-hit"):
        find("no-such-scenario")


@pytest.mark.parametrize("doc, match", [
    ({"name": "x", "runner": "nope"}, "runner"),
    ({"name": "x", "runner": "partial_hit", "fault": "gremlins"}, "fault"),
    ({"name": "x", "runner": "partial_hit", "replicas": ["Z"]}, "replicas"),
    ({"name": "x", "runner": "cross_host", "replicas": ["A", "H"]}, "mix"),
    ({"name": "x", "runner": "partial_hit", "colour": "red"}, "unknown fields"),
    ({"name": "y", "runner": "partial_hit"}, "file name"),
    ({"name": "x", "runner": "partial_hit", "control": {"name": "c"}}, "must name the oracle"),
    ({"name": "x", "runner": "partial_hit", "control": {"name": "c", "oracle": "vibes"}}, "must name the oracle"),
    ({"name": "x", "runner": "partial_hit", "control": {"name": "c", "oracle": "scenario", "by": 1}}, "unknown"),
])
def test_a_malformed_scenario_file_is_refused(tmp_path, doc, match):
    path = tmp_path / "x.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ScenarioError, match=match):
        Scenario.from_file(path)


def test_every_control_names_its_oracle():
    for sc in load_catalog():
        if sc.control is not None:
            assert sc.control.oracle in ("scenario", "output", "byte-exact", "miss causes", "requests"), sc.name


# -- crediting a negative control (kvgate.harness.scenarios.runner.judge_control) -------------------
def _parts(**false_reasons):  # noqa: ANN003, ANN202
    from kvgate.harness.checkers.verdict import Verdict
    from kvgate.harness.scenarios.catalog import ORACLES

    return [Verdict(False, false_reasons[n.replace(" ", "_").replace("-", "_")])
            if n.replace(" ", "_").replace("-", "_") in false_reasons else Verdict(True, "fine") for n in ORACLES]


def _judge(parts, raised=None, crashed=False, because="differ from every producer's bytes"):  # noqa: ANN001, ANN202
    from kvgate.harness.checkers.verdict import Verdict
    from kvgate.harness.scenarios.catalog import Control
    from kvgate.harness.scenarios.runner import _Run, judge_control

    run = _Run(Verdict(parts[0].valid, parts[0].reason), [], {}, crashed, raised)
    return judge_control(Control("hide_failures", {}, "byte-exact", because), run, parts)


def test_a_control_is_caught_by_the_oracle_it_names_for_its_reason():
    got = _judge(_parts(byte_exact="3 blocks differ from every producer's bytes"))
    assert got["caught"] and got["oracle"] == "byte-exact" and not got["inconclusive"]


def test_a_control_caught_only_by_another_check_is_not_caught():
    got = _judge(_parts(scenario="tokens differ", miss_causes="1 misclassified"))
    assert not got["caught"] and got["by"] == ["scenario", "miss causes"]


def test_a_control_caught_by_its_oracle_for_another_reason_is_not_caught():
    got = _judge(_parts(byte_exact="2 installed blocks had no producer record"))
    assert not got["caught"] and "for its reason" in got["why"]


@pytest.mark.parametrize("raised, crashed", [("AssertionError: timed out after 30s", False), (None, True)])
def test_a_control_run_that_raised_or_crashed_is_inconclusive(raised, crashed):
    got = _judge(_parts(byte_exact="3 blocks differ from every producer's bytes"), raised=raised, crashed=crashed)
    assert not got["caught"] and got["inconclusive"] and "INCONCLUSIVE" in got["why"]
