"""Conformance scenario `accounting`: over one run of a consumer replica, what the
connector claimed, what the engine did not compute, what was verifiably installed, what
vLLM's own metrics count and what the connector's own stats count must agree.

A computes two prompts; B (the consumer) is then asked for a full hit (the first prompt),
a partial hit (the second prompt's prefix with another tail, where the connector serves
prefixes), a miss (a fresh prompt) and a local hit (the first prompt again: B's own prefix
cache). For every request of B in the window:

  claimed      the connector's answer to get_num_new_matched_tokens (the audit's
               `audit_match`; the last answer of a request is the one vLLM admitted)
  verified     the blocks the audit saw installed for it that are byte for byte A's
  vLLM         /metrics of B before and after: vllm:external_prefix_cache_hits and
               _queries, vllm:prompt_tokens_by_source{local_compute, local_cache_hit,
               external_kv_transfer}
  own          the connector's own load counters where its profile reads them
               (kvpool: vllm:kvpool_loaded_blocks and _bytes)

Conservation: each request's claim is covered by exactly its verified blocks (no token
claimed that was not installed byte-exact, no block installed that was not claimed; a claim
that ends one token short of a block is allowed only at the prompt's last token, where the
engine completes the block: exact_boundaries judges that case by its output);
the claims add up to vLLM's external hits and to its external_kv_transfer tokens; the
prompt tokens less the local and the external ones add up to what vLLM computed; the
queries add up; and the connector's own load count equals the verified blocks (its bytes,
those blocks' bytes).

Negative controls (kvgate.faults.connector), each caught by a conservation check:
`claim_past_loaded` (the connector claims tokens it does not load) and, where the profile
reads the connector's own stats, `double_count_stats` (every load counted twice).
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from kvgate.harness.checkers.verdict import Checks

if TYPE_CHECKING:
    from kvgate.harness.conformance.context import Ctx

CONSERVATION = "conservation"  # the name every check of the oracle starts with
VLLM_COUNTERS = {  # what /metrics says, by (metric, source label)
    "external_hits": ("vllm:external_prefix_cache_hits", None),
    "external_queries": ("vllm:external_prefix_cache_queries", None),
    "computed": ("vllm:prompt_tokens_by_source", "local_compute"),
    "local": ("vllm:prompt_tokens_by_source", "local_cache_hit"),
    "external": ("vllm:prompt_tokens_by_source", "external_kv_transfer"),
    "prompt": ("vllm:prompt_tokens", None),
}


def counters(url: str) -> dict[tuple[str, str | None], float]:
    """Every counter of a replica's /metrics: (family, its `source` label or None) -> the
    sum over its other labels (engines, models)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=30).text
    out: dict[tuple[str, str | None], float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "counter":
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                key = (fam.name, s.labels.get("source"))
                out[key] = out.get(key, 0.0) + s.value
    return out


def settled_counters(url: str, quiet_s: float = 1.0, timeout_s: float = 20.0) -> dict:
    """/metrics once two reads `quiet_s` apart agree (the last step's stats have landed)."""
    last = counters(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = counters(url)
        if now == last:
            return now
        last = now
    return last


def kvpool_loads(c: dict[tuple[str, str | None], float]) -> dict[str, float]:
    """kvpool's own load counters (every source: the pool and a network tier)."""
    return {"blocks": sum(v for (name, _), v in c.items() if name == "vllm:kvpool_loaded_blocks"),
            "bytes": sum(v for (name, _), v in c.items() if name == "vllm:kvpool_loaded_bytes")}


def kvpool_block_bytes(c: dict[tuple[str, str | None], float]) -> float | None:
    """The bytes of one block as kvpool publishes it (a producer's counters)."""
    blocks = sum(v for (name, _), v in c.items() if name == "vllm:kvpool_published_blocks")
    nbytes = sum(v for (name, _), v in c.items() if name == "vllm:kvpool_published_bytes")
    return nbytes / blocks if blocks else None


def _delta(after: dict, before: dict, key: tuple[str, str | None]) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def covered(claimed: int, local: int, prompt: int, verified: int, installed: int, block: int) -> bool:
    """Whether a claim is exactly the blocks installed, every one byte-exact. The audit digests
    whole blocks; a claim may end inside one only where it stops at the prompt's last token
    (a connector that holds the whole prompt claims all but the token the engine computes:
    LMCache at a multiple of its chunk), and then only one token short of the block, which
    the engine completes. A claim past its loaded blocks anywhere else is not covered."""
    whole, rest = divmod(claimed, block)
    return verified == installed == whole and (rest == 0 or (rest == block - 1 and local + claimed == prompt - 1))


def accounting(ctx: Ctx, control: str | None = None) -> Checks:
    from kvgate.harness.checkers.history import records
    from kvgate.harness.conformance import context as base
    from kvgate.harness.workload.prompts import common_prefix_tails

    B = base.BLOCK
    rng = random.Random(ctx.seed)
    tag = base._tag("n", ctx.seed)
    full = ctx.corpus.text(1500, rng)
    partial = common_prefix_tails(ctx.corpus, rng, prefix_tokens=1000, tails=2, tail_tokens=300) \
        if ctx.profile.needs("prefix_hits") is None else None
    fresh = ctx.corpus.text(600, rng)
    ctx.run("A", full, f"{tag}-a-full")
    if partial is not None:
        ctx.run("A", partial[0].prompt, f"{tag}-a-partial")
    if control:
        base.arm_control(ctx, "B", control)
    before = settled_counters(ctx.url("B"))
    asks = [("full", full), *([("partial", partial[1].prompt)] if partial is not None else []), ("miss", fresh),
            ("local", full)]
    outs = {name: ctx.run("B", prompt, f"{tag}-b-{name}") for name, prompt in asks}
    after = settled_counters(ctx.url("B"))
    produced: dict[str, str] = {}
    for r in records(ctx.h, "audit", kind="produced", replica="A"):
        if r["t"] >= ctx.t0:
            produced.update(zip(r["hashes"], r["digests"]))

    c = Checks()
    per: dict[str, dict[str, Any]] = {}
    for name, _ in asks:
        t = f"{tag}-b-{name}"
        answers = records(ctx.h, "audit_match", tag=t, replica="B")
        m = answers[-1] if answers else None
        installed = ctx.installed("B", t)
        verified = sum(1 for h, d in installed.items() if produced.get(h) == d)
        claimed = m["external_tokens"] if m else None
        per[name] = {"prompt": m["prompt_tokens"] if m else None, "local": m["local_tokens"] if m else None,
                     "claimed": claimed, "installed": len(installed), "verified": verified,
                     "completed": outs[name].error is None and len(outs[name].token_ids) == 16}
        c.check(f"B's {name} request completed and its connector answered", m is not None and per[name]["completed"],
                per[name])
        if m is not None:
            c.check(f"{CONSERVATION}: the {name} request's claim ({claimed} tokens) is covered by exactly its blocks "
                    f"installed byte-exact", covered(claimed, m["local_tokens"], m["prompt_tokens"], verified,
                                                     len(installed), B), per[name])
    if any(p["claimed"] is None for p in per.values()):
        c.evidence.update(requests=per)
        return c
    claims = sum(p["claimed"] for p in per.values())
    local = sum(p["local"] for p in per.values())
    prompt = sum(p["prompt"] for p in per.values())
    verified = sum(p["verified"] for p in per.values())
    vllm = {k: _delta(after, before, key) for k, key in VLLM_COUNTERS.items()}
    c.check(f"{CONSERVATION}: vLLM counted the claimed tokens as its external hits",
            vllm["external_hits"] == claims == vllm["external"],
            {"claimed": claims, "external_prefix_cache_hits": vllm["external_hits"],
             "prompt_tokens_by_source[external_kv_transfer]": vllm["external"]})
    c.check(f"{CONSERVATION}: vLLM computed every prompt token neither cached locally nor claimed",
            vllm["computed"] == prompt - local - claims and vllm["local"] == local and vllm["prompt"] == prompt,
            {"prompt": prompt, "local": local, "claimed": claims, "vllm": vllm})
    c.check(f"{CONSERVATION}: vLLM's external queries are the prompt tokens past the local hits",
            vllm["external_queries"] == prompt - local, {"queries": vllm["external_queries"], "want": prompt - local})
    # the scenario's premise: without the full prompt's hit, conservation holds of nothing loaded
    c.check("the full request hit what A stored, and the fresh one missed",
            per["full"]["claimed"] > 0 and per["miss"]["claimed"] == 0,
            {"full": per["full"]["claimed"], "miss": per["miss"]["claimed"]})
    own = None
    if ctx.profile.load_metrics is not None:
        own = {k: v - ctx.profile.load_metrics(before)[k] for k, v in ctx.profile.load_metrics(after).items()}
        block_bytes = ctx.profile.block_bytes(counters(ctx.url("A"))) if ctx.profile.block_bytes else None
        c.check(f"{CONSERVATION}: the connector's own stats count exactly the blocks installed byte-exact",
                own["blocks"] == verified and (block_bytes is None or own["bytes"] == verified * block_bytes),
                {"own": own, "verified_blocks": verified, "block_bytes": block_bytes})
    c.evidence.update(requests=per, claimed=claims, verified_blocks=verified, vllm=vllm, own=own, control=control,
                      own_stats_read=ctx.profile.load_metrics is not None)
    return c
