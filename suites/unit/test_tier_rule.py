"""kvpool.tier.rule: the scheduler reads from the network tier only what arrives before its
deadline, holds a failing or too slow tier off (backing off while it keeps failing), then
measures it again with one block at a time before trusting it with more."""

from __future__ import annotations

import pytest

from kvpool.tier.rule import TierLoadStat, TierRule


def test_nothing_measured_claims_all_then_the_rate_times_the_deadline_caps_it():
    rule = TierRule(deadline_s=0.5)
    assert rule.claim(40, 0.0) == (40, None)
    rule.observe(TierLoadStat(40, 40, 2.0, None), 0.0)  # 20 blocks/s: 10 within the deadline
    n, why = rule.claim(40, 1.0)
    assert n == 10 and "deadline" in why
    assert rule.claim(6, 1.0) == (6, None)


@pytest.mark.parametrize("cause", ["timeout", "transport_error"])
def test_a_failed_load_holds_the_tier_off_then_one_probe_measures_it_again(cause):
    rule = TierRule(deadline_s=1.0, backoff_s=2.0, backoff_max_s=5.0)
    rule.observe(TierLoadStat(10, 3, 1.0, cause), 0.0)
    assert rule.claim(10, 1.0)[0] == 0 and rule.allow_lookup(1.0) is not None
    assert rule.allow_lookup(2.5) is None
    assert rule.claim(10, 2.5) == (1, "probe after a hold")
    assert rule.claim(10, 2.6) == (0, "a probe of the tier is in flight")  # one probe at a time
    rule.observe(TierLoadStat(1, 0, 1.0, "timeout"), 3.0)  # still failing: the hold doubles
    assert rule.allow_lookup(3.0 + 3.9) is not None and rule.allow_lookup(3.0 + 4.1) is None
    rule.observe(TierLoadStat(1, 1, 0.01, None), 8.0)  # healthy again: trusted, the backoff reset
    assert rule.claim(10, 8.0)[0] == 10
    rule.observe(TierLoadStat(10, 0, 0.0, "transport_error"), 9.0)
    assert rule.allow_lookup(9.0 + 1.9) is not None and rule.allow_lookup(9.0 + 2.1) is None


def test_a_rate_that_fills_no_block_within_the_deadline_is_held_off():
    rule = TierRule(deadline_s=0.2)
    rule.observe(TierLoadStat(2, 2, 20.0, None), 0.0)  # 0.1 blocks/s
    assert rule.claim(5, 0.5)[0] == 0


def test_a_failed_lookup_holds_the_tier_off_and_says_why():
    rule = TierRule(deadline_s=1.0, backoff_s=1.0)
    rule.fail(0.0, "TierUnavailable: refused")
    assert "refused" in rule.allow_lookup(0.5)
    assert rule.allow_lookup(1.5) is None


def test_a_deadline_must_be_positive():
    with pytest.raises(ValueError, match="tier_deadline_s"):
        TierRule(deadline_s=0)


def test_forget_drops_a_hold_and_says_why():
    rule = TierRule(deadline_s=1.0, backoff_s=5.0)
    assert rule.forget() is None
    rule.fail(0.0, "TierUnavailable: refused")
    assert rule.allow_lookup(1.0) is not None
    assert "refused" in rule.forget()
    assert rule.allow_lookup(1.0) is None and rule.claim(3, 1.0)[0] == 3 and rule.forget() is None
