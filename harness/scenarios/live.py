"""Live scenarios on a running cluster (replicas "A" and "B"); each returns a Verdict.
The live suites assert on them and the gate runs them for its seeds.

  cross_replica_hit      A computes a prompt longer than the prefill chunk and publishes;
                         B loads; its output equals A's own prefix hit (same partition); byte-exact.
  partial_hit            a common prefix with different tails: only the complete common
                         blocks load, the miss after them is never_published.
  shared_system_prompt   one system prompt, different questions: computed once, reused.
  hit_kinds              B's own prefix cache (local hit), a remote hit, and a miss are told
                         apart in the history and in the pool's counters.
  aligned_full_hit       a block-aligned prompt wholly in the pool: all blocks but the last load
                         (control: a connector that claims the whole prompt but loads less).
  load_poison            the clean-recompute oracle: a failed load must not poison the pool
                         (control: a save that does not see the failed load).
  load_failure           a fault in B's pool client (corrupt / transport_error / timeout / evict)
                         at block k: k blocks load, the cause is recorded, policy recompute
                         gives B's baseline tokens.
  pool_restart           the pool daemon killed under live replicas, then restarted.
  revision_mismatch      a replica of another model revision on the same pool.
  load_failure_fail      the same on A, whose policy is "fail": the request ends explicitly
                         with an error and the replica keeps serving.
  sessions               OFF-ON-ON-OFF six-turn sessions alternating replicas.
  stream_delay_store     the copy of a finished request's blocks delayed on a replica whose
                         freed blocks are reused at once: the pool still gets the bytes of
                         save time (control: the early-completion copier is caught).
  stream_delay_load      a load's copy delayed: the engine waits before attention reads
                         (control: the early-completion copier is caught).
  transport_fault        reset / truncate / bitflip / stall / drop_reply / slow injected by
                         a fault proxy into the remote replica's page frames (control:
                         failed blocks hidden from the engine).
  evict_leased           evictions and a capacity squeeze while a load holds its lease: all
                         refused until it is released (control: a leaseless pool).
  replica_crash          a replica SIGKILLed with a publish open: the pool reclaims it, nothing
                         becomes visible, the replica restarts (control: a leaky pool).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable

from kvgate.faults.schedule import draw_schedule
from kvgate.harness.checkers.byte_exact import exchange_exact, pool_digests
from kvgate.harness.checkers.history import audit_digests, namespace_of, records, unsettled_publishes
from kvgate.harness.checkers.verdict import Checks, Verdict
from kvgate.harness.client.http import Completion, complete, http_status
from kvgate.harness.system.cluster import Cluster
from kvgate.harness.workload.prompts import Corpus, common_prefix_tails
from kvgate.harness.scenarios.nemesis import wait_for, arm, arm_copier, pool_catalog
from kvgate.harness.workload.sessions import off_on_on_off


BLOCK = 128  # the tiny model's KV block, in tokens


def fault_free_reference(cluster: Cluster, producer: str, consumer: str, prompt: str, tag: str, blocks: int,
                         **consumer_args: object) -> Completion:
    """The run under test without its fault: `producer` publishes exactly `blocks` blocks of
    the prompt under another cache salt, `consumer` loads them and computes the rest. The
    same prefill partition as the run under test (the engine's output depends in its last
    bits on how a prefill was partitioned, so a run computed in other chunks is not a fair
    baseline), with nothing injected."""
    complete(cluster.replicas[producer].url, prompt, tag=f"{tag}-refa", replica=producer, cache_salt=f"ref-{tag}",
             publish_tokens=blocks * 128)
    return complete(cluster.replicas[consumer].url, prompt, tag=f"{tag}-ref", replica=consumer,
                    cache_salt=f"ref-{tag}", **consumer_args)


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
    wait_stored(cluster, f"{tag}-a", "A")
    b = complete(cluster.replicas["B"].url, prompt, tag=f"{tag}-b", replica="B")
    a_hit = complete(cluster.replicas["A"].url, prompt, tag=f"{tag}-ahit", replica="A", load=False, publish=False)
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
    a_lookup = _one(h, "lookup", tag=f"{tag}-ahit", replica="A")
    c.check("A's second run was its own prefix-cache hit of the same blocks",
            a_lookup["local_tokens"] == (n - 1) // B * B, a_lookup)
    # The same partition (the loaded blocks, then the tail) from the producer's own KV: B's
    # output, log-probabilities included, must equal it. A cold run is computed in other
    # chunks: its tokens are reported, not required.
    c.check("B generated its 16 tokens", len(b.token_ids) == 16, len(b.token_ids))
    c.output("B's tokens and log-probabilities equal A's prefix hit of the same prompt", b, a_hit)
    c.evidence.update(tokens_equal_cold=b.token_ids == cold.token_ids, tokens_equal_a_cold=a.token_ids == b.token_ids)
    v = exchange_exact(cluster, ("A", f"{tag}-a"), ("B", f"{tag}-b"), ("B", f"{tag}-cold"))
    c.check(v.reason, v.valid is True)
    c.evidence.update(v.evidence, prompt_tokens=n, chunks=-(-n // 2048), ttft_ms={"A": round(a.ttft_s * 1e3, 1),
                      "B_remote": round(b.ttft_s * 1e3, 1), "B_cold": round(cold.ttft_s * 1e3, 1)})
    return c.verdict(f"{(n - 1) // B} blocks loaded across replicas, byte-exact, output unchanged")


def partial_hit(cluster: Cluster, corpus: Corpus, seed: int, common: int = 1000) -> Verdict:
    rng = random.Random(seed)
    t1, t2 = common_prefix_tails(corpus, rng, prefix_tokens=common, tails=2, tail_tokens=300)
    tag = _tag("p", seed)
    complete(cluster.replicas["A"].url, t1.prompt, tag=f"{tag}-a", replica="A")
    wait_stored(cluster, f"{tag}-a", "A")
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
    v = exchange_exact(cluster, ("A", f"{tag}-a"), ("B", f"{tag}-b"), ("B", f"{tag}-cold"))
    c.check(v.reason, v.valid is True)
    c.evidence.update(common_tokens=common + 1, loaded_blocks=load["loaded"])
    return c.verdict(f"{full} complete common blocks loaded byte-exact, the tail recomputed")


def shared_system_prompt(cluster: Cluster, corpus: Corpus, seed: int, system_tokens: int = 1200,
                         questions: int = 4) -> Verdict:
    """A computes the first question; every other question, on B, loads the system
    prompt's complete blocks and recomputes only its own tail."""
    from kvgate.harness.workload.prompts import shared_system_prompt as workload

    rng = random.Random(seed)
    turns = workload(corpus, rng, system_tokens, questions)
    tag = _tag("s", seed)
    complete(cluster.replicas["A"].url, turns[0].prompt, tag=f"{tag}-q0", replica="A")
    wait_stored(cluster, f"{tag}-q0", "A")
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


def wait_stored(cluster: Cluster, tag: str, replica: str, timeout_s: float = 60.0, blocks: int | None = None) -> None:
    """Wait until the replica's stores of the request `tag` have ended for all its complete
    blocks (`blocks`, by default its prompt's: one publish record per prefill chunk): the
    response and the stores are independent, so a scenario whose next request expects these
    blocks in the pool must not depend on which of the two came first (a store that runs
    slow on a loaded machine ended after the consumer's lookup in a CI run)."""
    h = cluster.history_dir

    def done() -> bool:
        want = blocks
        if want is None:
            (lk,) = records(h, "lookup", tag=tag, replica=replica)[:1] or [{}]
            want = int(lk.get("prompt_tokens", 0)) // BLOCK
        return sum(int(r.get("blocks", 0)) for r in records(h, "publish", tag=tag, replica=replica)) >= max(1, want)

    wait_for(done, timeout_s, f"{replica}'s stores of {tag}")


def settle_publishes(cluster: Cluster, tag: str, replica: str, timeout_s: float = 20.0) -> None:
    """Wait until every store the replica queued for the request `tag` has its record (a
    session's next turn, on the other replica, looks them up: the response and the stores are
    independent). One that does not land within `timeout_s` is left to the scenario's checks."""
    deadline = time.monotonic() + timeout_s
    while unsettled_publishes(cluster.history_dir, replica, tag) and time.monotonic() < deadline:
        time.sleep(0.05)


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
    wait_stored(cluster, f"{tag}-y1", "A")
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
    # A malformed request: B (the connector alone) serves it without the pool; A (with
    # kvpool.connector.http's check in front) refuses it with a 400 naming the field; both keep serving.
    bad = complete(B, corpus.text(300, rng), tag=f"{tag}-bad", replica="B", raw_params={"publish_tokens": "x"})
    after_bad = complete(B, z, tag=f"{tag}-z2", replica="B")
    invalid = records(h, "invalid_params", tag=f"{tag}-bad", replica="B")
    c.check("a malformed kv_transfer_params is served without the pool, and said so",
            bad.finish_reason == "length" and len(invalid) == 1, (bad.finish_reason, bad.error, invalid))
    c.check("the replica serves the next request", after_bad.finish_reason == "length" and len(after_bad.token_ids) == 16)
    refused = http_status(A, {"model": "tiny", "prompt": "x", "max_tokens": 1,
                              "kv_transfer_params": {"kvpool": {"publish_tokens": "x"}}})
    c.check("A refuses it with a 400 naming the field", refused[0] == 400 and "publish_tokens" in refused[1], refused)
    after_refused = complete(A, z, tag=f"{tag}-z3", replica="A")
    c.check("and serves the next request", after_refused.finish_reason == "length")
    c.evidence.update({k: v["outcome"] for k, v in got.items()})
    return c.verdict("local hit, remote hit and misses classified as such; a malformed request served without "
                     "the pool")


def aligned_full_hit(cluster: Cluster, corpus: Corpus, seed: int, blocks: int = 12,
                     control: str | None = None) -> Verdict:
    """A block-aligned prompt whose every block is in the pool: B loads all but the last
    block (the engine must compute at least one prompt token, and a block is published
    whole), computes the last block itself, and its output equals A's own prefix hit, which
    vLLM's prefix cache caps the same way (the same partition).

    control="claim_past_loaded": B's connector tells the engine every prompt token but the
    last is external while it loads only the blocks it found (kvgate.faults.connector): the last
    block's first 127 tokens are neither loaded nor computed. Every page it loaded is
    exact and the pool keeps A's copy; only the output oracle can see it."""
    if control not in (None, "claim_past_loaded"):
        raise ValueError(f"unknown control {control!r}")
    rng = random.Random(seed)
    B = 128
    prompt = corpus.text(blocks * B - 1, rng)  # + BOS: exactly `blocks` complete blocks
    tag = _tag("al" if control is None else "ac", seed)
    A, Bu = cluster.replicas["A"].url, cluster.replicas["B"].url
    h = cluster.history_dir
    complete(A, prompt, tag=f"{tag}-a", replica="A", cache_salt=f"s-{tag}")
    wait_stored(cluster, f"{tag}-a", "A")
    a_hit = complete(A, prompt, tag=f"{tag}-ahit", replica="A", load=False, publish=False, cache_salt=f"s-{tag}")
    if control:
        cluster.faults["B"].write_text(json.dumps({"connector": {"control": control}}))
    b = complete(Bu, prompt, tag=f"{tag}-b", replica="B", cache_salt=f"s-{tag}")
    if control:
        cluster.faults["B"].write_text("{}")
    published = sum(r.get("committed", 0) for r in records(h, "publish", tag=f"{tag}-a", replica="A"))
    lookup = _one(h, "lookup", tag=f"{tag}-b", replica="B")
    load = _one(h, "load", tag=f"{tag}-b", replica="B")
    a_lookup = _one(h, "lookup", tag=f"{tag}-ahit", replica="A")
    produced = [r for r in records(h, "audit", kind="produced", tag=f"{tag}-b", replica="B")]
    c = Checks()
    c.check(f"A published all {blocks} blocks of the aligned prompt", published == blocks, published)
    c.check(f"B found {blocks - 1} blocks, all but the last", lookup["hit_blocks"] == blocks - 1
            and lookup["max_blocks"] == blocks - 1, lookup)
    c.check("B loaded them all", load["loaded"] == load["blocks"] == blocks - 1 and not load["failed_block_ids"], load)
    c.check("A's own prefix hit stopped at the same block", a_lookup["local_tokens"] == (blocks - 1) * B, a_lookup)
    c.check("B computed the last block itself", [r["first_block"] for r in produced] == [blocks - 1],
            [(r["first_block"], len(r["hashes"])) for r in produced])
    c.check("B generated its 16 tokens", len(b.token_ids) == 16, len(b.token_ids))
    c.output("B's tokens and log-probabilities equal A's prefix hit of the same partition", b, a_hit)
    c.evidence.update(blocks=blocks, control=control, tokens_equal_reference=b.token_ids == a_hit.token_ids)
    return c.verdict(f"a block-aligned prompt wholly in the pool: {blocks - 1} blocks loaded, the last computed, "
                     f"output equal to the producer's own prefix hit")


def load_failure(cluster: Cluster, corpus: Corpus, seed: int, kind: str, block: int | None = None,
                 control: str | None = None) -> Verdict:
    """A fault at block k of B's load (k drawn by the seed's fault schedule unless given).

    The fallback oracle compares B's output with a fault-free reference that has the same
    prefill partition: A publishes only the first k blocks of the same prompt (under
    another cache salt), B loads exactly those and computes the rest. The vLLM CPU engine's
    KV depends in its last bits on how prefill was partitioned, so a run computed in other
    chunks is not a fair baseline; whether the output also equals B's fully cold run is
    reported as evidence."""
    schedule = draw_schedule(seed)
    spec = schedule.spec(kind)
    if block is None:
        block = spec.params["block"]
    if kind == "transport_error":
        block = 0  # B's pages come through shared memory: only the acquire's frames can be cut
    rng = random.Random(seed)
    prompt = corpus.text(1500, rng)
    tag = _tag(f"r{kind[:3]}", seed)
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    complete(A, prompt, tag=f"{tag}-a", replica="A", cache_salt=f"s-{tag}")
    wait_stored(cluster, f"{tag}-a", "A")
    t_armed = time.time()
    # BUGGIFY-style: the site is active for this run and fires on each load that reaches it
    # with the schedule's probability, by the schedule's own draw; the schedule says at which
    # load it first fires, and the loads before it must pass the armed site untouched.
    warmups = schedule.first_firing(kind)
    if warmups is None:
        raise AssertionError(f"the schedule's {kind} site does not fire within 16 loads (seed {seed})")
    if kind == "transport_error":  # the proxy resets B's connection instead of answering an acquire
        arm(cluster, "B", control)
        cluster.arm_proxy("B", {"reset": {"ops": ["acquire"], "direction": "reply", "times": 1,
                                          "p": spec.probability, "schedule_seed": seed,
                                          "schedule_kind": "transport_error"}})
    else:
        arm(cluster, "B", control, kind=kind, block=block, seed=rng.randrange(2**32), p=spec.probability,
            schedule_seed=seed)
    for n in range(warmups):
        complete(A, prompt, tag=f"{tag}-w{n}a", replica="A", cache_salt=f"w{n}-{tag}")
        complete(B, prompt, tag=f"{tag}-w{n}", replica="B", cache_salt=f"w{n}-{tag}")
    b = complete(B, prompt, tag=f"{tag}-b", replica="B", cache_salt=f"s-{tag}")
    arm(cluster, "B", None)  # heal (a control must not outlive the faulted request)
    if kind == "transport_error":
        cluster.arm_proxy("B", {})
    ref = fault_free_reference(cluster, "A", "B", prompt, tag, block)
    cold = complete(B, prompt, tag=f"{tag}-cold", replica="B", load=False, publish=False, cache_salt=f"cold-{tag}")
    h = cluster.history_dir
    load = _one(h, "load", tag=f"{tag}-b", replica="B")
    start = _one(h, "lookup", tag=f"{tag}-b")["t"]
    fired = [r["kind"] for r in records(h, "fault", replica="B") if start <= r["t"] <= load["t"]]
    ref_lookup = _one(h, "lookup", tag=f"{tag}-ref")
    cause = "evicted" if kind == "evict" else kind
    injected = {"transport_error": "reset"}.get(kind, kind)  # the fault as its injector records it
    skipped = [r for r in records(h, "fault_skipped", replica="B") if r["kind"] == kind
               and t_armed <= r["t"] <= load["t"]]
    warm_loads = [_one(h, "load", tag=f"{tag}-w{n}", replica="B") for n in range(warmups)]
    c = Checks()
    c.check("the fault fired once", fired == [injected], fired)
    # the pool client's site records each load it lets through; the proxy's, each frame it forwards untouched
    passed = warmups if kind == "transport_error" else len(skipped)
    c.check(f"the site let the {warmups} loads before it through, as the schedule drew",
            passed == warmups and all(w["loaded"] == w["blocks"] for w in warm_loads),
            (len(skipped), [w["loaded"] for w in warm_loads]))
    c.check(f"the load stopped at block {block} as {cause}", load["miss_cause"] == cause and load["loaded"] == block
            and load["miss_index"] == block, load)
    c.check("every block from there was reported failed", len(load["failed_block_ids"]) == load["blocks"] - block)
    c.check("the reference loaded exactly the same blocks", ref_lookup["external_tokens"] == block * 128
            and ref_lookup["local_tokens"] == 0, ref_lookup)
    c.check("policy recompute: the request completed", b.finish_reason == "length", (b.finish_reason, b.error))
    c.output("policy recompute: tokens and log-probabilities equal the fault-free reference", b, ref)
    c.evidence.update(kind=kind, block=block, fired_at_load=warmups,
                      probability=spec.probability,
                      loaded=load["loaded"], failed=len(load["failed_block_ids"]),
                      tokens_equal_reference=b.token_ids == ref.token_ids, output_equal_reference=b.same_output(ref),
                      tokens_equal_full_cold_run=b.token_ids == cold.token_ids)
    return c.verdict(f"{kind} at block {block}: classified, recomputed, output equal to the fault-free run")


def load_poison(cluster: Cluster, corpus: Corpus, seed: int, block: int = 5, control: str | None = None) -> Verdict:
    """The clean-recompute oracle on the case where a failed load could poison the pool.

    A publishes the first 10 blocks of a 30-block prompt; B loads them with block k
    corrupt (in the arena, under its lease), so blocks k..9 fail; in that same step vLLM
    computes the next prefill chunk (blocks 10-25) on top of the failed blocks, then rolls
    B back and recomputes from block k. Every pooled block of the prompt must equal a
    clean computation of the same tokens in the same partition by a replica that loads
    nothing: blocks 0-9 A's run from the start under another salt (nothing pooled there),
    blocks 10-29 B's own run of the prompt on its prefix cache of the first k blocks (B
    computes them first as a prompt of their own), which starts computing at block k as
    B's recompute did. Block k itself is B's too: B's loader reported it corrupt and the
    pool, finding it corrupt at rest (the flip is healed only at the release), dropped it;
    B's recompute published it again. The producer's own bytes are no reference here: in the poisoned case
    they are the wrong bytes. The output is held to the fault-free run that loads the k
    verified blocks from the pool (`fault_free_reference`).

    control="publish_after_failed_load": the worker's save does not see the failed load
    (kvgate.faults.copier), so blocks computed on the failed blocks are published."""
    if control not in (None, "publish_after_failed_load"):
        raise ValueError(f"unknown control {control!r}")
    rng = random.Random(seed)
    prompt = corpus.text(30 * 128, rng)  # + BOS: 30 complete blocks and one token
    tag = _tag("pz" if control else "po", seed)
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    h = cluster.history_dir
    complete(A, prompt, tag=f"{tag}-a", replica="A", cache_salt=f"s-{tag}", publish_tokens=10 * 128)
    wait_stored(cluster, f"{tag}-a", "A", blocks=10)
    doc: dict[str, object] = {"load": {"kind": "corrupt", "block": block, "seed": rng.randrange(2**32)}}
    if control:
        doc["copier"] = {"control": control}
    cluster.faults["B"].write_text(json.dumps(doc))
    b = complete(B, prompt, tag=f"{tag}-b", replica="B", cache_salt=f"s-{tag}")
    cluster.faults["B"].write_text("{}")
    ref = fault_free_reference(cluster, "A", "B", prompt, tag, block)
    # The same partition from a replica that loads nothing: B computes the first `block`
    # blocks as a prompt of their own, then the whole prompt on its own prefix cache.
    prefix = " ".join(prompt.split()[: block * 128 - 1])  # + BOS: exactly `block` blocks (one word, one token)
    complete(B, prefix, tag=f"{tag}-lp", replica="B", load=False, publish=False, cache_salt=f"local-{tag}")
    complete(B, prompt, tag=f"{tag}-lf", replica="B", load=False, publish=False, cache_salt=f"local-{tag}")
    load = _one(h, "load", tag=f"{tag}-b", replica="B")
    # The pool keys of salt s and each block's index, from the audit's records of that salt.
    key_of: dict[str, str] = {}
    index_of: dict[str, int] = {}
    for r in records(h, "audit"):
        if r["tag"] in (f"{tag}-a", f"{tag}-b"):
            key_of.update(zip(r["hashes"], r["keys"]))
            index_of.update((x, r["first_block"] + j) for j, x in enumerate(r["hashes"]))
    # The clean computations, by replicas that load nothing, each in the partition of the
    # pooled copy it is held to: blocks 0-9 but k were published by A (its prompt computed from
    # the start: A's run under the reference salt, where nothing was pooled), k (dropped by the
    # pool on B's report) and 10-29 by B's recompute (from block k on): B's own run on its
    # prefix cache of the first k blocks.
    clean_a = audit_digests(h, "produced", f"{tag}-refa", "A")
    clean_b = audit_digests(h, "produced", f"{tag}-lf", "B")
    refa_lookup, lf_lookup = _one(h, "lookup", tag=f"{tag}-refa"), _one(h, "lookup", tag=f"{tag}-lf")
    pooled = pool_digests(cluster.pool, namespace_of(h, "B"), list(key_of.values()))
    hash_of = {v: k for k, v in key_of.items()}
    want = {x: (clean_a if index_of[x] < 10 and index_of[x] != block else clean_b).get(x)
            for x in (hash_of[k] for k in pooled)}
    compared = [x for x, d in want.items() if d is not None]
    differ = sorted(index_of[x] for x in compared if pooled[key_of[x]] != want[x])
    withheld = records(h, "publish_withheld", tag=f"{tag}-b", replica="B")
    # How the clean runs compare with the fault-free run that loads k verified blocks (evidence).
    loaded_ref = audit_digests(h, "produced", f"{tag}-ref", "B")
    agree = [x for x in clean_b if x in loaded_ref and loaded_ref[x] == clean_b[x]]
    c = Checks()
    c.check(f"B's load stopped at block {block} as corrupt", load["miss_cause"] == "corrupt"
            and load["loaded"] == block, load)
    c.check("the prompt's 30 blocks are in the pool", len(pooled) == 30, len(pooled))
    c.check("the clean runs loaded nothing", refa_lookup["external_tokens"] == 0 and lf_lookup["external_tokens"] == 0
            and lf_lookup["local_tokens"] == block * 128, (refa_lookup, lf_lookup))
    c.check("every pooled block has a clean computation to compare with", len(compared) == len(pooled),
            (len(compared), len(pooled)))
    c.check("pooled blocks equal a clean same-partition computation", not differ,
            f"{len(differ)} of {len(compared)} differ: blocks {differ[:20]}")
    c.check("B's request completed", b.finish_reason == "length", (b.finish_reason, b.error))
    c.output("B's output equals the same-partition fault-free run", b, ref)
    c.evidence.update(block=block, control=control, pooled=len(pooled), compared=len(compared), differ=differ,
                      withheld_blocks=sum(r["blocks"] for r in withheld),
                      clean_equal_to_loaded_reference=f"{len(agree)} of {sum(1 for x in clean_b if x in loaded_ref)}")
    return c.verdict(f"corrupt block {block} under B's load: nothing computed on the failed blocks was published; "
                     f"all {len(compared)} pooled blocks equal a clean computation of the same partition")


def _probe_fresh_s(cluster: Cluster, names: tuple[str, ...]) -> float:
    """The longest heartbeat age at which these replicas' connectors still trust the
    segment's index (kvpool.connector.settings.probe_fresh_s, or the replica's override)."""
    from kvpool.connector.settings import ConnectorSettings  # imports vLLM: the gate's catalog does not

    return max(float(dict(cluster.replicas[n].spec.connector_extra).get("probe_fresh_s",
                                                                        ConnectorSettings.probe_fresh_s))
               for n in names)


def pool_restart(cluster: Cluster, corpus: Corpus, seed: int, control: str | None = None) -> Verdict:
    """The pool daemon is killed (SIGKILL) under two live replicas, then restarted:
    while it is down every lookup is a transport_error and requests are computed
    locally with unchanged output; after the restart the replicas reconnect by
    themselves, the new pool starts empty (and says so), and sharing resumes.

    control="no_reconnect": B's pool client never replaces its dead connection."""
    if control not in (None, "no_reconnect"):
        raise ValueError(f"unknown control {control!r}")
    if control:
        cluster.faults["B"].write_text(json.dumps({"client": {"control": control}}))
    rng = random.Random(seed)
    p1, p2 = corpus.text(700, rng), corpus.text(700, rng)
    tag = _tag("k", seed)
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    h = cluster.history_dir
    complete(A, p1, tag=f"{tag}-a1", replica="A")
    cluster.nemesis("pool_kill")
    cluster.pool.kill()
    try:
        # The segment's index outlives the daemon, and a replica trusts it while its heartbeat
        # is at most probe_fresh_s old: a request sent sooner may find A's blocks by the probe
        # and meet the dead daemon only at its load (a transport_error there, recomputed). The
        # scenario judges the lookup's own path, so it waits until every replica's probe must
        # see the heartbeat stale (the daemon is dead: its last beat is behind us).
        time.sleep(_probe_fresh_s(cluster, ("B",)) + 0.05)
        b1 = complete(B, p1, tag=f"{tag}-b1", replica="B")
        down = _one(h, "lookup", tag=f"{tag}-b1")
    finally:  # the heal step runs whatever happened
        cluster.pool.restart()
        cluster.nemesis("pool_restart")
    b1_cold = complete(B, p1, tag=f"{tag}-b1cold", replica="B", load=False, publish=False, cache_salt=f"cold-{tag}")
    complete(A, p2, tag=f"{tag}-a2", replica="A")
    wait_stored(cluster, f"{tag}-a2", "A")
    b2 = complete(B, p2, tag=f"{tag}-b2", replica="B")
    up = _one(h, "lookup", tag=f"{tag}-b2")
    c = Checks()
    c.check("with the pool down the lookup is a transport_error", down["outcome"] == "miss"
            and down["miss_cause"] == "transport_error", down)
    c.check("the request was computed locally", len(b1.token_ids) == 16, len(b1.token_ids))
    c.output("computed locally with the pool down, its output equals a cold run's", b1, b1_cold)
    c.check("the restarted pool said it recovered from a crash", bool(cluster.pool.address["restarted_after_crash"]))
    c.check("after the restart sharing resumed", up["outcome"] == "remote_hit" and up["hit_blocks"] == 5, up)
    c.check("and its output is complete", len(b2.token_ids) == 16)
    c.evidence.update(down=down.get("error", "")[:120], recovery_note=cluster.pool.address.get("recovery_note"))
    return c.verdict("pool crash: lookups failed as transport_error, outputs unchanged, sharing resumed after restart")


def revision_mismatch(cluster: Cluster, corpus: Corpus, seed: int, replica: str = "C",
                      control: str | None = None) -> Verdict:
    """`replica` runs another revision of the model (other weights, same tokenizer) on the
    same pool: it must find A's blocks `incompatible`, name `model_revision` as the only
    differing field, load nothing, and generate what it generates cold.

    control="key_without_revision": A and `replica` key their blocks without the model
    revision (kvgate.faults.backend's namespace control), so the other revision loads A's KV."""
    if control not in (None, "key_without_revision"):
        raise ValueError(f"unknown control {control!r}")
    if control:
        for name in ("A", replica):
            cluster.faults[name].write_text(json.dumps({"namespace": {"drop": ["model_revision"]}}))
    rng = random.Random(seed)
    prompt = corpus.text(900, rng)
    tag = _tag("v", seed)
    complete(cluster.replicas["A"].url, prompt, tag=f"{tag}-a", replica="A")
    wait_stored(cluster, f"{tag}-a", "A")
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
    c.check("the other revision generated its 16 tokens", len(c_out.token_ids) == 16, len(c_out.token_ids))
    c.output("the other revision's output equals its own cold run", c_out, cold)
    c.evidence.update(miss_fields=lookup["miss_fields"])
    return c.verdict("another model revision found the blocks incompatible (model_revision) and loaded nothing")


def load_failure_fail(cluster: Cluster, corpus: Corpus, seed: int, control: str | None = None) -> Verdict:
    rng = random.Random(seed)
    prompt = corpus.text(1500, rng)
    tag = _tag("f", seed)
    complete(cluster.replicas["B"].url, prompt, tag=f"{tag}-b", replica="B")
    wait_stored(cluster, f"{tag}-b", "B")
    arm(cluster, "A", control, kind="corrupt", block=0)
    a = complete(cluster.replicas["A"].url, prompt, tag=f"{tag}-a", replica="A", timeout_s=120)
    arm(cluster, "A", None)
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
                        label=_tag("o", seed), settle=lambda tag, replica: settle_publishes(cluster, tag, replica))
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


# -- stream delay: the copy engine held back while the engine moves on ---------------------

def stream_delay_store(cluster: Cluster, corpus: Corpus, seed: int, *, control: bool = False,
                       replica: str = "D", consumer: str = "B") -> Verdict:
    """On `replica` (a small KV cache: its freed blocks are reused at once), the copy of a
    finished request X's blocks to the pool is delayed; request Y, sent as soon as X
    answers, needs more blocks than are free, so it can only run in X's blocks. The
    ordered copier keeps X's blocks until their copy is done: the pool gets the bytes X
    had at save time (the audit's `produced` digests), and a consumer loading X from the
    pool installs exactly those. With the known-bad copier (control=True) X's blocks are
    freed at once, Y overwrites them under the delayed copy, and the pool gets Y's bytes."""
    delay = draw_schedule(seed, "stream").spec("stream_delay").params["store_delay_ms"]
    rng = random.Random(seed)
    x, y = corpus.text(2600, rng), corpus.text(5900, rng)
    tag = _tag("cs" if control else "ds", seed)
    url = cluster.replicas[replica].url
    h = cluster.history_dir
    spec: dict[str, object] = {"store_delay_ms": delay, "times": 2}
    if control:
        spec["control"] = "early_completion"
    arm_copier(cluster, replica, **spec)
    complete(url, x, tag=f"{tag}-x", replica=replica, max_tokens=1, load=False)
    complete(url, y, tag=f"{tag}-y", replica=replica, max_tokens=1, load=False, publish=False)
    wait_for(lambda: sum(r.get("blocks", 0) for r in records(h, "publish", tag=f"{tag}-x", replica=replica)) >= 20,
              2 * delay / 1000 + 60, f"{replica}'s delayed stores of {tag}-x")
    arm_copier(cluster, replica)  # heal
    b = complete(cluster.replicas[consumer].url, x, tag=f"{tag}-b", replica=consumer, max_tokens=4)
    produced = audit_digests(h, "produced", f"{tag}-x", replica)
    pool = pool_digests(cluster.pool, namespace_of(h, replica), list(produced))
    x_blocks = {bid for r in records(h, "audit", kind="produced", tag=f"{tag}-x", replica=replica)
                for bid in r["block_ids"]}
    y_blocks = {bid for r in records(h, "audit", kind="produced", tag=f"{tag}-y", replica=replica)
                for bid in r["block_ids"]}
    start = _one(h, "lookup", tag=f"{tag}-x")["t"]
    fired = [r for r in records(h, "fault", replica=replica) if r["t"] >= start and r.get("site") == "copier"]
    differ = sorted(k for k, d in produced.items() if k in pool and pool[k] != d)
    c = Checks()
    c.check("the store delay fired on both of X's stores", sum(r["kind"] == "stream_delay" for r in fired) == 2,
            [r["kind"] for r in fired])
    c.check("X's 20 complete blocks are in the pool", len(produced) == 20 and len(pool) == 20,
            (len(produced), len(pool)))
    c.check("every pooled block holds the bytes X had at save time", not differ,
            f"{len(differ)} of {len(pool)} differ")
    v = exchange_exact(cluster, (replica, f"{tag}-x"), (consumer, f"{tag}-b"), None)
    c.check(f"{consumer} installed X's bytes: {v.reason}", v.valid is True)
    c.evidence.update(delay_ms=delay, control=control, pooled_blocks_differing=len(differ),
                      x_blocks_reused_by_y=len(x_blocks & y_blocks), consumer_installed=v.evidence.get("installed"),
                      consumer_tokens=len(b.token_ids))
    return c.verdict(f"stores delayed {delay} ms: X's blocks were held until copied; the pool and {consumer} "
                     "got the bytes of save time")


def stream_delay_load(cluster: Cluster, corpus: Corpus, seed: int, *, control: bool = False,
                      replica: str = "D", producer: str = "A") -> Verdict:
    """`producer` publishes a prompt; `replica` loads it with its copy delayed. The
    ordered copier makes the engine wait before the first layer reads: what attention
    reads (the audit's `seen` digests) equals the pool's pages and the output equals the
    replica's own cold run. With the known-bad copier the engine reads the blocks before
    the copy lands."""
    delay = draw_schedule(seed, "stream").spec("stream_delay").params["load_delay_ms"]
    rng = random.Random(seed)
    prompt = corpus.text(2600, rng)
    tag = _tag("cl" if control else "dl", seed)
    url = cluster.replicas[replica].url
    h = cluster.history_dir
    complete(cluster.replicas[producer].url, prompt, tag=f"{tag}-a", replica=producer, max_tokens=1)
    wait_stored(cluster, f"{tag}-a", producer)
    spec: dict[str, object] = {"load_delay_ms": delay, "times": 1}
    if control:
        spec["control"] = "early_completion"
    arm_copier(cluster, replica, **spec)
    d = complete(url, prompt, tag=f"{tag}-d", replica=replica, publish=False)
    wait_for(lambda: bool(records(h, "load", tag=f"{tag}-d", replica=replica)), delay / 1000 + 60,
              f"{replica}'s delayed load of {tag}-d")
    arm_copier(cluster, replica)  # heal
    ref = fault_free_reference(cluster, producer, replica, prompt, tag, 20, publish=False)
    cold = complete(url, prompt, tag=f"{tag}-cold", replica=replica, load=False, publish=False,
                    cache_salt=f"cold-{tag}")
    seen = audit_digests(h, "seen", f"{tag}-d", replica)
    pool = pool_digests(cluster.pool, namespace_of(h, replica), list(seen))
    load = _one(h, "load", tag=f"{tag}-d", replica=replica)
    start = _one(h, "lookup", tag=f"{tag}-d")["t"]
    fired = [r for r in records(h, "fault", replica=replica) if r["t"] >= start and r.get("site") == "copier"]
    differ = sorted(k for k, dg in seen.items() if pool.get(k) != dg)
    c = Checks()
    c.check("the load delay fired", [r["kind"] for r in fired] == ["stream_delay"], [r["kind"] for r in fired])
    c.check("the delayed load installed all 20 blocks", load["loaded"] == 20 and not load["failed_block_ids"], load)
    c.check("attention read the pool's bytes", len(seen) == 20 and not differ, f"{len(differ)} of {len(seen)} differ")
    c.check("D generated its 16 tokens", len(d.token_ids) == 16, len(d.token_ids))
    c.output("the output equals the same-partition run without the delay", d, ref)
    c.evidence.update(delay_ms=delay, control=control, blocks_read_before_copy=len(differ),
                      tokens_equal_cold=d.token_ids == cold.token_ids)
    return c.verdict(f"load delayed {delay} ms: the engine waited; attention read the pool's bytes; output unchanged")


# -- crashes ----------------------------------------------------------------------------------

def replica_crash(cluster: Cluster, corpus: Corpus, seed: int, *, replica: str = "D", consumer: str = "B",
                  control: str | None = None) -> Verdict:
    """`replica` is SIGKILLed while one of its publishes is open (pages reserved and
    written, the commit held back by kvgate.faults.backend's `publish: hang`). The pool must
    reclaim the reservation when the connection dies (its page accounting returns to
    where it was), make none of those blocks visible (the consumer's lookup is
    never_published and it computes the prompt itself), and the restarted replica
    publishes the prompt again.

    control="leaky_pool": the pool daemon runs the known-bad LeakyCatalog
    (kvgate.faults.controls), which never returns an aborted publish's pages."""
    if control not in (None, "leaky_pool"):
        raise ValueError(f"unknown control {control!r}")
    rng = random.Random(seed)
    x = corpus.text(2600, rng)
    tag = _tag("kc" if control else "kr", seed)
    h = cluster.history_dir
    with pool_catalog(cluster, "leaky" if control else None):
        with cluster.pool.client(name="crash") as pc:
            before = pc.stats()
        cluster.faults[replica].write_text(json.dumps({"publish": {"kind": "hang", "seconds": 600, "times": 1}}))
        complete(cluster.replicas[replica].url, x, tag=f"{tag}-x", replica=replica, max_tokens=1, load=False)
        start = _one(h, "lookup", tag=f"{tag}-x")["t"]
        wait_for(lambda: any(r["kind"] == "publish_hang" and r["t"] >= start
                              for r in records(h, "fault", replica=replica)), 60, f"{replica}'s publish to hang")
        with cluster.pool.client(name="crash") as pc:
            during = pc.stats()
        cluster.kill_replica(replica)
        c = Checks()
        with cluster.pool.client(name="crash") as pc:
            try:
                wait_for(lambda: pc.stats()["reserved_pages"] == before["reserved_pages"], 10,
                          "the pool to reclaim the dead replica's reservation")
            except AssertionError as exc:
                c.check("the pool reclaimed the open publish", False, str(exc))
            after = pc.stats()
        b = complete(cluster.replicas[consumer].url, x, tag=f"{tag}-b", replica=consumer, max_tokens=4)
        lookup = _one(h, "lookup", tag=f"{tag}-b")
        c.check("the publish was open when the replica died", during["reserved_pages"] > before["reserved_pages"],
                (before["reserved_pages"], during["reserved_pages"]))
        c.check("no page of it stays reserved", after["reserved_pages"] == before["reserved_pages"],
                (before["reserved_pages"], after["reserved_pages"]))
        c.check("every page came back to the free list", after["free_pages"] == before["free_pages"],
                (before["free_pages"], after["free_pages"]))
        c.check("none of its blocks became visible", lookup["outcome"] == "miss"
                and lookup["miss_cause"] == "never_published" and lookup["miss_index"] == 0, lookup)
        c.check(f"{consumer} computed the prompt itself", b.finish_reason == "length" and len(b.token_ids) == 4)
        cluster.faults[replica].write_text("{}")
        cluster.restart_replica(replica)  # heal
        again = complete(cluster.replicas[replica].url, x, tag=f"{tag}-x2", replica=replica, max_tokens=1,
                         load=False, cache_salt=f"after-{tag}")
        wait_for(lambda: any(r.get("committed") for r in records(h, "publish", tag=f"{tag}-x2", replica=replica)),
                  60, f"the restarted {replica} to publish")
        c.check(f"the restarted {replica} serves and publishes", again.finish_reason == "length")
        # The behaviour a leak breaks: the pool's whole capacity can be reserved again (committed
        # pages are evicted to make room; a page that never came back cannot be had).
        reservable = _reservable_pages(cluster, namespace_of(h, replica), rng)
        c.check("the pool's whole capacity can be reserved again", reservable == cluster.pool_pages,
                f"{reservable} of {cluster.pool_pages} pages")
        c.evidence.update(control=control, reserved_during=during["reserved_pages"] - before["reserved_pages"],
                          leaked_pages=before["free_pages"] - after["free_pages"], reservable_pages=reservable)
        return c.verdict(f"{replica} killed mid-publish: the pool reclaimed its {c.evidence['reserved_during']} "
                         f"reserved pages, none became visible, {consumer} computed the prompt, {replica} restarted")


def _reservable_pages(cluster: Cluster, ns, rng: random.Random) -> int:  # noqa: ANN001
    """How many pages one reservation of the pool's whole capacity gets (fresh seeded keys),
    then aborts it: what a publisher can still have, through the daemon's own allocator."""
    keys = [rng.randbytes(16) for _ in range(cluster.pool_pages)]
    with cluster.pool.client(name="capacity", timeout_s=30.0) as pc:
        res = pc.reserve(ns, keys, [1] * len(keys))
        got = sum(1 for slot in res.slots if slot.status == "reserved")
        if res.reservation_id:
            pc.abort(res.reservation_id)
    return got


# -- transport faults: the proxy between the remote replica and the pool --------------------

PROXY_SCHEDULE_KIND = {"reset": "conn_reset", "truncate": "truncated_frame", "bitflip": "bitflip", "stall": "stall",
                       "drop_reply": "stall", "slow": "slow_link"}  # the proxy's kind -> the schedule's
TRANSPORT_CAUSE = {"reset": "transport_error", "truncate": "transport_error", "bitflip": "corrupt",
                   "stall": "timeout", "drop_reply": "timeout", "slow": None}


def transport_fault(cluster: Cluster, corpus: Corpus, seed: int, kind: str, *, replica: str = "D",
                    producer: str = "A", control: str | None = None) -> Verdict:
    """`producer` publishes a prompt; `replica` (whose pool traffic crosses a fault proxy
    in remote mode: page bytes travel as frames) loads it while the proxy injects `kind`
    into the page-read frames (kvgate.faults.proxy). The load must end as the kind's cause
    (reset, truncate: transport_error; bitflip: corrupt; stall, drop_reply: timeout;
    slow: no miss at all) at the block the fault struck, every block from there is
    recomputed, and the output equals a fault-free run with the same prefill partition
    (the producer publishes exactly the blocks that loaded, under another salt).

    control="hide_failures": the replica's connector does not report failed blocks."""
    if kind not in TRANSPORT_CAUSE:
        raise ValueError(f"unknown transport fault {kind!r}; known {sorted(TRANSPORT_CAUSE)}")
    rng = random.Random(seed)
    prompt = corpus.text(1500, rng)
    n_blocks = 1501 // 128
    tag = _tag(f"t{kind[:3]}" + ("c" if control else ""), seed)
    url, purl = cluster.replicas[replica].url, cluster.replicas[producer].url
    h = cluster.history_dir
    complete(purl, prompt, tag=f"{tag}-a", replica=producer, cache_salt=f"s-{tag}")
    wait_stored(cluster, f"{tag}-a", producer)
    # BUGGIFY-style, from the run's fault schedule: the proxy's site is active for this run and
    # each page-read frame that reaches it fires with the schedule's probability, by the
    # schedule's own draw; the frames before the first firing pass untouched.
    skind = PROXY_SCHEDULE_KIND[kind]
    sched = draw_schedule(seed)
    sspec = sched.spec(skind)
    after = sched.first_firing(skind, limit=n_blocks - 1)  # the block the fault strikes
    if after is None:
        raise AssertionError(f"the schedule's {skind} site does not fire within {n_blocks - 1} frames (seed {seed})")
    spec: dict[str, object] = {"ops": ["read"], "direction": "reply", "times": 1, "p": sspec.probability,
                               "schedule_seed": seed, "schedule_kind": skind,
                               "seed": rng.randrange(2**32)}  # the proxy's draws (bit, cut) from this seed
    slowed = [n for n in range(n_blocks) if sched.fires(skind, n)]
    if kind == "stall":
        spec["seconds"] = 8.0
    elif kind == "slow":
        spec.update(bytes_per_s=4_000_000, latency_s=0.02, times=n_blocks)
    if control:
        cluster.faults[replica].write_text(json.dumps({"connector": {"control": control}}))
    cluster.arm_proxy(replica, {kind: spec})
    d = complete(url, prompt, tag=f"{tag}-d", replica=replica, cache_salt=f"s-{tag}")
    cluster.arm_proxy(replica, {})
    cluster.faults[replica].write_text("{}")
    load = _one(h, "load", tag=f"{tag}-d", replica=replica)
    k = load["loaded"]
    ref = fault_free_reference(cluster, producer, replica, prompt, tag, k)
    ref_load = records(h, "load", tag=f"{tag}-ref", replica=replica)
    start = _one(h, "lookup", tag=f"{tag}-d")["t"]
    fired = [r for r in records(h, "fault", replica=replica) if r["t"] >= start and r.get("role") == "proxy"
             and r["t"] <= load["t"]]
    want = TRANSPORT_CAUSE[kind]
    c = Checks()
    c.check(f"the proxy injected {kind}", bool(fired) and all(r["kind"] == kind for r in fired),
            [r["kind"] for r in fired])
    if want is None:
        c.check("the slowed load completed", k == load["blocks"] and load["miss_cause"] is None, load)
        c.check("the schedule's frames, and only those, were slowed", len(fired) == len(slowed),
                (len(fired), slowed))
    else:
        c.check(f"the load stopped as {want}", load["miss_cause"] == want and k < load["blocks"], load)
        c.check("at the block the fault struck", k == after, (k, after))
        c.check("every block from there was reported failed", len(load["failed_block_ids"]) == load["blocks"] - k)
    c.check("the reference loaded exactly the same blocks", (k == 0 and not ref_load)
            or (len(ref_load) == 1 and ref_load[0]["loaded"] == k), [r["loaded"] for r in ref_load])
    c.check("D's request completed", d.finish_reason == "length", (d.finish_reason, d.error))
    c.output("tokens and log-probabilities equal the fault-free run of the same partition", d, ref)
    c.evidence.update(kind=kind, block=after, loaded=k, fired=len(fired), control=control, probability=sspec.probability,
                      tokens_equal_reference=d.token_ids == ref.token_ids, output_equal_reference=d.same_output(ref),
                      load_seconds=load.get("seconds"))
    if want is None:
        return c.verdict(f"{kind} link: all {load['blocks']} blocks loaded byte-exact through it, output equal to "
                         "the fault-free run")
    return c.verdict(f"{kind} on the wire at block {after}: classified {want}, recomputed from there, output equal "
                     "to the fault-free run")


# -- evictions against leases -----------------------------------------------------------------

def evict_leased(cluster: Cluster, corpus: Corpus, seed: int, *, control: str | None = None) -> Verdict:
    """While B's load holds its lease (kvgate.faults.backend `hold`, at a seed-drawn block), the
    harness tries to evict every block B is loading and squeezes the pool's capacity to
    zero. Every eviction of a leased page must be refused (`leased`), the squeeze may
    take only unleased pages, B's load completes byte-exact with output equal to the
    same-partition run without the hold; once the lease is released, the squeeze takes the rest.

    control="leaseless_pool": the daemon runs the known-bad LeaselessCatalog
    (kvgate.faults.controls), which evicts leased pages."""
    import threading


    if control not in (None, "leaseless_pool"):
        raise ValueError(f"unknown control {control!r}")
    block = draw_schedule(seed, "eviction").spec("evict").params["block"] % 8
    rng = random.Random(seed)
    prompt = corpus.text(1500, rng)
    tag = _tag("ec" if control else "el", seed)
    h = cluster.history_dir
    with pool_catalog(cluster, "leaseless" if control else None):
        complete(cluster.replicas["A"].url, prompt, tag=f"{tag}-a", replica="A")
        wait_stored(cluster, f"{tag}-a", "A")
        keys = [bytes.fromhex(k) for k in audit_digests(h, "produced", f"{tag}-a", "A")]
        ns = namespace_of(h, "B")
        arm(cluster, "B", kind="hold", block=block, seconds=3)
        out: dict[str, object] = {}

        def request() -> None:
            out["b"] = complete(cluster.replicas["B"].url, prompt, tag=f"{tag}-b", replica="B")

        t = threading.Thread(target=request)
        t.start()
        def held() -> bool:
            lookup = records(h, "lookup", tag=f"{tag}-b")
            return bool(lookup) and any(r["kind"] == "lease_hold" and r["t"] >= lookup[0]["t"]
                                        for r in records(h, "fault", replica="B"))

        wait_for(held, 60, "B's load to hold its lease")
        cluster.nemesis("evict_leased", blocks=len(keys))
        with cluster.pool.client(name="evictor") as pc:
            outcomes = pc.evict(ns, keys[:11])
            pages = pc.stats()["num_pages"]
            squeezed = pc.set_capacity(0)
            during = pc.stats()
        t.join(120)
        with cluster.pool.client(name="evictor") as pc:
            after_release = pc.set_capacity(0)
            pc.set_capacity(pages)
        arm(cluster, "B", None)
        b = out.get("b")
        load = _one(h, "load", tag=f"{tag}-b", replica="B")
        ref = fault_free_reference(cluster, "A", "B", prompt, tag, load["blocks"])
        c = Checks()
        c.check("every eviction of a leased page was refused", bool(outcomes)
                and all(str(o) == "leased" for o in outcomes[:load["blocks"]]), [str(o) for o in outcomes])
        c.check("the squeeze left the leased pages", during["leased_pages"] >= load["blocks"],
                (during["leased_pages"], load["blocks"]))
        c.check("B's load completed under the squeeze", load["loaded"] == load["blocks"] and not load["miss_cause"],
                load)
        c.check("B generated its 16 tokens", b is not None and len(b.token_ids) == 16)
        c.output("B's output equals the same-partition run without the hold", b, ref)
        c.check("once released, the squeeze took the rest", after_release >= load["blocks"], after_release)
        v = exchange_exact(cluster, ("A", f"{tag}-a"), ("B", f"{tag}-b"), None)
        c.check(v.reason, v.valid is True)
        c.evidence.update(control=control, hold_block=block, evict_outcomes=sorted({str(o) for o in outcomes}),
                          squeezed_while_leased=squeezed, evicted_after_release=after_release)
        return c.verdict(f"{len(outcomes)} evictions of leased pages refused, the squeeze waited for the lease, "
                         "B's load completed byte-exact")


from kvgate.harness.scenarios.hosts import cross_host  # noqa: E402 - the multi-host runners (kvgate.harness.system.hosts)

RUNNERS: dict[str, Callable[..., Verdict]] = {
    "cross_replica_hit": cross_replica_hit,
    "partial_hit": partial_hit,
    "shared_system_prompt": shared_system_prompt,
    "hit_kinds": hit_kinds,
    "load_failure": load_failure,
    "aligned_full_hit": aligned_full_hit,
    "load_poison": load_poison,
    "load_failure_fail": load_failure_fail,
    "pool_restart": pool_restart,
    "revision_mismatch": revision_mismatch,
    "sessions": sessions,
    "stream_delay_store": stream_delay_store,
    "stream_delay_load": stream_delay_load,
    "replica_crash": replica_crash,
    "transport_fault": transport_fault,
    "evict_leased": evict_leased,
    "cross_host": cross_host,
}
