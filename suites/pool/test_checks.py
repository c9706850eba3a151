"""Miss-cause probes and crash recovery, as the gate runs them."""

from harness.scenarios.pool import crash_and_restart, miss_causes
from kvpool.errors import MissCause


def test_every_miss_cause_is_reported_as_itself(test_seed):
    verdict = miss_causes(test_seed)
    assert verdict.valid is True, verdict
    assert set(verdict.evidence["observed"]) == {c.value for c in MissCause}


def test_crash_and_restart(test_seed):
    verdict = crash_and_restart(test_seed)
    assert verdict.valid is True, verdict
