"""The pool daemon against the reference model, step by step (kvgate.harness.scenarios.pool_machine).

Seeded from --kv-seed (per test), so a failure replays. CI runs a bounded number of
examples; `--kv-slow` runs many more, with longer programs.
"""

import pytest

from kvgate.harness.scenarios.pool import state_machine


def test_pool_agrees_with_the_model(test_seed):
    verdict = state_machine(test_seed, examples=25, steps=30)
    assert verdict.valid is True, verdict


@pytest.mark.slow
def test_pool_agrees_with_the_model_deep(test_seed):
    verdict = state_machine(test_seed, examples=400, steps=80)
    assert verdict.valid is True, verdict


@pytest.mark.parametrize("control", ["forgetful", "leaseless", "leaky", "crossed"])
def test_the_machine_catches_each_known_bad_catalog_by_the_behaviour_it_breaks(control, test_seed):
    """Negative controls: a state machine that passes a broken pool proves nothing. Each is
    judged only by the kind of finding it exists to show (kvgate.faults.controls.CATALOG_BREAKS);
    the accounting invariant, which would trip first, does not end the run."""
    from kvgate.faults.controls import CATALOG_BREAKS, CATALOG_CONTROLS
    from kvgate.harness.scenarios.pool import CONTROL_BUDGET

    kind = CATALOG_BREAKS[control]
    verdict = state_machine(test_seed, examples=CONTROL_BUDGET, steps=50, catalog_factory=CATALOG_CONTROLS[control],
                            shrink=False, judged=frozenset({kind}))
    assert verdict.valid is False, f"the {control} control was not caught in {CONTROL_BUDGET} programs"
    assert verdict.evidence["finding"] == kind, verdict.reason


@pytest.mark.parametrize("kind", ["miss_cause", "lease", "capacity", "bytes"])
def test_a_healthy_pool_passes_when_judged_by_one_kind_of_finding(kind, test_seed):
    """The positive side of those controls: judged by the same kind alone, the real catalog passes."""
    verdict = state_machine(test_seed, examples=25, steps=50, judged=frozenset({kind}))
    assert verdict.valid is True, verdict
