"""`kvgate explain`: why a request, or a block's key, was not a hit, from a run's history
and (for a key) the pool itself.

  explain_request(recs, tag, replica=None) -> Explanation
        the request's lookups (outcome, local hit, claimed blocks, where and why the run
        stopped, the namespace fields that differed), its loads (what failed, the cause),
        the faults that fired on its replica while it ran, and one verdict sentence.
  explain_key(recs, key, client=None) -> Explanation
        who produced the block of that pool key (the audit's records), where it was
        installed, and what the pool says about it now (a lookup under the producer's
        namespace: committed, evicted, never published, incompatible).
An Explanation has `.verdict` (one sentence), `.facts` (lines, in time order) and
`.as_dict()`; `kvgate explain` prints them, or JSON with --json.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from kvpool.errors import MissCause

WHY = {
    MissCause.NEVER_PUBLISHED.value: "no replica had committed that block to the pool when it was asked for",
    MissCause.EVICTED.value: "the block was committed, then evicted before the lookup (the pool keeps a ghost of "
                             "it): the pool was too small for the reuse distance",
    MissCause.INCOMPATIBLE.value: "the same tokens are pooled under a namespace that differs in a field that changes "
                                  "KV bytes",
    MissCause.TRANSPORT_ERROR.value: "the pool or the path to it failed during the lookup or load; the blocks were "
                                     "recomputed",
    MissCause.CORRUPT.value: "a page's bytes did not match the digest taken at publish; it was refused and recomputed",
    MissCause.TIMEOUT.value: "the pool did not answer, or the load did not finish, within its bound; recomputed",
    MissCause.THROTTLED.value: "a load limit of the pool was reached; recomputed instead of queued",
    MissCause.IN_FLIGHT.value: "the block's publish was still in flight when the lookup's wait ran out",
}


class ExplainError(ValueError):
    """Nothing in the history matches what was asked about."""


@dataclasses.dataclass
class Explanation:
    subject: str
    verdict: str
    facts: list[str]
    data: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"subject": self.subject, "verdict": self.verdict, "facts": self.facts, **self.data}

    def text(self) -> str:
        return "\n".join([f"{self.subject}: {self.verdict}", *[f"  {f}" for f in self.facts]])


def _ts(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def explain_request(recs: list[dict], tag: str, replica: str | None = None) -> Explanation:
    mine = [r for r in recs if str(r.get("tag")) == tag and (replica is None or r.get("replica") == replica)]
    if not mine:
        raise ExplainError(f"no record of a request tagged {tag!r}" + (f" on replica {replica}" if replica else ""))
    replicas = sorted({r.get("replica") for r in mine if r.get("ev") == "lookup"})
    if replica is None and len(replicas) > 1:
        raise ExplainError(f"request {tag!r} was looked up on several replicas {replicas}: name one (--replica)")
    rep = replica or (replicas[0] if replicas else None)
    facts: list[str] = []
    lookups = [r for r in mine if r["ev"] == "lookup"]
    loads = [r for r in mine if r["ev"] in ("load", "tier_load")]
    ended = [r for r in mine if r["ev"] == "request" and r.get("phase") in ("ok", "fail")]
    t0 = min(r["t"] for r in mine)
    t1 = max(r["t"] for r in mine)
    for r in mine:
        ev = r["ev"]
        if ev == "request":
            if r.get("phase") == "invoke":
                facts.append(f"{_ts(r['t'])} sent to {r.get('replica')} (load={r.get('load')}, publish={r.get('publish')})")
            else:
                facts.append(f"{_ts(r['t'])} ended {r.get('phase')}: ttft {r.get('ttft_s')} s"
                             + (f", error {r.get('error')}" if r.get("error") else ""))
        elif ev == "lookup":
            what = (f"{_ts(r['t'])} lookup on {r['replica']}: {r.get('outcome')}, {r.get('prompt_tokens')} prompt "
                    f"tokens, {r.get('local_tokens', 0)} in the local prefix cache, {r.get('hit_blocks', 0)} blocks "
                    f"claimed from the pool")
            if r.get("tier_blocks"):
                what += f" and {r['tier_blocks']} from the tier"
            if r.get("via"):
                what += f" (via {r['via']})"
            if r.get("miss_cause"):
                what += f"; the run stopped at block {r.get('miss_index')}: {r['miss_cause']}"
                if r.get("miss_fields"):
                    what += f" (namespace fields that differ: {', '.join(r['miss_fields'])})"
            if r.get("reason") or r.get("error"):
                what += f" [{r.get('reason') or r.get('error')}]"
            facts.append(what)
        elif ev in ("load", "tier_load"):
            facts.append(f"{_ts(r['t'])} {ev} on {r['replica']}: {r.get('loaded')} of {r.get('blocks')} blocks"
                         + (f", stopped at block {r.get('miss_index')}: {r.get('miss_cause')}" if r.get("miss_cause")
                            else ""))
        elif ev in ("publish", "tier_publish"):
            facts.append(f"{_ts(r['t'])} {ev} by {r['replica']}: blocks {r.get('first_block')}.."
                         f"{int(r.get('first_block', 0)) + int(r.get('blocks', 0))}, committed {r.get('committed')}"
                         + (f", error {r.get('error')}" if r.get("error") else ""))
        elif ev in ("invalid_params", "unsupported"):
            facts.append(f"{_ts(r['t'])} {ev}: {r.get('error') or r.get('reason')}")
    faults = [r for r in recs if r.get("ev") in ("fault", "nemesis") and t0 - 1 <= r["t"] <= t1 + 1
              and (r.get("replica") in (rep, "harness", None) or r.get("ev") == "nemesis")]
    for r in faults:
        facts.append(f"{_ts(r['t'])} {r['ev']} while it ran: {r.get('kind') or r.get('action')}"
                     + (f" at {r.get('site')}" if r.get("site") else ""))
    facts.sort()
    verdict = _request_verdict(lookups, loads, mine)
    return Explanation(f"request {tag}" + (f" on {rep}" if rep else ""), verdict, facts,
                       {"lookups": lookups, "loads": loads, "ended": ended, "faults": faults})


def _request_verdict(lookups: list[dict], loads: list[dict], mine: list[dict]) -> str:
    if any(r["ev"] == "unsupported" for r in mine):
        return "served without the pool: " + next(r.get("reason") for r in mine if r["ev"] == "unsupported")
    if any(r["ev"] == "invalid_params" for r in mine):
        return "served without the pool: its kv_transfer_params were malformed"
    if not lookups:
        return "no lookup was recorded: the replica's connector is not kvpool's, or the request never reached its scheduler"
    last = lookups[-1]
    failed = [r for r in loads if r.get("failed_block_ids") or r.get("miss_cause")]
    if last.get("outcome") == "remote_hit":
        if failed:
            f = failed[-1]
            return (f"a remote hit whose load failed at block {f.get('miss_index')} ({f.get('miss_cause')}): "
                    f"{WHY.get(f.get('miss_cause'), 'see the load')}")
        stop = f"; past it, {last['miss_cause']}: {WHY.get(last['miss_cause'])}" if last.get("miss_cause") else ""
        return f"a remote hit of {last.get('hit_blocks', 0) + int(last.get('tier_blocks') or 0)} blocks{stop}"
    if last.get("outcome") == "local_hit":
        return "a local prefix-cache hit covered every block the pool could have served: the pool was not asked"
    if last.get("outcome") == "skipped":
        return f"the pool was not asked: {last.get('reason') or 'loading is off for this request or replica'}"
    cause = last.get("miss_cause")
    where = f" at block {last.get('miss_index')}" if last.get("miss_index") is not None else ""
    fields = f" ({', '.join(last['miss_fields'])})" if last.get("miss_fields") else ""
    return f"not a hit{where}: {cause}{fields}: {WHY.get(cause, 'no cause recorded')}"


def explain_key(recs: list[dict], key: str, client: Any = None) -> Explanation:
    """`key`: a block's pool key in hex (the audit records it as `keys`). `client`: a
    kvpool PoolClient to ask the pool now, under the namespace its producer used."""
    key = key.lower().removeprefix("0x")
    hits = []
    for r in recs:
        if r.get("ev") != "audit":
            continue
        for i, k in enumerate(r.get("keys") or []):
            if str(k).lower() == key:
                hits.append((r, i))
    if not hits:
        raise ExplainError(f"no audit record holds key {key}: the run was not audited, or no replica computed or "
                           "installed that block")
    facts = []
    produced = [(r, i) for r, i in hits if r.get("kind") == "produced"]
    for r, i in hits:
        facts.append(f"{_ts(r['t'])} {r['kind']} by {r['replica']}: request {r.get('tag')}, block "
                     f"{int(r.get('first_block', 0)) + i}, digest {str((r.get('digests') or [''] * (i + 1))[i])[:16]}")
    data: dict[str, Any] = {"records": len(hits)}
    state = None
    if client is not None and produced:
        ns = _namespace_of(recs, produced[0][0]["replica"])
        if ns is not None:
            found = client.lookup(ns, [bytes.fromhex(key)])
            state = "committed in the pool now" if found.hits else f"not in the pool now: {found.miss.cause.value}"
            data["pool"] = state
            facts.append(f"the pool, asked now under {produced[0][0]['replica']}'s namespace: {state}")
    if not produced:
        verdict = "installed from the pool, but no producer's record is in this history (produced in another run?)"
    elif state is not None and "not in the pool" in state:
        cause = state.rsplit(": ", 1)[-1]
        verdict = f"produced by {produced[0][0]['replica']}; {cause}: {WHY.get(cause, '')}"
    else:
        installs = [r for r, _ in hits if r.get("kind") == "installed"]
        verdict = (f"produced by {produced[0][0]['replica']}, installed {len(installs)} time(s) from the pool"
                   + (f"; {state}" if state else ""))
    return Explanation(f"key {key[:16]}...", verdict, sorted(facts), data)


def _namespace_of(recs: list[dict], replica: str):  # noqa: ANN202
    from kvpool.pool.keys import Namespace

    for r in recs:
        if r.get("ev") == "namespace" and r.get("replica") == replica and isinstance(r.get("ns"), dict):
            return Namespace.from_dict(r["ns"])
    return None
