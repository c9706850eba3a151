"""Conformance scenario `same_key_race`: two replicas publish one prefix at the same
moment (Mooncake#1374: a second put of a key in flight answered "exists" while the key
had no value yet).

The race is not left to timing. Both replicas compute the same prompt, and their
publishes take turns in a seeded order (kvgate.faults.barrier, armed at the connector's
store client): both are in flight at once, one reserves first, the other looks the
prefix up (its `witness`: what a reader sees mid-publish) and offers the same blocks
while the first's pages are reserved and not yet written, or written and not yet
committed (the seed picks which and who goes first). Then:

  * nothing of the open publish was visible: the witness found none of its blocks, and
    the second's offer was told they are pending, never that they exist;
  * exactly one copy of each block is stored, byte for byte what both replicas computed;
  * no reservation, lease or page is left behind (the store's own accounting, before
    and after);
  * both requests' outputs equal a cold run of the prompt to the last bit, and a replica
    that loads the prefix afterwards installs the one copy and gives its prefix hit's output.

A connector needs a store whose publish kvgate can hold at its steps (capability
`publish_race`, with the profile's `store`): kvpool's pool client. Negative control
`visible_at_reserve`: the pool restarted on a known-bad catalog that enters a reserved
page in its index at the reserve (kvgate.faults.race_controls), so a reader mid-publish finds
blocks whose pages hold nothing yet and the second publisher is told they exist; the
visibility check must catch it. Second control `pending_leak`: a catalog that takes a page
for each block the second publisher offers before it finds the block pending, and keeps
it; the store's accounting check must catch the leaked pages.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.faults.barrier import publish_race_order
from kvgate.faults.control import write_control
from kvgate.harness.checkers.verdict import Checks

if TYPE_CHECKING:
    from kvgate.harness.conformance.context import Ctx

VISIBILITY = "nothing of an open publish is visible"  # the check the control must fail
LEAK = "no reservation, lease or page is left behind"  # the check the pending_leak control must fail


class KvpoolStore:
    """kvpool's pool, as the race scenario sees it: its publishes held at the pool client
    (kvgate.faults.backend, section "publish" kind "turns"), its accounting (the daemon's
    stats), its committed copies (read under a lease and hashed by an oracle client), and
    the daemon restarted on a known-bad catalog for a control."""

    def arm(self, cluster, replica: str, spec: dict[str, Any]) -> None:  # noqa: ANN001
        path = cluster.faults[replica]
        doc = json.loads(path.read_text() or "{}")
        doc["publish"] = {"kind": "turns", "me": replica, **spec}
        write_control(path, doc)

    def disarm(self, cluster, replica: str) -> None:  # noqa: ANN001
        write_control(cluster.faults[replica], {})

    def stats(self, cluster) -> dict[str, int]:  # noqa: ANN001
        with cluster.pool.client(name="race-oracle") as c:
            return dict(c.stats())

    def digests(self, cluster, replica: str, keys: list[str]) -> dict[str, str]:  # noqa: ANN001
        from kvgate.harness.checkers.byte_exact import pool_digests
        from kvgate.harness.checkers.history import namespace_of

        return pool_digests(cluster.pool, namespace_of(cluster.history_dir, replica), keys)

    def restart(self, cluster, catalog: str | None) -> None:  # noqa: ANN001
        """The daemon on `catalog` (a known-bad one of kvgate.faults.race_controls), or on its own."""
        cluster.nemesis("pool_restart", catalog=catalog or "default")
        cluster.pool.stop()
        cluster.pool = cluster.pool.restart(catalog=catalog)


def _produced(ctx: Ctx, replica: str, tag: str) -> tuple[dict[str, str], dict[str, str]]:
    """({token-chain hash: digest}, {hash: pool key}) of the prompt blocks the replica computed."""
    from kvgate.harness.checkers.history import records

    digests, keys = {}, {}
    for r in records(ctx.h, "audit", kind="produced", tag=tag, replica=replica):
        digests.update(zip(r["hashes"], r["digests"]))
        keys.update(zip(r["hashes"], r.get("keys") or r["hashes"]))
    return digests, keys


def _wait_turns(turns_dir: Path, order: list[str], timeout_s: float) -> list[str]:
    """Wait until every turn is done (or skipped); the turns not done when it gave up."""
    deadline = time.monotonic() + timeout_s
    while True:
        undone = [t for t in order if not (turns_dir / f"done.{t.replace(':', '.')}").exists()]
        if not undone or time.monotonic() > deadline:
            return undone
        time.sleep(0.1)


def _turn(turns_dir: Path, turn: str) -> dict[str, Any]:
    try:
        return json.loads((turns_dir / f"done.{turn.replace(':', '.')}").read_text())
    except FileNotFoundError:
        return {}


def same_key_race(ctx: Ctx, control: str | None = None, prompt_tokens: int = 1500) -> Checks:
    import random

    from kvgate.harness.conformance import context as base

    store = ctx.profile.store
    rng = random.Random(ctx.seed)
    prompt = ctx.corpus.text(prompt_tokens, rng)
    tag = base._tag("k", ctx.seed)
    if control:  # the pool on the known-bad catalog; each replica reconnects on a request of its own
        store.restart(ctx.cluster, control)
        for r in ("A", "B"):
            ctx.run(r, ctx.corpus.text(300, rng), f"{tag}-reconnect-{r.lower()}")
    try:
        checks = _race(ctx, store, prompt, tag, control)
    finally:
        for r in ("A", "B"):
            store.disarm(ctx.cluster, r)
        if control:
            store.restart(ctx.cluster, None)
    if control:
        # Back on the default catalog, every replica reconnects now, on a request of its own. Else
        # each one's next store would meet the new segment in a later cell, where a GPU replica
        # drops it (its copy engine follows a restarted pool at the store after) and that cell's
        # hit is gone.
        for r in sorted(ctx.cluster.replicas):
            ctx.run(r, ctx.corpus.text(300, rng), f"{tag}-reattach-{r.lower()}")
    return checks


def _race(ctx: Ctx, store: KvpoolStore, prompt: str, tag: str, control: str | None) -> Checks:
    from kvgate.harness.checkers.history import records
    from kvgate.harness.client.http import RequestFailed, reset_prefix_cache
    from kvgate.harness.conformance import context as base

    order, plan = publish_race_order(ctx.seed, ("A", "B"))
    first, second = plan["first"], plan["second"]
    turns_dir = Path(ctx.cluster.report_dir) / f"turns-{tag}{'-' + control if control else ''}"
    before = store.stats(ctx.cluster)
    for r in ("A", "B"):
        store.arm(ctx.cluster, r, {"dir": str(turns_dir), "parties": ["A", "B"], "order": order, "timeout_s": 60})
    out: dict[str, Any] = {}

    def ask(replica: str) -> None:
        try:
            out[replica] = ctx.run(replica, prompt, f"{tag}-{replica.lower()}")
        except (RequestFailed, base.ScenarioDown, OSError) as exc:  # judged below (a ScenarioDown is raised again)
            out[replica] = exc

    threads = [threading.Thread(target=ask, args=(r,)) for r in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v in out.values():
        if isinstance(v, base.ScenarioDown):
            raise v
    undone = _wait_turns(turns_dir, order, 90.0)
    after = store.stats(ctx.cluster)
    for r in ("A", "B"):
        store.disarm(ctx.cluster, r)
    timeouts = [r for r in records(ctx.h, "fault", kind="turn_timeout") if r["t"] >= ctx.t0]

    c = Checks()
    c.check("both publishes were in flight at once and took their turns in the seeded order",
            not undone and not timeouts, {"undone": undone, "timeouts": [r["error"][:200] for r in timeouts]})
    witness = _turn(turns_dir, f"{second}:witness")
    offered = _turn(turns_dir, f"{second}:reserve")
    slots = offered.get("slots") or {}
    c.check(f"{VISIBILITY}: the second publisher's lookup found none of the first's blocks, and its offer was "
            "told they are pending, never that they exist",
            witness.get("visible") == 0 and not slots.get("exists") and not slots.get("reserved"),
            {"witness": witness, "second_reserve": offered})
    a_digests, a_keys = _produced(ctx, "A", f"{tag}-a")
    b_digests, _ = _produced(ctx, "B", f"{tag}-b")
    blocks = len(a_digests)
    committed = _turn(turns_dir, f"{first}:commit").get("committed")
    c.check("the first publish committed every block of the prefix", blocks > 0 and committed == blocks,
            {"committed": committed, "prompt_blocks": blocks})
    c.check("both replicas computed the same bytes", a_digests == b_digests,
            f"{sum(a_digests.get(k) != d for k, d in b_digests.items())} of {len(b_digests)} differ")
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("committed_pages", "free_pages", "entries")}
    c.check("exactly one copy of each block is stored",
            grew["committed_pages"] == blocks and grew["entries"] == blocks, {**grew, "prompt_blocks": blocks})
    left = {k: after.get(k) for k in ("reserved_pages", "open_reservations", "leased_pages", "open_leases")}
    c.check(LEAK,
            not any(left.values()) and grew["free_pages"] == -blocks, {**left, "free_pages_grew": grew["free_pages"]})
    pooled = store.digests(ctx.cluster, "A", [a_keys[h] for h in a_digests])
    wrong = [h for h, d in a_digests.items() if pooled.get(a_keys[h]) != d]
    c.check("the stored copy of every block is byte for byte what the replicas computed",
            len(pooled) == blocks and not wrong, {"stored": len(pooled), "differ": len(wrong)})
    # The references: a cold run of the prompt (its own salt: nothing stored reaches it), and
    # a load of the one copy by B with its own prefix cache emptied, against A's prefix hit.
    ref = ctx.run("A", prompt, f"{tag}-cold", cache_salt=f"{tag}-cold")
    for r in ("A", "B"):
        got = out.get(r)
        c.check(f"{r} completed its request", not isinstance(got, BaseException) and got.error is None,
                got if isinstance(got, BaseException) else got.error)
        if not isinstance(got, BaseException):
            base.same_output(c, ctx, f"{r}'s output under the race equals a cold run", got, ref)
    reset_prefix_cache(ctx.url("B"))
    reload = ctx.run("B", prompt, f"{tag}-reload")
    a_hit = ctx.run("A", prompt, f"{tag}-ahit")
    installed = ctx.installed("B", f"{tag}-reload")
    c.check("B, its own cache emptied, installed the stored copy byte for byte",
            len(installed) > 0 and all(a_digests.get(h) == d for h, d in installed.items()),
            {"installed": len(installed), "differ": sum(a_digests.get(h) != d for h, d in installed.items())})
    base.same_output(c, ctx, "B's reload equals A's prefix hit", reload, a_hit)
    c.evidence.update(plan=plan, order=order, witness=witness, second_reserve=offered, prompt_blocks=blocks,
                      pool_before={k: before.get(k) for k in ("committed_pages", "free_pages", "reserved_pages")},
                      pool_after={k: after.get(k) for k in ("committed_pages", "free_pages", "reserved_pages",
                                                             "open_reservations", "leased_pages")},
                      control=control)
    return c


KVPOOL_STORE = KvpoolStore()
