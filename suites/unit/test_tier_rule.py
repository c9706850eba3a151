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


def test_a_load_stat_crosses_the_stats_channel_as_a_list_and_back():
    """The worker sends TierLoadStat.as_list() through vLLM's connector stats; the scheduler
    rebuilds it with .of(): counts as ints, seconds as a float rounded to the microsecond."""
    stat = TierLoadStat(5, 3, 0.12345678, "timeout")
    assert stat.as_list() == [5, 3, 0.123457, "timeout"]
    assert TierLoadStat.of(stat.as_list()) == TierLoadStat(5, 3, 0.123457, "timeout")
    back = TierLoadStat.of(["4", 4.0, "2", None])  # what a JSON round trip may hand back
    assert back == TierLoadStat(4, 4, 2.0, None)
    assert type(back.wanted) is int and type(back.loaded) is int and type(back.seconds) is float


def test_a_hold_says_how_long_it_has_left():
    rule = TierRule(deadline_s=1.0, backoff_s=2.0)
    rule.fail(10.0, "TierUnavailable: refused")
    assert rule.allow_lookup(10.5) == "held off 1.50 s more: TierUnavailable: refused"
    assert rule.claim(4, 11.0) == (0, "held off 1.00 s more: TierUnavailable: refused")


def test_a_load_that_moved_nothing_or_took_no_time_measures_no_rate():
    rule = TierRule(deadline_s=1.0)
    rule.observe(TierLoadStat(5, 0, 1.0, None), 0.0)  # nothing loaded, nothing failed: no rate
    assert rule.rate is None and rule.allow_lookup(0.0) is None and rule.claim(5, 0.0) == (5, None)
    rule.observe(TierLoadStat(5, 5, 0.0, None), 0.0)  # no time measured: no rate either
    assert rule.rate is None and rule.claim(5, 0.0) == (5, None)


def test_the_rate_is_an_exponentially_weighted_mean_of_the_loads():
    rule = TierRule(deadline_s=1.0)  # weight 0.3 by default
    rule.observe(TierLoadStat(5, 5, 0.5, None), 0.0)  # 10 blocks/s, under a second too
    assert rule.rate == pytest.approx(10.0) and rule.claim(40, 0.0) == (10, "rate 10.0 blocks/s x deadline 1.0 s")
    rule.observe(TierLoadStat(20, 20, 1.0, None), 1.0)  # 20 blocks/s: 0.7 x 10 + 0.3 x 20
    assert rule.rate == pytest.approx(13.0) and rule.claim(40, 1.0)[0] == 13


def test_forget_drops_the_probe_that_follows_even_a_hold_of_no_time():
    rule = TierRule(deadline_s=1.0, backoff_s=0.0)
    rule.fail(0.0, "TierUnavailable: refused")  # held until 0.0: over at once, a probe due
    assert rule.claim(3, 0.0) == (1, "probe after a hold")
    assert rule.forget() == "TierUnavailable: refused"
    assert rule.claim(3, 0.0) == (3, None)


def test_a_claim_of_no_block_is_none_and_starts_no_probe():
    rule = TierRule(deadline_s=1.0, backoff_s=1.0)
    assert rule.claim(0, 0.0) == (0, None) and rule.claim(1, 0.0) == (1, None)
    rule.fail(0.0, "TierUnavailable: refused")
    assert rule.claim(0, 0.5) == (0, None)  # held, but nothing was asked for
    assert rule.claim(0, 2.0) == (0, None)  # the hold is over: still no probe for no block
    assert rule.claim(1, 2.0) == (1, None)  # a probe of the one block asked for: no limit applied
    rule.observe(TierLoadStat(1, 1, 0.1, None), 2.1)
    assert rule.claim(2, 2.2) == (2, None)


def test_a_hold_ends_at_its_instant():
    rule = TierRule(deadline_s=1.0, backoff_s=2.0)
    rule.fail(1.0, "TierUnavailable: refused")
    assert rule.allow_lookup(2.99) is not None and rule.allow_lookup(3.0) is None
    assert rule.claim(4, 3.0) == (1, "probe after a hold")


def test_a_probe_unanswered_for_twice_the_deadline_is_replaced():
    rule = TierRule(deadline_s=0.5, backoff_s=1.0)
    rule.fail(0.0, "TierUnavailable: refused")
    assert rule.claim(4, 1.0) == (1, "probe after a hold")
    assert rule.claim(4, 1.9) == (0, "a probe of the tier is in flight")
    assert rule.claim(4, 2.0) == (1, "probe after a hold")  # 2 x 0.5 s later: given up, probed again


def test_a_claim_the_rate_covers_exactly_is_whole():
    rule = TierRule(deadline_s=1.0)
    rule.observe(TierLoadStat(10, 10, 1.0, None), 0.0)
    assert rule.claim(10, 0.0) == (10, None) and rule.claim(11, 0.0) == (10, "rate 10.0 blocks/s x deadline 1.0 s")


def test_each_hold_says_what_caused_it():
    rule = TierRule(deadline_s=0.2, backoff_s=1.0)
    rule.observe(TierLoadStat(3, 1, 1.5, "timeout"), 0.0)
    assert rule.allow_lookup(0.0) == "held off 1.00 s more: a tier load ended on timeout after 1.50 s"
    slow = TierRule(deadline_s=0.2, backoff_s=1.0)
    slow.observe(TierLoadStat(2, 2, 20.0, None), 0.0)  # 0.1 blocks/s
    assert slow.allow_lookup(0.0) == "held off 1.00 s more: rate 0.10 blocks/s fills no block within 0.2 s"


@pytest.mark.parametrize("rate, deadline_s, held", [(4.0, 0.2, True), (2.0, 0.5, False), (3.0, 0.5, False)])
def test_a_tier_is_held_off_exactly_when_its_rate_fills_less_than_one_block_in_the_deadline(rate, deadline_s, held):
    rule = TierRule(deadline_s=deadline_s)
    rule.observe(TierLoadStat(int(rate), int(rate), 1.0, None), 0.0)
    assert (rule.allow_lookup(0.0) is not None) is held


def test_a_probe_that_loaded_nothing_keeps_the_tier_on_probation():
    rule = TierRule(deadline_s=1.0, backoff_s=1.0)
    rule.fail(0.0, "TierUnavailable: refused")
    assert rule.claim(5, 1.0) == (1, "probe after a hold")
    rule.observe(TierLoadStat(1, 0, 0.0, None), 1.1)  # nothing loaded, nothing failed: no verdict
    assert rule.claim(5, 1.2) == (1, "probe after a hold")


def test_the_default_hold_is_a_second_doubling_up_to_thirty():
    rule = TierRule(deadline_s=1.0)
    holds = []
    for k in range(7):
        now = 100.0 * k
        rule.fail(now, "TierUnavailable: refused")
        holds.append(rule.held_until - now)
    assert holds == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_probe_names_its_limit_whenever_more_than_one_block_was_asked_for():
    rule = TierRule(deadline_s=1.0, backoff_s=1.0)
    rule.fail(0.0, "TierUnavailable: refused")
    assert rule.claim(2, 1.0) == (1, "probe after a hold")
