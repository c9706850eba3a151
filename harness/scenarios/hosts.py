"""The multi-host scenarios: replicas G (host h1) and H (host h2) on their own pool
daemons, the network tier on a third host (kvgate.harness.system.hosts), faults on the store host.

  cross_host(system, corpus, seed, fault=None, rate="256kbit", control=None, store="redis")
      on a Redis or a Mooncake store (`store`: the system's). G computes two prompts (published to h1's pool and the tier); H's cold runs of them
      (a salt of their own: the same partition as a full recompute) are the baselines. Then
      the fault, and H asks for both prompts:
        None              H loads every block from the tier; its output equals G's prefix
                          hit (the same partition); the byte-exact oracle compares the
                          installed blocks with G's
        "store_kill"      the storage node SIGKILLed: H's first request takes nothing from
                          it (Redis: the lookup fails; Mooncake: the master still indexes
                          the pages and the load fails, transport_error), the second is
                          held off (kvpool.tier.rule); both recomputed with the baselines' output
        "store_partition" the store host's link down: the first lookup waits the tier's
                          timeout, the second is held off; both recomputed
        "store_degraded"  the store host's link at `rate` (tc tbf): a page takes longer than
                          the tier's timeout, so reading is slower than recomputing; the
                          first load gives up, the second request is held off; recomputed
        "store_slow"      the store host's link at `rate`, slower but still worth reading
                          (100 mbit/s: the prompt's 11 pages in about a tenth of a second,
                          well within the load's deadline, HOSTS_SETTINGS' 2 s): both loads
                          complete from the tier, byte-exact, and the
                          outputs equal G's prefix hits
      Heal (the store restarted empty, the link restored), the hold expires, and the tier
      serves again: G publishes a third prompt and H loads at least a probe of it from the
      tier; once the probe has measured the tier H loads the whole prompt from it, and its
      output equals G's prefix hit (the same partition).
      Negative controls: `claim_past_loaded` (no fault; the output oracle must catch it) and
      `deaf_tier_rule` (the faults: H's tier rule never holds the tier off; the scenario's
      held-off check must catch it), both kvgate.faults.connector's.
"""

from __future__ import annotations

import random
import time

from kvgate.harness.checkers.history import records
from kvgate.harness.checkers.verdict import Checks, Verdict
from kvgate.harness.client.http import complete, reset_prefix_cache
from kvgate.harness.scenarios.nemesis import wait_for
from kvgate.harness.workload.prompts import Corpus

B = 128
PROMPT_TOKENS = 11 * B + 60
FAULTS = (None, "store_kill", "store_partition", "store_degraded", "store_slow")


def _tag(prefix: str, seed: int) -> str:
    return f"{prefix}{seed % 10**8}"


def publish_on_g(system, prompt: str, tag: str, max_tokens: int = 8) -> None:  # noqa: ANN001
    """G computes the prompt; returns once every complete block of it is in the tier (put,
    or refused as already there), with no tier error: G's tier puts run after its response
    and must neither race H's lookup nor run under the next measurement."""
    complete(system.url("G"), prompt, tag=tag, replica="G", max_tokens=max_tokens)

    def stored() -> bool:
        recs = records(system.history_dir, "tier_publish", tag=tag)
        (lk,) = records(system.history_dir, "lookup", tag=tag, replica="G") or [{}]
        return bool(recs) and sum(r.get("put", 0) + r.get("refused", 0) for r in recs) >= \
            lk.get("prompt_tokens", 0) // B and all(r.get("error") is None for r in recs)

    wait_for(stored, 60, f"G's blocks of {tag} in the tier")


def _lookup(system, tag: str) -> dict:  # noqa: ANN001
    found = records(system.history_dir, "lookup", tag=tag, replica="H")
    return found[0] if found else {}


def served_from_tier(system, c: Checks, prompt: str, tag: str, what: str, tries: int = 4):  # noqa: ANN001, ANN201
    """H asks for a prompt G published, and reads it from the tier. After a hold its first
    request loads a probe (a block), and a claim is capped by the rate measured (x the load's
    deadline): H asks again (its own prefix cache reset), up to `tries` requests, until it loads
    the whole prompt, each load measuring the tier anew. That last run's output must equal G's
    prefix hit of the prompt, the same partition (every complete block cached, the tail
    computed): a probe's partition is no other run's, and a near tie between two partitions'
    last bits can turn a greedy token. Returns H's last completion and its tag."""
    whole = PROMPT_TOKENS // B
    limits = []
    for attempt in range(tries):
        if attempt:
            reset_prefix_cache(system.url("H"))
        t = tag if attempt == 0 else f"{tag}-{attempt}"
        got = complete(system.url("H"), prompt, tag=t, replica="H", max_tokens=8, publish=False)
        lk = _lookup(system, t)
        limits.append(lk.get("tier_limit"))
        if attempt == 0:
            c.check(f"{what}: H reads from the tier", lk.get("tier_blocks", 0) >= 1, lk)
        if got.error is not None or lk.get("tier_blocks") == whole or lk.get("tier_limit") is None:
            break
    c.evidence.setdefault("tier_limits", {})[what] = limits
    c.check(f"{what}: H's request completed", got.error is None, got.error)
    c.check(f"{what}: H loads the whole prompt from the tier, none of it from its own pool",
            (lk.get("hit_blocks"), lk.get("tier_blocks")) == (0, whole), lk)
    g_hit = complete(system.url("G"), prompt, tag=f"{t}-ghit", replica="G", max_tokens=8, publish=False)
    g_lk = (records(system.history_dir, "lookup", tag=f"{t}-ghit", replica="G") or [{}])[-1]  # its last
    c.check(f"{what}: G's reference has every complete block cached (its prefix cache or its pool)",
            g_lk.get("local_tokens", 0) + g_lk.get("external_tokens", 0) == whole * B, g_lk)
    c.output(f"{what}: H's tokens and log-probabilities equal G's prefix hit", got, g_hit)
    return got, t


def cross_host(system, corpus: Corpus, seed: int, fault: str | None = None, rate: str = "256kbit",  # noqa: ANN001
               control: str | None = None, store: str = "redis") -> Verdict:
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    if store != system.store_kind:
        raise ValueError(f"the scenario is for a {store} store; the system runs {system.store_kind}")
    rng = random.Random(seed)
    tag = _tag("h", seed)
    prompts = [corpus.text(PROMPT_TOKENS, rng) for _ in range(3)]
    if control:
        system.arm("H", "connector", {"control": control})
    for i in range(2):
        publish_on_g(system, prompts[i], f"{tag}-g{i}")
    refs = [complete(system.url("H"), p, tag=f"{tag}-cold{i}", replica="H", max_tokens=8, load=False, publish=False,
                     cache_salt=f"cold-{tag}") for i, p in enumerate(prompts[:2])]
    reset_prefix_cache(system.url("H"))
    if fault == "store_kill":
        system.kill_store()
    elif fault == "store_partition":
        system.partition("store")
    elif fault in ("store_degraded", "store_slow"):
        system.slow("store", rate)
    try:
        got = []
        for i in range(2):
            got.append(complete(system.url("H"), prompts[i], tag=f"{tag}-h{i}", replica="H", max_tokens=8,
                                publish=False))
            reset_prefix_cache(system.url("H"))
    finally:
        system.heal("store")
        if fault == "store_kill":
            system.restart_store()
    c = Checks()
    first, second = _lookup(system, f"{tag}-h0"), _lookup(system, f"{tag}-h1")
    c.evidence.update(lookups=[{k: lk.get(k) for k in ("tier_blocks", "tier_found", "tier_error", "tier_held",
                                                       "lookup_us", "hit_blocks")} for lk in (first, second)],
                      ttft_ms={"cold": [round(r.ttft_s * 1e3, 1) for r in refs[:2]],
                               "under_fault": [round(g.ttft_s * 1e3, 1) for g in got]})
    if fault in (None, "store_slow"):
        for i, lk in enumerate((first, second)[: 1 if fault is None else 2]):
            g_hit = complete(system.url("G"), prompts[i], tag=f"{tag}-ghit{i}", replica="G", max_tokens=8,
                             publish=False)
            c.check(f"H's lookup {i} found every block in the tier, none in its own pool",
                    (lk.get("hit_blocks"), lk.get("tier_blocks")) == (0, PROMPT_TOKENS // B), lk)
            loads = records(system.history_dir, "tier_load", tag=f"{tag}-h{i}", replica="H")
            c.check(f"H loaded them all from the store host (request {i})",
                    len(loads) == 1 and loads[0].get("loaded") == PROMPT_TOKENS // B, loads)
            c.output(f"H's tokens and log-probabilities equal G's prefix hit of prompt {i}", got[i], g_hit)
            c.evidence.setdefault("tier_load_s", []).append(loads[0].get("seconds") if loads else None)
    else:
        for i in range(2):  # every block recomputed: the baseline's partition, to the last bit
            c.output(f"H's request {i} under {fault} equals its cold run", got[i], refs[i])
        if fault == "store_kill":  # Redis: the lookup fails; Mooncake: the master still indexes the pages
            loads = records(system.history_dir, "tier_load", tag=f"{tag}-h0", replica="H")
            c.check("the first request took nothing from the dead storage node, and says why (its lookup "
                    "failed, or its load installed nothing: transport_error)",
                    str(first.get("tier_error", "")).startswith("TierUnavailable")
                    or (len(loads) == 1 and loads[0].get("loaded") == 0
                        and loads[0].get("miss_cause") == "transport_error"), (first, loads))
        elif fault == "store_partition":
            c.check("the first lookup waited the tier's timeout, not longer, and says why",
                    str(first.get("tier_error", "")).startswith("TierUnavailable")
                    and first.get("lookup_us", 1e9) < 5e6, first)
        else:
            loads = records(system.history_dir, "tier_load", tag=f"{tag}-h0", replica="H")
            c.check("the first load gave up on the degraded store (nothing installed from it)",
                    len(loads) == 1 and loads[0].get("loaded") == 0
                    and loads[0].get("miss_cause") in ("transport_error", "timeout"), loads)
        c.check("the next request was held off the failing tier (it recomputed at once)",
                "tier_held" in second and second.get("tier_blocks") == 0, second)
    # Healed: once the hold expires the tier serves again (a probe of one block at least).
    time.sleep(system.settings.get("tier_backoff_max_s", 30.0) + 0.3)
    publish_on_g(system, prompts[2], f"{tag}-g2")
    served_from_tier(system, c, prompts[2], f"{tag}-back", "healed")
    held = fault not in (None, "store_slow")
    return c.verdict(f"across hosts{' under ' + fault if fault else ''}: outputs unchanged"
                     + (", the failing tier held off" if held else "") + ", served again once healed")
