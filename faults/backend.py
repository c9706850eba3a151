"""A fault-injecting PoolBackend: wraps the real pool client of a live replica.

The replica's connector builds it when `faults_file` is set; the file is JSON and is
re-read whenever it changes, so a test switches faults without restarting the replica:

    {"load": {"kind": "transport_error" | "timeout" | "corrupt" | "evict",
              "block": 2,            # the lease's block index where the fault strikes
              "times": 1}}           # how many loads it hits (then it heals by itself)

  transport_error  the connection is closed under the load: TransportError at block k.
  timeout          the load's read of block k raises PoolTimeout.
  corrupt          block k's bytes arrive with one bit flipped (the digest must catch it).
  evict            between the scheduler's lookup and the worker's load, blocks k.. are
                   force-evicted from the pool: the load stops at k as `evicted`.
Every firing is written to the run's history (`fault` events) with what it did.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvpool.catalog import AcquireResult
from kvpool.client import PoolBackend
from kvpool.errors import PoolTimeout, TransportError
from kvpool.history import HistoryWriter

KINDS = ("transport_error", "timeout", "corrupt", "evict")


class FaultyBackend:
    def __init__(self, inner: PoolBackend, control: str | Path, history: HistoryWriter):
        self.inner = inner
        self.control = Path(control)
        self.history = history
        self._mtime = -1.0
        self._spec: dict = {}
        self._fired = 0
        self._lock = threading.Lock()

    @property
    def page_size(self) -> int:
        return self.inner.page_size

    def __getattr__(self, name: str):  # noqa: ANN204 - everything not faulted passes through
        return getattr(self.inner, name)

    def _load_fault(self) -> dict | None:
        with self._lock:
            try:
                mtime = os.stat(self.control).st_mtime_ns
            except FileNotFoundError:
                self._spec, self._mtime = {}, -1.0
                return None
            if mtime != self._mtime:
                self._mtime = mtime
                self._spec = json.loads(self.control.read_text() or "{}")
                self._fired = 0
                fault = self._spec.get("load")
                if fault is not None and fault.get("kind") not in KINDS:
                    raise ValueError(f"{self.control}: unknown fault kind {fault.get('kind')!r}; known {KINDS}")
            fault = self._spec.get("load")
            if fault is None or self._fired >= int(fault.get("times", 1)):
                return None
            return fault

    def acquire(self, ns, hashes: Sequence[bytes]) -> AcquireResult:  # noqa: ANN001
        fault = self._load_fault()
        if fault is not None and fault["kind"] == "evict":
            k = int(fault.get("block", 0))
            outcomes = self.inner.evict(ns, list(hashes[k:]))
            self._fired += 1
            self.history.write("fault", site="pool_client.acquire", kind="evict", block=k,
                               evicted=sum(o == "evicted" for o in outcomes))
            return self.inner.acquire(ns, hashes)
        lease = self.inner.acquire(ns, hashes)
        fault = fault if lease.lease_id else None
        if fault is not None and int(fault.get("block", 0)) < len(lease.hits):
            self._armed = (lease.lease_id, fault)
        else:
            self._armed = None
        return lease

    def read_page(self, lease: AcquireResult, index: int):  # noqa: ANN201
        armed = getattr(self, "_armed", None)
        if armed is None or armed[0] != lease.lease_id or index != int(armed[1].get("block", 0)):
            return self.inner.read_page(lease, index)
        fault = armed[1]
        self._armed = None
        self._fired += 1
        kind = fault["kind"]
        self.history.write("fault", site="pool_client.read_page", kind=kind, block=index, lease=lease.lease_id)
        if kind == "transport_error":
            self.inner.close()
            raise TransportError(f"injected: connection closed while loading block {index}")
        if kind == "timeout":
            raise PoolTimeout(f"injected: block {index} did not arrive within the deadline")
        data = np.array(self.inner.read_page(lease, index), dtype=np.uint8, copy=True).reshape(-1)
        data[len(data) // 2] ^= 0x10  # corrupt: one flipped bit
        return data
