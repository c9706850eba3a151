"""A fault-injecting PoolBackend: wraps the real pool client of a live replica.

kvgate.faults.connector.FaultConnector builds it, through kvpool's backend factory, around the
pool client of a replica whose `faults_file` is set; the file (kvgate.faults.control) is re-read
whenever it changes, so a test switches faults without restarting the replica:

    {"load": {"kind": "timeout" | "corrupt" | "evict" | "hold",
              "block": 2,            # the lease's block index where the fault strikes
              "seed": 7,             # the fault's own draws (which bit flips)
              "times": 1,            # how many loads it hits (then it heals by itself)
              "p": 0.8, "schedule_seed": 42}}   # optional: BUGGIFY-style, each load that
                                     # reaches the site fires with probability p, decided
                                     # by kvgate.faults.schedule.fires(schedule_seed, kind, n, p)

Each fault acts on the data, and the production code path must notice it by itself:

  corrupt          one seed-drawn bit of block k's committed page is flipped in the shared
                   arena once the load holds its lease (a stray write into a page at
                   rest); the loader's digest must catch it. Heal: the bit is flipped back
                   when the lease is released. (A client without the arena mapped gets
                   the flipped bit in the bytes that arrive.)
  timeout          the page reads of the load are slow: the read of block k-1 (for k = 0
                   the acquire) takes longer than the load's deadline, so the loader's
                   own deadline check stops it at block k. Heal: the next load runs at
                   speed.
  evict            between the scheduler's lookup and the worker's load, blocks k.. are
                   evicted through the daemon: the load stops at k as `evicted`.
  hold             the load pauses `seconds` (default 3) before block k, its lease held:
                   the window in which the harness tries to evict or squeeze leased pages.
A connection cut under a load is the transport proxy's (kvgate.faults.proxy): on one host the
page bytes come from shared memory, so only the frames around them can fail.
Every firing is written to the run's history (`fault` events) with what it did.

A publish that never completes (the window in which the harness kills the replica):

    {"publish": {"kind": "hang", "seconds": 120, "times": 1}}

  hang             the publish's pages are reserved and written, then its commit waits
                   `seconds` before it is sent: a replica killed meanwhile dies with an
                   open publish, which the pool must reclaim and never make visible.

Two publishes of one prefix from two replicas, in a seeded interleaving (the race of the
same_key_race conformance scenario; kvgate.faults.barrier):

    {"publish": {"kind": "turns", "me": "A", "dir": PATH, "parties": ["A", "B"],
                 "order": ["A:reserve", "B:witness", "B:reserve", "A:write", ...],
                 "timeout_s": 60, "times": 1}}

  turns            the replica's next publish takes its turns in `order`: `witness` (a
                   lookup of the publish's blocks just before its reserve: what a reader
                   sees while the other publish is open), `reserve`, `write` (its pages
                   written: marked done at its commit) and `commit`. A publish that
                   reserved nothing skips its write and commit turns. Each turn's record
                   (the witness's visible blocks, the reserve's slot statuses) is kept in
                   the turn's file and written to the history; a turn that cannot run in
                   `timeout_s` is recorded (`turn_timeout`) and the publish goes on unheld.

A negative control for reconnection:

    {"client": {"control": "no_reconnect"}}

  once a pool call of the replica has failed with a transport error, every later call
  fails the same way: a client that never replaces a dead connection (after a pool
  restart, sharing never resumes).

    {"client": {"control": "unguarded_probe", "pause_ms": 5}}

  the scheduler's same-host probe is kvgate.faults.hook_controls.unguarded_probe: it reads the
  client's socket and segment one attribute at a time, without the client's snapshot,
  pausing `pause_ms` between its reads (the window a busy scheduler thread leaves another
  thread); a restart reconnecting the client meanwhile makes it raise on the scheduler
  thread (which ends vLLM's engine core) or answer from the old segment.

A slow pool, as the scheduler's lookups see it (the window in which its lookup thread and
its probe share the client):

    {"lookup": {"delay_ms": 300}}

  every lookup of the replica waits `delay_ms` before it is sent (recorded as
  `lookup_delay`: no load is expected to end by it).

A negative control for the namespace (the key), in the same file:

    {"namespace": {"drop": ["model_revision"]}}

  every pool call of the replica uses its namespace with those fields blanked: a key
  that leaves the revision out. Two revisions of a model then share blocks, which the
  revision-mismatch scenario must catch.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvgate.faults.barrier import Turns, TurnTimeout
from kvgate.faults.control import ControlFile, ControlFileError
from kvgate.faults.hook_controls import unguarded_probe
from kvgate.faults.schedule import fires
from kvpool.pool.records import AcquireResult
from kvpool.client.backend import PoolBackend
from kvpool.errors import TransportError
from kvpool.connector.history import HistoryWriter

KINDS = ("timeout", "corrupt", "evict", "hold")
CLIENT_CONTROLS = (None, "no_reconnect", "unguarded_probe")


class FaultyBackend:
    def __init__(self, inner: PoolBackend, control: str | Path | ControlFile, history: HistoryWriter,
                 load_deadline_s: float = 10.0):
        self.inner = inner
        self.load_deadline_s = load_deadline_s
        self.control = control if isinstance(control, ControlFile) else ControlFile(control)
        self.history = history
        self._generation = -1
        self._spec: dict = {}
        self._fired = 0
        self._publish_fired = 0
        self._dead = False
        self._armed: tuple[int, dict] | None = None
        self._flipped: dict[int, tuple[np.ndarray, int, int]] = {}  # lease -> (page view, byte, bit) to restore
        self._opportunities = 0  # loads that reached the armed site since it was armed
        self._race: dict[int, tuple[Turns, str]] = {}  # reservation -> (its turns, this party), of a publish race
        self._lock = threading.Lock()

    @property
    def page_size(self) -> int:
        return self.inner.page_size

    def __getattr__(self, name: str):  # noqa: ANN204 - everything not faulted passes through
        return getattr(self.inner, name)

    def _load_fault(self) -> dict | None:
        doc, generation = self.control.read()
        with self._lock:
            if generation != self._generation:  # a new arming: every count starts again
                self._generation, self._spec = generation, doc
                self._fired = 0
                self._opportunities = 0
                self._publish_fired = 0
                self._dead = False
                fault = doc.get("load")
                if fault is not None and fault.get("kind") not in KINDS:
                    raise ControlFileError(f"{self.control.path}: unknown fault kind {fault.get('kind')!r}; "
                                           f"known {KINDS}", generation)
            fault = self._spec.get("load")
            if fault is None or self._fired >= int(fault.get("times", 1)):
                return None
            return fault

    def _call(self, fn, *args):  # noqa: ANN001, ANN202
        control = (self._spec.get("client") or {}).get("control")
        if control not in CLIENT_CONTROLS:
            raise ControlFileError(f"{self.control.path}: unknown client control {control!r}; known {CLIENT_CONTROLS}")
        if control == "no_reconnect" and self._dead:
            raise TransportError("control no_reconnect: the connection failed before and was never replaced")
        try:
            return fn(*args)
        except TransportError:
            self._dead = control == "no_reconnect"
            raise

    def _ns(self, ns):  # noqa: ANN001, ANN202
        self._load_fault()  # re-reads the file if it changed
        drop = (self._spec.get("namespace") or {}).get("drop") or []
        if not drop:
            return ns
        unknown = [f for f in drop if f not in ns.as_dict()]
        if unknown:
            raise ControlFileError(f"{self.control.path}: namespace has no fields {unknown}")
        return ns.replace(**{f: "" for f in drop})

    # -- the turns of a publish race (kvgate.faults.barrier) -----------------------------------
    def _turns_spec(self) -> dict | None:
        self._load_fault()
        spec = self._spec.get("publish")
        if spec is None or spec.get("kind") != "turns":
            return None
        with self._lock:
            if self._publish_fired >= int(spec.get("times", 1)):
                return None
            self._publish_fired += 1
        return spec

    def _turn(self, turns, me: str, point: str) -> bool:  # noqa: ANN001
        """Wait for the turn; False (recorded) when it timed out: the publish goes on unheld."""
        try:
            waited = turns.wait(me, point)
        except TurnTimeout as exc:
            self.history.write("fault", site="pool_client.publish", kind="turn_timeout", turn=f"{me}:{point}",
                               error=str(exc))
            return False
        self.history.write("fault", site="pool_client.publish", kind="turn", job="start", turn=f"{me}:{point}",
                           waited_s=round(waited, 4))
        return True

    def _race_reserve(self, spec: dict, ns, hashes, lengths, boundary):  # noqa: ANN001, ANN202
        turns = Turns(spec["dir"], spec["order"], spec["parties"], float(spec.get("timeout_s", 60)))
        me = str(spec["me"])
        if f"{me}:witness" in turns.order and self._turn(turns, me, "witness"):
            seen = self.inner.lookup(ns, hashes)
            info = {"blocks": len(hashes), "visible": len(seen.hits), "pending": int(seen.pending or 0),
                    "miss": str(seen.miss.cause) if seen.miss is not None else None}
            turns.done(me, "witness", **info)
            self.history.write("fault", site="pool_client.publish", kind="turn", job="done", turn=f"{me}:witness", **info)
        self._turn(turns, me, "reserve")
        res = self.inner.reserve(ns, hashes, lengths, boundary)
        statuses = [str(slot.status) for slot in res.slots]
        info = {"reservation": res.reservation_id, "slots": {st: statuses.count(st) for st in set(statuses)}}
        turns.done(me, "reserve", **info)
        self.history.write("fault", site="pool_client.publish", kind="turn", job="done", turn=f"{me}:reserve", **info)
        if not res.reservation_id:
            turns.skip(me, ["write", "commit"], "nothing reserved")
            return res
        self._race[res.reservation_id] = (turns, me)
        self._turn(turns, me, "write")  # the pages are written after this turn, before the commit
        return res

    def abort(self, reservation_id: int):  # noqa: ANN201
        raced = self._race.pop(reservation_id, None)
        if raced is not None:
            raced[0].skip(raced[1], ["write", "commit"], "aborted")
        return self.inner.abort(reservation_id)

    def commit(self, reservation_id: int, digests, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN201
        raced = self._race.pop(reservation_id, None)
        if raced is not None:
            turns, me = raced
            turns.done(me, "write", pages=len(digests))
            self._turn(turns, me, "commit")
            out = self.inner.commit(reservation_id, digests, *args, **kw)
            turns.done(me, "commit", committed=out.committed)
            self.history.write("fault", site="pool_client.publish", kind="turn", job="done", turn=f"{me}:commit",
                               committed=out.committed)
            return out
        self._load_fault()
        spec = self._spec.get("publish")
        if spec is not None and spec.get("kind") != "turns":
            if spec.get("kind") != "hang":
                raise ControlFileError(f"{self.control.path}: unknown publish fault {spec.get('kind')!r}; "
                                       f"known ('hang', 'turns')")
            with self._lock:
                fire = self._publish_fired < int(spec.get("times", 1))
                self._publish_fired += fire
            if fire:
                self.history.write("fault", site="pool_client.commit", kind="publish_hang", job="store",
                                   reservation=reservation_id, pages=len(digests), seconds=spec.get("seconds", 120))
                time.sleep(float(spec.get("seconds", 120)))
        return self.inner.commit(reservation_id, digests, *args, **kw)

    def renew(self, reservations=(), leases=()):  # noqa: ANN001, ANN201 - unfaulted, but a dead client stays dead
        return self._call(self.inner.renew, reservations, leases)

    def lookup(self, ns, hashes: Sequence[bytes], wait_pending_s: float = 0.0):  # noqa: ANN001, ANN201
        ns = self._ns(ns)
        delay = float((self._spec.get("lookup") or {}).get("delay_ms", 0)) / 1000
        if delay > 0:  # a slow pool, not a fault a load must answer for: its own record
            self.history.write("lookup_delay", site="pool_client.lookup", seconds=delay, blocks=len(hashes))
            time.sleep(delay)
        return self._call(self.inner.lookup, ns, hashes, wait_pending_s)

    @property
    def probe(self):  # noqa: ANN201
        """The inner backend's same-host probe with a lookup's faults; None where the inner
        backend has none (a GPU tier's), as the connector finds on the backend unwrapped."""
        return None if getattr(self.inner, "probe", None) is None else self._probe

    def _probe(self, ns, hashes: Sequence[bytes], fresh_s=None):  # noqa: ANN001, ANN201 - the same faults as a lookup
        ns = self._ns(ns)
        client = self._spec.get("client") or {}
        if client.get("control") == "unguarded_probe":
            pause = float(client.get("pause_ms", 0)) / 1000
            return self._call(unguarded_probe, self.inner, ns, hashes, fresh_s, pause)
        return self._call(self.inner.probe, ns, hashes, fresh_s)

    def reserve(self, ns, hashes, lengths, boundary=None):  # noqa: ANN001, ANN201
        ns = self._ns(ns)
        spec = self._turns_spec()
        if spec is not None:
            return self._race_reserve(spec, ns, hashes, lengths, boundary)
        return self.inner.reserve(ns, hashes, lengths, boundary)

    def evict(self, ns, hashes):  # noqa: ANN001, ANN201
        return self.inner.evict(self._ns(ns), hashes)

    def acquire(self, ns, hashes: Sequence[bytes]) -> AcquireResult:  # noqa: ANN001
        ns = self._ns(ns)
        fault = self._load_fault()
        if fault is not None and fault["kind"] == "evict":
            k = int(fault.get("block", 0))
            if k < len(hashes) and self._draw(fault):  # a load of k blocks or fewer has no block k to lose
                outcomes = self.inner.evict(ns, list(hashes[k:]))
                evicted = sum(o == "evicted" for o in outcomes)
                if evicted:
                    self._fired += 1
                    self.history.write("fault", site="pool_client.acquire", kind="evict", block=k, evicted=evicted)
                else:  # every block from k on leased by another load, or gone already: nothing happened
                    self.history.write("fault_skipped", site="pool_client.acquire", kind="evict", block=k,
                                       reason="nothing evicted", outcomes=[str(o) for o in outcomes])
            return self.inner.acquire(ns, hashes)
        lease = self.inner.acquire(ns, hashes)
        fault = fault if lease.lease_id else None
        k = int(fault.get("block", 0)) if fault is not None else -1
        self._armed = None
        if fault is None or k >= len(lease.hits) or not self._draw(fault):
            return lease
        if fault["kind"] == "corrupt" and getattr(self.inner, "arena", None) is not None:
            self._fired += 1
            self._flip(lease, k, fault)
        elif fault["kind"] == "timeout" and k == 0:
            self._fired += 1
            self._slow(lease, 0, "pool_client.acquire")
        else:
            self._armed = (lease.lease_id, fault)
        return lease

    def _draw(self, fault: dict) -> bool:
        """One opportunity of the armed site: fire, unless the fault carries a probability
        and the schedule's draw for this opportunity says no (recorded either way)."""
        n = self._opportunities
        self._opportunities += 1
        if "p" not in fault:
            return True
        fire = fires(int(fault["schedule_seed"]), fault["kind"], n, float(fault["p"]))
        if not fire:
            self.history.write("fault_skipped", site="pool_client.acquire", kind=fault["kind"], opportunity=n,
                               p=float(fault["p"]))
        return fire

    def _flip(self, lease: AcquireResult, k: int, fault: dict) -> None:
        """Flip one drawn bit of block k's committed page in the shared arena."""
        ref = lease.hits[k]
        rng = random.Random(f"{fault.get('seed', 0)}:corrupt:{k}")
        view = self.inner.arena.page(ref.page, ref.length)
        offset, bit = rng.randrange(ref.length), rng.randrange(8)
        view[offset] ^= 1 << bit
        self._flipped[lease.lease_id] = (view, offset, bit)
        self.history.write("fault", site="pool_arena.page", kind="corrupt", block=k, lease=lease.lease_id,
                           page=ref.page, offset=offset, bit=bit)

    def _slow(self, lease: AcquireResult, k: int, site: str) -> None:
        """Hold the load past its deadline, so that the loader stops at block k."""
        seconds = self.load_deadline_s + 0.25
        self.history.write("fault", site=site, kind="timeout", block=k, lease=lease.lease_id, seconds=seconds)
        time.sleep(seconds)

    def release(self, lease_id: int):  # noqa: ANN201
        flipped = self._flipped.pop(lease_id, None)
        if flipped is not None:  # heal: the committed page gets its bit back
            view, offset, bit = flipped
            view[offset] ^= 1 << bit
            self.history.write("heal", site="pool_arena.page", kind="corrupt", lease=lease_id)
        return self.inner.release(lease_id)

    def read_page(self, lease: AcquireResult, index: int):  # noqa: ANN201
        armed = self._armed
        if armed is None or armed[0] != lease.lease_id:
            return self.inner.read_page(lease, index)
        fault = armed[1]
        kind, k = fault["kind"], int(fault.get("block", 0))
        if kind == "timeout" and index == k - 1:  # the read before block k is slow
            self._armed = None
            self._fired += 1
            data = self.inner.read_page(lease, index)
            self._slow(lease, k, "pool_client.read_page")
            return data
        if index != k:
            return self.inner.read_page(lease, index)
        self._armed = None
        self._fired += 1
        if kind == "hold":
            self.history.write("fault", site="pool_client.read_page", kind="lease_hold", block=index,
                               lease=lease.lease_id, seconds=float(fault.get("seconds", 3)))
            time.sleep(float(fault.get("seconds", 3)))
            return self.inner.read_page(lease, index)
        # corrupt, on a client without the arena mapped: the bit flips on its way in
        self.history.write("fault", site="pool_client.read_page", kind=kind, block=index, lease=lease.lease_id)
        data = np.array(self.inner.read_page(lease, index), dtype=np.uint8, copy=True).reshape(-1)
        data[random.Random(f"{fault.get('seed', 0)}:corrupt:{k}").randrange(len(data))] ^= 0x10
        return data
