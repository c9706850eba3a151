"""Live scenarios on a running cluster (replicas "A" and "B"); each returns a Verdict.
The live suites assert on them and the gate runs them for its seeds.

  cross_replica_hit      A computes a prompt longer than the prefill chunk and publishes;
                         B loads; B's tokens equal its own cold baseline; byte-exact oracle.
  partial_hit            a common prefix with different tails: only the complete common
                         blocks load, the miss after them is never_published.
  shared_system_prompt   one system prompt, different questions: computed once, reused.
  hit_kinds              B's own prefix cache (local hit), a remote hit, and a miss are told
                         apart in the history and in the pool's counters.
  load_failure           a fault in B's pool client (corrupt / transport_error / timeout / evict)
                         at block k: k blocks load, the cause is recorded, policy recompute
                         gives B's baseline tokens.
  pool_restart           the pool daemon killed under live replicas, then restarted.
  revision_mismatch      a replica of another model revision on the same pool.
  load_failure_fail      the same on A, whose policy is "fail": the request ends explicitly
                         with an error and the replica keeps serving.
  sessions               OFF-ON-ON-OFF six-turn sessions alternating replicas.
"""

from __future__ import annotations

import json
import random

from faults.schedule import draw_schedule
from harness.cluster import Cluster
from harness.live_checks import byte_exact, records
from harness.sessions import off_on_on_off
from harness.workload import Corpus, common_prefix_tails, complete
from reports.render import Verdict


class Checks:
    """Named boolean checks that become one Verdict."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.evidence: dict[str, object] = {}

    def check(self, name: str, ok: bool, detail: object = None) -> bool:
        if not ok:
            self.failed.append(f"{name}" + (f" ({detail})" if detail is not None else ""))
        return ok

    def verdict(self, passed: str) -> Verdict:
        if self.failed:
            return Verdict(False, "; ".join(self.failed), self.evidence)
        return Verdict(True, passed, self.evidence)


def _tag(prefix: str, seed: int) -> str:
    return f"{prefix}{seed % 10**8}"


def _one(history, ev: str, **match) -> dict:  # noqa: ANN001
    found = records(history, ev, **match)
    if len(found) != 1:
        raise AssertionError(f"expected one {ev} record for {match}, found {len(found)}")
    return found[0]


def cross_replica_hit(cluster: Cluster, corpus: Corpus, seed: int, prompt_tokens: int = 5000) -> Verdict:
    rng = random.Random(seed)
    B = 128
    prompt = corpus.text(prompt_tokens, rng)
    n = prompt_tokens + 1
    tag = _tag("x", seed)
    a = complete(cluster.replicas["A"].url, prompt, tag=f"{tag}-a", replica="A")
    b = complete(cluster.replicas["B"].url, prompt, tag=f"{tag}-b", replica="B")
    cold = complete(cluster.replicas["B"].url, prompt, tag=f"{tag}-cold", replica="B", load=False, publish=False,
                    cache_salt=f"cold-{tag}")
    h = cluster.history_dir
    c = Checks()
    published = sum(r.get("committed", 0) for r in records(h, "publish", tag=f"{tag}-a", replica="A"))
    c.check("A published every complete prompt block", published == n // B, published)
    lookup = _one(h, "lookup", tag=f"{tag}-b", replica="B")
    c.check("B's lookup found every loadable block", lookup["outcome"] == "remote_hit"
            and lookup["hit_blocks"] == (n - 1) // B, lookup)
    load = _one(h, "load", tag=f"{tag}-b", replica="B")
    c.check("B loaded them all", load["loaded"] == load["blocks"] == (n - 1) // B and not load["failed_block_ids"], load)
    cold_lookup = _one(h, "lookup", tag=f"{tag}-cold", replica="B")
    c.check("the baseline was cold", cold_lookup["external_tokens"] == 0 and cold_lookup["local_tokens"] == 0)
    c.check("B's tokens equal its no-cache baseline", b.token_ids == cold.token_ids and len(b.token_ids) == 16,
            (b.token_ids[:4], cold.token_ids[:4]))
    c.check("A's tokens equal B's", a.token_ids == b.token_ids)
    v = byte_exact(cluster, ("A", f"{tag}-a"), ("B", f"{tag}-b"), ("B", f"{tag}-cold"))
    c.check(v.reason, v.valid is True)
    c.evidence.update(v.evidence, prompt_tokens=n, chunks=-(-n // 2048), ttft_ms={"A": round(a.ttft_s * 1e3, 1),
                      "B_remote": round(b.ttft_s * 1e3, 1), "B_cold": round(cold.ttft_s * 1e3, 1)})
    return c.verdict(f"{(n - 1) // B} blocks loaded across replicas, byte-exact, output unchanged")


def partial_hit(cluster: Cluster, corpus: Corpus, seed: int, common: int = 1000) -> Verdict:
    rng = random.Random(seed)
    t1, t2 = common_prefix_tails(corpus, rng, prefix_tokens=common, tails=2, tail_tokens=300)
    tag = _tag("p", seed)
    complete(cluster.replicas["A"].url, t1.prompt, tag=f"{tag}-a", replica="A")
    b = complete(cluster.replicas["B"].url, t2.prompt, tag=f"{tag}-b", replica="B")
    cold = complete(cluster.replicas["B"].url, t2.prompt, tag=f"{tag}-cold", replica="B", load=False, publish=False,
                    cache_salt=f"cold-{tag}")
    h = cluster.history_dir
    c = Checks()
    full = (common + 1) // 128  # BOS + the common words, complete blocks only
    lookup = _one(h, "lookup", tag=f"{tag}-b", replica="B")
    c.check("only the complete common blocks hit", lookup["hit_blocks"] == full, lookup["hit_blocks"])
    c.check("the first uncommon block is never_published", lookup["miss_cause"] == "never_published"
            and lookup["miss_index"] == full, lookup)
    load = _one(h, "load", tag=f"{tag}-b", replica="B")
    c.check("those blocks loaded", load["loaded"] == full, load["loaded"])
    c.check("the tail was recomputed", len(b.token_ids) == 16)
    # Reported, not asserted: the loaded blocks and B's cold run were computed in different
    # prefill partitions, whose KV may differ in its last bits (see load_failure's reference).
    c.evidence["tokens_equal_full_cold_run"] = b.token_ids == cold.token_ids
    v = byte_exact(cluster, ("A", f"{tag}-a"), ("B", f"{tag}-b"), ("B", f"{tag}-cold"))
    c.check(v.reason, v.valid is True)
    c.evidence.update(common_tokens=common + 1, loaded_blocks=load["loaded"])
    return c.verdict(f"{full} complete common blocks loaded byte-exact, the tail recomputed")


def shared_system_prompt(cluster: Cluster, corpus: Corpus, seed: int, system_tokens: int = 1200,
                         questions: int = 4) -> Verdict:
    """A computes the first question; every other question, on B, loads the system
    prompt's complete blocks and recomputes only its own tail."""
    from harness.workload import shared_system_prompt as workload

    rng = random.Random(seed)
    turns = workload(corpus, rng, system_tokens, questions)
    tag = _tag("s", seed)
    complete(cluster.replicas["A"].url, turns[0].prompt, tag=f"{tag}-q0", replica="A")
    c = Checks()
    full = (system_tokens + 1) // 128
    for i, t in enumerate(turns[1:], start=1):
        b = complete(cluster.replicas["B"].url, t.prompt, tag=f"{tag}-q{i}", replica="B", load=True)
        lookup = _one(cluster.history_dir, "lookup", tag=f"{tag}-q{i}")
        reused = lookup["local_tokens"] + lookup["external_tokens"]
        c.check(f"question {i} reuses the system prompt's {full} blocks", reused == full * 128, lookup)
        if i == 1:
            c.check("the first question on B loads them from the pool", lookup["outcome"] == "remote_hit", lookup)
        c.check(f"question {i} generated", len(b.token_ids) == 16)
    c.evidence.update(system_blocks=full, questions=questions)
    return c.verdict(f"the system prompt's {full} blocks were computed once and reused by every question")


def hit_kinds(cluster: Cluster, corpus: Corpus, seed: int) -> Verdict:
    rng = random.Random(seed)
    x, y, z = (corpus.text(700, rng) for _ in range(3))
    tag = _tag("l", seed)
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    with cluster.pool.client(name="hit-kinds") as pc:
        before = pc.stats()
    complete(B, x, tag=f"{tag}-x1", replica="B")
    complete(B, x, tag=f"{tag}-x2", replica="B")
    complete(A, y, tag=f"{tag}-y1", replica="A")
    complete(B, y, tag=f"{tag}-y2", replica="B")
    complete(B, z, tag=f"{tag}-z", replica="B")
    with cluster.pool.client(name="hit-kinds") as pc:
        after = pc.stats()
    h = cluster.history_dir
    got = {t: _one(h, "lookup", tag=f"{tag}-{t}") for t in ("x1", "x2", "y2", "z")}
    c = Checks()
    c.check("first sight is a miss, never_published", got["x1"]["outcome"] == "miss"
            and got["x1"]["miss_cause"] == "never_published", got["x1"])
    c.check("a repeat on B is B's local hit", got["x2"]["outcome"] == "local_hit"
            and got["x2"]["local_tokens"] == 5 * 128, got["x2"])
    c.check("A's prompt on B is a remote hit", got["y2"]["outcome"] == "remote_hit" and got["y2"]["hit_blocks"] == 5,
            got["y2"])
    c.check("an unseen prompt is a miss", got["z"]["outcome"] == "miss" and got["z"]["miss_cause"] == "never_published")
    c.check("the pool counted one remote hit of 5 blocks", after["hits"] - before["hits"] == 1
            and after["hit_blocks"] - before["hit_blocks"] == 5, (before["hits"], after["hits"]))
    c.evidence.update({k: v["outcome"] for k, v in got.items()})
    return c.verdict("local hit, remote hit and misses classified as such")


def arm(cluster: Cluster, replica: str, **fault: object) -> None:
    cluster.faults[replica].write_text(json.dumps({"load": fault}))


def load_failure(cluster: Cluster, corpus: Corpus, seed: int, kind: str, block: int | None = None) -> Verdict:
    """A fault at block k of B's load (k drawn by the seed's fault schedule unless given).

    The fallback oracle compares B's output with a fault-free reference that has the same
    prefill partition: A publishes only the first k blocks of the same prompt (under
    another cache salt), B loads exactly those and computes the rest. The vLLM CPU engine's
    KV depends in its last bits on how prefill was partitioned, so a run computed in other
    chunks is not a fair baseline; whether the output also equals B's fully cold run is
    reported as evidence."""
    if block is None:
        block = draw_schedule(seed).spec(kind).params["block"]
    rng = random.Random(seed)
    prompt = corpus.text(1500, rng)
    tag = _tag(f"r{kind[:3]}", seed)
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    complete(A, prompt, tag=f"{tag}-a", replica="A", cache_salt=f"s-{tag}")
    arm(cluster, "B", kind=kind, block=block)
    b = complete(B, prompt, tag=f"{tag}-b", replica="B", cache_salt=f"s-{tag}")
    complete(A, prompt, tag=f"{tag}-refa", replica="A", cache_salt=f"ref-{tag}", publish_tokens=block * 128)
    ref = complete(B, prompt, tag=f"{tag}-ref", replica="B", cache_salt=f"ref-{tag}")
    cold = complete(B, prompt, tag=f"{tag}-cold", replica="B", load=False, publish=False, cache_salt=f"cold-{tag}")
    h = cluster.history_dir
    load = _one(h, "load", tag=f"{tag}-b", replica="B")
    start = _one(h, "lookup", tag=f"{tag}-b")["t"]
    fired = [r["kind"] for r in records(h, "fault", replica="B") if start <= r["t"] <= load["t"]]
    ref_lookup = _one(h, "lookup", tag=f"{tag}-ref")
    cause = "evicted" if kind == "evict" else kind
    c = Checks()
    c.check("the fault fired once", fired == [kind], fired)
    c.check(f"the load stopped at block {block} as {cause}", load["miss_cause"] == cause and load["loaded"] == block
            and load["miss_index"] == block, load)
    c.check("every block from there was reported failed", len(load["failed_block_ids"]) == load["blocks"] - block)
    c.check("the reference loaded exactly the same blocks", ref_lookup["external_tokens"] == block * 128
            and ref_lookup["local_tokens"] == 0, ref_lookup)
    c.check("policy recompute: tokens equal the fault-free reference",
            b.finish_reason == "length" and b.token_ids == ref.token_ids, (b.finish_reason, b.error))
    c.evidence.update(kind=kind, block=block, loaded=load["loaded"], failed=len(load["failed_block_ids"]),
                      tokens_equal_full_cold_run=b.token_ids == cold.token_ids)
    return c.verdict(f"{kind} at block {block}: classified, recomputed, output equal to the fault-free run")


def pool_restart(cluster: Cluster, corpus: Corpus, seed: int) -> Verdict:
    """The pool daemon is killed (SIGKILL) under two live replicas, then restarted:
    while it is down every lookup is a transport_error and requests are computed
    locally with unchanged output; after the restart the replicas reconnect by
    themselves, the new pool starts empty (and says so), and sharing resumes."""
    rng = random.Random(seed)
    p1, p2 = corpus.text(700, rng), corpus.text(700, rng)
    tag = _tag("k", seed)
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    h = cluster.history_dir
    complete(A, p1, tag=f"{tag}-a1", replica="A")
    cluster.pool.kill()
    b1 = complete(B, p1, tag=f"{tag}-b1", replica="B")
    down = _one(h, "lookup", tag=f"{tag}-b1")
    cluster.pool.restart()
    b1_cold = complete(B, p1, tag=f"{tag}-b1cold", replica="B", load=False, publish=False, cache_salt=f"cold-{tag}")
    complete(A, p2, tag=f"{tag}-a2", replica="A")
    b2 = complete(B, p2, tag=f"{tag}-b2", replica="B")
    up = _one(h, "lookup", tag=f"{tag}-b2")
    c = Checks()
    c.check("with the pool down the lookup is a transport_error", down["outcome"] == "miss"
            and down["miss_cause"] == "transport_error", down)
    c.check("the request was computed locally with unchanged output", b1.token_ids == b1_cold.token_ids
            and len(b1.token_ids) == 16)
    c.check("the restarted pool said it recovered from a crash", bool(cluster.pool.address["restarted_after_crash"]))
    c.check("after the restart sharing resumed", up["outcome"] == "remote_hit" and up["hit_blocks"] == 5, up)
    c.check("and its output is complete", len(b2.token_ids) == 16)
    c.evidence.update(down=down.get("error", "")[:120], recovery_note=cluster.pool.address.get("recovery_note"))
    return c.verdict("pool crash: lookups failed as transport_error, outputs unchanged, sharing resumed after restart")


def revision_mismatch(cluster: Cluster, corpus: Corpus, seed: int, replica: str = "C") -> Verdict:
    """`replica` runs another revision of the model (other weights, same tokenizer) on the
    same pool: it must find A's blocks `incompatible`, name `model_revision` as the only
    differing field, load nothing, and generate what it generates cold."""
    rng = random.Random(seed)
    prompt = corpus.text(900, rng)
    tag = _tag("v", seed)
    complete(cluster.replicas["A"].url, prompt, tag=f"{tag}-a", replica="A")
    url = cluster.replicas[replica].url
    c_out = complete(url, prompt, tag=f"{tag}-c", replica=replica)
    cold = complete(url, prompt, tag=f"{tag}-cold", replica=replica, load=False, publish=False,
                    cache_salt=f"cold-{tag}")
    h = cluster.history_dir
    lookup = _one(h, "lookup", tag=f"{tag}-c")
    c = Checks()
    c.check("the lookup is incompatible", lookup["outcome"] == "miss" and lookup["miss_cause"] == "incompatible",
            lookup)
    c.check("naming model_revision only", lookup["miss_fields"] == ["model_revision"], lookup["miss_fields"])
    c.check("nothing was loaded", not records(h, "load", tag=f"{tag}-c"))
    c.check("the other revision's output equals its own cold run", c_out.token_ids == cold.token_ids
            and len(c_out.token_ids) == 16)
    c.evidence.update(miss_fields=lookup["miss_fields"])
    return c.verdict("another model revision found the blocks incompatible (model_revision) and loaded nothing")


def load_failure_fail(cluster: Cluster, corpus: Corpus, seed: int) -> Verdict:
    rng = random.Random(seed)
    prompt = corpus.text(1500, rng)
    tag = _tag("f", seed)
    complete(cluster.replicas["B"].url, prompt, tag=f"{tag}-b", replica="B")
    arm(cluster, "A", kind="corrupt", block=0)
    a = complete(cluster.replicas["A"].url, prompt, tag=f"{tag}-a", replica="A", timeout_s=120)
    load = _one(cluster.history_dir, "load", tag=f"{tag}-a", replica="A")
    again = complete(cluster.replicas["A"].url, prompt, tag=f"{tag}-a2", replica="A", timeout_s=120)
    c = Checks()
    c.check("the corrupt block was caught", load["miss_cause"] == "corrupt" and load["loaded"] == 0, load)
    c.check("policy fail: the request ended with an explicit error", a.finish_reason == "error" and not a.token_ids,
            (a.finish_reason, a.token_ids[:3]))
    c.check("the replica keeps serving", again.finish_reason == "length" and len(again.token_ids) == 16)
    c.evidence.update(error=a.error)
    return c.verdict("policy fail ended the request explicitly; nothing hung")


def sessions(cluster: Cluster, corpus: Corpus, seed: int, context_tokens: int = 1500) -> Verdict:
    out = off_on_on_off(cluster, corpus, seed % 10**6, sessions=1, turns=6, context_tokens=context_tokens,
                        label=_tag("o", seed))
    h = cluster.history_dir
    c = Checks()
    previous: dict[str, int] = {}
    for r in out["results"]:
        lookup = _one(h, "lookup", tag=r.completion.tag)
        on = r.block.endswith("-on")
        reused = lookup["local_tokens"] + lookup["external_tokens"]
        if not on:
            c.check(f"{r.block} turn {r.turn}: nothing loaded with the pool off", lookup["external_tokens"] == 0)
        elif r.turn > 0:  # everything the other replica completed in the turn before is reused
            want = previous[r.block] // 128 * 128
            c.check(f"{r.block} turn {r.turn}: reuses the previous turn's {want} tokens", reused >= want,
                    (lookup["local_tokens"], lookup["external_tokens"], lookup.get("miss_cause")))
        previous[r.block] = lookup["prompt_tokens"]
    remote = sum(1 for r in out["results"] if _one(h, "lookup", tag=r.completion.tag)["outcome"] == "remote_hit")
    c.check("the pool served cross-replica turns", remote > 0, remote)
    # Output equality across blocks is reported, not asserted: a block the other replica
    # computed in a different prefill partition can differ in its last bits from the
    # one this replica would compute (the byte-exact oracle still holds for the load).
    c.evidence["remote_hit_turns"] = remote
    c.evidence.update(ttft_median_ms_cross_turns=out["ttft_median_ms_cross_turns"], improvement=out["improvement"],
                      outputs_differing_between_blocks=out["mismatched_turns"])
    return c.verdict("with the pool on, each turn reuses everything the other replica computed the turn before")
