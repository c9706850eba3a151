"""Hostile scenario: a client of the network store moves and forges records (see
kvgate.harness.scenarios.hostile). On the multi-host system (kvgate.harness.system.hosts: replica G on
h1, H on h2, Redis on the store host with its access control on).

  store_forgery(system, corpus, seed, control=None, store="redis")
      The attacker is the store's operator (system.store_client(): every right on every key,
      no tier secret; what any client of an open Redis, or of Mooncake, can do). It learns
      G's keys by watching them appear (SCAN before and after each of G's publishes: the
      keys are opaque, it cannot compute one).
        1. G computes prompts 0, 1 and 2 (each published to h1's pool and the tier); H's
           cold runs of prompts 0 and 1 (a salt of their own: the same partition as a full
           recompute) are the baselines.
        2. H asks for prompt 2, untouched: it loads it from the tier (a probe first where a
           hold was left, then the whole prompt), nothing refused, its output that of G's
           prefix hit (genuine records pass the reader).
        3. The attack, between G's publish and H's load: each record of prompt 0 is moved
           under the next key of prompt 0 (a derangement: every key holds another block's
           genuine record); each record of prompt 1 has its page rewritten (with the page
           of a block of prompt 0: plausible KV) and the header's plain digest recomputed.
        4. H asks for prompts 0 and 1: its lookups still find them in the tier (the keys
           are there), each load ends `corrupt` at its first block with nothing installed,
           every block is recomputed, and H's output equals its cold run.
      Expect load causes exactly [corrupt]. Negative control `unauthenticated_tier`
      (kvgate.faults.copier: H's tier loads read records as they were read before records were
      authenticated and bound to their key): H installs the moved and forged pages as
      good, and the byte-exact oracle must catch it (H's installed blocks differ from every
      producer's bytes).

RUNNERS maps a scenario file's `runner` to its body (kvgate.harness.scenarios.catalog).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvgate.faults.tier_controls import UNAUTHENTICATED_TIER, forge_record, rotate
from kvgate.harness.checkers.history import records
from kvgate.harness.checkers.verdict import Checks, Verdict
from kvgate.harness.client.http import complete, reset_prefix_cache
from kvgate.harness.scenarios.hosts import B, PROMPT_TOKENS, _lookup, _tag, publish_on_g, served_from_tier
from kvgate.harness.system.pool import DEFAULT_TENANT
from kvgate.harness.workload.prompts import Corpus
from kvpool.tier.record import split_record, tier_prefix

CONTROLS = (UNAUTHENTICATED_TIER,)


def _keys(client, prefix: str) -> set[str]:  # noqa: ANN001 - a redis.Redis
    return {k.decode() if isinstance(k, bytes) else k for k in client.scan_iter(match=f"{prefix}*", count=1000)}


def _tier_load(system, tag: str) -> list[dict]:  # noqa: ANN001
    return records(system.history_dir, "tier_load", tag=tag, replica="H")


def store_forgery(system, corpus: Corpus, seed: int, *, control: str | None = None,  # noqa: ANN001
                  store: str = "redis") -> Verdict:
    if store != "redis" or system.store_kind != "redis":
        raise ValueError(f"the store client here is a Redis client: store 'redis', got {store!r} on a "
                         f"{system.store_kind} system")
    if control not in (None, *CONTROLS):
        raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
    rng = random.Random(seed)
    tag = _tag("x", seed)
    prompts = [corpus.text(PROMPT_TOKENS, rng) for _ in range(3)]
    if control:
        system.arm("H", "copier", {"control": control})
    op, prefix = system.store_client(), tier_prefix(DEFAULT_TENANT)
    keys: list[list[str]] = []
    for i in range(3):
        before = _keys(op, prefix)
        publish_on_g(system, prompts[i], f"{tag}-g{i}")
        keys.append(sorted(_keys(op, prefix) - before))
    refs = [complete(system.url("H"), p, tag=f"{tag}-cold{i}", replica="H", max_tokens=8, load=False, publish=False,
                     cache_salt=f"cold-{tag}") for i, p in enumerate(prompts[:2])]
    reset_prefix_cache(system.url("H"))
    c = Checks()
    c.check("the store client saw G's keys of prompts 0 and 1 appear (two at least each)",
            len(keys[0]) >= 2 and len(keys[1]) >= 2, [len(k) for k in keys])

    # Genuine records pass: prompt 2, untouched (also ends any hold an earlier scenario left).
    _, last = served_from_tier(system, c, prompts[2], f"{tag}-h2", "prompt 2, genuine")
    reset_prefix_cache(system.url("H"))
    lk, loads = _lookup(system, last), _tier_load(system, last)
    c.check("H loaded prompt 2's genuine records from the tier, none refused",
            lk.get("tier_blocks", 0) >= 1 and len(loads) == 1 and loads[0].get("loaded") == lk.get("tier_blocks")
            and loads[0].get("miss_cause") is None, (lk, loads))

    # The attack, in the store: prompt 0's records moved, prompt 1's pages rewritten.
    if len(keys[0]) >= 2 and len(keys[1]) >= 2:
        moved = {k: op.get(k) for k in keys[0]}
        for src, dst in rotate(keys[0]):
            op.set(dst, moved[src])
        donors = [split_record(moved[k])[2] for k in keys[0]]
        for j, k in enumerate(keys[1]):
            op.set(k, forge_record(op.get(k), page=donors[j % len(donors)]))
        system.nemesis("store_forgery", moved=len(keys[0]), forged=len(keys[1]))

    got = []
    for i in range(2):
        got.append(complete(system.url("H"), prompts[i], tag=f"{tag}-h{i}", replica="H", max_tokens=8,
                            publish=False))
        reset_prefix_cache(system.url("H"))
    what = ("moved", "forged")
    for i in range(2):
        lk, loads = _lookup(system, f"{tag}-h{i}"), _tier_load(system, f"{tag}-h{i}")
        c.check(f"H's lookup of prompt {i} ({what[i]}) still found blocks in the tier", lk.get("tier_blocks", 0) >= 1,
                lk)
        c.check(f"H's load of prompt {i}'s {what[i]} records was corrupt at its first block, nothing installed",
                len(loads) == 1 and loads[0].get("loaded") == 0 and loads[0].get("miss_cause") == "corrupt", loads)
        c.output(f"H's request {i} ({what[i]} records in the store) equals its cold run", got[i], refs[i])
    c.evidence.update(keys=[len(k) for k in keys],
                      lookups=[{k: _lookup(system, f"{tag}-h{i}").get(k) for k in ("tier_blocks", "tier_found",
                                                                                     "hit_blocks")}
                               for i in range(3)],
                      blocks_per_prompt=PROMPT_TOKENS // B)
    return c.verdict("a store client's moved and forged records: H's loads corrupt, nothing installed, "
                     "outputs unchanged; genuine records still served")


RUNNERS: dict[str, Callable[..., Verdict]] = {"store_forgery": store_forgery}
