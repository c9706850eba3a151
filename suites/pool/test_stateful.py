"""The pool daemon against the reference model, step by step (kvpool.testing).

Seeded from --kv-seed (per test), so a failure replays. CI runs a bounded number of
examples; `--slow` runs many more, with longer programs.
"""

import pytest

from harness.scenarios.pool import state_machine


def test_pool_agrees_with_the_model(test_seed):
    verdict = state_machine(test_seed, examples=25, steps=30)
    assert verdict.valid is True, verdict


@pytest.mark.slow
def test_pool_agrees_with_the_model_deep(test_seed):
    verdict = state_machine(test_seed, examples=400, steps=80)
    assert verdict.valid is True, verdict


@pytest.mark.parametrize("control", ["forgetful", "leaseless", "leaky", "crossed"])
def test_the_machine_catches_each_known_bad_catalog(control, test_seed):
    """Negative controls: a state machine that passes a broken pool proves nothing."""
    from faults.controls import CATALOG_CONTROLS

    verdict = state_machine(test_seed, examples=400, steps=50, catalog_factory=CATALOG_CONTROLS[control], shrink=False)
    assert verdict.valid is False, f"the {control} control was not caught"
