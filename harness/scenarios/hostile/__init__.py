"""The gate as an adversary: scenarios of fault kind `hostile` (profile `hostile`, part of
`make gate`), each an attempt by the least trusted party that can reach one boundary of
kvpool, judged by the oracles, each with its negative control (the pool's behaviour before
the boundary was closed) caught by the oracle it validates.

  tier        a client of the network store moves and forges records
  checkpoint  a checkpoint fine-tuned in place at one path (weights over 64 MiB)
  frames      a flood of maximal frames from an authenticated tenant
  scribble    a tenant scribbles over everything it can map
  rundir      the run directory's parent pre-created by another local user
  restart     a pool restart racing the same-host probe, many iterations

RUNNERS maps a scenario file's `runner` to its body (kvgate.harness.scenarios.catalog).
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.harness.checkers.verdict import Verdict
from kvgate.harness.scenarios.hostile import checkpoint, frames, restart, rundir, scribble, tier

RUNNERS: dict[str, Callable[..., Verdict]] = {
    **tier.RUNNERS, **checkpoint.RUNNERS, **frames.RUNNERS, **scribble.RUNNERS, **rundir.RUNNERS,
    **restart.RUNNERS,
}
