"""A plain reference model of the pool and a Hypothesis state machine that drives a real
pool daemon beside it (zarr's testing/stateful.py is the model). It is test code: it lives
in the harness, which the pool criteria (kvgate.harness.scenarios.pool.state_machine) run it from,
and kvpool never imports it (nor Hypothesis).

  PoolModel        dicts and lists, no cleverness: what the pool must answer.
  PoolMachine      a RuleBasedStateMachine over a real daemon (real sockets, real shared
                   memory): publish, open/commit/abort/abandon a publish, lookup, load,
                   hold/release a lease, read a held lease's pages, evict, squeeze
                   capacity, restart. After every step the daemon's page accounting must
                   equal the model's; every miss must carry the model's cause (and, for
                   incompatible, the model's fields); every loaded byte must equal the bytes
                   the model says were published; a held lease's pages never change.

Each finding is of one kind (FINDINGS), the behaviour it checks. `PoolMachine.judged`
limits which kinds end a run: a known-bad catalog is then caught by the behaviour it
breaks (a wrong miss cause, a page reused under a lease), not by the accounting invariant
that would trip first.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from kvpool.pool.catalog import Catalog, LoadLimits
from kvpool.pool.records import EvictOutcome, SlotStatus
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.errors import MissCause, TransportError
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import PoolDaemon

PAGE = 256
NUM_PAGES = 6
PER_CLIENT_LEASES = 3
N_KEYS = 10
NAMESPACES = (
    Namespace("tiny", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64),
    Namespace("tiny", "r2", "tok", "bfloat16", "cpu", 16, 2, 2, 64),
)
KEYS = [block_hashes([k] * 16, 16)[0] for k in range(N_KEYS)]

Entry = tuple[int, int]  # (namespace index, key index)

FINDINGS = {
    "accounting": "the daemon's page counts (stats) equal the model's",
    "answer": "a publish, an eviction or a lease is answered as the model says",
    "capacity": "a publish gets every page the model says is free or evictable",
    "miss_cause": "a lookup or load misses where the model says, with its cause",
    "probe": "the segment's index (a probe without a round trip) finds the run the model says",
    "bytes": "a loaded page holds the bytes that were published for its block",
    "lease": "a held lease's pages keep their bytes until it is released",
}


def page_bytes(ns: int, key: int, version: int) -> np.ndarray:
    return np.random.default_rng([ns, key, version]).integers(0, 256, PAGE, dtype=np.uint8)


class PoolModel:
    def __init__(self, num_pages: int, per_client: int):
        self.num_pages = num_pages
        self.capacity = num_pages
        self.per_client = per_client
        self.lru: OrderedDict[Entry, int] = OrderedDict()  # committed entry -> data version
        self.reserved: dict[int, list[Entry]] = {}  # reservation handle -> entries
        self.leases: dict[int, list[Entry]] = {}  # lease handle -> entries
        self.ghosts: OrderedDict[Entry, None] = OrderedDict()

    def used(self) -> int:
        return len(self.lru) + sum(len(v) for v in self.reserved.values())

    def lease_count(self, entry: Entry) -> int:
        return sum(entry in v for v in self.leases.values())

    def pending(self, entry: Entry) -> bool:
        return any(entry in v for v in self.reserved.values())

    def _evict_one(self) -> bool:
        for entry in self.lru:
            if not self.lease_count(entry):
                self._evict(entry)
                return True
        return False

    def _evict(self, entry: Entry) -> None:
        del self.lru[entry]
        self.ghosts[entry] = None
        self.ghosts.move_to_end(entry)
        while len(self.ghosts) > self.num_pages:
            self.ghosts.popitem(last=False)

    def reserve(self, ns: int, keys: list[int]) -> tuple[list[SlotStatus], list[Entry]]:
        statuses, entries = [], []
        for k in keys:
            e = (ns, k)
            if e in self.lru:
                self.lru.move_to_end(e)
                statuses.append(SlotStatus.EXISTS)
            elif self.pending(e) or e in entries:
                statuses.append(SlotStatus.PENDING)
            elif self.used() + len(entries) >= self.capacity and not self._evict_one():
                statuses.append(SlotStatus.NO_CAPACITY)
            else:
                statuses.append(SlotStatus.RESERVED)
                entries.append(e)
        return statuses, entries

    def commit(self, entries: list[Entry], version: int) -> None:
        for e in entries:
            self.lru[e] = version
            self.lru.move_to_end(e)
            self.ghosts.pop(e, None)

    def find(self, ns: int, keys: list[int]) -> tuple[list[Entry], MissCause | None, tuple[str, ...]]:
        hits: list[Entry] = []
        for k in keys:
            e = (ns, k)
            if e in self.lru:
                hits.append(e)
                continue
            if e in self.ghosts:
                return hits, MissCause.EVICTED, ()
            others = [o for (o, kk) in self.lru if kk == k and o != ns]
            if others:
                return hits, MissCause.INCOMPATIBLE, NAMESPACES[ns].differing_fields(NAMESPACES[others[0]])
            return hits, MissCause.NEVER_PUBLISHED, ()
        return hits, None, ()

    def acquire(self, ns: int, keys: list[int], client_leases: int) -> tuple[list[Entry], MissCause | None, bool]:
        hits, cause, _ = self.find(ns, keys)
        if not hits:
            return [], cause, False
        if self.per_client and client_leases >= self.per_client:
            return [], MissCause.THROTTLED, False
        for e in hits:
            self.lru.move_to_end(e)
        return hits, cause, True

    def squeeze(self, pages: int) -> int:
        self.capacity = pages
        evicted = 0
        while self.used() > pages and self._evict_one():
            evicted += 1
        return evicted


class PoolMachine(RuleBasedStateMachine):
    """Subclass and set `start_daemon` / `stop_daemon` to drive another deployment."""

    open_publishes = Bundle("open_publishes")
    held_leases = Bundle("held_leases")
    catalog_factory: type[Catalog] = Catalog
    judged: frozenset[str] | None = None  # the kinds of finding that end a run (None: all of FINDINGS)
    examples_run = 0  # programs started, counted per class (the budget a control needed)

    def __init__(self) -> None:
        super().__init__()
        self.daemon = None
        self.client: PoolClient | None = None
        self.version = 0

    # -- deployment hooks --------------------------------------------------------------
    def start_daemon(self):  # noqa: ANN201
        """A daemon in a background thread on a fresh name and run dir, its catalog built by
        `catalog_factory` (a subclass may plug in a known-bad one)."""
        name = f"kvgt-machine-{os.getpid()}-{secrets.token_hex(4)}"
        config = PoolConfig(name=name, page_size=PAGE, num_pages=NUM_PAGES, tenants={"default": "tok"},
                            run_dir=Path(tempfile.mkdtemp(prefix=f"{name}-")),
                            limits=LoadLimits(per_client=PER_CLIENT_LEASES), reap_interval_s=3600.0)
        return PoolDaemon(config, catalog_factory=self.catalog_factory).start_thread()

    def connect(self, name: str = "machine") -> PoolClient:
        return PoolClient(f"unix:{self.daemon.unix_path}", "default", "tok", name=name)

    # -- set-up and tear-down ----------------------------------------------------------
    @initialize()
    def boot(self) -> None:
        type(self).examples_run += 1
        self.daemon = self.start_daemon()
        self.client = self.connect()
        self.model = PoolModel(NUM_PAGES, PER_CLIENT_LEASES)
        self.side_clients: dict[int, PoolClient] = {}
        self.held: dict[int, tuple[int, list[Entry], object, list[int]]] = {}  # ns, entries, lease, versions
        self.runs: list[tuple[int, list[int]]] = []  # (ns, keys) of each publish, to load again as a run

    def teardown(self) -> None:
        for c in getattr(self, "side_clients", {}).values():
            c.close()
        if self.client is not None:
            self.client.close()
        if self.daemon is not None:
            self.daemon.stop_thread()

    # -- helpers -----------------------------------------------------------------------
    def _expect(self, kind: str, ok: bool, what: object) -> None:
        """A finding of `kind` (FINDINGS) when not ok; it ends the run if the kind is judged."""
        if not ok and (self.judged is None or kind in self.judged):
            raise AssertionError(f"[{kind}] {what}")

    def _blocks(self, ns: int, keys: list[int]) -> list[np.ndarray]:
        return [page_bytes(ns, k, self.version) for k in keys]

    def _wait_for(self, reserved: int, leased: int) -> dict[str, int]:
        for _ in range(500):
            s = self.client.stats()
            if s["reserved_pages"] == reserved and s["leased_pages"] == leased:
                return s
            time.sleep(0.002)
        self._expect("accounting", False, f"daemon did not reclaim: {s}")
        return s

    # -- rules -------------------------------------------------------------------------
    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4, unique=True))
    def publish(self, ns: int, keys: list[int]) -> None:
        self.version += 1
        statuses, entries = self.model.reserve(ns, keys)
        res = publish(self.client, NAMESPACES[ns], [KEYS[k] for k in keys], self._blocks(ns, keys))
        got = {
            SlotStatus.RESERVED: res.committed, SlotStatus.EXISTS: res.exists, SlotStatus.PENDING: res.pending,
            SlotStatus.NO_CAPACITY: res.no_capacity,
        }
        want = {s: statuses.count(s) for s in got}
        self._expect("capacity", got[SlotStatus.NO_CAPACITY] == want[SlotStatus.NO_CAPACITY],
                     f"publish: {got[SlotStatus.NO_CAPACITY]} blocks refused for capacity, the model refuses "
                     f"{want[SlotStatus.NO_CAPACITY]} ({got} vs {want})")
        self._expect("answer", got == want, f"publish: slots {got}, the model's {want}")
        self._expect("answer", res.rejected == 0, f"publish: {res.rejected} pages rejected")
        self.model.commit(entries, self.version)
        self.runs.append((ns, keys))

    @rule(target=open_publishes, ns=st.integers(0, 1),
          keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=3, unique=True))
    def open_publish(self, ns: int, keys: list[int]):  # noqa: ANN201
        self.version += 1
        statuses, entries = self.model.reserve(ns, keys)
        side = self.connect(f"side-{self.version}")
        res = side.reserve(NAMESPACES[ns], [KEYS[k] for k in keys], [PAGE] * len(keys))
        got = [s.status for s in res.slots]
        self._expect("capacity", got.count(SlotStatus.NO_CAPACITY) == statuses.count(SlotStatus.NO_CAPACITY),
                     f"reserve: slots {got}, the model's {statuses}")
        self._expect("answer", got == statuses, f"reserve: slots {got}, the model's {statuses}")
        blocks = self._blocks(ns, keys)
        for i, slot in enumerate(res.slots):
            if slot.status == SlotStatus.RESERVED:
                side.write_page(res, i, blocks[i])
        handle = self.version
        self.side_clients[handle] = side
        self.model.reserved[handle] = entries
        return (handle, res, [b for b, s in zip(blocks, res.slots) if s.status == SlotStatus.RESERVED])

    @rule(pub=consumes(open_publishes))
    def commit_open(self, pub) -> None:  # noqa: ANN001
        handle, res, blocks = pub
        side = self.side_clients.pop(handle, None)
        entries = self.model.reserved.pop(handle, None)
        if side is None or entries is None:
            return  # gone with a restart
        if res.reservation_id:
            from kvpool.pool.digest import page_digest

            out = side.commit(res.reservation_id, [page_digest(b) for b in blocks])
            self._expect("answer", out.committed == len(entries) and out.rejected == (),
                         f"commit: {out}, the model commits {len(entries)}")
            self.model.commit(entries, handle)
        side.close()

    @rule(pub=consumes(open_publishes), abandon=st.booleans())
    def abort_or_abandon_open(self, pub, abandon: bool) -> None:  # noqa: ANN001
        handle, res, _ = pub
        side = self.side_clients.pop(handle, None)
        entries = self.model.reserved.pop(handle, None)
        if side is None or entries is None:
            return
        if abandon:  # the publisher dies: its connection drops mid-publish
            side.close()
            self._wait_for(sum(len(v) for v in self.model.reserved.values()), self._leased_pages())
        else:
            if res.reservation_id:
                freed = side.abort(res.reservation_id)
                self._expect("answer", freed == len(entries), f"abort: {freed} pages, the model's {len(entries)}")
            side.close()

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4, unique=True))
    def lookup(self, ns: int, keys: list[int]) -> None:
        hits, cause, fields = self.model.find(ns, keys)
        got = self.client.lookup(NAMESPACES[ns], [KEYS[k] for k in keys])
        self._expect("miss_cause", len(got.hits) == len(hits) and (got.miss.cause if got.miss else None) == cause
                     and (got.miss is None or got.miss.index == len(hits)),
                     f"lookup: {len(got.hits)} hits then {got.miss}, the model's {len(hits)} then {cause}")
        if cause is not None and got.miss is not None:
            self._expect("miss_cause", got.miss.fields == fields, f"lookup: fields {got.miss.fields}, the model's {fields}")
        probed = self.client.probe(NAMESPACES[ns], [KEYS[k] for k in keys])
        self._expect("probe", probed is None or probed == len(hits),
                     f"probe: {probed} blocks in the segment's index, the model's {len(hits)}")

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4, unique=True))
    def load(self, ns: int, keys: list[int]) -> None:
        hits, cause, ok = self.model.acquire(ns, keys, len(self.held))
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        res = load(self.client, NAMESPACES[ns], [KEYS[k] for k in keys], out.__getitem__)
        self._expect("miss_cause", res.loaded == len(hits) and (res.miss.cause if res.miss else None) == cause,
                     f"load: {res.loaded} loaded then {res.miss}, the model's {len(hits)} then {cause}")
        for (n, k), data in zip(hits[:res.loaded], out):
            self._expect("bytes", np.array_equal(data, page_bytes(n, k, self.model.lru[(n, k)])),
                         f"load: the page of block {(n, k)} holds other bytes")

    @precondition(lambda self: bool(getattr(self, "runs", None)))
    @rule(data=st.data())
    def load_published(self, data) -> None:  # noqa: ANN001
        """Load a run of blocks as it was published: multi-block hits, whose pages must come
        back each in its own place."""
        ns, keys = data.draw(st.sampled_from(self.runs), label="run")
        self.load(ns, keys)

    @rule(target=held_leases, data=st.data())
    def hold_lease(self, data):  # noqa: ANN001, ANN201
        # Mostly start from a committed block, so leases are actually granted.
        committed = list(self.model.lru)
        if committed and data.draw(st.booleans(), label="from_committed"):
            ns, first = data.draw(st.sampled_from(committed), label="first")
        else:
            ns, first = data.draw(st.integers(0, 1), label="ns"), data.draw(st.integers(0, N_KEYS - 1), label="first")
        rest = data.draw(st.lists(st.integers(0, N_KEYS - 1), max_size=2, unique=True), label="rest")
        keys = [first] + [k for k in rest if k != first]
        hits, cause, ok = self.model.acquire(ns, keys, len(self.held))
        got = self.client.acquire(NAMESPACES[ns], [KEYS[k] for k in keys])
        self._expect("miss_cause", len(got.hits) == len(hits) and (got.miss.cause if got.miss else None) == cause,
                     f"acquire: {len(got.hits)} hits then {got.miss}, the model's {len(hits)} then {cause}")
        if not ok:
            self._expect("answer", got.lease_id == 0, f"acquire: lease {got.lease_id} granted past the limit")
            return 0
        if not got.lease_id or len(got.hits) != len(hits):
            return 0  # a finding above, not judged in this run: keep no lease the model does not know
        self.held[got.lease_id] = (ns, hits, got, [self.model.lru[e] for e in hits])
        self.model.leases[got.lease_id] = hits
        return got.lease_id

    @rule(lease=consumes(held_leases))
    def release_lease(self, lease: int) -> None:
        if lease == 0 or lease not in self.held:
            return
        del self.held[lease]
        del self.model.leases[lease]
        stale = self.client.release(lease).stale
        self._expect("answer", stale == (), f"release: stale pages {stale}")

    @rule(lease=held_leases)
    def read_held(self, lease: int) -> None:
        """A loader's view: the pages of a lease it holds, read now, are the bytes of its
        blocks as they were when it was granted (nothing may reuse a leased page)."""
        if lease not in self.held:
            return
        _, entries, got, versions = self.held[lease]
        for i, ((n, k), version) in enumerate(zip(entries, versions)):
            data = np.frombuffer(bytes(self.client.read_page(got, i))[:PAGE], np.uint8)
            self._expect("lease", np.array_equal(data, page_bytes(n, k, version)),
                         f"read: the page of block {(n, k)} changed under lease {lease}")

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=3, unique=True))
    def evict(self, ns: int, keys: list[int]) -> None:
        want = []
        for k in keys:
            e = (ns, k)
            if e not in self.model.lru:
                want.append(EvictOutcome.NOT_FOUND)
            elif self.model.lease_count(e):
                want.append(EvictOutcome.LEASED)
            else:
                self.model._evict(e)
                want.append(EvictOutcome.EVICTED)
        got = self.client.evict(NAMESPACES[ns], [KEYS[k] for k in keys])
        self._expect("answer", got == want, f"evict: {got}, the model's {want}")

    @rule(lease=held_leases)
    def evict_leased(self, lease: int) -> None:
        """Eviction attempts on pages a loader holds must all be refused."""
        if lease not in self.held:
            return
        ns, entries, _, _ = self.held[lease]
        keys = [k for _, k in entries]
        got = self.client.evict(NAMESPACES[ns], [KEYS[k] for k in keys])
        self._expect("answer", got == [EvictOutcome.LEASED] * len(keys), f"evict of leased pages: {got}")
        # The same blocks published again at once: they are still there (exists); a pool that
        # let them go hands their pages (the free list is LIFO) to the new copies, which the
        # lease holder then reads.
        self.version += 1
        statuses, fresh = self.model.reserve(ns, keys)
        res = publish(self.client, NAMESPACES[ns], [KEYS[k] for k in keys], self._blocks(ns, keys))
        self._expect("answer", res.committed == statuses.count(SlotStatus.RESERVED),
                     f"republish of leased blocks: {res.committed} committed, the model's "
                     f"{statuses.count(SlotStatus.RESERVED)}")
        self.model.commit(fresh, self.version)
        self.read_held(lease)

    @rule(pages=st.integers(1, NUM_PAGES))
    def squeeze(self, pages: int) -> None:
        got, want = self.client.set_capacity(pages), self.model.squeeze(pages)
        self._expect("answer", got == want, f"squeeze to {pages}: {got} evicted, the model's {want}")

    @precondition(lambda self: self.daemon is not None)
    @rule()
    def restart(self) -> None:
        for c in self.side_clients.values():
            c.close()
        self.client.close()
        self.daemon.stop_thread()
        self.daemon = self.start_daemon()
        self.client = self.connect()
        try:
            self.client.ping()
        except TransportError as exc:  # pragma: no cover - a failing restart is a finding
            raise AssertionError(f"pool did not come back: {exc}") from exc
        self.model = PoolModel(NUM_PAGES, PER_CLIENT_LEASES)
        self.side_clients = {}
        self.held = {}

    # -- invariants --------------------------------------------------------------------
    def _leased_pages(self) -> int:
        return len({e for v in self.model.leases.values() for e in v})

    @invariant()
    def accounting_agrees(self) -> None:
        if self.client is None:
            return
        s = self.client.stats()
        reserved = sum(len(v) for v in self.model.reserved.values())
        want = {"committed_pages": len(self.model.lru), "reserved_pages": reserved,
                "leased_pages": self._leased_pages(), "free_pages": NUM_PAGES - len(self.model.lru) - reserved,
                "capacity_pages": self.model.capacity, "ghosts": len(self.model.ghosts)}
        got = {k: s[k] for k in want}
        self._expect("accounting", got == want, f"stats {got}, the model's {want}")
