"""The harness's side of the nemesis: arming and healing the injectors (faults/) of a live
cluster through their control files, and the actions the harness performs itself. Every
action is recorded in the run's history (the injectors record their firings; the cluster's
`nemesis` records the harness's own actions).

  arm(cluster, replica, control=None, **fault)   a pool-client fault (kvgate.faults.backend,
                         section "load") and optionally a connector control
                         (kvgate.faults.connector, e.g. hide_failures); arm(cluster, r) heals.
  arm_copier(cluster, replica, **spec)           the copier's section (kvgate.faults.copier).
  pool_catalog(cluster, name)                    a block run on the pool daemon with a
                         known-bad catalog (python -m kvgate.faults.pool), then the normal one.
  wait_for(predicate, timeout_s, what)          poll until true; AssertionError past it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from kvgate.harness.system.cluster import Cluster


def arm(cluster: Cluster, replica: str, control: str | None = None, **fault: object) -> None:
    """Arm a pool-client fault (kvgate.faults.backend) on `replica`; `control` also plugs in a
    known-bad connector behaviour (kvgate.faults.connector), e.g. "hide_failures"."""
    doc: dict[str, object] = {"load": fault} if fault else {}
    if control:
        doc["connector"] = {"control": control}
    cluster.faults[replica].write_text(json.dumps(doc))


def arm_copier(cluster: Cluster, replica: str, **spec: object) -> None:
    cluster.faults[replica].write_text(json.dumps({"copier": spec}))


def wait_for(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


@contextlib.contextmanager
def pool_catalog(cluster: Cluster, control: str | None) -> Iterator[None]:
    """Run the block with the pool daemon on a known-bad catalog (kvgate.faults.controls, by
    name), then on a normal one again; None: leave the pool as it is. Each swap restarts
    the daemon (the pool starts empty) and is recorded in the history."""
    if control is None:
        yield
        return
    cluster.pool.stop()
    cluster.pool.restart(catalog=control)
    cluster.nemesis("pool_swap", catalog=control)
    try:
        yield
    finally:
        cluster.pool.stop()
        cluster.pool.restart()
        cluster.nemesis("pool_swap", catalog="normal")
