"""The segment index's seqlock (kvpool.pool.index) raced as a race: a writer process (the
real ShmIndex, as the daemon drives it: insert, remove, and the rewrite of an entry in
place, of blocks that share buckets) over a shared mapping, reader processes probing a
read-only mapping of it, as clients do.

The oracle: a probe claims a block only if that block was in the index, whole, under that
namespace, at some moment the probe spans. Besides the blocks the program writes, the
readers probe "phantoms": every block a torn read of a written entry could spell (the
namespace fingerprint of one block with hash words of another, the old block under the new
namespace, ...); none was ever committed, so a claim of one is a torn read taken for a hit.

Three runs, each over a program of writes derived from the test's seed:

* paused: the writer stops after each word it stores (ShmIndex._write: the seq odd with
  page + 1 zeroed in one store, the three block words, the seq even with the page) and both
  readers probe every block the entry could spell there, so every intermediate state of
  the write protocol is probed, deterministically. Control (a): a writer without the
  protocol (the block words rewritten under the old, even seq and page, the head last) is
  caught at the first paused state of every in-place rewrite that changes the namespace.
* interleaved: one reader's loads interleaved with the writer's stores at every point: the
  probe's two reads of the entry (8 words, first word first) against the writer's 5
  stores, every one of the C(13, 8) = 1287 monotone schedules, for every write of the
  program. Control (b): the reader without its re-read (one read of each entry) claims
  a phantom under the schedules that tear an in-place rewrite (the head read before the
  writer starts, the block words after it stored the new namespace) -- every run.
* free-running: the writer loops a program that ends empty, as fast as it can, while two
  readers probe; each checks its claims against the writes the writer had completed
  before and after the probe (a progress word the writer stores after each write).
  It asserts the oracle only; how often the readers met the writer mid-write is reported,
  never asserted (it is up to the scheduler: the paused and interleaved runs are what
  control the interleavings, and where the controls are caught).

The reader's checks, one at a time (variants of the real probe, its source with that check
taken out, so they follow the probe as it changes):

* the odd-seq check alone is redundant given the writer's page-zeroing: the store that
  makes seq odd writes page + 1 = 0 in the same 64-bit word (`w[0] = seq + 1`), so every
  head a reader can load with an odd seq also has page + 1 == 0, which the empty check
  refuses. The run asserts that invariant over every state, and that the probe without the
  odd check answers exactly as the real one over every paused state and every schedule.
* the empty check (page + 1 != 0) alone is redundant given the odd check and the re-read:
  an even seq with page + 1 == 0 is an entry never written or removed, whose block words
  the writer zeroed (remove writes 0, 0, 0), so it could only match a probe under the
  namespace fingerprint 0 of the block whose two hash words are 0; a torn read pairing such
  a head with later block words is refused by the re-read (the head changed). Asserted as
  for the odd check.
* without both (no odd check and no empty check) the reader is caught: at the paused state
  where the entry holds the new block whole under the odd seq, before the writer's last
  store, it claims the block before its commit (every insert and rewrite: control (b)).
* the page bound (page + 1 <= the segment's pages) is not a race check: the writer never
  stores a page past the segment, so no state of the protocol exercises it (asserted as
  above); it is what keeps a scribbled region from naming a page outside the segment,
  pinned by suites/connector/test_hook_safety.py
  (test_a_scribbled_index_raises_nothing_and_claims_no_page_outside_the_segment).
"""

from __future__ import annotations
import __future__

import dataclasses
import inspect
import itertools
import mmap
import multiprocessing as mp
import os
import random
import textwrap
import time
from collections.abc import Callable, Iterable
from typing import Self

import numpy as np

from kvpool.pool import index as index_module
from kvpool.pool.index import ENTRY, SLOTS, ShmIndex

BUCKETS = 8  # 32 entries; the program's blocks use buckets 0-3 only, so they share them
MASK = BUCKETS - 1
PAGES = 64  # the segment's pages: the readers' page bound
LOW32 = 0xFFFF_FFFF
INDEX_BYTES = BUCKETS * SLOTS * ENTRY.itemsize
FILE_BYTES = INDEX_BYTES + 16  # + the writer's progress word and its stop word
WAIT_S = 60.0  # a process that has not answered in this long is stuck: the test fails, nothing is caught

Block = tuple[int, int, int]  # (namespace fingerprint, hash word 0, hash word 1)
ZERO: Block = (0, 0, 0)


def key_of(k0: int, k1: int) -> bytes:
    return k0.to_bytes(8, "little") + k1.to_bytes(8, "little")


def bucket_of(row: int) -> int:
    return row // SLOTS


def buckets(block: Block) -> tuple[int, int]:
    return block[1] & MASK, block[2] & MASK


# -- the program: the writes, and what the index holds between them ---------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """One write of the program. `removed` leaves the index at its first store, `added`
    enters it at its last; `old`/`new` are the blocks the touched entry held before/after."""

    kind: str  # insert | remove | rewrite
    block: Block  # inserted, removed, or written in place (rewrite)
    page: int
    row: int  # the entry written (-1: an insert that found both buckets full: nothing stored)
    old: Block
    new: Block
    removed: Block | None
    added: Block | None
    before: frozenset[Block]
    after: frozenset[Block]

    def live_after_store(self, k: int, stores: int) -> frozenset[Block]:
        """What the index holds after the k-th of the write's `stores` stores (k >= 1)."""
        if k >= stores:
            return self.after
        return self.before - {self.removed} if self.removed else self.before

    def exposes_torn_namespace(self) -> bool:
        """An in-place rewrite to another namespace and another block, where the old block
        under the new namespace is not in the index: the torn state (new fp, old hash words)
        is a phantom."""
        return (self.kind == "rewrite" and self.old[0] != self.new[0] and self.old[1:] != self.new[1:]
                and (self.new[0], *self.old[1:]) not in self.before)


@dataclasses.dataclass(frozen=True)
class Program:
    fps: tuple[int, ...]
    keys: tuple[tuple[int, int], ...]
    steps: tuple[Step, ...]

    def blocks(self) -> list[Block]:
        return [(fp, k0, k1) for fp in self.fps for k0, k1 in self.keys]

    def phantoms(self) -> set[Block]:
        """Every block a torn read of a written entry could spell, never written whole."""
        written = {b for s in self.steps for b in (s.old, s.new)}
        out: set[Block] = set()
        for s in self.steps:
            out |= spellings(s.old, s.new)
        return out - written - {ZERO}

    def queries(self) -> list[Block]:
        return sorted(set(self.blocks()) | self.phantoms())


def spellings(old: Block, new: Block) -> set[Block]:
    """Each block an entry being rewritten from `old` to `new` can spell, word by word."""
    return {(fp, k0, k1) for fp in {old[0], new[0]} for k0 in {old[1], new[1]} for k1 in {old[2], new[2]}
            if (k0, k1) != (0, 0)}


class _Row:
    """One entry's words, with a call after each store into them."""

    def __init__(self, words: np.ndarray, i: int, after_store: Callable[[int, int], None]):
        self._words, self._i, self._after = words, i, after_store

    def __getitem__(self, j):  # noqa: ANN001, ANN204
        return self._words[self._i, j]

    def __setitem__(self, j: int, value) -> None:  # noqa: ANN001
        self._words[self._i, j] = value
        self._after(self._i, j)


class StoreHook:
    """Stands for ShmIndex._words in a writer: reads go to the words, and every store the
    write protocol makes into an entry (`w = self._words[i]; w[j] = ...`) calls
    `after_store(row, word)` once it is in memory: where a paused writer stops."""

    def __init__(self, words: np.ndarray, after_store: Callable[[int, int], None]):
        self._words, self._after = words, after_store

    def __getitem__(self, key):  # noqa: ANN001, ANN204
        if isinstance(key, (int, np.integer)):
            return _Row(self._words, int(key), self._after)
        return self._words[key]


def hook_stores(ix: ShmIndex, after_store: Callable[[int, int], None]) -> ShmIndex:
    ix._words = StoreHook(ix._words, after_store)  # noqa: SLF001 - the writer's stores, one by one
    return ix


class UnprotectedWriter(ShmIndex):
    """Control (a), a writer without the seqlock protocol: it rewrites an entry's block
    words under the old head (the old even seq and page), then stores the head with the
    new seq and page last. A reader that loads the entry between its stores sees an even
    seq and a page with a block that was never committed."""

    def _write(self, i: int, head: int, fp: int, k0: int, k1: int, page1: int) -> None:
        w = self._words[i]
        w[1], w[2], w[3] = fp, k0, k1
        w[0] = (((head & LOW32) + 2) & LOW32) | page1 << 32


WRITERS: dict[str, type[ShmIndex]] = {"protocol": ShmIndex, "unprotected": UnprotectedWriter}


def run_step(ix: ShmIndex, step: Step) -> None:
    """The step's write, through the writer's own ShmIndex methods."""
    key = key_of(*step.block[1:])
    if step.kind == "insert":
        ix.insert(key, step.block[0], step.page)
    elif step.kind == "remove":
        assert ix.remove(key, step.block[0], step.page)
    else:
        words = ix.e.view(np.uint64).reshape(-1, 4)
        head = int(words[step.row, 0])
        ix._write(step.row, head, step.block[0], step.block[1], step.block[2], step.page + 1)  # noqa: SLF001


def make_program(seed: int, n_steps: int, exposing: int = 4, drain: bool = False) -> Program:
    """A seeded program of writes over 3 namespaces and 6 blocks whose buckets are among
    4 (so they share buckets and rewrite each other's entries): at least `exposing` of
    its steps are in-place rewrites that change the namespace (Step.exposes_torn_namespace);
    `drain`: it ends with every entry removed (the free-running writer repeats it)."""
    rng = random.Random(seed)
    fps = tuple(rng.getrandbits(64) | 1 for _ in range(3))
    keys = []
    for _ in range(6):
        b0, b1 = rng.sample(range(4), 2)
        keys.append((rng.getrandbits(61) << 3 | b0, rng.getrandbits(61) << 3 | b1))
    universe = [(fp, k0, k1) for fp in fps for k0, k1 in keys]
    shadow = ShmIndex(np.zeros(BUCKETS * SLOTS, dtype=ENTRY), num_pages=PAGES)
    rows: list[int] = []
    hook_stores(shadow, lambda row, word: rows.append(row))
    words = shadow.e.view(np.uint64).reshape(-1, 4)
    live: dict[Block, tuple[int, int]] = {}  # block -> (row, page)
    free = list(range(PAGES))
    steps: list[Step] = []

    def entry(row: int) -> Block:
        return tuple(int(x) for x in words[row, 1:])  # type: ignore[return-value]

    def record(kind: str, block: Block, page: int, fn: Callable[[], None], removed: Block | None,
               added: Block | None) -> None:
        before = frozenset(live)
        rows.clear()
        old_row = live[removed][0] if removed in live else -1
        old = entry(old_row) if old_row >= 0 else ZERO
        fn()
        row = rows[0] if rows else -1
        assert len(set(rows)) <= 1
        if kind == "insert":
            old = ZERO
            if row >= 0:
                live[block] = (row, page)
            else:
                added = None  # both buckets full: never in the index
                free.append(page)
        if removed is not None:
            free.append(live.pop(removed)[1])
        if kind == "rewrite":
            live[block] = (row, page)
        new = entry(row) if row >= 0 else ZERO
        steps.append(Step(kind, block, page, row, old, new, removed, added, before, frozenset(live)))

    for _ in range(100 * n_steps):
        if len(steps) >= n_steps and sum(s.exposes_torn_namespace() for s in steps) >= exposing:
            break
        absent = [b for b in universe if b not in live]
        r = rng.random()
        if live and r < 0.3:  # remove
            block = rng.choice(sorted(live))
            _, page = live[block]
            record("remove", block, page, lambda b=block, p=page: shadow.remove(key_of(*b[1:]), b[0], p),
                   block, None)
        elif live and r < 0.7:  # rewrite an entry in place with a block that may sit in its bucket
            old = rng.choice(sorted(live))
            row, _ = live[old]
            fits = [b for b in absent if bucket_of(row) in buckets(b)]
            exposing_fits = [b for b in fits if b[0] != old[0] and b[1:] != old[1:] and (b[0], *old[1:]) not in live]
            pool = exposing_fits if exposing_fits and rng.random() < 0.7 else fits
            if not pool:
                continue
            block = rng.choice(pool)
            page = free.pop(rng.randrange(len(free)))
            record("rewrite", block, page, lambda r_=row, b=block, p=page: run_step(
                shadow, Step("rewrite", b, p, r_, ZERO, ZERO, None, None, frozenset(), frozenset())), old, block)
        elif absent:  # insert
            block = rng.choice(absent)
            page = free.pop(rng.randrange(len(free)))
            record("insert", block, page, lambda b=block, p=page: shadow.insert(key_of(*b[1:]), b[0], p),
                   None, block)
    else:
        raise AssertionError(f"seed {seed}: no program of {n_steps} steps with {exposing} exposing rewrites")
    if drain:
        for block in sorted(live):
            _, page = live[block]
            record("remove", block, page, lambda b=block, p=page: shadow.remove(key_of(*b[1:]), b[0], p),
                   block, None)
    return Program(fps, tuple(keys), tuple(steps))


# -- readers: the real probe and the probe with a check taken out ------------------------

_CHECKS = {
    "no_reread": ("if np.array_equal(got, again):", "if True:"),
    "no_odd_check": ("(head & _ODD == 0) & ", ""),
    "no_empty_check": ("(page1 != 0) & ", ""),
    "no_page_bound": ("(page1 <= self._max_page1) & ", ""),
}
VARIANTS: dict[str, tuple[str, ...]] = {
    "real": (),
    "no_reread": ("no_reread",),  # control (b), caught by the interleaved run
    "no_state_checks": ("no_odd_check", "no_empty_check"),  # control (b), caught by the paused run
    "no_odd_check": ("no_odd_check",),  # redundant (see the module docstring): answers as the real probe
    "no_empty_check": ("no_empty_check",),  # redundant likewise
    "no_page_bound": ("no_page_bound",),  # not a race check: answers as the real probe over every state
}
REDUNDANT = ("no_odd_check", "no_empty_check", "no_page_bound")


def reader_class(name: str) -> type[ShmIndex]:
    """ShmIndex whose probe is the real probe's source with the variant's checks taken out;
    each text it takes out must be in that source exactly once (else the variant no longer
    describes the probe, and the test says so)."""
    if not VARIANTS[name]:
        return ShmIndex
    src = textwrap.dedent(inspect.getsource(ShmIndex.probe))
    for check in VARIANTS[name]:
        old, new = _CHECKS[check]
        assert src.count(old) == 1, f"the probe no longer has {old!r}: update {check} in {__name__}"
        src = src.replace(old, new)
    scope: dict = {}
    code = compile(src, f"<ShmIndex.probe {name}>", "exec", flags=__future__.annotations.compiler_flag,
                   dont_inherit=True)
    exec(code, vars(index_module), scope)  # noqa: S102 - the probe's own source, one check out
    return type(f"ShmIndex_{name}", (ShmIndex,), {"probe": scope["probe"]})


def claims(ix: ShmIndex, queries: Iterable[Block]) -> frozenset[Block]:
    return frozenset(q for q in queries if ix.probe(q[0], [key_of(q[1], q[2])]))


# -- the shared mapping and the processes ----------------------------------------------


def _map(path: str, writable: bool) -> tuple[mmap.mmap, np.ndarray, np.ndarray]:
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, FILE_BYTES, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)
    entries = np.frombuffer(mm, dtype=ENTRY, count=BUCKETS * SLOTS)
    control = np.frombuffer(mm, dtype="<u8", count=2, offset=INDEX_BYTES)  # progress, stop
    return mm, entries, control


def _writer_main(path: str, seed: int, n_steps: int, writer: str, mode: str, conn, seconds: float) -> None:  # noqa: ANN001
    """Paused: stop after every store until told to go on. Free: repeat the (draining)
    program for `seconds`, storing the count of completed writes after each."""
    mm, entries, control = _map(path, writable=True)
    ix = WRITERS[writer](entries, num_pages=PAGES)
    program = make_program(seed, n_steps, drain=(mode == "free"))
    if mode == "paused":
        where = {"step": 0, "store": 0}

        def pause(row: int, word: int) -> None:
            where["store"] += 1
            conn.send(("stored", where["step"], where["store"], row, word))
            if conn.recv() != "go":
                raise SystemExit(0)  # stopped: the run ended early (its failure is the coordinator's)

        hook_stores(ix, pause)
        for j, step in enumerate(program.steps):
            where["step"], where["store"] = j, 0
            run_step(ix, step)
            conn.send(("written", j, where["store"]))
            if conn.recv() != "go":
                raise SystemExit(0)  # stopped: the run ended early (its failure is the coordinator's)
        conn.send(("done", len(program.steps)))
    else:
        done, deadline = 0, time.monotonic() + seconds
        while time.monotonic() < deadline:
            for step in program.steps:
                run_step(ix, step)
                done += 1
                control[0] = done
        control[1] = 1
        conn.send(("done", done, done // len(program.steps)))
    conn.recv()
    del entries, control, ix
    mm.close()


def _reader_main(path: str, conn) -> None:  # noqa: ANN001
    mm, entries, control = _map(path, writable=False)
    readers = {name: reader_class(name)(entries, num_pages=PAGES) for name in VARIANTS}
    while True:
        msg = conn.recv()
        if msg[0] == "probe":
            _, names, queries = msg
            conn.send({name: claims(readers[name], queries) for name in names})
        elif msg[0] == "free":
            conn.send(_free_reader(readers["real"], entries, control, *msg[1:]))
        else:
            break
    del readers, entries, control
    mm.close()


class Processes:
    """A writer and two readers over one mapping (spawned: nothing inherited)."""

    def __init__(self, path: str, seed: int, n_steps: int, writer: str, mode: str, seconds: float = 0.0):
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for target, args in [(_writer_main, (path, seed, n_steps, writer, mode)), (_reader_main, (path,)),
                             (_reader_main, (path,))]:
            ours, theirs = ctx.Pipe()
            extra = (theirs, seconds) if target is _writer_main else (theirs,)
            p = ctx.Process(target=target, args=(*args, *extra), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(ours)

    @property
    def writer(self):  # noqa: ANN201
        return self.conns[0]

    @property
    def readers(self):  # noqa: ANN201
        return self.conns[1:]

    def recv(self, conn):  # noqa: ANN001, ANN201
        if not conn.poll(WAIT_S):
            raise AssertionError(f"a race process gave no answer within {WAIT_S} s: stuck, so nothing was shown")
        try:
            return conn.recv()
        except EOFError:
            raise AssertionError(f"a race process went away: exit codes {[p.exitcode for p in self.procs]}") from None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, *_) -> None:  # noqa: ANN001
        self.close(check=exc_type is None)

    def close(self, check: bool = True) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",) if conn is not self.writer else "stop")
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        codes = [p.exitcode for p in self.procs]
        assert codes == [0, 0, 0] or not check, f"race processes exited with {codes}"


def _index_file(tmp_path) -> str:  # noqa: ANN001
    path = tmp_path / "index"
    path.write_bytes(bytes(FILE_BYTES))
    return str(path)


# -- paused: every state of the write protocol, probed by two reader processes ---------


def relevant(program: Program, step: Step, queries: list[Block]) -> list[Block]:
    """The blocks whose probe can change while the step's entry changes: those that may sit
    in its bucket, and every block in the index (each must be found: the probe works)."""
    b = bucket_of(step.row)
    return [q for q in queries if b in buckets(q) or q in step.before or q in step.after]


def paused_run(tmp_path, seed: int, n_steps: int, writer: str, names: tuple[str, ...]) -> dict:  # noqa: ANN001
    """Run the program with the writer paused after each store; at each pause both readers
    probe with each variant in `names`. Returns per variant the violations (pause, claim)
    and the count of paused states probed."""
    program = make_program(seed, n_steps)
    queries = program.queries()
    path = _index_file(tmp_path)
    # each reader probes with "real" and half the other variants; the two must agree on "real"
    rest = [n for n in names if n != "real"]
    shares = [("real", *rest[0::2]), ("real", *rest[1::2])]
    out: dict = {"states": 0, "violations": {n: [] for n in names}, "missed": [], "odd_with_page": 0,
                 "page_past": 0, "differ": {n: 0 for n in names}, "stores": {}}
    with Processes(path, seed, n_steps, writer, "paused") as procs:
        while True:
            msg = procs.recv(procs.writer)
            if msg[0] == "done":
                assert msg[1] == len(program.steps)
                break
            if msg[0] == "written":
                out["stores"][msg[1]] = msg[2]
                procs.writer.send("go")
                continue
            _, j, k, row, _word = msg
            step = program.steps[j]
            assert row == step.row, (j, row, step.row)
            stores = 5 if writer == "protocol" else 4
            live = step.live_after_store(k, stores)
            heads = np.fromfile(path, dtype="<u8", count=BUCKETS * SLOTS * 4).reshape(-1, 4)[:, 0]
            out["odd_with_page"] += int(np.count_nonzero((heads & 1 == 1) & (heads >> np.uint64(32) != 0)))
            out["page_past"] += int(np.count_nonzero(heads >> np.uint64(32) > PAGES))
            asked = relevant(program, step, queries)
            for conn, share in zip(procs.readers, shares):
                conn.send(("probe", share, asked))
            answers = [procs.recv(conn) for conn in procs.readers]
            assert answers[0]["real"] == answers[1]["real"], f"two readers of one paused state disagree at {j}, {k}"
            got = {**answers[0], **answers[1]}
            out["states"] += 1
            for name in names:
                for claim in sorted(got[name] - live):
                    out["violations"][name].append((j, k, step.kind, claim))
                if got[name] != got.get("real", got[name]):
                    out["differ"][name] += 1
            if "real" in got and writer == "protocol":
                out["missed"] += [(j, k, b) for b in sorted((live & set(asked)) - got["real"])
                                  if b != step.new or k == stores]
            procs.writer.send("go")
    out["program"] = program
    return out


def test_every_state_of_the_write_protocol_is_probed_and_none_is_taken_for_a_hit(tmp_path, test_seed):
    """Paused writer, two reader processes: the real probe never claims a block the index did
    not hold at that state, and finds every block it did (but the one being written); the
    probe without its odd-seq and empty checks (control b) claims the entry's new block
    before the writer's last store, at every insert and rewrite; the single checks'
    variants answer as the real probe (redundant, see the module docstring)."""
    names = ("real", "no_state_checks", *REDUNDANT)
    out = paused_run(tmp_path, test_seed, 40, "protocol", names)
    program = out["program"]
    written = [s for s in program.steps if s.row >= 0]
    assert out["states"] == sum(out["stores"].values()) == 5 * len(written), out["states"]
    assert out["violations"]["real"] == [], out["violations"]["real"][:5]
    assert out["missed"] == [], out["missed"][:5]
    assert out["odd_with_page"] == 0 and out["page_past"] == 0  # why the single checks are redundant
    for name in REDUNDANT:
        assert out["differ"][name] == 0 and out["violations"][name] == [], name
    # control (b): caught at the 4th store (the new block whole, seq still odd) of every write of a block
    caught = {(j, k) for j, k, _, claim in out["violations"]["no_state_checks"] if claim == program.steps[j].new}
    expected = {(j, 4) for j, s in enumerate(program.steps) if s.row >= 0 and s.kind != "remove"}
    assert expected and expected <= caught, sorted(expected - caught)[:5]
    print(f"paused: {len(program.steps)} writes, {out['states']} states probed by 2 readers; "
          f"no_state_checks caught at {len(expected)} of {len(expected)} writes of a block")


def test_a_writer_without_the_protocol_is_caught_at_its_paused_states(tmp_path, test_seed):
    """Control (a): the same program written by UnprotectedWriter; the real probe, at the
    state after its first store (the new namespace under the old even seq and page, the old
    hash words), claims the phantom (new fp, old block) -- at every rewrite that changes the
    namespace, of which the program has at least four."""
    out = paused_run(tmp_path, test_seed, 40, "unprotected", ("real",))
    program = out["program"]
    exposing = {j for j, s in enumerate(program.steps) if s.exposes_torn_namespace()}
    caught = {j for j, k, kind, claim in out["violations"]["real"]
              if k == 1 and claim == (program.steps[j].new[0], *program.steps[j].old[1:])}
    assert len(exposing) >= 4 and exposing <= caught, (sorted(exposing), sorted(caught))
    print(f"unprotected writer: caught at {len(exposing)} of {len(exposing)} exposing rewrites "
          f"({len(out['violations']['real'])} phantom claims in all)")


# -- interleaved: a reader's loads against the writer's stores, every schedule ----------


class ScheduledWords:
    """Stands for ShmIndex._words in a reader: a probe's reads (`take`) of the index, with
    the entry being written read word by word from the state the schedule puts each load
    at: the first read of the entry (4 words) at states t0..t3, the second at t4..t7, later
    reads at the writer's last state; every other entry as it stands."""

    def __init__(self, states: list[np.ndarray], row: int, schedule: tuple[int, ...]):
        self.row = row
        final = states[-1]
        self.base = final
        firsts = [np.array([states[t][row, w] for w, t in enumerate(schedule[i: i + 4])], dtype=np.uint64)
                  for i in (0, 4)]
        self.reads = [*firsts, final[row].copy()]
        self.takes = 0

    def take(self, slots: np.ndarray, axis: int = 0) -> np.ndarray:
        assert axis == 0
        out = self.base.take(slots, axis=0)
        out[slots == self.row] = self.reads[min(self.takes, 2)]
        self.takes += 1
        return out


def step_states(program: Program, j: int, writer: str = "protocol") -> list[np.ndarray]:
    """The index's words before step j and after each of its stores (replayed)."""
    ix = WRITERS[writer](np.zeros(BUCKETS * SLOTS, dtype=ENTRY), num_pages=PAGES)
    for step in program.steps[:j]:
        run_step(ix, step)
    words = ix.e.view(np.uint64).reshape(-1, 4)
    states = [words.copy()]
    hook_stores(ix, lambda row, word: states.append(words.copy()))
    run_step(ix, program.steps[j])
    return states


def probe_scheduled(cls: type[ShmIndex], states: list[np.ndarray], row: int, schedule: tuple[int, ...],
                    queries: list[Block]) -> tuple[frozenset[Block], bool]:
    """Each query probed by a reader of class `cls` whose loads follow `schedule`; and
    whether any probe read the entry a third time (its span then reaches the last state)."""
    got, reread = set(), False
    ix = cls(np.zeros(BUCKETS * SLOTS, dtype=ENTRY), num_pages=PAGES)
    for q in queries:
        ix._words = sw = ScheduledWords(states, row, schedule)  # noqa: SLF001 - the reader's loads, scheduled
        if ix.probe(q[0], [key_of(q[1], q[2])]):
            got.add(q)
        reread |= sw.takes > 2
    return frozenset(got), reread


def interleaved_run(program: Program, names: tuple[str, ...]) -> dict:
    readers = {name: reader_class(name) for name in names}
    out: dict = {"schedules": 0, "probes": 0, "violations": {n: [] for n in names}, "differ": {n: 0 for n in names}}
    for j, step in enumerate(program.steps):
        if step.row < 0:
            continue
        states = step_states(program, j)
        last = len(states) - 1
        assert last == 5
        queries = sorted((spellings(step.old, step.new) | {step.old, step.new}) - {ZERO})
        seen: dict[tuple, dict[str, tuple[frozenset[Block], bool]]] = {}
        for schedule in itertools.combinations_with_replacement(range(last + 1), 8):
            out["schedules"] += 1
            key = tuple(int(states[t][step.row, w % 4]) for w, t in enumerate(schedule))
            if key not in seen:
                seen[key] = {name: probe_scheduled(cls, states, step.row, schedule, queries)
                             for name, cls in readers.items()}
                out["probes"] += len(queries) * len(readers)
            for name in names:
                got, reread = seen[key][name]
                # the states the probe spans: from its first load to its last (the writer's
                # last state when it read the entry a third time)
                span = range(schedule[0], (last if reread else schedule[-1]) + 1)
                live = frozenset().union(*(step.live_after_store(t, last) if t else step.before for t in span))
                for claim in sorted(got - live):
                    out["violations"][name].append((j, schedule, claim))
                if got != seen[key]["real"][0]:
                    out["differ"][name] += 1
    return out


def test_every_interleaving_of_a_probe_with_a_write_claims_only_committed_blocks(test_seed):
    """The probe's two reads of the entry against each write's stores, every monotone
    schedule (1287 per write): the real probe never claims a block the index did not hold
    at some state it spans; the probe without its re-read (control b) claims the phantom
    (new fp, old block) at every rewrite that changes the namespace; the single checks'
    variants answer as the real probe."""
    program = make_program(test_seed, 24)
    names = ("real", "no_reread", *REDUNDANT)
    out = interleaved_run(program, names)
    written = sum(s.row >= 0 for s in program.steps)
    assert out["schedules"] == 1287 * written
    assert out["violations"]["real"] == [], out["violations"]["real"][:5]
    for name in REDUNDANT:
        assert out["differ"][name] == 0 and out["violations"][name] == [], name
    exposing = {j for j, s in enumerate(program.steps) if s.exposes_torn_namespace()}
    caught = {j for j, _, claim in out["violations"]["no_reread"]
              if claim == (program.steps[j].new[0], *program.steps[j].old[1:])}
    assert len(exposing) >= 4 and exposing <= caught, (sorted(exposing), sorted(caught))
    print(f"interleaved: {written} writes x 1287 schedules = {out['schedules']}, {out['probes']} probes; "
          f"no_reread caught at {len(exposing)} of {len(exposing)} exposing rewrites")


# -- free-running: the writer as fast as it goes, two readers probing ------------------


def _intervals(program: Program) -> dict[Block, list[tuple[int, int]]]:
    """Per block, the steps (c, r) of each time it was in the index: entered at step c's last
    store, left at step r's first (the program drains, so each ends)."""
    out: dict[Block, list[tuple[int, int]]] = {}
    since: dict[Block, int] = {}
    for i, s in enumerate(program.steps):
        if s.removed is not None:
            out.setdefault(s.removed, []).append((since.pop(s.removed), i))
        if s.added is not None:
            since[s.added] = i
    assert not since
    return out


def _free_reader(ix: ShmIndex, entries: np.ndarray, control: np.ndarray, seed: int, n_steps: int,
                 reader: int) -> dict:
    program = make_program(seed, n_steps, drain=True)
    n = len(program.steps)
    intervals = _intervals(program)
    queries = program.queries()
    rng = random.Random(seed * 7 + reader)
    words = entries.view(np.uint64).reshape(-1, 4)
    out = {"probes": 0, "claims": 0, "violations": [], "mid_write": 0, "reads_differed": 0}

    def held(block: Block, before: int, after: int) -> bool:
        for cycle in range(before // n, after // n + 1):
            for c, r in intervals.get(block, ()):
                if c + cycle * n <= after and r + cycle * n >= before:
                    return True
        return False

    order = list(range(len(queries)))
    while not control[1]:
        rng.shuffle(order)
        for qi in order:
            q = queries[qi]
            run = [q] if rng.random() < 0.7 else [q, *rng.sample(queries, 2)]
            run = [(q[0], *b[1:]) for b in run]  # one namespace
            before = int(control[0])
            found = ix.probe(q[0], [key_of(b[1], b[2]) for b in run])
            after = int(control[0])
            out["probes"] += 1
            out["claims"] += found
            for b in run[:found]:
                if not held(b, before, after):
                    out["violations"].append((before, after, b))
            if qi % 16 == 0:  # how often this reader meets the writer mid-write (reported only)
                a, b2 = words.copy(), words.copy()
                out["mid_write"] += int(np.count_nonzero(a[:, 0] & 1))
                out["reads_differed"] += int(not np.array_equal(a, b2))
            if control[1]:
                break
    return out


def test_a_free_running_writer_never_makes_a_reader_claim_an_uncommitted_block(tmp_path, test_seed, record_property):
    """Free-running stress: the writer process repeats a draining program for 4 s while two
    reader processes probe blocks and phantoms (single blocks and runs); each claim is
    checked against the writes completed before the probe began and when it ended. The
    verdict is the oracle's alone; the contacts with the writer mid-write are reported."""
    n_steps = 300
    with Processes(_index_file(tmp_path), test_seed, n_steps, "protocol", "free", seconds=4.0) as procs:
        for i, conn in enumerate(procs.readers):
            conn.send(("free", test_seed, n_steps, i))
        results = [procs.recv(conn) for conn in procs.readers]
        done = procs.recv(procs.writer)
        procs.writer.send("stop")
    writes, cycles = done[1], done[2]
    totals = {k: sum(r[k] for r in results) for k in ("probes", "claims", "mid_write", "reads_differed")}
    record_property("free_running", {"writes": writes, "cycles": cycles, **totals})
    print(f"free-running: {writes} writes ({cycles} cycles), {totals}")
    assert writes > 10 * n_steps and totals["probes"] > 1000 and totals["claims"] > 0, (writes, totals)
    violations = [v for r in results for v in r["violations"]]
    assert violations == [], violations[:5]
