"""Multi-turn sessions that alternate replicas, and the OFF-ON-ON-OFF comparison.

  run_sessions(cluster, corpus, seed, ...)   N sessions of T turns; turn t goes to the
      replica the router picks; its prompt is the whole conversation so far. With the pool
      off, requests neither load nor publish; `salt` isolates a block of sessions from every
      cache entry an earlier block left (local prefix caches and the pool alike).
  off_on_on_off(cluster, corpus, seed, ...)  the same sessions four times: pool off, on,
      on, off. Returns per-turn results and TTFT medians of the cross-replica turns, and
      checks that every (session, turn) generated the same tokens in all four blocks.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable

from kvgate.harness.system.cluster import Cluster
from kvgate.harness.client.http import Completion, complete
from kvgate.harness.workload.prompts import Corpus, six_turn_session
from kvgate.harness.workload.router import Router


@dataclasses.dataclass(frozen=True)
class TurnResult:
    block: str
    session: int
    turn: int
    replica: str
    completion: Completion


def run_sessions(cluster: Cluster, corpus: Corpus, seed: int, *, sessions: int, turns: int, context_tokens: int,
                 pool_on: bool, salt: str, block: str, user_tokens: int = 64, max_tokens: int = 16,
                 router_kind: str = "alternating", replicas: tuple[str, ...] = ("A", "B"),
                 settle: Callable[[str, str], None] | None = None) -> list[TurnResult]:
    """`settle(tag, replica)`, with the pool on: called after each turn, before the next is sent
    (the stores of a turn end after its response: a next turn whose lookup expects them must
    not depend on which came first)."""
    router = Router(router_kind, list(replicas), seed)
    out: list[TurnResult] = []
    for s in range(sessions):
        rng = random.Random(f"{seed}:session:{s}")
        context, users = six_turn_session(corpus, rng, context_tokens, user_tokens, turns)
        conversation = context
        for t, user in enumerate(users):
            conversation += " " + user
            name = router.pick(f"s{s}", t)
            c = complete(cluster.replicas[name].url, conversation, tag=f"{block}-s{s}-t{t}", replica=name,
                         max_tokens=max_tokens, load=pool_on, publish=pool_on, cache_salt=salt)
            out.append(TurnResult(block, s, t, name, c))
            if pool_on and settle is not None:
                settle(c.tag, name)
            conversation += " " + c.text.strip()
    return out


def off_on_on_off(cluster: Cluster, corpus: Corpus, seed: int, *, sessions: int = 2, turns: int = 6,
                  context_tokens: int = 2000, label: str = "ooo",
                  settle: Callable[[str, str], None] | None = None) -> dict:
    results: list[TurnResult] = []
    for i, on in enumerate((False, True, True, False)):
        block = f"{label}{i}-{'on' if on else 'off'}"
        results += run_sessions(cluster, corpus, seed, sessions=sessions, turns=turns, context_tokens=context_tokens,
                                pool_on=on, salt=f"{label}-{seed}-{i}", block=block, settle=settle)
    by_key: dict[tuple[int, int], list[list[int]]] = {}
    for r in results:
        by_key.setdefault((r.session, r.turn), []).append(r.completion.token_ids)
    mismatched = [k for k, outs in by_key.items() if any(o != outs[0] for o in outs)]
    medians = {}
    for i in range(4):
        ttfts = [r.completion.ttft_s for r in results if r.block.startswith(f"{label}{i}-") and r.turn > 0]
        medians[f"{i}:{'on' if i in (1, 2) else 'off'}"] = round(statistics.median(ttfts) * 1000, 1)
    off = statistics.mean([medians["0:off"], medians["3:off"]])
    on = statistics.mean([medians["1:on"], medians["2:on"]])
    return {"results": results, "ttft_median_ms_cross_turns": medians, "mismatched_turns": mismatched,
            "improvement": round(1 - on / off, 3) if off else None}
