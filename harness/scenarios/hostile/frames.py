"""Hostile scenario: frames. An authenticated tenant floods the pool daemon with maximal
frames (the most a frame may carry, and past it: repeated indexes, repeated hashes, lists
one over their bound, page bytes of the wrong size, a namespace of megabytes, a frame over
the limit) while replicas A and B keep serving a cross-replica hit.

  Memory / memory(pid)      the daemon's VmRSS and VmHWM (its peak RSS) from /proc/PID/status
  RssWatch(pid)             samples VmRSS every 2 ms on a thread; `.growth_kib()`: the most the
                            daemon's RSS rose above its level at the start (the sampled peak, or
                            VmHWM where the peak passed the high-water mark it had before)
  rss_bound_kib(page_size)  the stated bound on that growth: 8 frame limits + 64 MiB
                            (kvpool.pool.protocol.frame_limit: 16 pages + 4 MiB; 104 MiB at 64 KiB)
  HostileSession            a raw authenticated connection that answers every frame with an
                            Answer: the reply's kind (an Ok struct's name or "error:<code>"), its
                            size, and whether it was over the frame limit (then read and dropped
                            in chunks, never decoded)
  flood(address, tenant, token, pid, seed, rounds, repeats) -> FloodReport
                            the flood: a one-page lease and a one-page reservation of the
                            tenant's own (under a namespace of its own, so no replica's page is
                            touched), `rounds` rounds of every maximal frame (and more, 100 ms
                            apart, until `until` is set: the live runner floods for as long as
                            the replicas' hit runs), then one frame over the limit on a
                            connection of its own; stops early once the
                            daemon's growth passes the bound. The report says how each frame
                            was answered, the growth, and whether the session still reads its
                            own page byte-exact.
  judge_flood(report, c)    the flood's checks: growth within the bound, every frame answered
                            by a typed error or a reply within the frame limit, each refused
                            frame refused, the session still served.
  start_control_pool(...)   kvgate.faults.frame_controls' unbounded daemon as a small pool process.
  frame_flood(cluster, corpus, seed, *, control=None, rounds, repeats)
                            the live runner: the flood on a thread against the cluster's pool
                            (control "unbounded_frames": against the known-bad daemon, its own
                            pool process) while A publishes a prompt and B loads it
                            (kvgate.harness.scenarios.live.cross_replica_hit: byte-exact, output equal
                            to A's own prefix hit).
"""

from __future__ import annotations

import dataclasses
import random
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvgate.harness.checkers.verdict import Checks, Verdict, describe_difference
from kvgate.harness.system.pool import DEFAULT_TENANT, PoolProcess, unique_name
from kvpool.pool import protocol as P
from kvpool.pool.digest import page_digest
from kvpool.errors import ErrorCode, MalformedFrame, WrongVersion
from kvpool.pool.keys import HASH_BYTES, Namespace

MIB = 1024
SAMPLE_S = 0.002
CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Memory:
    rss_kib: int
    hwm_kib: int


def memory(pid: int) -> Memory:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return Memory(fields["VmRSS"], fields["VmHWM"])


def rss_bound_kib(page_size: int) -> int:
    """The most the daemon's RSS may grow while it answers the flood (KiB)."""
    return (8 * P.frame_limit(page_size)) // 1024 + 64 * MIB


class RssWatch:
    """The daemon's RSS growth over a stretch of time (see the module docstring)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.start = memory(pid)
        self.peak_kib = self.start.rss_kib
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-watch", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                self.peak_kib = max(self.peak_kib, memory(self.pid).rss_kib)
            except (OSError, KeyError):  # the process is gone (or a zombie without VmRSS)
                return

    def growth_kib(self) -> int:
        now = memory(self.pid)
        peak = max(self.peak_kib, now.rss_kib)
        if now.hwm_kib > self.start.hwm_kib:  # the peak passed the old high-water mark: it is exact
            peak = max(peak, now.hwm_kib)
        return peak - self.start.rss_kib

    def stop(self) -> int:
        growth = self.growth_kib()
        self._stop.set()
        self._thread.join(timeout=1.0)
        return growth


@dataclasses.dataclass(frozen=True)
class Answer:
    kind: str  # an Ok reply's struct name, "error:<code>", or "over-limit" (not decoded)
    nbytes: int
    reply: object = None

    @property
    def typed_error(self) -> bool:
        return self.kind.startswith("error:")


class HostileSession:
    """A raw, authenticated connection to a pool daemon (Unix socket path or HOST:PORT)."""

    def __init__(self, address: str, tenant: str, token: str, timeout_s: float = 60.0):
        if address.startswith("/"):
            self.sock = socket.socket(socket.AF_UNIX)
            target: object = address
        else:
            host, _, port = address.rpartition(":")
            self.sock = socket.socket(socket.AF_INET)
            target = (host, int(port))
        self.sock.settimeout(timeout_s)
        self.sock.connect(target)
        self.ids = iter(range(1, 2**62))
        hello = self.ask(P.Hello(tenant, token, "hostile-frames"))
        if not isinstance(hello.reply, P.HelloOk):
            raise PermissionError(f"hello refused: {hello.kind}")
        self.page_size = hello.reply.page_size
        self.limit = P.frame_limit(self.page_size)

    def _recv(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(min(CHUNK, n - len(out)))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            out += chunk
        return bytes(out)

    def send(self, frame: bytes) -> Answer:
        self.sock.sendall(frame)
        return self.answer()

    def answer(self) -> Answer:
        (n,) = P.LENGTH.unpack(self._recv(P.LENGTH.size))
        if n > getattr(self, "limit", 1 << 20):  # over the frame limit: read and drop, never held whole
            left = n
            while left:
                left -= len(self._recv(min(CHUNK, left)))
            return Answer("over-limit", n)
        _, reply = P.decode_reply(self._recv(n))
        kind = f"error:{reply.code.value}" if isinstance(reply, P.Error) else type(reply).__name__
        return Answer(kind, n, reply)

    def ask(self, op: P.Request) -> Answer:
        """`op` as it is, whatever its lists hold (encoding checks no bound)."""
        return self.send(P.encode_request(next(self.ids), op))

    def close(self) -> None:
        self.sock.close()


@dataclasses.dataclass
class FloodReport:
    page_size: int
    frame_limit: int
    bound_kib: int
    growth_kib: int = 0
    frames: int = 0
    rounds: int = 0
    answers: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # label -> kind -> count
    over_limit: list[str] = dataclasses.field(default_factory=list)  # labels answered over the frame limit
    not_refused: list[str] = dataclasses.field(default_factory=list)  # must-refuse labels that were not
    stopped_early: str = ""
    still_served: bool = False
    error: str = ""

    def as_evidence(self) -> dict[str, object]:
        return {"growth_mib": round(self.growth_kib / MIB, 1), "bound_mib": round(self.bound_kib / MIB, 1),
                "frames": self.frames, "rounds": self.rounds, "frame_limit": self.frame_limit, "answers": self.answers,
                "over_limit": sorted(set(self.over_limit))[:8], "not_refused": sorted(set(self.not_refused))[:8],
                "stopped_early": self.stopped_early, "still_served": self.still_served, "error": self.error}


def _ns(tenant: str, seed: int, model_id: str = "kvgate-hostile-frames") -> Namespace:
    return Namespace(model_id, f"flood-{seed}", "tok", "bfloat16", "cpu", 16, 2, 2, 64, tenant=tenant)


def _frames(s: HostileSession, ns: Namespace, lease: int, own: bytes, reservation: int, rng: random.Random,
            repeats: int, tenant: str, token: str) -> list[tuple[str, bool, P.Request]]:
    """(label, must be refused, op) of one round: every list at its bound, one past it, repeated."""
    blocks = P.MAX_BLOCKS_PER_FRAME
    distinct = [rng.randbytes(HASH_BYTES) for _ in range(blocks + 1)]
    page = bytes(s.page_size)
    big_ns = msgspec.structs.replace(ns, model_id="m" * (2 << 20), model_revision=f"r{rng.random()}")
    return [
        (f"read: {repeats} repeats of one leased index", True, P.ReadPages(lease, [0] * repeats)),
        ("read: one leased index twice", True, P.ReadPages(lease, [0, 0])),
        ("read: indexes past the lease", True, P.ReadPages(lease, list(range(P.MAX_PAGES_PER_FRAME)))),
        ("read: the leased page", False, P.ReadPages(lease, [0])),
        (f"acquire: one hash {repeats} times", True, P.Acquire(ns, [own] * repeats)),
        (f"lookup: {blocks} distinct hashes", False, P.Lookup(ns, distinct[:blocks])),
        (f"lookup: {blocks + 1} hashes", True, P.Lookup(ns, distinct)),
        (f"lookup: one hash {blocks} times", True, P.Lookup(ns, [own] * blocks)),
        (f"evict: {blocks} unknown hashes", False, P.Evict(ns, distinct[1:blocks + 1])),
        ("evict: one unknown hash twice", True, P.Evict(ns, [distinct[0]] * 2)),
        (f"reserve: one hash {blocks} times", True, P.Reserve(ns, [distinct[0]] * blocks, [s.page_size] * blocks)),
        (f"reserve: {blocks + 1} hashes", True, P.Reserve(ns, distinct, [s.page_size] * (blocks + 1))),
        ("write: one slot 16 times", True, P.WritePages(reservation, [0] * 16, [page] * 16)),
        ("write: 17 slots", True, P.WritePages(reservation, list(range(17)), [page] * 17)),
        ("write: a payload one byte over the page", True, P.WritePages(reservation, [0], [page + b"x"])),
        (f"commit: {blocks + 1} digests", True, P.Commit(reservation, [bytes(16)] * (blocks + 1))),
        ("hello: a client name of 1 MiB", True, P.Hello(tenant, token, "n" * (1 << 20))),
        ("hello: again, on the authenticated connection", True, P.Hello(tenant, token, "again")),
        ("lookup: a namespace of 2 MiB", True, P.Lookup(big_ns, [own])),
        ("reserve: under a new namespace of 2 MiB", True, P.Reserve(big_ns, [distinct[1]], [s.page_size])),
    ]


def _undo(s: HostileSession, answer: Answer) -> None:
    """What a frame the daemon should have refused left behind (an unbounded daemon grants it)."""
    reply = answer.reply
    if isinstance(reply, P.AcquireOk) and reply.lease_id:
        s.ask(P.Release(reply.lease_id))
    elif isinstance(reply, P.ReserveOk) and reply.reservation_id:
        s.ask(P.Abort(reply.reservation_id))


def _over_limit(address: str, tenant: str, token: str) -> Answer:
    """One frame of frame_limit + 1 bytes on a connection of its own."""
    s = HostileSession(address, tenant, token)
    try:
        n = s.limit + 1
        s.sock.sendall(P.LENGTH.pack(n))
        try:
            s.sock.sendall(bytes(n))  # a daemon that enforces the limit answers and closes first
        except OSError:
            pass  # refused before its bytes: the answer is already on its way
        return s.answer()
    finally:
        s.close()


def flood(address: str, tenant: str, token: str, pid: int, seed: int, rounds: int = 2, repeats: int = 4096,
          watch: RssWatch | None = None, until: threading.Event | None = None, max_rounds: int = 400,
          pause_s: float = 0.1) -> FloodReport:
    """`rounds` rounds of the maximal frames, then more (up to `max_rounds`, `pause_s` apart)
    until `until` is set, if given: a flood for as long as something else runs beside it."""
    rng = random.Random(f"frames:{seed}")
    s = HostileSession(address, tenant, token)
    report = FloodReport(s.page_size, s.limit, rss_bound_kib(s.page_size))
    ns = _ns(tenant, seed)
    own, mine = rng.randbytes(HASH_BYTES), rng.randbytes(HASH_BYTES)
    data = rng.randbytes(s.page_size)
    watch = watch or RssWatch(pid)
    try:
        res = s.ask(P.Reserve(ns, [own], [s.page_size])).reply
        if not (isinstance(res, P.ReserveOk) and res.reservation_id):
            raise RuntimeError(f"the flood's own page was not reserved: {res}")
        s.ask(P.WritePages(res.reservation_id, [0], [data]))
        s.ask(P.Commit(res.reservation_id, [page_digest(memoryview(data))]))
        lease = s.ask(P.Acquire(ns, [own])).reply
        if not (isinstance(lease, P.AcquireOk) and lease.lease_id):
            raise RuntimeError(f"the flood's own page was not leased: {lease}")
        spare = s.ask(P.Reserve(ns, [mine], [s.page_size])).reply
        reservation = spare.reservation_id if isinstance(spare, P.ReserveOk) else 0
        done = 0
        while done < rounds or (until is not None and not until.wait(pause_s) and done < max_rounds):
            done += 1
            for label, refuse, op in _frames(s, ns, lease.lease_id, own, reservation, rng, repeats, tenant, token):
                answer = s.ask(op)
                _undo(s, answer)
                report.frames += 1
                kinds = report.answers.setdefault(label, {})
                kinds[answer.kind] = kinds.get(answer.kind, 0) + 1
                if answer.nbytes > s.limit:
                    report.over_limit.append(label)
                if refuse and not answer.typed_error:
                    report.not_refused.append(label)
                report.growth_kib = watch.growth_kib()
                if report.growth_kib > report.bound_kib:
                    report.stopped_early = f"after {label!r}: the daemon grew {report.growth_kib // MIB} MiB"
                    break
            if report.stopped_early:
                break
        report.rounds = done
        if not report.stopped_early:
            answer = _over_limit(address, tenant, token)
            report.frames += 1
            report.answers["a frame over the frame limit"] = {answer.kind: 1}
            if answer.kind != f"error:{ErrorCode.OVERSIZED.value}":
                report.not_refused.append("a frame over the frame limit")
        got = s.ask(P.ReadPages(lease.lease_id, [0])).reply
        report.still_served = (isinstance(got, P.PagesOk) and got.data == [data]
                               and isinstance(s.ask(P.Ping()).reply, P.Pong))
        s.ask(P.Release(lease.lease_id))
        if reservation:
            s.ask(P.Abort(reservation))
        s.ask(P.Evict(ns, [own]))
    except (OSError, ConnectionError, RuntimeError, msgspec.DecodeError, MalformedFrame, WrongVersion) as exc:
        report.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        s.close()
        report.growth_kib = max(report.growth_kib, watch.growth_kib())
    return report


def judge_flood(report: FloodReport, c: Checks) -> None:
    c.check(f"the daemon's RSS grew at most {report.bound_kib // MIB} MiB under the flood",
            report.growth_kib <= report.bound_kib, f"RSS grew {report.growth_kib // MIB} MiB")
    c.check("the flood ran to its end", not report.error and not report.stopped_early,
            report.error or report.stopped_early)
    c.check(f"every frame was answered by a typed error or a reply of at most {report.frame_limit} bytes",
            not report.over_limit, sorted(set(report.over_limit))[:4])
    c.check("every frame past a bound was refused with a typed error", not report.not_refused,
            sorted(set(report.not_refused))[:4])
    c.check("the flooding session still reads its own page byte-exact", report.still_served)
    c.evidence["flood"] = report.as_evidence()


CONTROLS = ("unbounded_frames",)


def start_control_pool(page_size: int = 64 * 1024, num_pages: int = 64, timeout: float = 20.0) -> PoolProcess:
    """kvgate.faults.frame_controls' daemon (no per-frame bounds) as a pool process of its own."""
    import secrets

    name = unique_name("kvg-frames")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    token = secrets.token_hex(8)
    log_path = run_dir / "pool.log"
    args = ["--name", name, "--run-dir", str(run_dir), "--page-size", str(page_size), "--pages", str(num_pages),
            "--tenant", f"{DEFAULT_TENANT}={token}"]
    return PoolProcess._spawn(name, run_dir, token, log_path, args, timeout, module="kvgate.faults.frame_controls",
                              what="the unbounded-frames pool")


def frame_flood(cluster, corpus, seed: int, *, control: str | None = None, rounds: int = 2,  # noqa: ANN001
                repeats: int = 4096, prompt_tokens: int = 3000) -> Verdict:
    """The flood on a thread while A publishes a prompt and B loads it (see the module
    docstring). control="unbounded_frames": the flood goes to kvgate.faults.frame_controls' daemon,
    started as a small pool of its own; the replicas' hit still runs on the cluster's pool."""
    from kvgate.harness.scenarios import live

    if control not in (None, *CONTROLS):
        raise ValueError(f"unknown control {control!r}")
    own = start_control_pool() if control else None
    target = own or cluster.pool_for("A")
    if target is None:
        raise RuntimeError("the cluster's pool is down")
    cluster.nemesis("frame_flood", control=control, pid=target.proc.pid)
    done: list[FloodReport] = []
    failed: list[str] = []
    hit_over = threading.Event()

    def run() -> None:
        try:
            done.append(flood(target.address["unix"], DEFAULT_TENANT, target.token, target.proc.pid, seed,
                              rounds=rounds, repeats=repeats, until=hit_over))
        except Exception as exc:  # noqa: BLE001 - judged below: a flood that could not run is a failed check
            failed.append(f"{type(exc).__name__}: {exc}"[:300])

    thread = threading.Thread(target=run, name="frame-flood", daemon=True)
    try:
        thread.start()
        try:
            hit = live.cross_replica_hit(cluster, corpus, seed, prompt_tokens=prompt_tokens)
        finally:
            hit_over.set()
        thread.join(timeout=300)
    finally:
        if own is not None:
            own.stop()
            own.cleanup()
    c = Checks()
    c.check("the flood finished", bool(done) and not thread.is_alive(), failed[0] if failed else None)
    if done:
        judge_flood(done[0], c)
    c.check("the daemon under the flood is still running", target.proc.poll() is None or own is not None)
    _merge(c, hit)
    return c.verdict("an authenticated tenant's maximal frames were each refused or answered within the frame "
                     "limit, the daemon's RSS stayed within its bound, and the cross-replica hit was byte-exact "
                     "with its output unchanged")


def _merge(c: Checks, v: Verdict) -> None:
    """Another runner's checks and output comparisons into `c`."""
    c.failed.extend(v.evidence.get("checks_failed", []))
    for rec in v.evidence.get("output", []):
        c.outputs.append(rec)
        if not rec.get("equal"):
            c.output_failed.append(f"{rec['check']} ({describe_difference(rec)})")
    c.evidence["cross_replica_hit"] = {k: v for k, v in v.evidence.items() if k not in ("checks_failed", "output")}


RUNNERS: dict[str, Callable[..., Verdict]] = {"frame_flood": frame_flood}
