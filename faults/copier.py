"""A fault-injecting copy engine: wraps a replica worker's copier (kvpool.connector.copier).

kvgate.faults.connector.FaultConnector builds it, through kvpool's copier factory, around the
HostCopier of a replica whose `faults_file` is set. Armed through that fault-control file
(kvgate.faults.control), section "copier":

    {"copier": {"store_delay_ms": 3000,    # each store job starts this late
                "load_delay_ms": 1000,     # each load job starts this late
                "times": 2,                # how many jobs are delayed (then it heals)
                "control": "early_completion"}}   # optional: a known-bad copier

  stream delay     the CPU analogue of a CUDA copy stream held back behind the engine's
                   stream: the copy job waits on the copy thread while the engine moves
                   on (frees and reuses blocks, or reads the blocks being loaded). An
                   ordered copier still gives exact bytes; only slower.
  early_completion a negative control (kvgate.faults.controls.EarlyCompletionCopier): the
                   copier reports each job done when it is queued, so the engine frees
                   blocks that are still to be read, and reads blocks still to be written.
  publish_after_failed_load
                   a negative control: the worker's save does not see this step's failed
                   loads (`failed` reads empty; the engine is still told, take_failed is
                   untouched), so the blocks a request computed on top of its failed load
                   in that step are published: KV computed on a wrong context, kept and
                   served (what kvpool.connector's save must never do). Its stores are
                   copied synchronously at save time, so the bytes published are the
                   step's, whatever the recompute does next.
  unauthenticated_tier
                   a negative control (kvgate.faults.tier_controls.UnauthenticatedTier): the
                   worker's loads from the network tier read records as they were read
                   before records were authenticated and bound to their key: a record a
                   store client moved or forged is installed as good.
(hide_failures, the control that keeps failed blocks from the engine, acts at the
connector API: kvgate.faults.connector.)
Every delayed job and every job under the control is written to the history (`fault`
events, site "copier").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvgate.faults.control import ControlFile, ControlFileError
from kvgate.faults.controls import EarlyCompletionCopier
from kvgate.faults.tier_controls import UNAUTHENTICATED_TIER, UnauthenticatedTier
from kvpool.connector.copier import CopyRun, HostCopier
from kvpool.connector.history import HistoryWriter
from kvpool.pool.keys import Namespace

CONTROLS = ("early_completion", "publish_after_failed_load", UNAUTHENTICATED_TIER)


class FaultyCopier:
    def __init__(self, inner: HostCopier, control: str | Path | ControlFile, history: HistoryWriter):
        self.inner = inner
        self.control = control if isinstance(control, ControlFile) else ControlFile(control)
        self.history = history
        self._early = EarlyCompletionCopier(inner)
        self._generation = -1
        self._fired = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str):  # noqa: ANN204 - register, block_segments, failed, ...
        return getattr(self.inner, name)

    @property
    def ordered(self) -> bool:
        spec = self._spec()
        return not (spec and spec.get("control") == "early_completion")

    def _spec(self) -> dict | None:
        spec, generation = self.control.section("copier")
        with self._lock:
            if generation != self._generation:
                self._generation, self._fired = generation, 0
                if spec and spec.get("control") not in (None, *CONTROLS):
                    raise ControlFileError(f"unknown copier control {spec.get('control')!r}; known {CONTROLS}")
        return spec

    def _delay(self, spec: dict | None, kind: str) -> float:
        if not spec:
            return 0.0
        ms = float(spec.get(f"{kind}_delay_ms", 0))
        with self._lock:
            if ms <= 0 or self._fired >= int(spec.get("times", 1)):
                return 0.0
            self._fired += 1
        return ms / 1000

    def _wrap(self, kind: str, run: CopyRun, job: Callable[[], Any]) -> tuple[Callable[[], Any], dict | None]:
        spec = self._spec()
        delay = self._delay(spec, kind)
        control = spec.get("control") if spec else None
        if delay or control == "early_completion":
            self.history.write("fault", site="copier", kind="stream_delay" if delay else "copier_control",
                               job=kind, req=run.req_id, tag=run.tag, first_block=run.first_block,
                               blocks=len(run.block_ids), delay_ms=round(delay * 1000), control=control)
        if not delay:
            return job, spec

        def delayed() -> Any:
            time.sleep(delay)
            return job()

        return delayed, spec

    def _engine(self, spec: dict | None):  # noqa: ANN202
        return self._early if spec and spec.get("control") == "early_completion" else self.inner

    def store(self, ns: Namespace, run: CopyRun, keep: Sequence[int]) -> Future:
        job, spec = self._wrap("store", run, self.inner.store_job(ns, run, keep))
        if spec and spec.get("control") == "publish_after_failed_load":
            # Copied here, at save time: the step's own bytes are published. On the copy
            # thread the rolled-back request's recompute could rewrite the blocks first, and
            # whether the control published poison would depend on that race.
            done: Future = Future()
            try:
                done.set_result(job())
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the future, as the copy thread would
                done.set_exception(exc)
            return done
        return self._engine(spec).submit(job, "store")

    def load(self, ns: Namespace, run: CopyRun, deadline_s: float) -> Future:
        job, spec = self._wrap("load", run, self.inner.load_job(ns, run, deadline_s))
        return self._engine(spec).submit(job, "load")

    def tier_load(self, tier: Any, ns: Namespace, run: CopyRun, deadline_s: float) -> Future:
        spec = self._spec()
        if spec and spec.get("control") == UNAUTHENTICATED_TIER:
            self.history.write("fault", site="copier", kind="copier_control", job="tier_load", req=run.req_id,
                               tag=run.tag, first_block=run.first_block, blocks=len(run.block_ids),
                               control=UNAUTHENTICATED_TIER)
            tier = UnauthenticatedTier(tier)
        return self.inner.tier_load(tier, ns, run, deadline_s)

    def wait(self, futures: Sequence[Future], timeout_s: float) -> None:
        self.inner.wait(futures, timeout_s)

    @property
    def failed(self) -> set[int]:
        failed = self.inner.failed
        spec = self._spec()
        if failed and spec and spec.get("control") == "publish_after_failed_load":
            self.history.write("fault", site="copier", kind="copier_control", job="store",
                               control="publish_after_failed_load", hidden_from_save=sorted(failed))
            return set()
        return failed
