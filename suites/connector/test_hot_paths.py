"""The connector's hooks on vLLM's hot paths hold the engine only within their bounds while
the pool is stalled (its daemon stopped: connections accepted, nothing answered), measured
by kvgate.harness.bench.stall with short settings. The control is the same scheduler waiting in
the call for each lookup's answer: it holds the engine for the lookup's whole timeout at
every new request, which the check must see.

The margins are wide (the bounds here are 0.1-0.6 s; the control's calls take at least
its 0.3 s timeout, and the pre-change scheduler took 10 s and a resend): what is checked
is which side of its bound each hook falls on, not how fast it is."""

from __future__ import annotations

import pytest

from kvgate.harness.bench.stall import run_stall

SETTINGS = {"timeout_s": 1.0, "load_deadline_s": 0.5, "lookup_timeout_s": 0.3, "lookup_sync_s": 0.1,
            "lookup_poll_s": 0.005, "lookup_wait_pending_s": 0.2, "pool_backoff_s": 5.0}
MARGIN_S = 0.5


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_stall(SETTINGS, requests=4, root=tmp_path_factory.mktemp("stall"))


def test_a_stalled_pool_holds_the_scheduler_only_within_its_bound(measured):
    stalled = measured["phases"]["stalled"]
    lookups = stalled["get_num_new_matched_tokens"]
    assert lookups["worst_call_s"] <= SETTINGS["lookup_sync_s"] + MARGIN_S, lookups
    assert lookups["hit_blocks"] == [0, 0, 0, 0], lookups  # recompute, although the first prompt is pooled
    # The first request pays the lookup's timeout (with its pending wait); the ones after it
    # are not sent to the pool while it is paused after the timeout.
    assert lookups["request_waited_s"][0] >= SETTINGS["lookup_timeout_s"], lookups
    assert max(lookups["request_waited_s"][1:]) <= MARGIN_S, lookups
    assert measured["phases"]["recovered"]["get_num_new_matched_tokens"]["hit_blocks"] == [6]


def test_control_a_scheduler_that_waits_for_its_lookups_is_caught(measured):
    blocking = measured["phases"]["stalled"]["blocking baseline: get_num_new_matched_tokens"]
    assert blocking["worst_call_s"] >= SETTINGS["lookup_timeout_s"], \
        f"negative control NOT caught: a blocking lookup held the engine only {blocking['worst_call_s']} s"
    assert measured["ratio_worst_call_vs_blocking"] < 1


def test_worker_hooks_under_a_stalled_pool(measured):
    stalled = measured["phases"]["stalled"]
    load = stalled["load (start_load_kv + wait_for_layer_load)"]
    assert load["worst_call_s"] <= SETTINGS["load_deadline_s"] + MARGIN_S, load  # the load's deadline bounds it
    assert stalled["blocks_failed"] == 4  # the load failed: its blocks are recomputed
    finished = stalled["get_finished"]
    assert finished["worst_call_s"] <= MARGIN_S and finished["calls"] > 1, finished  # never waits: asked again
    assert finished["reported_after_s"] < 60, finished  # and the request is reported (its blocks freed)
    assert stalled["wait_for_save"]["worst_call_s"] <= MARGIN_S
    # The one hook that waits on the pool by design: a preempted request's store must have
    # read its blocks before the next forward writes them; the client's timeout bounds it.
    drain = stalled["preempted drain (start_load_kv)"]
    assert drain["worst_call_s"] <= 2 * SETTINGS["timeout_s"] + MARGIN_S, drain
