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
      .instance            the keeper's instance id this session is bound to (its hello's).
      .connected           the session's socket is open (a call that failed closed it).
      .peer_closed()       the keeper ended the session (EOF or reset while idle): closed here.
      .close()

  TierLink(address_dir, tenant, token, **TierClient's keywords, client_cls=TierClient)
      a replica's link to whichever keeper instance the run directory's keeper-address.json
      names (written by `kvpool keeper`, kvpool.gpu.cli). Each call goes through the current
      TierClient while its session is open and its keeper's heartbeat fresh; otherwise the
      address file is read again, and if it names an instance (or a session) other than the
      one held, a new TierClient connects to it and maps its buffer, and the old one's session
      is closed; its mapping is dropped then, or, while a lease or reservation of it is still
      open, when the last of them ends through the link (release, commit, abort: each refused
      as WrongInstance, the caller's copies done by then), never under a copy. A call that fails is not repeated (a reserve or commit may have
      reached the keeper); the next call reconnects. While no live keeper is there the calls
      raise TransportError (KeeperStale once the old heartbeat is stale): the lookup falls
      through to the host pool.
      .acquire(ns, hashes) -> TierLease        .reserve(ns, hashes, lengths, boundary) -> TierReservation
      .release(lease) / .commit(reservation, digests, kind) / .abort(reservation)
      .renew(reservations, leases)  the grants' deadlines moved (TierClient.renew)
      .page_view(grant, i) / .generation(grant, i)   the i-th page of a lease (its hits) or of a
                           reservation (its slots), through the mapping of the instance that
                           granted it.
                           A grant carries the instance id and the session it was granted in;
                           presented to another (a restarted keeper, a new session), it is
                           refused with WrongInstance before a byte is sent or a page touched:
                           lease and page numbers of one instance name other pages, or another
                           client's lease, in the next.
      .lookup(ns, hashes), .stats(), .run(ns), .instance, .client, .reconnects, .close()
      .metrics             one ClientMetrics for every session of the link (keeper_stale counts
                           across reconnects).
  read_keeper_address(run_dir) -> KeeperAddress   the address file, parsed; TransportError if
                           it is missing (no keeper there now) or not a keeper's.

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

import contextlib
import dataclasses
import itertools
import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from kvpool.client.pool_client import recv_exact, renew_in_frames
from kvpool.errors import (
    MalformedFrame,
    MissCause,
    PoolError,
    PoolTimeout,
    TransportError,
    error_from_code,
)
from kvpool.gpu.handout import verify_listener
from kvpool.gpu.tier import KeeperRefused, TierRun, WrongInstance
from kvpool.gpu.tier_map import TierMap
from kvpool.pool import protocol as P
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import Namespace
from kvpool.pool.metrics import ClientMetrics
from kvpool.pool.records import AcquireResult, CommitResult, LookupResult, ReleaseResult, RenewResult, ReserveResult


ADDRESS_FILE = "keeper-address.json"
ADDRESS_KIND = "kvgate-gpu-keeper"
ADDRESS_VERSION = 1



def _lookup_run(lookup, ns: Namespace) -> TierRun:  # noqa: ANN001 - a client's or a link's lookup
    """The tier's run for kvpool.gpu.tier.fall_through: the hits of a lookup, its miss cause; a
    keeper that cannot be reached (stale, gone, refusing) is a transport_error, a slow one a timeout."""
    def run(hashes: Sequence[bytes]) -> tuple[int, MissCause | None]:
        try:
            found = lookup(ns, hashes)
        except TransportError:
            return 0, MissCause.TRANSPORT_ERROR
        except PoolTimeout:
            return 0, MissCause.TIMEOUT
        return len(found.hits), None if found.miss is None else found.miss.cause
    return run

class KeeperStale(TransportError):
    """The GPU keeper's heartbeat in its state segment is stale (the keeper is stopped, wedged or
    dead): the tier is not used; the lookup or load falls through to the host pool."""


@dataclasses.dataclass(frozen=True)
class KeeperAddress:
    """What a keeper's keeper-address.json says (kvpool.gpu.cli writes it once serving)."""

    socket: str
    attach: str
    pid: int
    instance: bytes
    gpu: int
    backing: str
    device_uuid: bytes
    page_size: int
    tenant_pages: dict[str, int]
    host_pool: str | None = None
    recovery_note: str = ""

    def to_json(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out.update(kind=ADDRESS_KIND, version=ADDRESS_VERSION, instance=self.instance.hex(),
                   device_uuid=self.device_uuid.hex())
        return out

    @classmethod
    def from_json(cls, data: object) -> KeeperAddress:
        if not isinstance(data, dict) or data.get("kind") != ADDRESS_KIND or data.get("version") != ADDRESS_VERSION:
            raise ValueError(f"not a version-{ADDRESS_VERSION} {ADDRESS_KIND} address")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["instance"] = bytes.fromhex(values["instance"])
        values["device_uuid"] = bytes.fromhex(values["device_uuid"])
        if len(values["instance"]) != 16 or not isinstance(values["pid"], int):
            raise ValueError("an instance id of 16 bytes and an integer pid are needed")
        return cls(**values)


def read_keeper_address(run_dir: str | os.PathLike) -> KeeperAddress:
    """The keeper address in `run_dir` (or the file itself, if a file is named)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / ADDRESS_FILE
    try:
        return KeeperAddress.from_json(json.loads(path.read_text()))
    except FileNotFoundError as exc:
        raise TransportError(f"no GPU keeper serves there now ({path} is absent)") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TransportError(f"{path} is not a GPU keeper's address: {exc}") from exc


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
        except BaseException:  # a typed refusal, or the mapping itself failing (OSError): no session left open
            self.close()
            raise
        if self.tier.descriptor.instance != hello.arena_instance:
            self.close()
            raise MalformedFrame("the buffer handed out is not the keeper's that said hello (instance ids differ)")
        self.hello, self.client_id = hello, hello.session
        return self

    @property
    def instance(self) -> bytes:
        if self.hello is None:
            raise TransportError("not connected to the GPU keeper")
        return self.hello.arena_instance

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def peer_closed(self) -> bool:
        """Between calls nothing may arrive: a readable idle session is at EOF or reset (its keeper
        ended it or died) and is closed here. One zero-timeout poll."""
        with self._lock:
            if self._sock is None:
                return True
            if not select.select([self._sock], [], [], 0)[0]:
                return False
            self._break("the keeper ended the session")
            return True

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
        return recv_exact(self._sock, n, f"the GPU keeper at {self.path!r}")

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

    @property
    def reservation_ttl_s(self) -> float:
        """The TTL of an open reservation the keeper advertised at hello (0: none; do not renew)."""
        return self.hello.reservation_ttl_s if self.hello is not None else 0.0

    @property
    def lease_ttl_s(self) -> float:
        return self.hello.lease_ttl_s if self.hello is not None else 0.0

    def renew(self, reservations: Sequence[int] = (), leases: Sequence[int] = ()) -> RenewResult:
        """This session still works on these reservations and leases of its own (a copy into
        the pages still queued behind a forward, say): each deadline moves to now + its TTL, or
        is refused per id (kvpool.pool.records.RenewRefusal), as with the host pool
        (PoolClient.renew; kvpool.client.keepalive drives either). At most MAX_RENEW_IDS of
        each a frame."""
        return renew_in_frames(lambda op: self._call(op, P.RenewOk), reservations, leases)

    def stats(self) -> dict[str, int]:
        return dict(self._call(P.Stats(), P.StatsOk).stats)

    def run(self, ns: Namespace) -> TierRun:
        return _lookup_run(self.lookup, ns)

    def end_session(self) -> None:
        """Close the session's socket and keep the mapping (a copy into or out of its pages may
        still run): TierLink retires a client this way while grants of it are open."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self.end_session()
        if self.tier is not None:
            self.tier.close()
            self.tier = None

    def __enter__(self) -> TierClient:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a link that follows the keeper across restarts ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class TierLease:
    """A lease and the keeper instance and session that granted it."""

    instance: bytes
    session: int
    result: AcquireResult

    @property
    def lease_id(self) -> int:
        return self.result.lease_id


@dataclasses.dataclass(frozen=True)
class TierReservation:
    """A reservation and the keeper instance and session that granted it."""

    instance: bytes
    session: int
    result: ReserveResult

    @property
    def reservation_id(self) -> int:
        return self.result.reservation_id


RETIRE_DEFAULT_S = 60.0  # a replaced instance that advertised no TTL


class TierLink:
    def __init__(self, address_dir: str | os.PathLike, tenant: str, token: str, *,
                 client_cls: type[TierClient] = TierClient, retire_max_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, **client_kw: object):
        self.address_dir = Path(address_dir)
        self.retire_max_s = retire_max_s  # None: the replaced instance's own longest TTL
        self._clock = clock
        self.tenant = tenant
        self._token = token
        self._client_cls = client_cls
        self.metrics = client_kw.pop("metrics", None) or ClientMetrics()  # one for every session of the link
        self._client_kw = {**client_kw, "metrics": self.metrics}
        self.client: TierClient | None = None
        self.reconnects = 0  # sessions opened after the first
        self._lock = threading.RLock()
        # (instance, session) -> the grants of it not ended yet through this link: ("lease" |
        # "reservation", id); a client replaced while some are open is retired, its mapping kept
        self._open: dict[tuple[bytes, int], set[tuple[str, int]]] = {}
        self._retired: dict[tuple[bytes, int], tuple[TierClient, float]] = {}  # with when it is dropped
        self.close_errors: list[str] = []  # a retired mapping's close that failed (kept, not raised)

    @property
    def instance(self) -> bytes | None:
        return None if self.client is None else self.client.instance

    # -- the session ------------------------------------------------------------------------
    def _current(self) -> TierClient:
        """The client to call: the one held while its session is open and its keeper beats; else
        one connected to what the address file names now (see the class docstring)."""
        self._sweep_retired()
        old = self.client
        if old is not None and not old.peer_closed() and not old.keeper_stale():
            return old
        try:
            address = read_keeper_address(self.address_dir)
        except TransportError as exc:
            if old is not None and old.tier is not None and old.keeper_stale():
                raise old._stale("no keeper's address") from exc
            raise
        if old is not None and old.connected and address.instance == old.instance:
            return old  # stale, and no other instance there: its own call raises KeeperStale
        try:
            new = self._client_cls(address.socket, self.tenant, self._token, **self._client_kw).connect()
        except (TransportError, PoolTimeout) as exc:
            if old is not None and old.tier is not None and old.keeper_stale():
                raise old._stale(f"reconnect to {address.socket}") from exc
            raise
        except PoolError as exc:  # refused (a token the new instance does not know, no room, a bad
            # handout): the tier is unreachable for this replica, a transport_error miss to its lookups
            if old is not None and old.tier is not None and old.keeper_stale():
                raise old._stale(f"reconnect to {address.socket}: {type(exc).__name__}: {exc}") from exc
            raise KeeperRefused(f"reconnect to the keeper at {address.socket} refused: "
                                f"{type(exc).__name__}: {exc}") from exc
        if new.instance != address.instance:  # the address file changed between its read and the hello
            new.close()
            raise TransportError(f"the keeper at {address.socket} is instance {new.instance.hex()}, its address "
                                 f"file says {address.instance.hex()} (a restart in between)")
        self._adopt(old, new)
        return new

    def _adopt(self, old: TierClient | None, new: TierClient) -> None:
        """`new` becomes the link's client. The old one's session ends, and no grant of it is used
        again (WrongInstance) nor a new view of its pages handed out; its mapping is dropped at
        once if no grant of it is open, else when the last open one ends through this link (a
        lease released, a reservation committed or aborted: each refused as WrongInstance, and
        the caller's copies into or out of those pages are done by then, as the release and
        commit edges require). Unmapping under a copy still running would fault the GPU."""
        if old is not None:
            key = (old.hello.arena_instance, old.client_id) if old.hello is not None else None
            if key is not None and self._open.get(key):
                old.end_session()
                bound = self.retire_max_s
                if bound is None:  # a grant of it outlives neither TTL at its keeper
                    bound = max(old.reservation_ttl_s, old.lease_ttl_s) or RETIRE_DEFAULT_S
                self._retired[key] = (old, self._clock() + bound)
            else:
                old.close()
            self.reconnects += 1
        self.client = new

    def _granted(self, kind: str, c: TierClient, grant_id: int) -> None:
        if grant_id:
            self._open.setdefault((c.instance, c.client_id), set()).add((kind, grant_id))

    def _ended(self, kind: str, grant: TierLease | TierReservation, grant_id: int) -> None:
        key = (grant.instance, grant.session)
        ids = self._open.get(key)
        if ids is None:
            return
        ids.discard((kind, grant_id))
        if not ids:
            del self._open[key]
            self._drop_retired(key)

    def _drop_retired(self, key: tuple[bytes, int]) -> None:
        """Close a retired client's mapping. Called where another error may be on its way out
        (a refused release in a finally): a close that fails is kept in close_errors, not
        raised over it."""
        entry = self._retired.pop(key, None)
        self._open.pop(key, None)
        if entry is None:
            return
        try:
            entry[0].close()
        except (OSError, PoolError) as exc:
            self.close_errors.append(f"instance {key[0].hex()} session {key[1]}: {type(exc).__name__}: {exc}")

    def _sweep_retired(self) -> None:
        """Drop the retired mappings past their bound: a grant never ended through the link
        (a caller that lost it) would otherwise keep a replaced instance's whole buffer mapped,
        and under VMM its device memory allocated. By then the grant has expired at its keeper
        (the bound is that instance's longest TTL), and no copy of a live caller runs that long."""
        now = self._clock()
        for key in [k for k, (_, until) in self._retired.items() if until <= now]:
            self._drop_retired(key)

    @property
    def retired(self) -> int:
        """Clients replaced while grants of theirs were open, their mappings still held (the old
        buffer and the new one both mapped, and under VMM both allocated, meanwhile)."""
        return len(self._retired)

    def connect(self) -> TierLink:
        with self._lock:
            self._current()
        return self

    def _check(self, grant: TierLease | TierReservation) -> TierClient:
        """The client a grant may be used through: the one of the instance and session that
        granted it, still current; else WrongInstance (nothing sent, no page touched)."""
        c = self.client
        if c is None or c.hello is None or (grant.instance, grant.session) != (c.instance, c.client_id):
            now = "none" if c is None or c.hello is None else f"instance {c.instance.hex()} session {c.client_id}"
            raise WrongInstance(f"{type(grant).__name__} of instance {grant.instance.hex()} session {grant.session} "
                                f"presented to {now}: refused, nothing sent")
        return c

    def _mapping(self, grant: TierLease | TierReservation) -> TierMap:
        return self._check(grant).tier

    # -- the operations ---------------------------------------------------------------------
    def lookup(self, ns: Namespace, hashes: Sequence[bytes]) -> LookupResult:
        with self._lock:
            return self._current().lookup(ns, hashes)

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> TierLease:
        with self._lock:
            c = self._current()
            lease = TierLease(c.instance, c.client_id, c.acquire(ns, hashes))
            self._granted("lease", c, lease.lease_id)
            return lease

    def release(self, lease: TierLease) -> ReleaseResult:
        """The lease ends here whatever the answer (the caller's copies out of it are done)."""
        with self._lock:
            try:
                return self._check(lease).release(lease.lease_id)
            finally:
                self._ended("lease", lease, lease.lease_id)

    def reserve(self, ns: Namespace, hashes: Sequence[bytes], lengths: Sequence[int],
                boundary: int | None = None) -> TierReservation:
        with self._lock:
            c = self._current()
            res = TierReservation(c.instance, c.client_id, c.reserve(ns, hashes, lengths, boundary))
            self._granted("reservation", c, res.reservation_id)
            return res

    def commit(self, reservation: TierReservation, digests: Sequence[bytes],
               kind: DigestKind = DigestKind.SKETCH) -> CommitResult:
        """The reservation ends here whatever the answer (the caller's copies into it are done)."""
        with self._lock:
            try:
                return self._check(reservation).commit(reservation.reservation_id, digests, kind)
            finally:
                self._ended("reservation", reservation, reservation.reservation_id)

    def abort(self, reservation: TierReservation) -> int:
        """The reservation ends here whatever the answer: only once the caller's copies into it
        are done (the keeper reuses its pages at once, and a retired mapping is dropped here)."""
        with self._lock:
            try:
                return self._check(reservation).abort(reservation.reservation_id)
            finally:
                self._ended("reservation", reservation, reservation.reservation_id)

    def renew(self, reservations: Sequence[TierReservation] = (), leases: Sequence[TierLease] = ()) -> RenewResult:
        """Renew grants of the current session (TierClient.renew); a grant of another instance
        or session is refused as WrongInstance before anything is sent."""
        with self._lock:
            grants = [*reservations, *leases]
            c = self._check(grants[0]) if grants else self._current()
            for g in grants[1:]:
                self._check(g)
            return c.renew([r.reservation_id for r in reservations], [le.lease_id for le in leases])

    def _page(self, grant: TierLease | TierReservation, index: int) -> int:
        if isinstance(grant, TierLease):
            return grant.result.hits[index].page
        slot = grant.result.slots[index]
        if slot.page < 0:
            raise WrongInstance(f"slot {index} of reservation {grant.reservation_id} holds no page "
                                f"({slot.status.value})")
        return slot.page

    def page_view(self, grant: TierLease | TierReservation, index: int) -> object:
        """The i-th page of the grant (a CudaArray on the GPU, a memoryview of a host stand-in)."""
        with self._lock:
            return self._mapping(grant).page_view(self._page(grant, index))

    def generation(self, grant: TierLease | TierReservation, index: int) -> int:
        with self._lock:
            return self._mapping(grant).generation(self._page(grant, index))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._current().stats()

    def run(self, ns: Namespace) -> TierRun:
        return _lookup_run(self.lookup, ns)

    def close(self) -> None:
        """The session and every mapping, retired ones included (the caller's copies are done)."""
        with self._lock:
            clients = [c for c in (self.client, *(c for c, _ in self._retired.values())) if c is not None]
            self.client = None
            self._retired.clear()
            self._open.clear()
            with contextlib.ExitStack() as stack:  # every one closed, whichever raises
                for c in clients:
                    stack.callback(c.close)

    def __enter__(self) -> TierLink:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()
