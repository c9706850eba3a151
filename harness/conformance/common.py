"""What the conformance scenarios' bodies share (kvgate.harness.conformance.scenarios and
.lifecycle): a request tag from the scenario's seed, a connector control armed on a
replica, and every digest a replica's audit recorded.

  tag(prefix, seed) -> str
  arm_control(ctx, replica, control)        kvgate.faults.connector's section "connector"
  all_digests(ctx, kind, replica, tag) -> {block hash: {digest, ...}}
"""

from __future__ import annotations

import json
from typing import Any

from kvgate.harness.checkers.history import records


def tag(prefix: str, seed: int) -> str:
    return f"c{prefix}{seed % 10**8}"


def arm_control(ctx: Any, replica: str, control: str) -> None:
    """Add a connector control (kvgate.faults.connector) to what the replica's fault file
    arms; the runner restarts the replica (disarmed) after the scenario."""
    path = ctx.cluster.faults[replica]
    doc = json.loads(path.read_text() or "{}")
    doc["connector"] = {"control": control}
    path.write_text(json.dumps(doc))
    ctx.armed.add(replica)


def all_digests(ctx: Any, kind: str, replica: str, tag: str) -> dict[str, set[str]]:
    """Every digest the replica's audit recorded per block (a preempted request's blocks
    are computed again: each computation counts)."""
    out: dict[str, set[str]] = {}
    for r in records(ctx.h, "audit", kind=kind, tag=tag, replica=replica):
        for k, d in zip(r["hashes"], r["digests"]):
            out.setdefault(k, set()).add(d)
    return out
