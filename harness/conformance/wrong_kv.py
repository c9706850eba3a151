"""The wrong-KV count of one conformance run: how many blocks a replica installed whose
bytes are no computation of that block by a replica serving the same weights.

  count(recs, identity) -> dict
        over the audit records of one run (kvpool.connector.audit: `produced`, `installed`,
        `audit_load_errors`): each installed block, once per replica, worker and step, is
          * exempt      the engine was told its load failed (it is recomputed),
          * checked     a replica of its own identity computed the block (same token-chain
                        hash: the same tokens and adapter), and wrong if its bytes equal
                        none of those computations; `misplaced` where they are another
                        block's as computed in the run (stale or shifted KV, not garbage),
                        with that block's tag and index in its prompt,
          * foreign     no replica of its identity computed it, and its bytes are those of
                        another computation: of this block by a replica with other weights
                        (another model revision, weights replaced in place), or of another
                        block (other tokens, or the same tokens under another adapter):
                        wrong,
          * unverified  nobody computed it in the run: not counted either way.
        `identity(replica, t)` names the weights a replica served at time t.
  of_run(ctx, t0, t1) -> dict
        count() over the history of the run between t0 and t1, with each replica's identity
        its model folder, changed where the scenario said it loaded other weights in place
        (Ctx.reidentify).

The scenario's seeded faults (a broken stored block, a held store, a claim past the load)
are on during the run counted: a connector that handles them installs no wrong block; its
negative controls are each counted on their own run, where the count shows the defect.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kvgate.harness.checkers.history import read_history, within


def count(recs: list[dict[str, Any]], identity: Callable[[str, float], str]) -> dict[str, Any]:
    produced: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    computed_as: dict[str, set[tuple[str, str]]] = defaultdict(set)  # digest -> {(block, weights)}
    position: dict[str, tuple[object, int]] = {}  # digest -> (tag, index in its prompt) of its first computation
    # (where several blocks computed the same bytes, the first one is named)
    told_failed: dict[tuple[str, object, object], set[int]] = defaultdict(set)
    for r in recs:
        if r["ev"] == "audit" and r["kind"] == "produced":
            who = identity(r["replica"], r["t"])
            for i, (h, d) in enumerate(zip(r["hashes"], r["digests"], strict=True)):
                produced[h][who].add(d)
                computed_as[d].add((h, who))
                position.setdefault(d, (r.get("tag"), int(r.get("first_block", 0)) + i))
        elif r["ev"] == "audit_load_errors":
            told_failed[(r["replica"], r.get("pid"), r.get("step"))].update(r["block_ids"])
    out = {"wrong": 0, "differ": 0, "misplaced": 0, "foreign": 0, "checked": 0, "unverified": 0, "exempt": 0}
    first: list[dict[str, Any]] = []
    seen: set[tuple[str, object, object, int]] = set()
    for r in recs:
        if r["ev"] != "audit" or r["kind"] != "installed":
            continue
        who = identity(r["replica"], r["t"])
        failed = told_failed.get((r["replica"], r.get("pid"), r.get("step")), set())
        for bid, h, d in zip(r["block_ids"], r["hashes"], r["digests"], strict=True):
            once = (r["replica"], r.get("pid"), r.get("step"), bid)
            if once in seen:
                continue
            seen.add(once)
            if bid in failed:
                out["exempt"] += 1
                continue
            own = produced.get(h, {}).get(who)
            if own:
                out["checked"] += 1
                if d not in own:
                    out["differ"] += 1
                    wrong = {"replica": r["replica"], "tag": r.get("tag"), "block_id": bid, "hash": h,
                             "why": "differs from every computation of the block with its weights"}
                    others = computed_as.get(d, set())
                    if any(block != h for block, _ in others):  # another block's KV, put in this one's place
                        out["misplaced"] += 1
                        tag, index = position[d]
                        wrong.update(why=f"{wrong['why']}: its bytes are block {index} of {tag} as computed",
                                     equals={"tag": tag, "index": index})
                    elif others:  # this very block, as a replica with other weights computed it
                        wrong.update(why=f"{wrong['why']}: its bytes are this block's under other weights "
                                         f"({', '.join(sorted(w for _, w in others))})")
                    first.append(wrong)
            elif computed_as.get(d, set()) - {(h, who)}:
                out["checked"] += 1
                out["foreign"] += 1
                first.append({"replica": r["replica"], "tag": r.get("tag"), "block_id": bid, "hash": h,
                              "why": "the bytes of another computation (other weights, or another block), "
                                     "none of this block with its own weights"})
            else:
                out["unverified"] += 1
    out["wrong"] = out["differ"] + out["foreign"]
    out["first"] = first[:3]
    return out


def of_run(ctx: Any, t0: float, t1: float) -> dict[str, Any]:
    """count() over [t0, t1] of the run's history (ctx: kvgate.harness.conformance.context.Ctx)."""
    recs = [r for r in within(read_history(ctx.h), t0, t1) if r["ev"] in ("audit", "audit_load_errors")]
    return count(recs, ctx.identity)
