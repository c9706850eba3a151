"""Hosts as network namespaces (harness.system.hosts): replica G on host h1 with h1's pool
daemon, replica H on host h2 with its own, and Redis on a third host, the network tier of
both; every byte between hosts crosses a veth link the nemesis can slow, cut or kill the
far end of.

- healthy: H, whose pool has none of G's prompt, loads every block from the store host
  byte for byte as G computed them, and gives G's own prefix hit's tokens and
  log-probabilities;
- the storage node degraded (its link at 256 kbit/s: one page takes longer than the tier's
  timeout, so reading is slower than recomputing): H's load fails on its deadline, the
  blocks are recomputed with the cold run's tokens and log-probabilities (the same
  partition), and the next request does not ask the tier at all (held off);
- the storage node killed: a lookup is no tier hit (transport error) and H recomputes;
  restarted empty, then healed: G publishes again and H hits again, byte-exact;
- the storage host partitioned away: the lookup waits the tier's timeout once, then the
  tier is held off; nothing hangs.
Times to first token under each fault are measured by `kvgate bench hosts`, not here.""" 

from __future__ import annotations

import random
import time

import pytest

from fixtures.tiny_model import build_tiny_model
from harness.checkers.history import audit_digests, records
from harness.client import http
from harness.client.http import complete
from harness.scenarios.nemesis import wait_for
from harness.system.netns import netns_unavailable
from harness.system.stores import redis_binary
from harness.workload.prompts import Corpus

_why_not = netns_unavailable() or (None if redis_binary() else "redis-server is not installed (make test installs it)")
pytestmark = [pytest.mark.live, pytest.mark.skipif(_why_not is not None, reason=str(_why_not))]
B = 128
PROMPT_TOKENS = 11 * B + 60
SETTINGS = {"tier_timeout_s": 0.5, "tier_deadline_s": 0.5, "tier_backoff_s": 3.0, "tier_backoff_max_s": 3.0}


@pytest.fixture(scope="module")
def hosts(live_report_dir):
    from harness.system.hosts import MultiHost

    root = live_report_dir / "hosts"
    model = build_tiny_model(root / "tiny", seed=0, revision="r1")
    recorder = http.RECORDER
    system = MultiHost(model, root, {"h1": ["G"], "h2": ["H"]}, settings=SETTINGS)
    try:
        system.start()
        yield system
    finally:
        http.RECORDER = recorder
        system.stop()


@pytest.fixture
def fresh(hosts, test_seed):
    """Links healed, pools, store and prefix caches emptied, and H's tier rule trusting the
    tier again: an earlier test's hold has expired, and a warm-up load has passed its probe."""
    hosts.reset()
    time.sleep(SETTINGS["tier_backoff_max_s"] + 0.2)
    warm = _prompt(hosts, test_seed, "warm-up")
    _publish_on_g(hosts, warm, "warm-g")
    for i in range(2):  # a probe of one block if a hold preceded, then a load of them all
        complete(hosts.url("H"), warm, tag=f"warm-h{i}", replica="H", max_tokens=1, publish=False)
        hosts.reset()
        _publish_on_g(hosts, warm, f"warm-g{i}")
    hosts.reset()
    return hosts


def _prompt(hosts, seed: int, salt: str) -> str:  # noqa: ANN001
    return Corpus(hosts.model_dir).text(PROMPT_TOKENS, random.Random(f"{seed}-{salt}"))


def _publish_on_g(hosts, prompt: str, tag: str) -> None:  # noqa: ANN001
    complete(hosts.url("G"), prompt, tag=tag, replica="G", max_tokens=8)
    wait_for(lambda: any(r.get("put") for r in records(hosts.history_dir, "tier_publish", tag=tag)),
             30, "G's blocks in the tier")


def _lookup(hosts, tag: str) -> dict:  # noqa: ANN001
    (found,) = records(hosts.history_dir, "lookup", tag=tag, replica="H")
    return found


def test_healthy_a_replica_on_another_host_loads_the_prompt_from_the_store_host_byte_exact(fresh, test_seed):
    hosts = fresh
    prompt, tag = _prompt(hosts, test_seed, "ok"), f"xh{test_seed % 10**8}"
    _publish_on_g(hosts, prompt, f"{tag}-g")
    h = complete(hosts.url("H"), prompt, tag=f"{tag}-h", replica="H", max_tokens=8)
    g_hit = complete(hosts.url("G"), prompt, tag=f"{tag}-ghit", replica="G", max_tokens=8)
    lookup = _lookup(hosts, f"{tag}-h")
    assert (lookup["hit_blocks"], lookup["tier_blocks"]) == (0, PROMPT_TOKENS // B)  # h2's pool: nothing
    produced = audit_digests(hosts.history_dir, "produced", f"{tag}-g", "G")
    installed = audit_digests(hosts.history_dir, "installed", f"{tag}-h", "H")
    assert len(installed) == PROMPT_TOKENS // B
    assert all(produced.get(k) == d for k, d in installed.items()), "H installed other bytes than G computed"
    assert h.error is None and h.token_ids == g_hit.token_ids and h.logprobs == g_hit.logprobs, (h.ttft_s,)


@pytest.mark.parametrize("control", [False, True], ids=["rule", "control-deaf-tier-rule"])
def test_degraded_storage_node_the_replica_recomputes_instead_of_waiting(fresh, test_seed, control):
    """Negative control `deaf_tier_rule`: the scheduler never hears of the timed-out load,
    and the next request is sent to the degraded node again: the held-off check must fail."""
    hosts = fresh
    if control:
        hosts.arm("H", "connector", {"control": "deaf_tier_rule"})
    first, second = _prompt(hosts, test_seed, "d1"), _prompt(hosts, test_seed, "d2")
    tag = f"xd{test_seed % 10**8}"
    for i, p in enumerate((first, second)):
        _publish_on_g(hosts, p, f"{tag}-g{i}")
    cold = [complete(hosts.url("H"), p, tag=f"{tag}-cold{i}", replica="H", max_tokens=8, load=False, publish=False,
                     cache_salt=f"cold-{tag}") for i, p in enumerate((first, second))]
    hosts.slow("store", "256kbit")  # one 128 KiB page: about 4 s, past the tier's 0.5 s timeout
    try:
        h1 = complete(hosts.url("H"), first, tag=f"{tag}-h1", replica="H", max_tokens=8, publish=False)
        h2 = complete(hosts.url("H"), second, tag=f"{tag}-h2", replica="H", max_tokens=8, publish=False)
    finally:
        hosts.heal("store")
    (load,) = records(hosts.history_dir, "tier_load", tag=f"{tag}-h1", replica="H")
    assert load["loaded"] == 0 and load["miss_cause"] in ("transport_error", "timeout"), load
    held = "tier_held" in _lookup(hosts, f"{tag}-h2") and _lookup(hosts, f"{tag}-h2")["tier_blocks"] == 0
    if control:
        assert any(r.get("control") == "deaf_tier_rule" for r in records(hosts.history_dir, "fault", replica="H"))
        assert not held, "negative control not caught: the second request was held off the degraded tier"
        return
    assert held
    # Reading the 11 pages at this rate would take about 45 s: the load gave up on its first.
    assert load["seconds"] < 5.0, load
    for got, ref in ((h1, cold[0]), (h2, cold[1])):  # all recomputed: the cold run's partition
        assert got.error is None and got.token_ids == ref.token_ids and got.logprobs == ref.logprobs


def test_storage_node_killed_then_restarted_empty_then_the_tier_serves_again(fresh, test_seed):
    hosts = fresh
    prompt, tag = _prompt(hosts, test_seed, "k"), f"xk{test_seed % 10**8}"
    _publish_on_g(hosts, prompt, f"{tag}-g")
    cold = complete(hosts.url("H"), prompt, tag=f"{tag}-cold", replica="H", max_tokens=8, load=False, publish=False,
                    cache_salt=f"cold-{tag}")
    hosts.kill_store()
    dead = complete(hosts.url("H"), prompt, tag=f"{tag}-dead", replica="H", max_tokens=8, publish=False)
    assert _lookup(hosts, f"{tag}-dead")["tier_error"].startswith("TierUnavailable")
    assert dead.error is None and dead.token_ids == cold.token_ids and dead.logprobs == cold.logprobs
    hosts.restart_store()
    # The restarted node is empty, and what h1's pool still holds is never published again:
    # G computes the prompt anew (its pool and prefix cache emptied) and stores it again.
    hosts.reset()
    time.sleep(SETTINGS["tier_backoff_max_s"] + 0.2)
    _publish_on_g(hosts, prompt, f"{tag}-g2")
    back = complete(hosts.url("H"), prompt, tag=f"{tag}-back", replica="H", max_tokens=8, publish=False)
    assert _lookup(hosts, f"{tag}-back")["tier_blocks"] >= 1  # a probe first, after the hold
    assert back.error is None and back.token_ids == cold.token_ids


def test_storage_host_partitioned_away_costs_one_timeout_then_nothing(fresh, test_seed):
    hosts = fresh
    first, second = _prompt(hosts, test_seed, "p1"), _prompt(hosts, test_seed, "p2")
    tag = f"xp{test_seed % 10**8}"
    for i, p in enumerate((first, second)):
        _publish_on_g(hosts, p, f"{tag}-g{i}")
    hosts.partition("store")
    try:
        p1 = complete(hosts.url("H"), first, tag=f"{tag}-h1", replica="H", max_tokens=8, publish=False)
        p2 = complete(hosts.url("H"), second, tag=f"{tag}-h2", replica="H", max_tokens=8, publish=False)
    finally:
        hosts.heal("store")
    assert _lookup(hosts, f"{tag}-h1")["tier_error"].startswith("TierUnavailable")
    assert "tier_held" in _lookup(hosts, f"{tag}-h2")
    assert p1.error is None and p2.error is None and len(p1.token_ids) == len(p2.token_ids) == 8
    assert _lookup(hosts, f"{tag}-h1")["lookup_us"] < 5e6  # one timeout of the tier (0.5 s), not a hang
