"""PoolClient: the blocking socket client of a pool daemon (Unix or TCP), typed errors, the
zero-copy mapping of the arena on the daemon's host, and the probe of its read-only index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import platform
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from kvpool.pool import protocol as P
from kvpool.pool.arena import Arena
from kvpool.pool.records import (
    AcquireResult,
    CommitResult,
    CorruptOutcome,
    EvictOutcome,
    LookupResult,
    ReleaseResult,
    RenewResult,
    ReserveResult,
    SlotStatus,
)
from kvpool.pool.digest import DigestKind
from kvpool.pool.index import ShmIndex, ns_fingerprint
from kvpool.errors import (
    ArenaError,
    InvalidRequest,
    MalformedFrame,
    PoolError,
    PoolTimeout,
    TransportError,
    UntrustedPool,
    error_from_code,
)
from kvpool.pool.keys import NAMESPACE_RESET, Namespace
from kvpool.pool.metrics import ClientMetrics
from kvpool.client.backend import parse_address


# A call begun at or past its thread's deadline still gets this long (a release after a
# load's deadline, say: it unpins the pages at once instead of at the lease's TTL).
MIN_CALL_S = 0.05

# Requests whose repetition changes nothing: safe to resend when no reply byte arrived (a
# Renew resent on a new connection is refused: the grants went with the old session).
_IDEMPOTENT = (P.Ping, P.Lookup, P.Stats, P.Metrics, P.Renew)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
PROBE_ORDERED = platform.machine() in ("x86_64", "AMD64")  # kvpool.pool.index's seqlock needs x86 ordering


def _check_run(hits: object, asked: int, op: str) -> None:
    """A run of hits answers the blocks asked for, from the first: never more of them (the
    caller would install, or claim to vLLM, blocks past its own)."""
    if len(hits) > asked:
        raise MalformedFrame(f"{op} of {asked} blocks answered with a run of {len(hits)}")


def renew_in_frames(call: Callable[[P.Renew], P.RenewOk], reservations: Sequence[int],
                    leases: Sequence[int]) -> RenewResult:
    """One Renew per MAX_RENEW_IDS ids of each kind, through `call` (a client's request-reply:
    the host pool's PoolClient or the GPU keeper's TierClient), the answers in order;
    MalformedFrame when a reply does not answer every id it was asked."""
    res, lea = [int(i) for i in reservations], [int(i) for i in leases]
    out_res: list = []
    out_lea: list = []
    step = P.MAX_RENEW_IDS
    for k in range(0, max(len(res), len(lea), 1), step):
        r = call(P.Renew(res[k : k + step], lea[k : k + step]))
        if len(r.reservations) != len(res[k : k + step]) or len(r.leases) != len(lea[k : k + step]):
            raise MalformedFrame(f"Renew of {len(res[k : k + step])} reservations and {len(lea[k : k + step])} "
                                 f"leases answered with {len(r.reservations)} and {len(r.leases)}")
        out_res.extend(r.reservations)
        out_lea.extend(r.leases)
    return RenewResult(tuple(out_res), tuple(out_lea))


def recv_exact(sock: socket.socket, n: int, peer: str) -> bytes:
    """Exactly `n` bytes from a blocking socket; TransportError naming `peer` at EOF."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError(f"{peer} closed the connection")
        got += k
    return bytes(buf)


def _peer_closed(sock: socket.socket) -> bool:
    """Between requests nothing may arrive: a readable idle socket is at EOF, reset, or
    out of step, and is not reused. One zero-timeout poll, no blocking."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class _ProbeView:
    """What a probe reads, as one snapshot: the live session's socket, the segment of the
    daemon at its other end, and that segment's index (None: the index region the segment
    declares is not one an index can be: the probe answers None, the lookup asks)."""

    sock: socket.socket
    arena: Arena
    index: ShmIndex | None

    @classmethod
    def of(cls, sock: socket.socket, arena: Arena, client: PoolClient) -> _ProbeView:
        entries = arena.index_entries
        try:
            index = ShmIndex(entries, num_pages=arena.num_pages) if entries is not None and entries.size else None
        except ValueError as exc:  # the segment's header declares an index of another shape
            client.attach_error = f"the segment's index is not probed: {exc}"
            index = None
        return cls(sock, arena, index)


class PoolClient:
    """A connection to one pool daemon. Thread-safe (one request in flight at a time)."""

    def __init__(self, address: str, tenant: str, token: str, *, name: str = "",
                 timeout_s: float = 5.0, zero_copy: bool = True, metrics: ClientMetrics | None = None,
                 pool_uids: Collection[int] | None = None):
        self.address = address
        # Who may listen at a Unix address (SO_PEERCRED): this user and root unless told otherwise.
        self.pool_uids = frozenset(pool_uids) if pool_uids is not None else frozenset({os.geteuid(), 0})
        self.tenant = tenant
        self._token = token
        self.name = name
        self.timeout_s = timeout_s
        self.zero_copy = zero_copy
        self.metrics = metrics or ClientMetrics()
        self._family, self._sockaddr = parse_address(address)
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._local = threading.local()  # .deadline: this thread's call_deadline, if any
        # Guards what a connect or a restart swaps (the socket, the mapped segment, the probe's
        # view of them, the pages each lease and reservation was granted in). Held only for
        # those assignments and for a probe's read of the index, never across a call to the
        # daemon: the scheduler's probe never waits on the pool.
        self._state = threading.Lock()
        self.arena: Arena | None = None
        self._probe_view: _ProbeView | None = None
        self._granted: dict[tuple[str, int], Arena | None] = {}  # ("lease" | "reservation", id) -> segment it was granted in
        self._fingerprints: dict[Namespace, int] = {}
        self.attach_error = ""  # why the arena is not mapped here, if it was offered and is not
        self.hello: P.HelloOk | None = None
        self.page_size = 0
        self.connect()

    # -- connection ----------------------------------------------------------------------
    def connect(self) -> P.HelloOk:
        with self._lock:
            self._drop_socket()
            try:
                sock = socket.socket(self._family, socket.SOCK_STREAM)
                sock.settimeout(self.timeout_s)
                sock.connect(self._sockaddr)
            except TimeoutError as exc:
                sock.close()
                raise PoolTimeout(f"connect to {self.address} timed out after {self.timeout_s}s") from exc
            except OSError as exc:
                sock.close()
                raise TransportError(f"cannot connect to pool at {self.address}: {exc}") from exc
            if self._family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                try:
                    self._verify_peer(sock, self.address)
                except UntrustedPool:
                    sock.close()
                    raise
            with self._state:
                self._sock = sock
            hello = self._call(P.Hello(self.tenant, self._token, self.name), retry=False)
            assert isinstance(hello, P.HelloOk)
            self.hello = hello
            self.page_size = hello.page_size
            self._attach(hello)
            return hello

    def _verify_peer(self, sock: socket.socket, what: str) -> None:
        """Before a byte is sent on a Unix socket: the kernel's word (SO_PEERCRED) on who
        listens there must be one of `pool_uids`, whatever the path's directories are."""
        pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid not in self.pool_uids:
            raise UntrustedPool(f"{what}: the process listening there (pid {pid}) runs as uid {uid}, not as "
                                f"{' or '.join(map(str, sorted(self.pool_uids)))}: nothing was sent to it")

    def _attach(self, hello: P.HelloOk) -> None:
        """Map the segment of the daemon this session's hello came from (or keep the one
        mapped, if it is that daemon's), and only then let the probe read it together with
        this session's socket (the caller holds self._lock)."""
        if self.arena is not None and (self.arena.instance != hello.arena_instance or self.arena.closed):
            self._close_arena()
        if self.zero_copy and self.arena is None and hello.ticket:
            arena = self._fetch_arena(hello)  # I/O: without self._state
            if arena is not None and arena.instance != hello.arena_instance:
                arena.close()  # a segment that is not this daemon's
                arena = None
            if arena is not None:
                with self._state:
                    self.arena = arena
        with self._state:
            if self.arena is not None and self._sock is not None:
                self._probe_view = _ProbeView.of(self._sock, self.arena, self)

    def _fetch_arena(self, hello: P.HelloOk) -> Arena | None:
        """Trade the hello's ticket for the tenant's segments at the daemon's attach socket:
        the daemon's private state (mapped read-only: kvpool.pool.arena) and the pages."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout_s)
                sock.connect(hello.arena)
                self._verify_peer(sock, f"attach socket {hello.arena!r}")
                sock.sendall(hello.ticket)
                answer, fds, _, _ = socket.recv_fds(sock, 1, 2)
        except (OSError, ValueError) as exc:  # no attach socket here (another host, a proxy in between)
            self.attach_error = f"attach socket {hello.arena!r}: {exc}"
            return None
        except UntrustedPool as exc:  # another user's socket: the ticket stays here, pages go in frames
            self.attach_error = str(exc)
            return None
        if answer != b"\x00" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            self.attach_error = (f"attach socket {hello.arena!r} refused the ticket (answer {answer!r}, "
                                 f"{len(fds)} descriptors)")
            return None
        try:
            return Arena.from_fds(fds[0], fds[1], f"{self.address}:{self.tenant}")
        except ArenaError as exc:
            self.attach_error = str(exc)
            return None

    def _close_arena(self) -> None:
        with self._state:
            arena, self.arena = self.arena, None
            self._probe_view = None
            # Every lease and reservation was granted in that segment: none is read or written
            # in the next one (its page numbers name other blocks' pages there).
            self._granted.clear()
            if arena is not None:
                try:
                    arena.close()
                except ArenaError:
                    pass  # a caller still holds a page view; the mapping goes when it drops it

    def _drop_socket(self) -> None:
        with self._state:
            sock, self._sock = self._sock, None
            self._probe_view = None  # a probe reads the segment only beside a live session
            if sock is not None:
                sock.close()

    def close(self) -> None:
        with self._lock:
            self._drop_socket()
            self._close_arena()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one request ---------------------------------------------------------------------
    def _recv_exact(self, n: int) -> bytes:
        assert self._sock is not None
        return recv_exact(self._sock, n, f"pool at {self.address}")

    def _peer_closed(self) -> bool:
        assert self._sock is not None
        return _peer_closed(self._sock)

    @contextlib.contextmanager
    def call_deadline(self, seconds: float):  # noqa: ANN201
        """Within the block, this thread's calls end by `seconds` from now."""
        outer = getattr(self._local, "deadline", None)
        mine = time.monotonic() + seconds
        self._local.deadline = mine if outer is None else min(outer, mine)
        try:
            yield
        finally:
            self._local.deadline = outer

    def _call_timeout(self, extra_s: float) -> float:
        timeout = self.timeout_s + extra_s
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None:
            timeout = min(timeout, max(deadline - time.monotonic(), MIN_CALL_S))
        return timeout

    def _call(self, op: P.Request, retry: bool = True, extra_s: float = 0.0) -> P.Reply:
        if not self._lock.acquire(timeout=self._call_timeout(extra_s)):
            raise PoolTimeout(f"{type(op).__name__} to {self.address}: the connection stayed busy with another "
                              f"thread's call past this call's timeout")
        try:
            return self._call_locked(op, retry, extra_s)
        finally:
            self._lock.release()

    def _call_locked(self, op: P.Request, retry: bool, extra_s: float) -> P.Reply:
        """One request, one reply. A connection that was reused after sitting idle may be
        dead (the daemon restarted): if it fails before the daemon can have read the
        request (on send), or with no reply byte to a request that is safe to repeat,
        the request is sent once more on a fresh connection. `extra_s`: time the daemon
        may take on purpose before replying (a lookup's wait), added to the timeout."""
        # the caller holds self._lock
        reused = self._sock is not None
        # The daemon (or a proxy) hung up while the socket sat idle. Not for retry=False:
        # connect()'s hello on its brand-new socket, which must fail, not reconnect.
        if reused and retry and self._peer_closed():
            self._drop_socket()
            reused = False
        if not reused:
            self.connect()
        request_id = next(self._ids)
        stage = "send"
        timeout = self._call_timeout(extra_s)
        try:
            if timeout != self.timeout_s:
                self._sock.settimeout(timeout)
            self._sock.sendall(P.encode_request(request_id, op))
            stage = "reply"
            header = self._recv_exact(P.LENGTH.size)
            stage = "body"
            payload = self._recv_exact(P.LENGTH.unpack(header)[0])
            if timeout != self.timeout_s:
                self._sock.settimeout(self.timeout_s)
        except TimeoutError as exc:
            self._drop_socket()
            raise PoolTimeout(f"{type(op).__name__} to {self.address} timed out after {timeout}s") from exc
        except (OSError, TransportError) as exc:  # TransportError: EOF from _recv_exact
            self._drop_socket()
            repeatable = stage == "send" or (stage == "reply" and isinstance(op, _IDEMPOTENT))
            if retry and reused and repeatable:
                return self._call_locked(op, False, extra_s)
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"{type(op).__name__} to {self.address} failed: {exc}") from exc
        try:
            reply_id, reply = P.decode_reply(payload)
        except PoolError:
            self._drop_socket()
            raise
        if isinstance(reply, P.Error):
            raise error_from_code(reply.code, reply.message)
        if reply_id != request_id:
            self._drop_socket()
            raise MalformedFrame(f"reply id {reply_id} does not answer request {request_id}")
        return reply

    def _expect(self, op: P.Request, kind: type, extra_s: float = 0.0) -> object:
        reply = self._call(op, extra_s=extra_s)
        if not isinstance(reply, kind):
            raise MalformedFrame(f"{type(op).__name__} answered with {type(reply).__name__}")
        return reply

    # -- the protocol, one method per op ---------------------------------------------------
    def ping(self) -> None:
        self._expect(P.Ping(), P.Pong)

    def lookup(self, ns: Namespace, hashes: Sequence[bytes], wait_pending_s: float = 0.0) -> LookupResult:
        if not (wait_pending_s >= 0 and math.isfinite(wait_pending_s)):
            raise InvalidRequest(f"wait_pending_s must be >= 0, got {wait_pending_s}")
        wait_ms = round(wait_pending_s * 1000)
        hashes = hashes[:P.MAX_BLOCKS_PER_FRAME]  # one frame's worth: a run past it is recomputed
        r = self._expect(P.Lookup(ns, list(hashes), wait_ms), P.LookupOk, extra_s=wait_ms / 1000)
        _check_run(r.hits, len(hashes), "Lookup")
        return LookupResult(r.hits, r.miss)

    def probe(self, ns: Namespace, hashes: Sequence[bytes], fresh_s: float | None = None) -> int | None:
        """How many of `hashes`, from the first, the tenant's segment holds committed under
        `ns`, read from the segment's index (kvpool.pool.index): no round trip. None: no
        segment mapped here (another host, a proxy in between), or not an x86 host (the
        index's seqlock relies on x86's ordering of loads and of stores), or the segment is
        not the one of the daemon at the other end of this client's live session (between a
        restart's new connection and its new mapping), or (with `fresh_s`) the daemon's
        heartbeat is older than `fresh_s` seconds or absent, or its end of this client's
        session is closed (a daemon that exited: known at once, not after `fresh_s`); ask
        lookup(), which also says why a run stops. A hit is advisory, as a lookup's is:
        the acquire is what leases the pages.

        Safe beside another thread's reconnect: the socket, the segment and its index are
        read as one snapshot under self._state, which every swap of them takes too (and
        which no call to the daemon holds), so the probe never sees a socket being dropped
        or a segment being unmapped; what it reads from the shared index is validated
        (kvpool.pool.index), so a torn or scribbled entry is a block not held. Nothing the
        pool or its segment holds makes it raise (hashes that are not 16 bytes do: the
        caller's mistake)."""
        if not PROBE_ORDERED:
            return None
        fp = self._fingerprints.get(ns)
        if fp is None:
            fp = self._fingerprints[ns] = ns_fingerprint(ns)
        with self._state:
            view = self._probe_view
            if view is None or view.index is None:
                return None
            if fresh_s is not None:
                age = view.arena.heartbeat_age_s()
                if age is None or age > fresh_s:  # stopped, wedged, or not beating
                    return None
                if _peer_closed(view.sock):  # exited: the kernel closed its end of the session
                    return None
            return view.index.probe(fp, hashes)

    def _call_granting(self, op: P.Request, kind: type, what: str, grant_id: Callable[[object], int]) -> object:
        """A call that grants pages (an acquire's lease, a reserve's reservation): the
        segment they were granted in is noted with the grant, under the call's own lock
        (no swap of the segment can come between the reply and the note)."""
        if not self._lock.acquire(timeout=self._call_timeout(0.0)):
            raise PoolTimeout(f"{type(op).__name__} to {self.address}: the connection stayed busy with another "
                              f"thread's call past this call's timeout")
        try:
            reply = self._call_locked(op, True, 0.0)
            if not isinstance(reply, kind):
                raise MalformedFrame(f"{type(op).__name__} answered with {type(reply).__name__}")
            gid = grant_id(reply)
            if gid:
                with self._state:
                    self._granted[(what, gid)] = self.arena
            return reply
        finally:
            self._lock.release()

    def _granted_arena(self, what: str, gid: int) -> Arena | None:
        """The segment a lease's or a reservation's pages are in, if it is still this
        client's mapping; None where it was granted without one (page bytes then travel on
        the socket). TransportError if the pool's segment changed since (a restart): the
        page numbers name other pages in the new one."""
        with self._state:
            if (what, gid) not in self._granted:
                if self.arena is None:
                    return None
                raise TransportError(f"{what} {gid} was not granted in the pool's current segment (a restart)")
            arena = self._granted[(what, gid)]
            if arena is not None and arena is not self.arena:
                raise TransportError(f"{what} {gid}: the pool's segment changed under it (a restart)")
            return arena

    def _forget_grant(self, what: str, gid: int) -> None:
        with self._state:
            self._granted.pop((what, gid), None)

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> AcquireResult:
        hashes = hashes[:P.MAX_BLOCKS_PER_FRAME]  # one frame's worth (as lookup)
        r = self._call_granting(P.Acquire(ns, list(hashes)), P.AcquireOk, "lease", lambda x: x.lease_id)
        if len(r.hits) > len(hashes) and r.lease_id:  # not kept: the answer is not one to this request
            self._forget_grant("lease", r.lease_id)
            try:
                self._call(P.Release(r.lease_id))
            except PoolError:
                pass  # the daemon reclaims it at the lease's TTL or when the connection drops
        _check_run(r.hits, len(hashes), "Acquire")
        return AcquireResult(r.lease_id, r.hits, r.miss)

    def release(self, lease_id: int) -> ReleaseResult:
        self._forget_grant("lease", lease_id)
        r = self._expect(P.Release(lease_id), P.ReleaseOk)
        return ReleaseResult(tuple(r.stale))

    def read_page(self, lease: AcquireResult, index: int) -> np.ndarray | bytes:
        ref = lease.hits[index]
        arena = self._granted_arena("lease", lease.lease_id)
        if arena is not None:
            return arena.page(ref.page, ref.length)
        r = self._expect(P.ReadPages(lease.lease_id, [index]), P.PagesOk)
        if len(r.data) != 1:
            raise MalformedFrame(f"ReadPages of one page answered with {len(r.data)}")
        return r.data[0]

    def reserve(self, ns: Namespace, hashes: Sequence[bytes], lengths: Sequence[int],
                boundary: int | None = None) -> ReserveResult:
        r = self._call_granting(P.Reserve(ns, list(hashes), [int(n) for n in lengths], boundary), P.ReserveOk,
                                "reservation", lambda x: x.reservation_id)
        return ReserveResult(r.reservation_id, tuple(r.slots))

    def reserved_view(self, reservation: ReserveResult, slot: int) -> np.ndarray | None:
        """The reserved page itself, writable, where the arena is mapped (else None)."""
        s = reservation.slots[slot]
        if s.status != SlotStatus.RESERVED:
            raise InvalidRequest(f"slot {slot} is {s.status.value}, not reserved")
        arena = self._granted_arena("reservation", reservation.reservation_id)
        return None if arena is None else arena.page(s.page)

    def write_page(self, reservation: ReserveResult, slot: int, data: np.ndarray | bytes) -> None:
        s = reservation.slots[slot]
        if s.status != SlotStatus.RESERVED:
            raise InvalidRequest(f"slot {slot} is {s.status.value}, not reserved")
        arena = self._granted_arena("reservation", reservation.reservation_id)
        if arena is not None:
            src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
            arena.page(s.page, src.size)[:] = src
            return
        res_slot = sum(1 for x in reservation.slots[:slot] if x.status == SlotStatus.RESERVED)
        payload = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        self._expect(P.WritePages(reservation.reservation_id, [res_slot], [payload]), P.WriteOk)

    def commit(self, reservation_id: int, digests: Sequence[bytes],
               kind: DigestKind = DigestKind.XXH3) -> CommitResult:
        self._forget_grant("reservation", reservation_id)
        r = self._expect(P.Commit(reservation_id, list(digests), DigestKind(kind)), P.CommitOk)
        return CommitResult(r.committed, tuple(r.rejected))

    def abort(self, reservation_id: int) -> int:
        self._forget_grant("reservation", reservation_id)
        return self._expect(P.Abort(reservation_id), P.AbortOk).freed

    @property
    def reservation_ttl_s(self) -> float:
        """The TTL of an open reservation the daemon advertised (0: it did not; do not renew)."""
        hello = self.hello
        return hello.reservation_ttl_s if hello is not None else 0.0

    @property
    def lease_ttl_s(self) -> float:
        hello = self.hello
        return hello.lease_ttl_s if hello is not None else 0.0

    def renew(self, reservations: Sequence[int] = (), leases: Sequence[int] = ()) -> RenewResult:
        """This session is still working on these reservations and leases: each deadline moves
        to now + its TTL (never past the pool's maximum age), or is refused per id
        (kvpool.pool.records.RenewRefusal); a frame carries at most MAX_RENEW_IDS of each.
        Only for a daemon whose hello advertised the TTL (an older one answers MALFORMED)."""
        return renew_in_frames(lambda op: self._expect(op, P.RenewOk), reservations, leases)

    def evict(self, ns: Namespace, hashes: Sequence[bytes]) -> list[EvictOutcome]:
        return list(self._expect(P.Evict(ns, list(hashes)), P.EvictOk).outcomes)

    def reset_namespace(self, ns: Namespace) -> list[EvictOutcome]:
        """Everything published under `ns` leaves the pool, for every client at once
        (kvpool.pool.catalog.Catalog.reset_namespace): one outcome per page taken out."""
        return self.evict(ns, [NAMESPACE_RESET])

    def set_capacity(self, pages: int, tenant: str = "") -> int:
        """An admin's squeeze of `tenant`'s segment (by default its own) to `pages`."""
        return self._expect(P.SetCapacity(pages, tenant), P.CapacityOk).evicted

    def set_load_limits(self, per_client: int, total: int, tenant: str = "") -> tuple[int, int]:
        """An admin's load limits of `tenant` (by default its own): concurrent leases per
        client and in all, 0 for none. Returns the limits it replaced."""
        r = self._expect(P.SetLimits(per_client, total, tenant), P.LimitsOk)
        return r.per_client, r.total

    def stats(self) -> dict[str, int]:
        return dict(self._expect(P.Stats(), P.StatsOk).stats)

    def report_corrupt(self, lease_id: int, indexes: Sequence[int]) -> list[CorruptOutcome]:
        """Tell the daemon that these pages of a lease still held failed the loader's digest
        check. It re-hashes them at rest and drops those that are corrupt there (dropped);
        a page whose bytes at rest match stays (intact: the copy went wrong on this side)."""
        return list(self._expect(P.ReportCorrupt(lease_id, [int(i) for i in indexes]), P.ReportOk).outcomes)

    def metrics_text(self) -> str:
        return self._expect(P.Metrics(), P.MetricsOk).text
