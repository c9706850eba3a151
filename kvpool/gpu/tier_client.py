"""A replica's client of the GPU keeper's control plane (kvpool.gpu.keeper_server): the session,
the tier's mapping it gets with it (kvpool.gpu.tier_map), and the keeper's liveness read from
the keeper's state segment.

  TierClient(path, tenant, token, *, name="", timeout_s=5.0, stale_after_s=2.0,
             device_index=None, access=(), trusted_uids=None, metrics=None,
             clock_ns=time.monotonic_ns)
      .connect()           SO_PEERCRED first (the listener must run as a trusted user, or nothing
                           is sent, not the token: UntrustedPool), then the hello, then the
                           handout of the tenant's buffer with the hello's ticket (TierMap.attach).
      .tier                the TierMap (page views, generations, the keeper's heartbeat).
      .client_id           the tier's id of this session (the keeper's HelloOk.session).
      .lookup(ns, hashes) -> LookupResult       .acquire(ns, hashes) -> AcquireResult
      .release(lease_id) -> ReleaseResult       .reserve(ns, hashes, lengths, boundary) -> ReserveResult
      .commit(reservation_id, digests, kind=SKETCH) -> CommitResult   .abort(reservation_id) -> int
      .stats() -> dict                          .ping()
                           one request, one reply each (the keeper's GpuTier methods, one to one).
                           Only this session's leases and reservations can be released, committed
                           or aborted.
      .keeper_stale() -> bool   the heartbeat in the state segment is older than `stale_after_s`
                           by `clock_ns` (CLOCK_MONOTONIC: the keeper's clock, one per host).
      .run(ns) -> TierRun  the tier's lookup for kvpool.gpu.tier.fall_through: a TransportError
                           (KeeperStale included) is a run of 0 blocks missing as transport_error
                           (a PoolTimeout, as timeout), so the lookup falls through to the host pool.
      .close()

Errors are typed: the keeper's Error replies as kvpool.errors maps their codes; a socket that
fails or closes, TransportError; a reply past the timeout, PoolTimeout; a reply that is not the
protocol's, MalformedFrame. KeeperStale (a TransportError) before any call whose keeper's
heartbeat is stale, and for a call that fails or times out while it is: a stopped or dead keeper
is judged by its heartbeat, never by how long a socket stayed silent. Each KeeperStale counts
once in ClientMetrics.keeper_stale; the connector counts it as a transport_error miss (as every
TransportError) and loads from the host pool. A connection that failed is not reused (its
stream may be out of step); a stale check that refused a call sent nothing, and the same
client works again once the keeper beats again.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence

from kvpool.errors import (
    MalformedFrame,
    MissCause,
    PoolError,
    PoolTimeout,
    TransportError,
    error_from_code,
)
from kvpool.gpu.handout import verify_listener
from kvpool.gpu.tier import TierRun
from kvpool.gpu.tier_map import TierMap
from kvpool.pool import protocol as P
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.pool.metrics import ClientMetrics
from kvpool.pool.records import AcquireResult, CommitResult, LookupResult, ReleaseResult, ReserveResult


class KeeperStale(TransportError):
    """The GPU keeper's heartbeat in its state segment is stale (the keeper is stopped, wedged or
    dead): the tier is not used; the lookup or load falls through to the host pool."""


class TierClient:
    def __init__(self, path: str | os.PathLike, tenant: str, token: str, *, name: str = "",
                 timeout_s: float = 5.0, stale_after_s: float = 2.0, device_index: int | None = None,
                 access: tuple[int, ...] = (), trusted_uids: Collection[int] | None = None,
                 metrics: ClientMetrics | None = None, clock_ns: Callable[[], int] = time.monotonic_ns):
        self.path = str(path)
        self.tenant = tenant
        self._token = token
        self.name = name
        self.timeout_s = timeout_s
        self.stale_after_s = stale_after_s
        self.device_index = device_index
        self.access = access
        self.trusted_uids = frozenset({os.geteuid(), 0} if trusted_uids is None else trusted_uids)
        self.metrics = metrics or ClientMetrics()
        self.clock_ns = clock_ns
        self.tier: TierMap | None = None
        self.client_id = 0
        self.hello: P.HelloOk | None = None
        self._sock: socket.socket | None = None
        self._broken: str | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # -- the session ------------------------------------------------------------------------
    def connect(self) -> TierClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(self.path)
            verify_listener(sock, f"the GPU keeper's socket {self.path!r}", self.trusted_uids)
        except TimeoutError as exc:
            sock.close()
            raise PoolTimeout(f"the GPU keeper at {self.path!r} did not accept within {self.timeout_s}s") from exc
        except OSError as exc:
            sock.close()
            raise TransportError(f"the GPU keeper at {self.path!r}: {exc}") from exc
        except PoolError:
            sock.close()
            raise
        self._sock = sock
        try:
            hello = self._exchange(P.Hello(self.tenant, self._token, self.name), P.HelloOk)
            self.tier = TierMap.attach(hello.arena, hello.ticket, self.device_index, self.access,
                                       self.timeout_s, self.trusted_uids)
        except PoolError:
            self.close()
            raise
        if self.tier.descriptor.instance != hello.arena_instance:
            self.close()
            raise MalformedFrame("the buffer handed out is not the keeper's that said hello (instance ids differ)")
        self.hello, self.client_id = hello, hello.session
        return self

    def keeper_age_s(self) -> float:
        if self.tier is None:
            raise TransportError("not connected to the GPU keeper")
        return (self.clock_ns() - self.tier.keeper_heartbeat_ns()) / 1e9

    def keeper_stale(self) -> bool:
        return self.keeper_age_s() > self.stale_after_s

    def _stale(self, what: str) -> KeeperStale:
        self.metrics.keeper_stale.inc()
        return KeeperStale(f"{what}: the GPU keeper's heartbeat is {self.keeper_age_s():.2f}s old (stale after "
                           f"{self.stale_after_s}s)")

    # -- one request ------------------------------------------------------------------------
    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:], n - got)
            if k == 0:
                raise TransportError(f"the GPU keeper at {self.path!r} closed the connection")
            got += k
        return bytes(buf)

    def _break(self, why: str) -> None:
        self._broken = why
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _exchange(self, op: P.Request, kind: type) -> P.Reply:
        """Send `op`, read its reply (the caller holds the session; `_call` checks staleness)."""
        what = type(op).__name__
        if self._sock is None:
            raise TransportError(f"{what}: the connection to the GPU keeper is gone ({self._broken or 'closed'})")
        request_id = next(self._ids)
        try:
            self._sock.sendall(P.encode_request(request_id, op))
            (n,) = P.LENGTH.unpack(self._recv_exact(P.LENGTH.size))
            if n > P.CONTROL_FRAME_BYTES:
                self._break("oversized reply")
                raise MalformedFrame(f"{what}: a reply of {n} bytes, past the frame limit")
            payload = self._recv_exact(n)
        except TimeoutError as exc:
            self._break("timed out")
            if self.tier is not None and self.keeper_stale():
                raise self._stale(what) from exc
            raise PoolTimeout(f"{what} to the GPU keeper timed out after {self.timeout_s}s") from exc
        except (OSError, TransportError) as exc:
            self._break(f"failed: {exc}")
            if self.tier is not None and self.keeper_stale():
                raise self._stale(what) from exc
            if isinstance(exc, TransportError):
                raise
            raise TransportError(f"{what} to the GPU keeper failed: {exc}") from exc
        try:
            reply_id, reply = P.decode_reply(payload)
        except PoolError:
            self._break("a malformed reply")
            raise
        if isinstance(reply, P.Error):
            raise error_from_code(reply.code, reply.message)
        if reply_id != request_id or not isinstance(reply, kind):
            self._break("a reply out of step")
            raise MalformedFrame(f"{what} (request {request_id}) answered with {type(reply).__name__} "
                                 f"(reply {reply_id})")
        return reply

    def _call(self, op: P.Request, kind: type) -> P.Reply:
        with self._lock:
            if self.tier is None:
                raise TransportError("not connected to the GPU keeper")
            if self.keeper_stale():
                raise self._stale(type(op).__name__)
            return self._exchange(op, kind)

    # -- the operations ---------------------------------------------------------------------
    def ping(self) -> None:
        self._call(P.Ping(), P.Pong)

    def lookup(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        r = self._call(P.Lookup(ns, list(hashes)), P.LookupOk)
        return LookupResult(r.hits, r.miss)

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> AcquireResult:
        r = self._call(P.Acquire(ns, list(hashes)), P.AcquireOk)
        return AcquireResult(r.lease_id, r.hits, r.miss)

    def release(self, lease_id: int) -> ReleaseResult:
        """After this host saw every copy out of the lease's pages complete (the release edge)."""
        r = self._call(P.Release(lease_id), P.ReleaseOk)
        return ReleaseResult(tuple(r.stale))

    def reserve(self, ns: Namespace, hashes: Sequence[bytes], lengths: Sequence[int],
                boundary: int | None = None) -> ReserveResult:
        r = self._call(P.Reserve(ns, list(hashes), list(lengths), boundary), P.ReserveOk)
        return ReserveResult(r.reservation_id, tuple(r.slots))

    def commit(self, reservation_id: int, digests: Sequence[bytes],
               kind: DigestKind = DigestKind.SKETCH) -> CommitResult:
        """After this host saw its copy into the pages and its sketch of them complete (the
        commit edge)."""
        r = self._call(P.Commit(reservation_id, list(digests), kind), P.CommitOk)
        return CommitResult(r.committed, tuple(r.rejected))

    def abort(self, reservation_id: int) -> int:
        return self._call(P.Abort(reservation_id), P.AbortOk).freed

    def stats(self) -> dict[str, int]:
        return dict(self._call(P.Stats(), P.StatsOk).stats)

    def run(self, ns: Namespace) -> TierRun:
        def run(hashes: Sequence[bytes]) -> tuple[int, MissCause | None]:
            try:
                found = self.lookup(ns, hashes)
            except TransportError:
                return 0, MissCause.TRANSPORT_ERROR
            except PoolTimeout:
                return 0, MissCause.TIMEOUT
            return len(found.hits), None if found.miss is None else found.miss.cause
        return run

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def __enter__(self) -> TierClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()
