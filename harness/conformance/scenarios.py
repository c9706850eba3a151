"""The connector-agnostic scenarios: each judged only from what any V1 connector shows
through its hooks (kvpool.connector.audit's records: what it claimed at get_num_new_matched_tokens,
the blocks it installed and the blocks producers computed, by token-chain hash; the
blocks it reported failed) and from the requests' outputs. Nothing here reads kvpool's
own records, so the same scenario gates kvpool and any other connector.

  SCENARIOS   name -> Scenario (what it needs, its body)
  Cell        one scenario's result for one connector: pass | fail | n/a | not run

A scenario's body returns (ok, reason, evidence) or raises; a body that needs a capability
the connector lacks is never run: its cell is "n/a" with the connector's reason. Every
prompt comes from the scenario's seed. A negative (or positive) control runs where the
scenario has one, and a control that is not caught fails the cell.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

from kvgate.harness.checkers.history import records
from kvgate.harness.checkers.verdict import Checks
from kvgate.harness.client.http import Completion, RequestFailed, complete
from kvgate.harness.conformance import lifecycle
from kvgate.harness.conformance.accounting import CONSERVATION, accounting
from kvgate.harness.conformance.boundaries import exact_boundaries
from kvgate.harness.conformance.context import (
    BLOCK,
    Ctx,
    ScenarioDown,
    _exact,
    _tag,
    all_digests,
    arm_control,
    same_output,
)
from kvgate.harness.conformance.race import LEAK, VISIBILITY, same_key_race
from kvgate.harness.workload.prompts import common_prefix_tails

def cross_replica_hit(ctx: Ctx, prompt_tokens: int = 1500, control: str | None = None) -> Checks:
    """A computes a prompt; B loads what A stored and computes the rest: the installed
    blocks equal A's bytes, and B's output (tokens and log-probabilities) equals A's own
    prefix-cache hit of the prompt (the same prefill partition: cached blocks, then the tail)."""
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    n = prompt_tokens + 1
    tag = _tag("x", ctx.seed)
    ctx.run("A", prompt, f"{tag}-a")
    if control:
        arm_control(ctx, "B", control)
    b = ctx.run("B", prompt, f"{tag}-b")
    a_hit = ctx.run("A", prompt, f"{tag}-ahit")
    c = Checks()
    m = ctx.match("B", f"{tag}-b")
    c.check("B's connector claimed a hit", m is not None and m["external_tokens"] > 0, m)
    _exact(c, ctx, ("B", f"{tag}-b"), ("A", f"{tag}-a"), 1)
    c.check("B generated 16 tokens", len(b.token_ids) == 16 and b.error is None, b.error)
    same_output(c, ctx, "B's output equals A's prefix hit of the same prompt", b, a_hit)
    c.evidence.update(prompt_tokens=n, claimed=m)
    return c


def long_prompt(ctx: Ctx) -> Checks:
    """cross_replica_hit with a prompt of 5000 tokens: longer than the prefill chunk
    (2048), so A stores it over three steps and B loads a run that spans them."""
    return cross_replica_hit(ctx, prompt_tokens=5000)


def aligned_full_hit(ctx: Ctx, blocks: int = 12) -> Checks:
    """A block-aligned prompt (12 x 128 tokens) whose every block A computed: B may load
    all but the last block (one prompt token is always computed; a connector that loads
    asynchronously may claim them all, and the engine computes the last token again),
    completes, and its output equals A's prefix hit."""
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(blocks * BLOCK - 1, rng)  # + BOS: exactly `blocks` blocks
    tag = _tag("f", ctx.seed)
    ctx.run("A", prompt, f"{tag}-a")
    b = ctx.run("B", prompt, f"{tag}-b")
    a_hit = ctx.run("A", prompt, f"{tag}-ahit")
    c = Checks()
    m = ctx.match("B", f"{tag}-b")
    # A synchronous loader must leave the last token to compute; after an asynchronous load of
    # the whole prompt the engine computes it again itself (vLLM's full-prompt-hit rule).
    c.check("B's connector claimed a hit that leaves a token to compute (or loads asynchronously)",
            m is not None and 0 < m["external_tokens"]
            and (m["local_tokens"] + m["external_tokens"] < blocks * BLOCK or m["load_async"]), m)
    _exact(c, ctx, ("B", f"{tag}-b"), ("A", f"{tag}-a"), 1)
    c.check("B generated 16 tokens", len(b.token_ids) == 16 and b.error is None, b.error)
    same_output(c, ctx, "B's output equals A's prefix hit", b, a_hit)
    c.evidence.update(claimed=m, prompt_tokens=blocks * BLOCK)
    return c


def partial_hit(ctx: Ctx, common: int = 1000) -> Checks:
    """Two prompts share a 1001-token prefix (7 complete blocks): after A computed the
    first, B loads common blocks of the second (at its own granularity) and computes the
    rest. Its output
    equals the same partition computed by A alone: under a cache_salt of their own, A
    computes the first prompt, then the second on its own cached prefix (the salt keeps
    what B stored of the second prompt out of that run)."""
    rng = random.Random(ctx.seed)
    t1, t2 = common_prefix_tails(ctx.corpus, rng, prefix_tokens=common, tails=2, tail_tokens=300)
    tag = _tag("p", ctx.seed)
    full = (common + 1) // BLOCK
    ctx.run("A", t1.prompt, f"{tag}-a")
    b = ctx.run("B", t2.prompt, f"{tag}-b")
    ctx.run("A", t1.prompt, f"{tag}-ref1", cache_salt=f"{tag}-ref")
    a2 = ctx.run("A", t2.prompt, f"{tag}-a2", cache_salt=f"{tag}-ref")
    c = Checks()
    m = ctx.match("B", f"{tag}-b")
    claimed = None if m is None else m["local_tokens"] + m["external_tokens"]
    c.check(f"B's connector claimed part of the {full} common blocks and nothing past them",
            claimed is not None and 0 < m["external_tokens"] and claimed <= full * BLOCK, m)
    _exact(c, ctx, ("B", f"{tag}-b"), ("A", f"{tag}-a"), 1)
    same_output(c, ctx, "B's output equals A's run of the same prompt on its own cached prefix", b, a2)
    c.evidence.update(common_blocks=full, claimed=m)
    return c


def salt_isolation(ctx: Ctx, prompt_tokens: int = 1200) -> Checks:
    """A computes a prompt under cache_salt s1. B asks for it under s2: nothing of A's may
    be installed. Positive control: B asks again under s1 and must hit (else the
    isolation check could not have seen a hit at all)."""
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    tag = _tag("s", ctx.seed)
    s1, s2 = f"{tag}-one", f"{tag}-two"
    ctx.run("A", prompt, f"{tag}-a", cache_salt=s1)
    ctx.run("B", prompt, f"{tag}-b2", cache_salt=s2)
    c = Checks()
    produced = ctx.produced("A", f"{tag}-a")
    leaked = ctx.installed_from("B", f"{tag}-b2", produced)
    m2 = ctx.match("B", f"{tag}-b2")
    c.check("B under another salt installed none of A's blocks", not leaked,
            f"{len(leaked)} blocks of salt {s1!r} installed under {s2!r}")
    c.check("B's connector claimed nothing under another salt", m2 is not None and m2["external_tokens"] == 0, m2)
    ctx.run("B", prompt, f"{tag}-b1", cache_salt=s1)
    got = ctx.installed_from("B", f"{tag}-b1", produced)
    c.check("positive control: B under the same salt installed A's blocks", len(got) > 0, len(got))
    c.evidence.update(leaked=len(leaked), positive_control_installed=len(got))
    return c


def revision_isolation(ctx: Ctx, prompt_tokens: int = 1200) -> Checks:
    """C serves another revision of the model (other weights, same tokenizer) on the same
    store: it may not install what A (revision r1) computed; positive control: B (r1)
    installs it."""
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    tag = _tag("r", ctx.seed)
    ctx.run("A", prompt, f"{tag}-a")
    ctx.run("C", prompt, f"{tag}-c")
    c = Checks()
    produced = ctx.produced("A", f"{tag}-a")
    leaked = ctx.installed_from("C", f"{tag}-c", produced)
    m = ctx.match("C", f"{tag}-c")
    c.check("C (revision r2) installed none of A's (r1) blocks", not leaked,
            f"{len(leaked)} blocks computed by revision r1 installed by revision r2")
    c.check("C's connector claimed nothing", m is not None and m["external_tokens"] == 0, m)
    ctx.run("B", prompt, f"{tag}-b")
    got = ctx.installed_from("B", f"{tag}-b", produced)
    c.check("positive control: B (r1) installed A's blocks", len(got) > 0, len(got))
    c.evidence.update(leaked=len(leaked), positive_control_installed=len(got))
    return c


def _broke(c: Checks, broken: dict) -> None:
    """The data fault broke something where the connector keeps what the scenario stored (a
    fault that found nothing to break would leave the scenario nothing to judge)."""
    c.check("the data fault broke what the connector stored", broken.get("broken", 1) > 0, broken)


def load_failure_recompute(ctx: Ctx, prompt_tokens: int = 1500, control: str | None = None) -> Checks:
    """A computes a prompt; its stored KV is broken where the connector keeps it (the
    whole run: its first block, or a file of every layer's record); B (policy
    recompute) asks for it. B must complete with A's output to the last bit (the whole
    prompt recomputed: A's own partition), and every block it claimed and did not load
    must have been reported failed. Negative control `hide_failures`: the failures are not
    reported, the engine computes on what the blocks held, and the output differs."""
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    tag = _tag("l", ctx.seed)
    a = ctx.run("A", prompt, f"{tag}-a")
    broken = ctx.profile.break_stored(ctx.cluster, "B")
    if control:
        arm_control(ctx, "B", control)
    b = ctx.run("B", prompt, f"{tag}-b")
    c = Checks()
    _broke(c, broken)
    m = ctx.match("B", f"{tag}-b")
    failed = ctx.failed_reported("B")
    claimed = 0 if m is None else m["external_tokens"] // BLOCK
    c.check("B completed (policy recompute)", b.error is None and len(b.token_ids) == 16, b.error)
    c.check("the broken blocks it claimed were reported failed", claimed == 0 or len(failed) > 0,
            {"claimed_blocks": claimed, "reported_failed": len(failed)})
    c.output("B's output equals A's (the prompt recomputed)", b, a)
    c.evidence.update(broken=broken, claimed=m, reported_failed=len(failed))
    return c


def load_failure_fail(ctx: Ctx, prompt_tokens: int = 1500) -> Checks:
    """B computes a prompt; its stored KV is broken; A (policy fail) asks for it: the
    request ends with an explicit error, and A keeps serving."""
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    tag = _tag("e", ctx.seed)
    ctx.run("B", prompt, f"{tag}-b")
    broken = ctx.profile.break_stored(ctx.cluster, "A")
    c = Checks()
    _broke(c, broken)
    hung = False
    try:
        a = complete(ctx.url("A"), prompt, tag=f"{tag}-a", replica="A", timeout_s=ctx.timeout_s)
        error = a.error
    except RequestFailed as exc:  # an HTTP error is explicit; a request that never answered is not
        import requests

        hung = isinstance(exc.__cause__, (requests.Timeout, requests.ConnectionError))
        error = None if hung else str(exc)
    if ctx.cluster.crashed():
        raise ScenarioDown(f"A died on its failed load; gone: {ctx.cluster.crashed()}")
    c.check("A's request ended with an explicit error", error is not None,
            f"no answer within {ctx.timeout_s} s" if hung else error)
    after = ctx.run("A", ctx.corpus.text(200, rng), f"{tag}-after")
    c.check("A keeps serving", after.error is None and len(after.token_ids) == 16, after.error)
    c.evidence.update(broken=broken, error=(error or "")[:300])
    return c


def _schedule_records(ctx: Ctx, replica: str, since: float) -> list[dict]:
    """The replica's fault connector's schedule records (its worker's history files only:
    read often while a request is in flight) since the wall clock `since`."""
    from kvgate.harness.checkers.history import read_history

    return [r for r in read_history(ctx.h, f"{replica}.faults-worker.*.jsonl")
            if r["ev"] == "schedule" and r.get("kind") == "hold_recv" and r["t"] >= since]


def abort_during_load(ctx: Ctx, prompt_tokens: int = 1800, control: str | None = None) -> Checks:
    """A computes a prompt (one prefill chunk: a longer one is long_prompt's case); B is
    asked for it and its client goes away while B's load is in flight. Where B's connector
    loads asynchronously, B's fault connector holds the load's completion (schedule section
    `hold_recv`) until the engine has finished the request, and the client leaves as soon as
    the load is held: the abort lands during the load, every run. Where it loads inside the
    engine's step (synchronously) or claims nothing, no load is ever in flight between steps:
    the client leaves after a seeded delay (10-300 ms), or when the answer is already there
    (the report says which; a tiny request can finish first). Either way B keeps serving, every
    block it installed before a synchronous abort equals A's bytes, and the same prompt asked again is
    loaded byte-exact with A's prefix hit's output. Negative control `stale_completion`: the
    aborted request is reported finished once more (vllm#43226's double completion), and B
    must be seen to stop serving."""
    import json

    from kvgate.faults.control import write_control
    from kvgate.harness.client.http import abandon

    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    delay = round(rng.uniform(0.01, 0.3), 3)
    tag = _tag("q", ctx.seed)
    ctx.run("A", prompt, f"{tag}-a")
    path = ctx.cluster.faults["B"]
    doc = json.loads(path.read_text() or "{}")
    doc["schedule"] = {"hold_recv": True}
    write_control(path, doc)
    if control:
        arm_control(ctx, "B", control)
    t_send = time.time()
    seen: dict[str, dict] = {}  # B's first answer to the lookup of this request, once read

    def match() -> dict | None:
        if "m" not in seen:
            from kvgate.harness.checkers.history import read_history

            found = [r for r in read_history(ctx.h, "B.audit-scheduler.*.jsonl")
                     if r["ev"] == "audit_match" and r.get("tag") == f"{tag}-abort"]
            if found:
                seen["m"] = found[0]
        return seen.get("m")

    def mine(job: str) -> list[dict]:  # this request's hold records of one kind
        m = match()
        return [] if m is None else [r for r in _schedule_records(ctx, "B", t_send)
                                     if r.get("job") == job and r.get("req") == m["req"]]

    def moment(elapsed: float) -> str | None:
        m = match()
        if m is None:
            return None
        if mine("hold"):
            return "load held"
        if not (m["load_async"] and m["external_tokens"] > 0) and elapsed >= delay:
            return "synchronous load" if m["external_tokens"] > 0 else "no claim"
        return None

    try:
        why, left = abandon(ctx.url("B"), prompt, tag=f"{tag}-abort", replica="B", until=moment,
                            limit_s=min(ctx.timeout_s, 120.0), poll_s=0.05)
        # The engine's finish of the request reaches B's worker (job "finished"); a held load is
        # then released in the same call ("release", why "finished")
        deadline = time.monotonic() + 30
        finished = released = None
        while time.monotonic() < deadline:
            finished = next(iter(mine("finished")), None)
            released = next((r["why"] for r in mine("release")), None)
            if finished is not None and (why != "load held" or released is not None):
                break
            time.sleep(0.05)
    finally:  # the hold lifted and the control disarmed, however the abort went: what is held is reported now
        doc = json.loads(path.read_text() or "{}")
        doc.pop("schedule", None)
        doc.pop("connector", None)
        write_control(path, doc)
    time.sleep(1.0)  # the engine's abort of the request, and anything it set off, lands
    c = Checks()
    c.evidence.update(abort_after_s=round(left, 3), abort_moment=why, seeded_delay_s=delay, control=control,
                      answered_before_the_client_left=why == "answered")
    c.check("B's client went away within its limit", why != "limit",
            f"no load held and no claim after {left:.0f} s")
    c.check("B's engine finished the request", finished is not None, "its finish did not reach the worker in 30 s")
    if why == "load held":
        c.check("the abort landed while the load was in flight (the held completion was released by the "
                "request's finish)", released == "finished", released or "not released within 30 s")
    before = ctx.installed("B", f"{tag}-abort")
    c.evidence.update(installed_before_abort=len(before))
    if why != "load held":  # a held request is never scheduled: nothing of it is installed, by construction
        produced = ctx.produced("A", f"{tag}-a")
        c.check("every block B installed before the abort equals A's bytes",
                all(produced.get(k) == d for k, d in before.items()), len(before))
    # B serves the same prompt again: an engine that died of the abort answers 500 before its
    # process is gone, or is gone
    b, refused = None, None
    if not ctx.cluster.crashed():
        try:
            b = complete(ctx.url("B"), prompt, tag=f"{tag}-b", replica="B", timeout_s=ctx.timeout_s)
        except RequestFailed as exc:
            refused = str(exc)[:300]
    gone = ctx.cluster.crashed()
    c.check("B keeps serving after a request aborted during its load",
            b is not None and b.error is None and len(b.token_ids) == 16 and not gone,
            {"gone": gone, "refused": refused} if b is None or gone else b.error)
    if b is None or gone:  # nothing more to ask of B; the runner reports a death and restarts it
        return c
    if ctx.profile.settle is not None:
        ctx.profile.settle(ctx.cluster.report_dir, "B", f"{tag}-b")
    a_hit = ctx.run("A", prompt, f"{tag}-ahit")
    _exact(c, ctx, ("B", f"{tag}-b"), ("A", f"{tag}-a"), 0)
    same_output(c, ctx, "B's output equals A's prefix hit", b, a_hit)
    return c


def shared_blocks_one_fails(ctx: Ctx, common: int = 1500) -> Checks:
    """A computes a prefix; B gets two requests at once that share it, each with its own
    tail, and the load of exactly one of them is broken (the data fault, armed for one
    load). Both complete with the tokens of A's own runs of the same prompts (on its own
    cached prefix: the partitions differ from a failed load's recompute, so tokens are
    compared, not log-probabilities)."""
    import threading

    rng = random.Random(ctx.seed)
    t1, t2 = common_prefix_tails(ctx.corpus, rng, prefix_tokens=common, tails=2, tail_tokens=200)
    tag = _tag("w", ctx.seed)
    prefix = " ".join(t1.prompt.split(" ")[:common])  # the shared words (the tails follow after a space)
    ctx.run("A", prefix, f"{tag}-a")
    broken = ctx.profile.break_stored(ctx.cluster, "B")
    out: dict[str, Completion | BaseException] = {}

    def ask(name: str, prompt: str) -> None:
        try:
            out[name] = ctx.run("B", prompt, f"{tag}-{name}")
        except (RequestFailed, ScenarioDown, OSError) as exc:
            out[name] = exc

    threads = [threading.Thread(target=ask, args=(n, p)) for n, p in (("b1", t1.prompt), ("b2", t2.prompt))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, v in out.items():
        if isinstance(v, ScenarioDown):
            raise v
    # The references: A alone, under a cache_salt of their own (nothing B stored reaches them).
    salt = f"{tag}-ref"
    ctx.run("A", prefix, f"{tag}-refp", cache_salt=salt)
    ref1 = ctx.run("A", t1.prompt, f"{tag}-ref1", cache_salt=salt)
    ref2 = ctx.run("A", t2.prompt, f"{tag}-ref2", cache_salt=salt)
    c = Checks()
    _broke(c, broken)
    failed = ctx.failed_reported("B")
    for name, ref in (("b1", ref1), ("b2", ref2)):
        got = out.get(name)
        ok = isinstance(got, Completion) and got.error is None and got.token_ids == ref.token_ids
        c.check(f"B's {name} completed with the tokens of A's run of its prompt", ok,
                got if not isinstance(got, Completion) else got.error)
    c.check("the broken load was reported failed", len(failed) > 0, len(failed))
    c.evidence.update(broken=broken, reported_failed=len(failed),
                      loaded={n: len(ctx.installed("B", f"{tag}-{n}")) for n in ("b1", "b2")})
    return c


def _preemptions(ctx: Ctx, replica: str) -> float:
    """The engine's own count of preempted requests (vllm:num_preemptions, /metrics)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{ctx.url(replica)}/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "vllm:num_preemptions"
               for s in fam.samples if s.name.endswith("_total"))


def preempt_during_store(ctx: Ctx, control: str | None = None, prompts: int = 3, prompt_tokens: int = 1600,
                         decode: int = 1500) -> Checks:
    """D has a KV cache of 64 blocks. Three requests of 1600 prompt tokens (13 blocks)
    each decode 1500 tokens (25 blocks in all): D's schedule gathers them (kvgate.faults.connector,
    section "schedule") and admits them one per step, so each prompt prefills in one step
    and the three decode side by side however the sends and the steps interleave. Together
    they need 75 blocks, so the engine preempts and resumes them while their prompts' KV
    is being stored. Then a request of
    61 blocks reuses every block D has. B then asks for the three prompts: every block it
    (and D, on a resume) installed must be byte for byte a computation of that block on
    D, and D must have preempted (its vllm:num_preemptions counter). Negative control
    `late_store`: D's stores are held until the reuse is done (the blocks freed at
    finish, the copies later), and B installs what the blocks held by then."""
    import json
    import threading

    from kvgate.faults.control import write_control

    rng = random.Random(ctx.seed)
    texts = [ctx.corpus.text(prompt_tokens, rng) for _ in range(prompts)]
    reuse = ctx.corpus.text(61 * BLOCK - 200, rng)
    tag = _tag("m", ctx.seed)
    path = ctx.cluster.faults["D"]
    doc = json.loads(path.read_text() or "{}")
    doc["schedule"] = {"gather": f"{tag}-d", "count": prompts}
    write_control(path, doc)  # disarmed at the end, or by the next scenario's reset
    if control:
        arm_control(ctx, "D", control)
    before = _preemptions(ctx, "D")
    out: dict[int, Completion | BaseException] = {}

    def ask(i: int) -> None:
        try:
            out[i] = ctx.run("D", texts[i], f"{tag}-d{i}", max_tokens=decode)
        except (RequestFailed, ScenarioDown, OSError) as exc:
            out[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v in out.values():
        if isinstance(v, ScenarioDown):
            raise v
    preempted = _preemptions(ctx, "D") - before
    ctx.run("D", reuse, f"{tag}-reuse", max_tokens=1)  # takes every block the burst had
    if control:  # the held stores land now, on what the blocks hold after the reuse
        doc = json.loads(path.read_text() or "{}")
        doc["connector"] = {"control": control, "release": True}
        write_control(path, doc)
    ctx.run("D", ctx.corpus.text(100, rng), f"{tag}-step", max_tokens=2)
    write_control(path, {})
    gathered = [r for r in records(ctx.h, "schedule", replica="D") if r["t"] >= ctx.t0 and r.get("job") == "admit"]
    c = Checks()
    c.check("D's schedule admitted the burst together", len(gathered) == prompts, len(gathered))
    c.check("D preempted requests under the burst (vllm:num_preemptions)", preempted > 0, preempted)
    for i in range(prompts):
        got = out.get(i)
        c.check(f"D's request {i} completed its {decode} tokens",
                isinstance(got, Completion) and got.error is None and len(got.token_ids) == decode,
                got if not isinstance(got, Completion) else (got.error, len(got.token_ids)))
    b_installed = differ = 0
    d_differ = d_installed = 0
    for i in range(prompts):
        computed = all_digests(ctx, "produced", "D", f"{tag}-d{i}")
        for k, ds in all_digests(ctx, "installed", "D", f"{tag}-d{i}").items():  # D's own resumes
            d_installed += 1
            d_differ += not (ds <= computed.get(k, set()))
        b = ctx.run("B", texts[i], f"{tag}-b{i}")
        c.check(f"B completed prompt {i}", b.error is None and len(b.token_ids) == 16, b.error)
        for k, d in ctx.installed("B", f"{tag}-b{i}").items():
            b_installed += 1
            differ += d not in computed.get(k, set())
    c.check("every block B installed is byte for byte one D computed", not differ,
            f"{differ} of {b_installed} differ")
    c.check("every block D installed on a resume is one D computed", not d_differ, f"{d_differ} of {d_installed}")
    c.check("B installed blocks D stored", b_installed > 0, b_installed)
    fired = [r for r in records(ctx.h, "fault", replica="D") if r["t"] >= ctx.t0 and r.get("control") == "late_store"]
    c.evidence.update(preemptions=preempted, b_installed=b_installed, b_installed_differ=differ,
                      d_installed_on_resume=d_installed, control=control,
                      control_fired={j: sum(r.get("job") == j for r in fired) for j in ("free", "replay")})
    return c


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    body: Callable[..., Checks] | None
    needs: tuple[str, ...]
    describe: str
    control: str | None = None  # a negative control run with this connector control
    control_oracle: str = ""  # "output", or the name of the check that must fail under the control
    # more negative controls: (control, its oracle as above, the capability it needs or ""); each
    # runs where the connector has that capability, and one not caught fails the cell
    more_controls: tuple[tuple[str, str, str], ...] = ()
    replicas: tuple[str, ...] = ("A", "B")
    not_run: str = ""  # why kvgate does not run it yet
    # the control's defect takes the replica down on this vLLM (the oracle then sees the request
    # fail): a replica down after the control run is judged by the oracle, not inconclusive
    control_down_judged: bool = False


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("cross_replica_hit", cross_replica_hit, ("shared_store",),
             "installed bytes equal the producer's; output equals the producer's prefix hit",
             control="claim_past_loaded", control_oracle="output"),
    Scenario("long_prompt", long_prompt, ("shared_store",), "a prompt longer than the prefill chunk"),
    Scenario("aligned_full_hit", aligned_full_hit, ("shared_store",), "a block-aligned prompt fully available"),
    Scenario("partial_hit", partial_hit, ("shared_store", "prefix_hits"), "a shared prefix loaded, the tail recomputed"),
    Scenario("salt_isolation", salt_isolation, ("shared_store",), "cache_salt isolation, with a positive control"),
    Scenario("revision_isolation", revision_isolation, ("shared_store",),
             "another model revision on the same store", replicas=("A", "B", "C")),
    Scenario("load_failure_recompute", load_failure_recompute, ("shared_store", "data_fault"),
             "a failed load reported block by block, then recomputed",
             control="hide_failures", control_oracle="output"),
    Scenario("load_failure_fail", load_failure_fail, ("shared_store", "data_fault"),
             "a failed load under policy fail: an explicit error"),
    Scenario("preempt_during_store", preempt_during_store, ("shared_store",),
             "preemption while a store is in flight (small KV cache, concurrent requests)",
             control="late_store", control_oracle="every block B installed is byte for byte one D computed",
             replicas=("B", "D")),
    Scenario("abort_during_load", abort_during_load, ("shared_store",),
             "a request aborted while its load is in flight (held there where the load is asynchronous)",
             control="stale_completion", control_oracle="B keeps serving after a request aborted",
             control_down_judged=True),
    Scenario("shared_blocks_one_fails", shared_blocks_one_fails, ("shared_store", "prefix_hits", "data_fault"),
             "two concurrent requests sharing blocks when one's load fails"),
    Scenario("exact_boundaries", exact_boundaries, ("shared_store",),
             "prompts of exact multiples of the block, the prefill chunk and the connector's chunk, one below and one "
             "above: a full hit at an exact multiple gives the cold run's output",
             control="claim_one_more", control_oracle="output"),
    Scenario("same_key_race", same_key_race, ("shared_store", "publish_race"),
             "two replicas publish one prefix at once, in a seeded order: nothing visible mid-publish, exactly one "
             "byte-exact copy, nothing leaked, both outputs equal a cold run",
             control="visible_at_reserve", control_oracle=VISIBILITY,
             more_controls=(("pending_leak", LEAK, "publish_race"),)),
    Scenario("accounting", accounting, ("shared_store",),
             "what the connector claims, what vLLM did not compute, the blocks installed byte-exact, vLLM's "
             "external-hit metrics and the connector's own load stats agree (conservation)",
             control="claim_past_loaded", control_oracle=CONSERVATION,
             more_controls=(("double_count_stats", CONSERVATION, "own_load_stats"),)),
)}


# The cache's lifecycle around the requests (kvgate.harness.conformance.lifecycle: a reset
# after a weight update, a request that reads no cache, an adapter reloaded under its name).

SCENARIOS.update({s.name: s for s in (
    Scenario("reset_external", lifecycle.reset_external, ("shared_store",),
             "after a weight update and POST /reset_prefix_cache?reset_external=true, no request hits KV published "
             "before the reset", control="deaf_reset", control_oracle="output"),
    Scenario("prompt_logprobs_warm", lifecycle.prompt_logprobs_warm, ("shared_store",),
             "prompt_logprobs over a prefix the connector holds: full-length and equal to the cold run's",
             control="load_despite_skip", control_oracle="the warm request's prompt_logprobs",
             control_down_judged=True),
    Scenario("adapter_reload_same_name", lifecycle.adapter_reload_same_name, ("shared_store",),
             "two LoRA adapters loaded in turn under one name (and one path): no stale hit",
             control="adapter_by_name", control_oracle="output", replicas=("E", "F")),
)})
