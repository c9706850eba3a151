"""The lease raced as a race: loaders holding leases while other connections' publishes
evict under pressure and the scrub runs and drops a corrupt page, over real sockets and
the shared segment (kvpool.pool.daemon).

Each iteration (seeded): a run of 2-4 blocks is published (trusted at commit, so each page
waits in the scrub's fresh queue), one of its pages maybe corrupted at rest by a stray
write, and the run leased by a loader (reading through its mapping, or over TCP). While the
lease is held, a drawn sequence of steps: pressure (another connection publishes as many
fresh blocks as the pool has pages: every page that may be evicted is, and rewritten),
a scrub round (a corrupt leased page is dropped: out of the index, its page held for the
lease), and copies of some of the leased pages. The oracle:
  * byte-exact: every page the loader copied is the bytes published (with the stray
    write where there was one): a leased page is never reused or rewritten while leased;
  * freed after release: once released, no page of the lease stays dropped, and a
    pressure of as many blocks as the pool has pages gets every page (nothing the lease
    pinned is kept from eviction).
Also checked, on the correct pool: the pressure while leased gets all but the leased pages
(the pressure reached the lease), and the scrub dropped the corrupt leased page while it
was leased (the scrub reached it), and the daemon's own release check found nothing stale.

What the test controls: the scrub only runs when the iteration says (the catalog's scrub
calls see no page while its gate is shut: ScrubGate, mixed into the correct or known-bad
catalog), and a scrub step waits for a whole round that began after the gate opened;
every other step is a request whose reply is read before the next. Nothing else moves a
page, so each step's effect is determined by the seed.

Controls (the known-bad catalogs of kvgate.faults, runnable with `python -m
kvgate.faults.pool serve --catalog NAME`), each through the schedule's first iterations;
the oracle must flag exactly the iterations (and the pages) its model says, at least one:
  leaseless       evicts leased pages: every page copied after a pressure differs;
  eager_drop      the scrub's drop frees the leased page at once: the corrupt page, copied
                  after a scrub and then a pressure (or over TCP: the daemon reads a free page
                  as empty), differs;
  kept_drop       a page dropped while leased is never freed: caught after the release;
  pinned_release  a release does not unpin: caught after the release (two iterations: it
                  pins the pool full).
A free-running phase follows on the correct pool (publishers evicting, loaders copying and
checking every page, the scrub running freely); its verdict is the byte-exact oracle alone.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import numpy as np
import pytest

from kvgate.faults.controls import LeaselessCatalog
from kvgate.faults.race_controls import RACE_CATALOG_CONTROLS
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import publish
from kvpool.pool.catalog import Catalog
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGE = 4096
PAGES = 12
CONTROLS = {"leaseless": LeaselessCatalog, **{n: RACE_CATALOG_CONTROLS[n] for n in
                                                ("eager_drop", "kept_drop", "pinned_release")}}


class ScrubGate:
    """Mixed into the daemon's catalog: while `open` is False the scrub's calls for its
    next pages (scrub_fresh, scrub_cycle) get none; `rounds` counts its rounds (one
    scrub_fresh call each, the next only once the last round's pages are judged)."""

    open = False
    rounds = 0

    def scrub_fresh(self, n: int):  # noqa: ANN201
        self.rounds += 1
        return super().scrub_fresh(n) if self.open else []

    def scrub_cycle(self, n: int):  # noqa: ANN201
        return super().scrub_cycle(n) if self.open else []


@dataclasses.dataclass
class LeaseIteration:
    m: int  # blocks leased
    corrupt: int  # the block corrupted at rest before the lease (-1: none)
    tcp: bool  # the loader copies over TCP (else through its mapping)
    steps: list[tuple]  # while leased: ("pressure",), ("scrub",), ("copy", indexes)


def draw(rng: random.Random) -> LeaseIteration:
    m = rng.randint(2, 4)
    corrupt = rng.randrange(m) if rng.random() < 0.6 else -1
    steps: list[tuple] = [("pressure",)] * rng.choice([0, 1, 1, 2]) + [("scrub",)] * rng.choice([0, 1, 1])
    order = list(range(m))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, m), rng.randint(0, min(2, m - 1)))) if m > 1 else []
    for a, b in zip([0, *cuts], [*cuts, m]):
        steps.append(("copy", tuple(order[a:b])))
    rng.shuffle(steps)
    return LeaseIteration(m, corrupt, rng.random() < 0.3, steps)


FORCED = {
    "leaseless": lambda rng: LeaseIteration(2, -1, False, [("pressure",), ("copy", (0, 1))]),
    "eager_drop": lambda rng: LeaseIteration(3, 1, False, [("copy", (0,)), ("scrub",), ("pressure",),
                                                           ("copy", (1, 2))]),
    "kept_drop": lambda rng: LeaseIteration(2, 0, True, [("scrub",), ("copy", (0, 1))]),
    "pinned_release": lambda rng: LeaseIteration(2, -1, False, [("copy", (0, 1))]),
}


def schedule(seed: int, count: int, worlds=tuple(FORCED)) -> list[LeaseIteration]:  # noqa: ANN001
    """`count` drawn iterations, and one forced for each of `worlds` that none exposes."""
    rng = random.Random(seed)
    its = [draw(rng) for _ in range(count)]
    for world in worlds:
        make = FORCED[world]
        if not any(expected(it, world) != expected(it, "correct") for it in its):
            its.insert(rng.randrange(len(its) + 1), make(rng))
    return its


def expected(it: LeaseIteration, world: str) -> tuple[frozenset[int], bool]:
    """On the pool `world`: the leased blocks whose copy differs from what was published,
    and whether the release leaves a page of the lease unfreed. A page freed under the
    lease differs once a pressure has rewritten it, and at once over TCP (the daemon reads
    a free page as empty); through the mapping it holds its bytes until rewritten."""
    pressured = dropped = freed = rewritten = False
    bad: set[int] = set()
    for step in it.steps:
        if step[0] == "pressure":
            pressured = True
            rewritten |= freed
        elif step[0] == "scrub" and it.corrupt >= 0:
            dropped = True
            freed |= world in ("leaseless", "eager_drop")
        elif step[0] == "copy":
            for i in step[1]:
                if (world == "leaseless" and pressured) or (i == it.corrupt and freed and (rewritten or it.tcp)):
                    bad.add(i)
    return frozenset(bad), world == "pinned_release" or (world == "kept_drop" and dropped)


# -- running an iteration -------------------------------------------------------------------


def _until(what: str, pred, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} (the step was not reached: nothing shown)")
        time.sleep(0.005)


def scrub_round(catalog: ScrubGate) -> None:
    """Open the gate, wait for a whole round that began after it opened, shut it, and wait
    for the round that may have been under way to end."""
    start = catalog.rounds
    catalog.open = True
    _until("a whole scrub round", lambda: catalog.rounds >= start + 2)
    catalog.open = False
    shut = catalog.rounds
    _until("the scrub round under way ended", lambda: catalog.rounds >= shut + 1)


class Pool:
    """The daemon (its catalog the world's, with the scrub's gate) and its clients."""

    def __init__(self, world: str, seed: int):
        base = Catalog if world == "correct" else CONTROLS[world]
        self.world = world
        self.rng = random.Random(seed ^ 0x1EA5E)
        self.daemon = thread_pool(page_size=PAGE, num_pages=PAGES, verify_commits=False, scrub_interval_s=0.005,
                                  scrub_pages_per_round=PAGES, scrub_rest_pages_per_round=PAGES,
                                  catalog_factory=type(f"Gated{base.__name__}", (ScrubGate, base), {}))
        self.catalog = self.daemon.pools["default"].catalog
        self.pub = self._client("publisher")
        self.pressure_client = self._client("pressure")
        self.loaders = {False: self._client("loader"), True: self._client("loader-tcp", tcp=True)}
        self.next_block = 0

    def _client(self, name: str, tcp: bool = False) -> PoolClient:
        if tcp:
            return PoolClient(f"tcp:127.0.0.1:{self.daemon.tcp_port}", "default", "tok", name=name, zero_copy=False)
        return PoolClient(f"unix:{self.daemon.unix_path}", "default", "tok", name=name)

    def fresh(self, n: int) -> tuple[list[bytes], list[np.ndarray]]:
        hs = block_hashes(range(self.next_block * 16, (self.next_block + n) * 16), 16)
        self.next_block += n
        return hs, [np.frombuffer(self.rng.randbytes(PAGE), np.uint8) for _ in range(n)]

    def pressure(self) -> int:
        """Publish as many fresh blocks as the pool has pages; the blocks it had no page for."""
        hs, data = self.fresh(PAGES)
        out = publish(self.pressure_client, NS, hs, data)
        assert out.committed + out.no_capacity == PAGES, out
        return out.no_capacity

    def close(self) -> None:
        for c in (self.pub, self.pressure_client, *self.loaders.values()):
            c.close()
        self.daemon.stop_thread()


def run_iteration(pool: Pool, it: LeaseIteration, left_before: int) -> dict:
    """The iteration on `pool`: the blocks whose copy differed, whether the release left a
    page unfreed (more pages dropped than before it, or more kept from a pressure than the
    `left_before` earlier iterations left: a known-bad pool's leftovers are not this
    iteration's), and what the steps met on the way."""
    hs, data = pool.fresh(it.m)
    assert publish(pool.pub, NS, hs, data).committed == it.m
    want = [d.copy() for d in data]
    if it.corrupt >= 0:  # a stray write at rest, before the scrub has seen the page
        page = pool.pub.lookup(NS, hs).hits[it.corrupt].page
        at, bit = pool.rng.randrange(PAGE), 1 << pool.rng.randrange(8)
        pool.pub.arena.page(page)[at] ^= bit
        want[it.corrupt][at] ^= bit
    dropped_before = pool.pub.stats()["dropped_pages"]
    loader = pool.loaders[it.tcp]
    lease = loader.acquire(NS, hs)
    assert lease.lease_id and len(lease.hits) == it.m and lease.miss is None, lease
    out: dict = {"no_capacity": [], "dropped_while_leased": []}
    bad: set[int] = set()
    for step in it.steps:
        if step[0] == "pressure":
            out["no_capacity"].append(pool.pressure())
        elif step[0] == "scrub":
            scrub_round(pool.catalog)
            out["dropped_while_leased"].append(pool.pub.stats()["dropped_pages"] - dropped_before)
        else:
            for i in step[1]:
                got = np.frombuffer(bytes(loader.read_page(lease, i)), np.uint8)
                if not np.array_equal(got, want[i]):
                    bad.add(i)
    out["stale"] = loader.release(lease.lease_id).stale
    dropped_after = pool.pub.stats()["dropped_pages"]
    out["left"] = pool.pressure()
    out["got"] = (frozenset(bad), dropped_after > dropped_before or out["left"] > left_before)
    return out


def run_world(world: str, seed: int, count: int) -> list[dict]:
    """Every iteration of the schedule on a pool of `world`'s catalog: per iteration what the
    oracle found, and the model's answer for the correct pool and for `world`."""
    its = schedule(seed, count, tuple(FORCED) if world == "correct" else (world,))
    pool = Pool(world, seed)
    rows: list[dict] = []
    try:
        for i, it in enumerate(its):
            out = run_iteration(pool, it, rows[-1]["left"] if rows else 0)
            rows.append({"iteration": i, "it": it, "correct": expected(it, "correct"), "model": expected(it, world),
                         **out})
    finally:
        pool.close()
    return rows


def test_a_leased_page_is_never_reused_while_leased_and_is_freed_after_release(test_seed):
    rows = run_world("correct", test_seed, 60)
    wrong = [(r["iteration"], r["it"], r["got"]) for r in rows if r["got"] != r["correct"]]
    assert wrong == [], wrong[:3]
    for r in rows:
        it = r["it"]
        # the pressure reached the lease: every page but the leased ones was taken
        assert all(n == it.m for n in r["no_capacity"]), (r["iteration"], r["no_capacity"], it)
        # the scrub reached the lease: the corrupt leased page was dropped while leased
        assert all(n == (it.corrupt >= 0) for n in r["dropped_while_leased"]), (r["iteration"], it)
        assert r["stale"] == () and r["left"] == 0, r
    pressured = sum(any(s[0] == "pressure" for s in r["it"].steps) for r in rows)
    scrubbed = sum(any(s[0] == "scrub" for s in r["it"].steps) and r["it"].corrupt >= 0 for r in rows)
    print(f"lease: {len(rows)} iterations, {pressured} with pressure while leased, "
          f"{scrubbed} with a corrupt leased page dropped by the scrub while leased")


@pytest.mark.parametrize("world", sorted(CONTROLS))
def test_the_lease_oracle_catches_a_known_bad_pool(world, test_seed):
    """The oracle against a known-bad catalog flags exactly the iterations, and the pages,
    its model says (at least one iteration every run)."""
    rows = run_world(world, test_seed, 2 if world == "pinned_release" else 12)
    exposed = {r["iteration"] for r in rows if r["model"] != r["correct"]}
    flagged = {r["iteration"] for r in rows if r["got"] != r["correct"]}
    assert exposed, "the schedule exposes this control nowhere: it would prove nothing"
    assert flagged == exposed, (sorted(flagged), sorted(exposed))
    assert all(r["got"] == r["model"] for r in rows), [(r["got"], r["model"]) for r in rows if r["got"] != r["model"]]
    print(f"{world}: caught in {len(flagged)} of {len(rows)} iterations")


def test_free_running_loaders_copy_only_what_was_published(test_seed):
    """Loaders acquire, copy and release runs while a publisher evicts under pressure and
    the scrub runs freely (3 s, and on until it has done enough to prove anything): every
    copied page is byte-exact and no release finds its pages moved. Its verdict is the
    oracle's; the controls are caught above."""
    pool = Pool("correct", test_seed)
    pool.catalog.open = True
    published: list[tuple[list[bytes], list[bytes]]] = []
    stop = threading.Event()
    found = {"loads": 0, "pages": 0, "bad": [], "stale": [], "errors": []}

    def publisher() -> None:
        with pool._client("free-publisher") as c:
            while not stop.is_set():
                hs, data = pool.fresh(3)
                publish(c, NS, hs, data)
                published.append((hs, [d.tobytes() for d in data]))

    def loader(tcp: bool, seed: int) -> None:
        rng = random.Random(seed)
        with pool._client(f"free-loader-{seed}", tcp=tcp) as c:
            while not stop.is_set():
                if not published:
                    time.sleep(0.001)
                    continue
                hs, data = published[max(0, len(published) - 1 - rng.randrange(6))]
                lease = c.acquire(NS, hs)
                if not lease.lease_id:
                    continue
                for i in range(len(lease.hits)):
                    if bytes(c.read_page(lease, i)) != data[i]:
                        found["bad"].append((hs[i], lease.hits[i].page))
                found["stale"] += c.release(lease.lease_id).stale
                found["loads"] += 1
                found["pages"] += len(lease.hits)

    errors: list[BaseException] = []
    threads = [threading.Thread(target=_recording, args=(fn, args, errors))
               for fn, args in ((publisher, ()), (loader, (False, test_seed)), (loader, (True, test_seed + 1)))]
    for t in threads:
        t.start()
    # 3 s at least, and until the run has done what it must to prove anything (more than 10 loads
    # and 10 evictions: a loaded machine takes longer), at most 60 s
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60.0 and not errors:
        time.sleep(0.25)
        if time.monotonic() - t0 >= 3.0 and found["loads"] > 10 and pool.pub.stats()["evictions"] > 10:
            break
    stop.set()
    for t in threads:
        t.join(30)
    try:
        stats = pool.pub.stats()
    finally:
        pool.close()
    assert errors == [], errors[:3]
    print(f"free-running lease: {found['loads']} loads, {found['pages']} pages copied, "
          f"{stats['evictions']} evictions, {stats['scrubbed_pages']} pages scrubbed")
    assert found["loads"] > 10 and stats["evictions"] > 10, (found["loads"], stats["evictions"])
    assert found["bad"] == [] and found["stale"] == [], (found["bad"][:3], found["stale"][:3])


def _recording(fn, args: tuple, errors: list[BaseException]) -> None:  # noqa: ANN001
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - a thread's failure, kept for the test's verdict
        errors.append(exc)
