"""Hostile scenario: a tenant scribbles over everything it can map (see kvgate.harness.scenarios.hostile).

The adversary is a client of the replicas' own tenant (it has their token): the least
trusted party that is handed the tenant's segments. It maps every descriptor the attach
socket gives it as writable as the kernel lets it, writes seeded random bytes over every
byte it can write, and tries to forge the daemon's private state (kvpool.pool.arena): index
entries for blocks the pool does not hold, frozen generations, a heartbeat of a daemon
that looks alive for an hour, through every way it has (the mapping, write(2), mprotect,
the descriptor reopened through /proc).

  Scribbler(address, tenant, token, seed)
        attaches as the tenant (PoolClient, no zero-copy: it trades its hello's ticket at
        the attach socket itself) and maps the descriptors: .maps (what each is, whether a
        shared writable mapping was refused and why), .layout (the private header, read
        from the mapping as the attacker can read it).
  .scribble() -> bytes written       seeded random bytes over every writable mapping, whole.
  .forge(fp, keys, page)             every attempt on the private state (.attempts: each
                                     {"try", "answer"}, the answer "done" or "refused: ...").
  .running()                         a context: seeded random spans scribbled in a thread
                                     (a page at a time, every few ms) until it ends.
  .pin(ns, keys) -> leased blocks    a lease (an ordinary acquire) on blocks, held until close:
                                     the pages stay in the pool whatever else drops corrupt
                                     pages, so a loader meets them scribbled.
  .read_private()                    the generations and heartbeat as its mapping shows them.

  pool_level(seed, arena=None) -> Verdict
        the attempt on a small pool of its own (a daemon that never beats, standing in for
        a stopped one): A publishes, the scribbler scribbles and forges, B probes and
        loads; then A publishes and B loads while it scribbles. Judged: no attempt on the
        private state succeeded; B's probe never claims what the pool does not hold; the
        daemon's generations are what it wrote and B reads them; B sees no heartbeat; B's
        loads install A's bytes exactly or end `corrupt` (or `never_published` where the
        daemon rejected A's scribbled commit), never other bytes. `arena` names a known-bad
        layout (kvgate.faults.private_controls.ARENA_CONTROLS): the negative control.
  tenant_scribble(cluster, corpus, seed, control=None) -> Verdict     (runner "tenant_scribble")
        on the live cluster, as the replicas' tenant: A publishes P1 and P2, P2 is
        evicted; the scribbler pins P1, scribbles the whole page segment, forges index
        entries for P2 under B's namespace; then, while it keeps scribbling, A publishes
        P3 and B requests P1 and P2. Judged: every attempt on the private state refused;
        the private state it reads shows nothing it forged and a live heartbeat; B's load of
        P1 ends `corrupt` (its scribbled pages caught by their digests) and installs no
        other bytes; B's lookup of P2 claims nothing (the pool does not hold it); every
        block A committed under the scribble is byte-exact or caught by its digest; B's
        outputs equal the same-partition runs without the scribble; and pool_level passes.
        The heal step evicts every page (each one the scribbler wrote over is known bad).
        control="writable_private": pool_level on the known-bad layout (faults.private_
        controls.SharedPrivateArena: the private state in the page segment, as before
        layout 4; it needs a daemon started with it, so the control runs on a small pool
        of its own); caught by the scenario's own check that B's probe never claims what
        the pool does not hold.

What the scribbler is not: a client that computes what it writes. Its bytes are random, and
random bytes are caught by the digests. A client of the tenant can also publish any bytes
under any key, and it can compute a kv-sketch-1 collision (the sketch is linear and its key
is public: kvpool.pool.digest, "no MAC"). Within a tenant the clients are trusted to publish;
tenants are the boundary between them (suites/pool/test_tenants.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
import random
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from kvgate.faults.private_controls import ARENA_CONTROLS
from kvgate.harness.checkers.history import namespace_of, records
from kvgate.harness.checkers.verdict import Checks, Verdict
from kvgate.harness.client.http import complete
from kvgate.harness.scenarios.live import _one, _tag, fault_free_reference, wait_stored
from kvgate.harness.system.cluster import Cluster
from kvgate.harness.system.pool import DEFAULT_TENANT, unique_name
from kvgate.harness.workload.prompts import Corpus
from kvpool.pool.arena import HEARTBEAT_OFF, Arena, Layout, read_layout
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.pool.digest import page_digest
from kvpool.errors import MissCause
from kvpool.pool.keys import Namespace, block_hashes
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import PoolDaemon
from kvpool.pool.index import ENTRY, SLOTS, ns_fingerprint

FORGED_GENERATION = 0x5CB1_BB1E_5CB1_BB1E  # what the scribbler writes into every generation
FORGED_BEAT_AHEAD_NS = 3600 * 10**9  # its heartbeat: a daemon that looks alive for an hour
DONE = "done"


@dataclasses.dataclass
class Mapped:
    what: str  # "private" (the first descriptor) or "pages"
    fd: int
    size: int
    writable: bool
    refused: str  # why a shared writable mapping was refused ("" if it was not)
    mm: mmap.mmap


class Scribbler:
    """A client of the tenant gone hostile (see the module's docstring)."""

    def __init__(self, address: str, tenant: str, token: str, seed: int, name: str = "scribbler"):
        self.rng = random.Random(seed)
        self.attempts: list[dict[str, str]] = []
        self.maps: list[Mapped] = []
        self.forged_beat = 0
        self._lease = 0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self.client = PoolClient(address, tenant, token, name=name, zero_copy=False)
        try:
            hello = self.client.hello
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(hello.arena)
                sock.sendall(hello.ticket)
                answer, fds, _, _ = socket.recv_fds(sock, 1, 8)
            if answer != b"\x00" or not fds:
                raise AssertionError(f"the attach socket gave the tenant's ticket nothing (answer {answer!r})")
            for i, fd in enumerate(fds):
                self.maps.append(self._map("private" if i == 0 else "pages", fd))
            private = self.maps[0]
            self.layout: Layout = read_layout(private.mm, private.size, self.maps[-1].size, "scribbled")
        except BaseException:
            self.close()
            raise

    def _map(self, what: str, fd: int) -> Mapped:
        size = os.fstat(fd).st_size
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            refused = ""
        except OSError as exc:
            refused = f"{type(exc).__name__}: {exc.strerror}"
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.attempts.append({"try": f"map the {what} segment shared and writable",
                              "answer": f"refused: {refused}" if refused else DONE})
        return Mapped(what, fd, size, not refused, refused, mm)

    # -- the attack --------------------------------------------------------------------------
    def scribble(self) -> int:
        """Random bytes over every byte of every writable mapping."""
        n = 0
        for m in self.maps:
            if m.writable:
                m.mm[:] = self.rng.randbytes(m.size)
                n += m.size
        return n

    def _attempt(self, what: str, act: Callable[[], object]) -> bool:
        try:
            act()
        except (OSError, ValueError, TypeError) as exc:  # the kernel's or the mapping's refusal, recorded
            self.attempts.append({"try": what, "answer": f"refused: {type(exc).__name__}: {exc}"})
            return False
        self.attempts.append({"try": what, "answer": DONE})
        return True

    def forge(self, fp: int, keys: list[bytes], page: int = 0) -> list[dict[str, str]]:
        """Every way it has at the private state; returns (and keeps) what each answered."""
        private, lay = self.maps[0], self.layout
        self._attempt("write(2) the private segment", lambda: os.pwrite(private.fd, bytes(8), HEARTBEAT_OFF))

        def mprotect() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            view = np.frombuffer(private.mm, dtype=np.uint8)
            try:
                if libc.mprotect(ctypes.c_void_p(view.ctypes.data), private.size,
                                 mmap.PROT_READ | mmap.PROT_WRITE) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            finally:
                del view

        self._attempt("mprotect its mapping of the private segment writable", mprotect)

        def reopen() -> None:
            fd = os.open(f"/proc/self/fd/{private.fd}", os.O_RDWR)
            try:
                mmap.mmap(fd, private.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE).close()
            finally:
                os.close(fd)

        self._attempt("reopen the private segment through /proc read-write and map it writable", reopen)

        def plant() -> None:
            entries = np.frombuffer(private.mm, dtype=ENTRY, count=lay.index_entries, offset=lay.index_off)
            mask = entries.size // SLOTS - 1
            for key in keys:  # kvpool.pool.index's layout: an even seq, page + 1, the namespace, the hash
                k0, k1 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")
                entries[(k0 & mask) * SLOTS] = (2, page + 1, fp, k0, k1)

        self._attempt(f"plant index entries for {len(keys)} blocks the pool does not hold", plant)

        def freeze() -> None:
            gens = np.frombuffer(private.mm, dtype=np.uint64, count=lay.num_pages, offset=lay.gen_off)
            gens[:] = FORGED_GENERATION

        self._attempt("freeze every generation", freeze)
        self.forged_beat = time.monotonic_ns() + FORGED_BEAT_AHEAD_NS

        def beat() -> None:
            private.mm[HEARTBEAT_OFF : HEARTBEAT_OFF + 8] = self.forged_beat.to_bytes(8, "little")

        self._attempt("write a heartbeat an hour ahead", beat)
        return self.attempts

    def done(self) -> list[dict[str, str]]:
        """The attempts that succeeded."""
        return [a for a in self.attempts if a["answer"] == DONE and "pages segment" not in a["try"]]

    def pin(self, ns: Namespace, keys: list[bytes]) -> int:
        lease = self.client.acquire(ns, keys)
        self._lease = lease.lease_id
        return len(lease.hits)

    @contextlib.contextmanager
    def running(self, span: int = 128 * 1024, every_s: float = 0.005) -> Iterator[None]:
        rng = random.Random(self.rng.randrange(2**63))  # its own: the thread's draws do not depend on the caller's
        targets = [m for m in self.maps if m.writable]
        stop = self._stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                m = rng.choice(targets)
                at = rng.randrange(m.size)
                n = min(span, m.size - at)
                m.mm[at : at + n] = rng.randbytes(n)

        self._thread = threading.Thread(target=loop, name="scribbler", daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._halt()

    def _halt(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def read_private(self) -> dict[str, object]:
        lay, mm = self.layout, self.maps[0].mm
        gens = np.frombuffer(mm, dtype=np.uint64, count=lay.num_pages, offset=lay.gen_off).copy()
        beat = int.from_bytes(mm[HEARTBEAT_OFF : HEARTBEAT_OFF + 8], "little")
        return {"generations": gens, "heartbeat": beat,
                "heartbeat_age_s": None if beat == 0 else (time.monotonic_ns() - beat) / 1e9}

    def close(self) -> None:
        self._halt()
        if self._lease:
            self.client.release(self._lease)
            self._lease = 0
        for m in self.maps:
            m.mm.close()
            os.close(m.fd)
        self.maps = []
        self.client.close()

    def __enter__(self) -> Scribbler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- at pool level: the attempt on a pool of its own --------------------------------------------

_TENANT = "replicas"


def _ns() -> Namespace:
    return Namespace("scribble", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64, tenant=_TENANT)


def _keys(start: int, n: int) -> list[bytes]:
    return block_hashes(range(start * 16, (start + n) * 16), 16)


def pool_level(seed: int, *, arena: str | None = None, pages: int = 32, page_size: int = 4096,
               rounds: int = 6) -> Verdict:
    factory = Arena.anonymous if arena is None else ARENA_CONTROLS[arena]
    rng = random.Random(seed)
    token = f"{rng.getrandbits(64):016x}"
    name = unique_name("kvgs")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    config = PoolConfig(name=name, page_size=page_size, num_pages=pages, run_dir=run_dir,
                        tenants={_TENANT: token}, heartbeat_s=0.0,  # a daemon that never beats
                        # nor scrubs at rest: what B's loads meet is the scribble, not when the
                        # scrub's cursor happened to drop a scribbled page (the live run keeps it)
                        scrub_rest_pages_per_round=0)
    d = PoolDaemon(config, arena_factory=factory).start_thread()
    c = Checks()
    ns = _ns()
    address = f"unix:{d.unix_path}"
    try:
        with PoolClient(address, _TENANT, token, name="A") as a, PoolClient(address, _TENANT, token, name="B") as b:
            c.check("B mapped the tenant's segments", b.arena is not None, b.attach_error)
            held, unheld = _keys(0, 8), _keys(1000, 8)
            data = [np.frombuffer(rng.randbytes(page_size), dtype=np.uint8) for _ in held]
            c.check("A published its blocks", publish(a, ns, held, data).committed == len(held))
            cat = d.pools[_TENANT].catalog
            gens = np.array(cat.gen, copy=True)
            with Scribbler(address, _TENANT, token, rng.randrange(2**32)) as s:
                scribbled = s.scribble()
                s.forge(ns_fingerprint(ns), unheld)
                c.check("the tenant could not write the daemon's private state", not s.done(), s.done())
                for what, keys in (("blocks it never held", unheld), ("blocks it holds", held)):
                    claimed, holds = b.probe(ns, keys), len(b.lookup(ns, keys).hits)
                    c.check(f"B's probe never claims what the pool does not hold ({what})",
                            claimed is not None and claimed <= holds, f"it claimed {claimed}, the pool holds {holds}")
                c.check("the daemon's generations are the ones it wrote", np.array_equal(cat.gen, gens),
                        f"{int(np.sum(cat.gen != gens))} of {gens.size} changed")
                if b.arena is not None:
                    c.check("B reads the daemon's generations", np.array_equal(b.arena.generations, cat.gen))
                    c.check("B sees no heartbeat of a daemon that never beat", b.arena.heartbeat_age_s() is None,
                            f"a heartbeat {b.arena.heartbeat_age_s()} s old")
                wrong, causes = _load_exact(b, ns, held, data)
                c.check("B's load of scribbled pages installs no other bytes and ends corrupt",
                        not wrong and causes == {MissCause.CORRUPT.value}, (wrong, causes))
                with s.running(span=page_size, every_s=0.0005):
                    for r in range(rounds):
                        keys = _keys(100 + 10 * r, 4)
                        blocks = [np.frombuffer(rng.randbytes(page_size), dtype=np.uint8) for _ in keys]
                        publish(a, ns, keys, blocks)
                        claimed, holds = b.probe(ns, keys), len(b.lookup(ns, keys).hits)
                        c.check(f"round {r}: B's probe never claims what the pool does not hold",
                                claimed is not None and claimed <= holds,
                                f"it claimed {claimed}, the pool holds {holds}")
                        wrong, got = _load_exact(b, ns, keys, blocks)
                        causes |= got
                        c.check(f"round {r}: B's load installs A's bytes or nothing", not wrong, wrong)
                c.check("B's loads under the scribble end as hits, corrupt or never_published (a commit "
                        "the daemon rejected)", causes <= {MissCause.CORRUPT.value, MissCause.NEVER_PUBLISHED.value,
                                                           None}, causes)
                c.evidence.update(scribbled_bytes=scribbled, attempts=s.attempts, load_causes=sorted(map(str, causes)),
                                  layout=arena or "private segment (layout 4)")
    finally:
        d.stop_thread()
        shutil.rmtree(run_dir, ignore_errors=True)
    return c.verdict(f"a tenant scribbling every byte it can map ({c.evidence.get('scribbled_bytes')} bytes) "
                     "planted nothing another replica trusts: no index entry, generation or heartbeat; "
                     "its scribbled pages were caught by their digests")


def _load_exact(b: PoolClient, ns: Namespace, keys: list[bytes], data: list[np.ndarray]) -> tuple[list[int], set]:
    """Load `keys` into fresh buffers: the blocks installed with other bytes than `data`, and
    the load's miss cause (None: all of them loaded)."""
    out = [np.zeros(x.size, dtype=np.uint8) for x in data]
    res = load(b, ns, keys, out.__getitem__)
    wrong = [i for i in range(res.loaded) if not np.array_equal(out[i], data[i])]
    return wrong, {None if res.miss is None else res.miss.cause.value}


# -- on the live cluster ---------------------------------------------------------------------

def _pool_keys(h: Path, tag: str, replica: str) -> tuple[list[bytes], dict[bytes, str]]:
    """A request's pool keys, in block order, and what the producer's audit digested for each."""
    recs = sorted(records(h, "audit", kind="produced", tag=tag, replica=replica), key=lambda r: r["first_block"])
    keys: list[bytes] = []
    produced: dict[bytes, str] = {}
    for r in recs:
        for key, digest in zip(r["keys"], r["digests"]):
            k = bytes.fromhex(key)
            if k not in produced:
                keys.append(k)
            produced[k] = digest
    return keys, produced


def _published(h: Path, tag: str, replica: str) -> dict[str, int]:
    out = {"committed": 0, "rejected": 0}
    for r in records(h, "publish", tag=tag, replica=replica):
        for k in out:
            out[k] += int(r.get(k, 0) or 0)
    return out


def tenant_scribble(cluster: Cluster, corpus: Corpus, seed: int, *, control: str | None = None) -> Verdict:
    if control not in (None, "writable_private"):
        raise ValueError(f"unknown control {control!r}")
    if control:  # the known-bad layout needs a daemon started with it: a small pool of its own
        return pool_level(seed, arena="shared_private")
    rng = random.Random(seed)
    p1, p2, p3 = (corpus.text(1500, rng) for _ in range(3))
    tag = _tag("hs", seed)
    A, B = cluster.replicas["A"].url, cluster.replicas["B"].url
    h = cluster.history_dir
    c = Checks()
    complete(A, p1, tag=f"{tag}-a1", replica="A")
    wait_stored(cluster, f"{tag}-a1", "A")
    complete(A, p2, tag=f"{tag}-a2", replica="A")
    wait_stored(cluster, f"{tag}-a2", "A")
    ns, ns_b = namespace_of(h, "A"), namespace_of(h, "B")
    keys1, _ = _pool_keys(h, f"{tag}-a1", "A")
    keys2, _ = _pool_keys(h, f"{tag}-a2", "A")
    with cluster.pool.client(name="scribble-evict") as pc:
        evicted = [str(o) for o in pc.evict(ns, keys2)]
    c.check("P2's blocks were evicted: the pool does not hold them", bool(keys2) and set(evicted) == {"evicted"},
            evicted)
    cluster.nemesis("scribble", tenant=DEFAULT_TENANT, seed=seed)
    with Scribbler(cluster.pool.unix, DEFAULT_TENANT, cluster.pool.token, rng.randrange(2**32)) as s:
        pinned = s.pin(ns, keys1)
        c.check("the scribbler holds a lease on every block of P1", bool(keys1) and pinned == len(keys1),
                (pinned, len(keys1)))
        pages = [m for m in s.maps if m.what == "pages"]
        scribbled = s.scribble()
        c.check("it mapped the page segment writable and scribbled every byte of it",
                bool(pages) and scribbled >= sum(m.size for m in pages), scribbled)
        s.forge(ns_fingerprint(ns_b), keys2)
        # The one load this explains: B's of P1, every page of which is scribbled and pinned.
        cluster.history.write("fault", replica="B", role="scribbler", kind="corrupt", tag=f"{tag}-b1",
                              where="every byte of the tenant's page segment")
        with s.running():
            complete(A, p3, tag=f"{tag}-a3", replica="A")
            b1 = complete(B, p1, tag=f"{tag}-b1", replica="B")
            b2 = complete(B, p2, tag=f"{tag}-b2", replica="B")
            wait_stored(cluster, f"{tag}-a3", "A")
        seen = s.read_private()
        done = s.done()
        attempts = list(s.attempts)
    cluster.nemesis("scribble_end", tenant=DEFAULT_TENANT)
    c.check("the tenant could not write the daemon's private state (index, generations, heartbeat)",
            not done, done)
    forged_gens = int(np.sum(seen["generations"] == FORGED_GENERATION))
    c.check("the private state it reads shows nothing it forged", forged_gens == 0
            and seen["heartbeat"] != s.forged_beat, (forged_gens, seen["heartbeat"], s.forged_beat))
    c.check("and the daemon's own heartbeat, fresh", seen["heartbeat_age_s"] is not None
            and 0 <= seen["heartbeat_age_s"] < 5, seen["heartbeat_age_s"])
    load1 = _one(h, "load", tag=f"{tag}-b1", replica="B")
    c.check("B's load of the scribbled P1 was caught corrupt", load1["miss_cause"] == MissCause.CORRUPT.value
            and load1["loaded"] < load1["blocks"], load1)
    lookup2 = _one(h, "lookup", tag=f"{tag}-b2", replica="B")
    c.check("B's probe never claims what the pool does not hold", lookup2["outcome"] == "miss"
            and not lookup2["hit_blocks"], lookup2)
    # A's blocks committed under the scribble: each one a loader would install is A's bytes.
    keys3, produced3 = _pool_keys(h, f"{tag}-a3", "A")
    exact, caught, wrong = 0, 0, []
    with cluster.pool.client(name="scribble-check") as pc:
        lease = pc.acquire(ns, keys3)
        try:
            for i, ref in enumerate(lease.hits):
                got = bytes(pc.read_page(lease, i))
                if page_digest(got, ref.kind) != ref.digest:
                    caught += 1  # a loader calls it corrupt
                elif page_digest(got).hex() == produced3.get(keys3[i]):
                    exact += 1
                else:
                    wrong.append(i)
        finally:
            if lease.lease_id:
                pc.release(lease.lease_id)
    c.check("every block A committed under the scribble is A's bytes or caught by its digest", not wrong, wrong)
    ref1 = fault_free_reference(cluster, "A", "B", p1, tag, load1["loaded"])
    cold2 = complete(B, p2, tag=f"{tag}-cold2", replica="B", load=False, publish=False, cache_salt=f"cold-{tag}")
    c.check("B's requests completed", b1.finish_reason == "length" and b2.finish_reason == "length",
            (b1.finish_reason, b2.finish_reason))
    c.output("B's output on the scribbled P1 equals the same-partition run without the scribble", b1, ref1)
    c.output("B's output on the evicted P2 equals its cold run", b2, cold2)
    at_pool = pool_level(seed)
    c.check(f"at pool level: {at_pool.reason}", at_pool.valid is True)
    # Heal: every page the scribbler wrote over is known bad (each caught by its digest); none stays.
    with cluster.pool.client(name="scribble-heal") as pc:
        total = pc.stats()["num_pages"]
        pc.set_capacity(0)
        pc.set_capacity(total)
    cluster.nemesis("scribble_heal", evicted="every page")
    c.evidence.update(attempts=attempts, scribbled_bytes=scribbled, p3_exact=exact, p3_caught=caught,
                      p3_published=_published(h, f"{tag}-a3", "A"), load_p1=load1.get("miss_cause"),
                      pool_level=at_pool.evidence)
    tried = sum(1 for a in attempts if "pages segment" not in a["try"])
    return c.verdict(f"a tenant scribbled its {scribbled} mapped bytes and tried the daemon's private state "
                     f"{tried} ways: refused; B's load caught the scribbled pages as corrupt, its probe "
                     "claimed nothing the pool does not hold, outputs unchanged")


RUNNERS: dict[str, Callable[..., Verdict]] = {"tenant_scribble": tenant_scribble}
