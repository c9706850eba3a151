"""The lookup wait raced as a race: a lookup parked on a publish in flight (wait_pending_s)
while other connections commit, abort, get their verify rejected or go away, in seeded
orderings, over real sockets (kvpool.pool.daemon).

Each iteration (fresh blocks) lays out a run of 1-3 segments of 1-3 blocks, each segment
with its fate, drawn from the seed: committed before the lookup, never published, or
reserved and written by a publisher of its own connection and then committed, committed
with one page's digest wrong (that page rejected), aborted, or its publisher's connection
closed -- each before the waiting lookup starts or after it is parked, the events after
in a drawn order -- or left in flight (the lookup then runs out its bound). The oracle:
the waiting lookup answers exactly the run the pool committed (each hit's digest that of
the bytes written) and, past it, the right miss: never_published where the block's
publish closed without a commit or never opened, in_flight only where it is still open
when the bound runs out; and it answers when the publish it waits on closes, not at its
bound (a settled answer that took the whole bound is a wake-up lost), and never later
than its bound (a hang). Never a block that was aborted, never an answer taken before a
commit was visible.

What the test controls: every event is complete before the next is sent (its reply read;
a closed connection's reservations seen gone from the pool's stats), and before each
event the waiting lookup has looked up as many times as the model of the pool under test
says it has by then (the catalog counts its lookups: the first, and one each time a close
woke the lookup, which parks again in the same step of the daemon's loop). So a woken
lookup looks again before the next event arrives, whatever the order in which the loop
runs its callbacks and reads its sockets (it does not always run the woken lookup first:
without this sync a control's catch depended on it). What is left to time is the bound:
long against the events (20 s; 0.3 s where a segment is left in flight, and then no
segment before it has an event after the lookup starts, so the bound decides nothing else).

Controls (kvgate.faults.race_controls, runnable with `python -m kvgate.faults.pool serve
--catalog NAME`), each run through the schedule's first iterations: the oracle must flag exactly the
iterations where that defect changes the answer (from a model of the defect, so the
catch is deterministic from the seed), and there is at least one such iteration in every
run (the schedule forces one per control if the draw has none):
  abort_visible  an abandoned publish committed instead of freed (hits for aborted blocks);
  lost_wakeup    a publish closed without a commit never wakes its waiters: they answer at
                 their bound (the daemon looks once more then, so the hits and the miss are
                 right; the time is not); run with a 3 s bound, which each exposed
                 iteration costs, and 10 iterations;
  late_visible   the lookup woken by a commit does not see the commit's blocks yet.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import time

import numpy as np
import pytest

from kvgate.faults.race_controls import RACE_CATALOG_CONTROLS
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.errors import MissCause
from kvpool.pool.catalog import Catalog
from kvpool.pool.digest import DIGEST_BYTES, page_digest
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
PAGE = 4096
LONG_S = 20.0  # the bound where every publish the lookup meets closes: never reached
LEFT_S = 0.3  # the bound where a segment is left in flight: the lookup runs it out
EVENTS = ("commit", "reject", "abort", "disconnect")
ZERO_DIGEST = bytes(DIGEST_BYTES)


@dataclasses.dataclass
class Segment:
    start: int  # its first block in the run
    n: int
    fate: str  # "before" (committed before the lookup) | "absent" | "left" | one of EVENTS
    after: bool = False  # the event comes after the lookup is parked (else before it starts)
    reject: int = -1  # fate "reject": the slot whose digest is wrong


@dataclasses.dataclass
class Iteration:
    segments: list[Segment]
    order: list[int]  # the segments whose event comes after the lookup is parked, in order

    @property
    def n(self) -> int:
        return sum(s.n for s in self.segments)

    @property
    def left(self) -> bool:
        return any(s.fate == "left" for s in self.segments)


def draw(rng: random.Random) -> Iteration:
    segments, start = [], 0
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(1, 3)
        fate = rng.choices(["before", "absent", "left", *EVENTS], weights=[12, 4, 6, 38, 10, 15, 15])[0]
        seg = Segment(start, n, fate, after=fate in EVENTS and rng.random() < 0.8)
        if fate == "reject":
            seg.reject = rng.randrange(n)
        segments.append(seg)
        start += n
    for i, seg in enumerate(segments):  # at most one left in flight; nothing before it after the start
        if seg.fate == "left":
            for other in segments[i + 1:]:
                if other.fate == "left":
                    other.fate = "absent"
            for other in segments[:i]:
                other.after = False
            break
    order = [i for i, s in enumerate(segments) if s.after]
    rng.shuffle(order)
    return Iteration(segments, order)


def laid(rng: random.Random, *specs: tuple[str, bool], order: tuple[int, ...] = ()) -> Iteration:
    """An iteration of the given (fate, after) segments, 1-3 blocks each, end to end."""
    segments, start = [], 0
    for fate, after in specs:
        n = rng.randint(1, 3)
        segments.append(Segment(start, n, fate, after))
        start += n
    return Iteration(segments, list(order))


FORCED = {  # one iteration per control that it changes: a lookup parked on the event
    "abort_visible": lambda rng: laid(rng, ("before", False), ("abort", True), order=(1,)),
    "lost_wakeup": lambda rng: laid(rng, ("disconnect", True), order=(0,)),
    "late_visible": lambda rng: laid(rng, ("commit", True), order=(0,)),
}
COVERED = {  # one iteration per kind of answer of the correct pool, if the draw has none
    None: lambda rng: laid(rng, ("commit", True), order=(0,)),
    MissCause.NEVER_PUBLISHED: lambda rng: laid(rng, ("abort", True), order=(0,)),
    MissCause.IN_FLIGHT: lambda rng: laid(rng, ("before", False), ("left", False)),
}


def schedule(seed: int, count: int) -> list[Iteration]:
    """`count` drawn iterations; then one forced for each control that no drawn one
    exposes, and one for each kind of answer that none gives."""
    rng = random.Random(seed)
    its = [draw(rng) for _ in range(count)]
    for world, make in FORCED.items():
        if not any(expected(it, world) != expected(it, "correct") for it in its):
            its.insert(rng.randrange(len(its) + 1), make(rng))
    for cause, make in COVERED.items():
        if not any(_cause(expected(it, "correct")) == cause for it in its):
            its.insert(rng.randrange(len(its) + 1), make(rng))
    return its


def _cause(answer: Answer) -> MissCause | None:
    return answer.miss[1] if answer.miss else None


# -- the model: the answer each pool gives -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Answer:
    hits: tuple[str, ...]  # per hit block: "C" (the bytes written) or "Z" (an all-zero digest)
    miss: tuple[int, MissCause] | None
    by_bound: bool  # the answer came when the lookup's bound ran out (else when a publish closed)


def expected(it: Iteration, world: str) -> Answer:
    """What the waiting lookup answers on the pool `world` ("correct" or a control)."""
    return model(it, world)[0]


def model(it: Iteration, world: str) -> tuple[Answer, list[int]]:
    """The waiting lookup's answer on the pool `world`, and, after each event that comes
    after it starts (in order), how many times it has looked up by then (its first look,
    and one more each time a closed publish woke it)."""
    state: list[str] = []  # per block: C committed, Z committed under a zero digest, P pending, N none
    owner: list[int] = []
    for si, seg in enumerate(it.segments):
        state += ["P" if seg.fate == "left" or seg.after else _closed(seg, world, i) for i in range(seg.n)]
        owner += [si] * seg.n
    hidden = {b for b, s in enumerate(state) if s in "CZ"} if world == "late_visible" else set()

    def look() -> tuple[str, int]:
        nonlocal hidden
        seen, hidden = hidden, set()
        for b, s in enumerate(state):
            if s in "CZ" and b not in seen:
                continue
            if s == "P":
                return "wait", b
            return "answer", b
        return "answer", len(state)

    def answer(h: int, by_bound: bool = False) -> Answer:
        cause = MissCause.IN_FLIGHT if h < len(state) and state[h] == "P" else MissCause.NEVER_PUBLISHED
        return Answer(tuple(state[:h]), None if h == len(state) else (h, cause), by_bound)

    looks = [0]
    syncs: list[int] = []

    def look_again() -> tuple[str, int]:
        looks[0] += 1
        return look()

    what, h = look_again()
    if what == "answer":
        return answer(h), [looks[0]] * len(it.order)
    stuck = False  # parked on a publish that closed without waking it (lost_wakeup)
    result = None
    for si in it.order:
        seg = it.segments[si]
        for i in range(seg.n):
            state[seg.start + i] = _closed(seg, world, i)
        if world == "late_visible" and seg.fate in ("commit", "reject"):
            hidden |= {seg.start + i for i in range(seg.n)}
        if result is None and owner[h] == si and not stuck:
            if world == "lost_wakeup" and seg.fate in ("abort", "disconnect"):
                stuck = True
            else:
                what, h = look_again()
                if what == "answer":
                    result = answer(h)
        syncs.append(looks[0])
    if result is not None:
        return result, syncs
    if stuck:  # the bound ran out; the daemon looks once more, after every event
        return answer(look()[1], by_bound=True), syncs
    return answer(h, by_bound=True), syncs  # in flight at the bound; its hits as last looked up


def _closed(seg: Segment, world: str, i: int) -> str:
    """Block i of a segment once its fate is done."""
    if seg.fate in ("before", "commit"):
        return "C"
    if seg.fate == "reject":
        return "N" if i == seg.reject else "C"
    if seg.fate in ("abort", "disconnect"):
        return "Z" if world == "abort_visible" else "N"
    return "N"  # absent


# -- running an iteration on a daemon -------------------------------------------------------


class CountedLookups:
    """Mixed into the daemon's catalog (correct or known-bad): counts its lookups, so the
    test knows when the waiting lookup, woken by a close, has looked again (and parked
    again, in the same step of the daemon's loop) before it sends the next event."""

    lookups = 0

    def lookup(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        self.lookups += 1
        return super().lookup(*args, **kwargs)


def _client(d, name: str) -> PoolClient:  # noqa: ANN001
    return PoolClient(f"unix:{d.unix_path}", "default", "tok", name=name)


def _until(what: str, pred, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} (the ordering was not reached: nothing shown)")
        time.sleep(0.005)


def observe(found, n: int, digests: list[bytes], by_bound: bool) -> Answer:  # noqa: ANN001 - a LookupResult
    """The lookup's answer in the model's terms; a hit whose digest is neither the written
    bytes' nor all zeros is kept as "?" (never expected)."""
    hits = []
    for i in range(len(found.hits)):
        got = found.hits.digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]
        hits.append("C" if got == digests[i] else "Z" if got == ZERO_DIGEST else "?")
    miss = None if found.miss is None else (found.miss.index, found.miss.cause)
    assert miss is not None or len(hits) == n
    return Answer(tuple(hits), miss, by_bound)


def run_iteration(d, obs: PoolClient, waiter: PoolClient, it: Iteration, index: int, rng: random.Random,
                  bound_s: float, world: str) -> tuple[Answer, float]:  # noqa: ANN001
    """Lay the iteration out, start the waiting lookup, play the events after it, each once
    the lookup has looked up as often as `world`'s model says it has by then; the lookup's
    answer and how long it took."""
    catalog = d.pools["default"].catalog
    _, syncs = model(it, world)
    hashes = block_hashes(range(index * 1000 * 16, (index * 1000 + it.n) * 16), 16)
    data = [rng.randbytes(PAGE) for _ in range(it.n)]
    digests = [page_digest(np.frombuffer(b, np.uint8)) for b in data]
    producers: dict[int, PoolClient] = {}
    reservations: dict[int, int] = {}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        for si, seg in enumerate(it.segments):
            if seg.fate == "absent":
                continue
            prod = producers[si] = _client(d, f"producer-{si}")
            hs = hashes[seg.start:seg.start + seg.n]
            res = prod.reserve(NS, hs, [PAGE] * seg.n)
            assert res.reservation_id and all(s.status.value == "reserved" for s in res.slots), res
            for i in range(seg.n):
                prod.write_page(res, i, np.frombuffer(data[seg.start + i], np.uint8))
            reservations[si] = res.reservation_id
            if seg.fate == "before" or (seg.fate in EVENTS and not seg.after):
                _event(obs, prod, seg, res.reservation_id, digests)
        base = catalog.lookups
        t0 = time.monotonic()
        future = pool.submit(waiter.lookup, NS, hashes, wait_pending_s=bound_s)
        _until("the lookup looked up (and parked, or answered)", lambda: catalog.lookups == base + 1)
        for si, looks in zip(it.order, syncs):
            _event(obs, producers[si], it.segments[si], reservations[si], digests)
            _until(f"the lookup looked up {looks} times", lambda n=looks: catalog.lookups == base + n)
        try:
            found = future.result(timeout=bound_s + 20.0)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"the waiting lookup hung past its bound of {bound_s} s") from None
        took = time.monotonic() - t0
        # at its bound: the daemon's clock (the loop's, cached per pass) may start it a few ms
        # before ours; an answer woken by a close comes in milliseconds
        return observe(found, it.n, digests, by_bound=took >= 0.8 * bound_s), took
    finally:
        pool.shutdown(wait=False)
        for prod in producers.values():
            prod.close()
        _until("the iteration's publishes closed and its lookup gone", lambda: _settled(obs.stats()))


def _settled(stats: dict[str, int]) -> bool:
    return stats["open_reservations"] == 0 and stats["lookup_waiting"] == 0


def _event(obs: PoolClient, prod: PoolClient, seg: Segment, rid: int, digests: list[bytes]) -> None:
    mine = digests[seg.start:seg.start + seg.n]
    if seg.fate in ("before", "commit"):
        assert prod.commit(rid, mine).committed == seg.n
    elif seg.fate == "reject":
        wrong = [ZERO_DIGEST if i == seg.reject else d for i, d in enumerate(mine)]
        assert prod.commit(rid, wrong).rejected == (seg.reject,)
    elif seg.fate == "abort":
        prod.abort(rid)
    elif seg.fate == "disconnect":
        open_before = obs.stats()["open_reservations"]
        prod.close()
        _until("the closed publisher's reservation dropped", lambda: obs.stats()["open_reservations"] < open_before)


def run_world(world: str, seed: int, count: int, long_s: float) -> dict:
    """Every iteration of the schedule on a daemon of `world`'s catalog: per iteration the
    answer, the model's for the correct pool and for `world`, and the time taken."""
    its = schedule(seed, count)
    rng = random.Random(seed ^ 0x5EED)
    base = Catalog if world == "correct" else RACE_CATALOG_CONTROLS[world]
    factory = type(f"Counted{base.__name__}", (CountedLookups, base), {})
    # no reaping and no scrub: nothing but the iteration's events closes a publish or drops a
    # page (a known-bad pool's all-zero digests would be dropped at rest, whenever the scrub came)
    d = thread_pool(page_size=PAGE, num_pages=2048, max_lookup_wait_s=60.0, reap_interval_s=3600.0,
                    scrub_pages_per_round=0, scrub_rest_pages_per_round=0, catalog_factory=factory)
    rows = []
    try:
        with _client(d, "observer") as obs, _client(d, "waiter") as waiter:
            for i, it in enumerate(its):
                bound = LEFT_S if it.left else long_s
                got, took = run_iteration(d, obs, waiter, it, i, rng, bound, world)
                rows.append({"iteration": i, "got": got, "correct": expected(it, "correct"),
                             "model": expected(it, world), "took": took, "bound": bound, "it": it})
    finally:
        d.stop_thread()
    return {"rows": rows, "flagged": {r["iteration"] for r in rows if r["got"] != r["correct"]},
            "exposed": {r["iteration"] for r in rows if r["model"] != r["correct"]}}


def test_a_waiting_lookup_answers_the_committed_run_whatever_the_order_of_commits_and_aborts(test_seed):
    out = run_world("correct", test_seed, 80, LONG_S)
    rows = out["rows"]
    wrong = [(r["iteration"], r["it"], r["got"], r["correct"]) for r in rows if r["got"] != r["correct"]]
    assert wrong == [], wrong[:3]
    assert {_cause(r["correct"]) for r in rows} == set(COVERED)  # every kind of answer (the schedule sees to it)
    parked = sum(bool(r["it"].order) for r in rows)
    woken = sum(r["got"].by_bound is False and bool(r["it"].order) for r in rows)
    print(f"lookup wait: {len(rows)} iterations, {parked} with events after the lookup started "
          f"({woken} answered when a publish closed), {sum(r['it'].left for r in rows)} run out in flight")


@pytest.mark.parametrize("world", sorted(FORCED))
def test_the_lookup_wait_oracle_catches_a_known_bad_pool(world, test_seed):
    """The same oracle against a known-bad catalog flags exactly the iterations its defect
    changes (at least one every run)."""
    # lost_wakeup's exposed iterations wait the bound out: 3 s each, long enough that a woken
    # answer, even after a loaded machine's slow events, is not read as one at the bound (0.8 of it)
    long_s, count = (3.0, 10) if world == "lost_wakeup" else (LONG_S, 14)
    out = run_world(world, test_seed, count, long_s)
    rows = out["rows"]
    assert out["exposed"], "the schedule exposes this control nowhere: it would prove nothing"
    for it in schedule(test_seed, count):  # the segments lie end to end
        assert [s.start for s in it.segments] == [sum(x.n for x in it.segments[:i]) for i in range(len(it.segments))]
    assert out["flagged"] == out["exposed"], (sorted(out["flagged"]), sorted(out["exposed"]),
                                              [(r["got"], r["model"]) for r in rows if r["got"] != r["model"]][:3])
    assert all(r["got"] == r["model"] for r in rows)  # the defect did what its model says, no more
    print(f"{world}: caught in {len(out['flagged'])} of {len(rows)} iterations")
