"""A plain reference model of the pool and a Hypothesis state machine that drives a real
pool daemon beside it. Shipped in the package so every backend can be checked with it.

  PoolModel        dicts and lists, no cleverness: what the pool must answer.
  PoolMachine      a RuleBasedStateMachine over a real daemon (real sockets, real shared
                   memory): publish, open/commit/abort/abandon a publish, lookup, load,
                   hold/release a lease, evict, squeeze capacity, restart. After every step
                   the daemon's page accounting must equal the model's; every miss must
                   carry the model's cause (and, for incompatible, the model's fields);
                   every loaded byte must equal the bytes the model says were published.
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

from kvpool.catalog import Catalog, EvictOutcome, LoadLimits, SlotStatus
from kvpool.client import PoolClient, load, publish
from kvpool.errors import MissCause, TransportError
from kvpool.keys import Namespace, block_hashes
from kvpool.server import PoolConfig, PoolDaemon

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
        self.daemon = self.start_daemon()
        self.client = self.connect()
        self.model = PoolModel(NUM_PAGES, PER_CLIENT_LEASES)
        self.side_clients: dict[int, PoolClient] = {}
        self.held: dict[int, tuple[int, list[Entry]]] = {}

    def teardown(self) -> None:
        for c in getattr(self, "side_clients", {}).values():
            c.close()
        if self.client is not None:
            self.client.close()
        if self.daemon is not None:
            self.daemon.stop_thread()

    # -- helpers -----------------------------------------------------------------------
    def _blocks(self, ns: int, keys: list[int]) -> list[np.ndarray]:
        return [page_bytes(ns, k, self.version) for k in keys]

    def _wait_for(self, reserved: int, leased: int) -> dict[str, int]:
        for _ in range(500):
            s = self.client.stats()
            if s["reserved_pages"] == reserved and s["leased_pages"] == leased:
                return s
            time.sleep(0.002)
        raise AssertionError(f"daemon did not reclaim: {s}")

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
        assert got == want, (got, want)
        assert res.rejected == 0
        self.model.commit(entries, self.version)

    @rule(target=open_publishes, ns=st.integers(0, 1),
          keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=3, unique=True))
    def open_publish(self, ns: int, keys: list[int]):  # noqa: ANN201
        self.version += 1
        statuses, entries = self.model.reserve(ns, keys)
        side = self.connect(f"side-{self.version}")
        res = side.reserve(NAMESPACES[ns], [KEYS[k] for k in keys], [PAGE] * len(keys))
        assert [s.status for s in res.slots] == statuses
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
            from kvpool.digest import page_digest

            out = side.commit(res.reservation_id, [page_digest(b) for b in blocks])
            assert out.committed == len(entries) and out.rejected == ()
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
                assert side.abort(res.reservation_id) == len(entries)
            side.close()

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4, unique=True))
    def lookup(self, ns: int, keys: list[int]) -> None:
        hits, cause, fields = self.model.find(ns, keys)
        got = self.client.lookup(NAMESPACES[ns], [KEYS[k] for k in keys])
        assert len(got.hits) == len(hits)
        if cause is None:
            assert got.miss is None
        else:
            assert got.miss is not None and got.miss.cause == cause and got.miss.index == len(hits), (got.miss, cause)
            assert got.miss.fields == fields

    @rule(ns=st.integers(0, 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=4, unique=True))
    def load(self, ns: int, keys: list[int]) -> None:
        hits, cause, ok = self.model.acquire(ns, keys, len(self.held))
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        res = load(self.client, NAMESPACES[ns], [KEYS[k] for k in keys], out.__getitem__)
        assert res.loaded == len(hits), (res, hits, cause)
        assert (res.miss.cause if res.miss else None) == cause
        for (n, k), data in zip(hits, out):
            assert np.array_equal(data, page_bytes(n, k, self.model.lru[(n, k)])), "loaded bytes differ"

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
        assert len(got.hits) == len(hits)
        assert (got.miss.cause if got.miss else None) == cause
        if not ok:
            assert got.lease_id == 0
            return 0
        self.held[got.lease_id] = (ns, hits)
        self.model.leases[got.lease_id] = hits
        return got.lease_id

    @rule(lease=consumes(held_leases))
    def release_lease(self, lease: int) -> None:
        if lease == 0 or lease not in self.held:
            return
        del self.held[lease]
        del self.model.leases[lease]
        assert self.client.release(lease).stale == ()

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
        assert self.client.evict(NAMESPACES[ns], [KEYS[k] for k in keys]) == want

    @rule(lease=held_leases)
    def evict_leased(self, lease: int) -> None:
        """Eviction attempts on pages a loader holds must all be refused."""
        if lease not in self.held:
            return
        ns, entries = self.held[lease]
        keys = [k for _, k in entries]
        assert self.client.evict(NAMESPACES[ns], [KEYS[k] for k in keys]) == [EvictOutcome.LEASED] * len(keys)

    @rule(pages=st.integers(1, NUM_PAGES))
    def squeeze(self, pages: int) -> None:
        assert self.client.set_capacity(pages) == self.model.squeeze(pages)

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
        assert s["committed_pages"] == len(self.model.lru), (s, len(self.model.lru))
        assert s["reserved_pages"] == reserved
        assert s["leased_pages"] == self._leased_pages()
        assert s["free_pages"] == NUM_PAGES - len(self.model.lru) - reserved
        assert s["capacity_pages"] == self.model.capacity
        assert s["ghosts"] == len(self.model.ghosts)
