"""The GPU keeper's control plane: one GpuKeeper (kvpool.gpu.keeper) served on a Unix socket,
so that replicas in other processes look up, lease, reserve and commit tier pages. The wire is
the pool's (kvpool.pool.protocol: length-prefixed msgpack frames, typed and versioned, one reply
per request); the keeper serves the ops that map one to one onto its tier, and answers every
other op INVALID.

  KeeperServer(keeper, tokens, *, path=None, hosts=None, maintenance_s=0.2, hello_timeout_s=5.0,
               max_clients=256, trusted_uids=None, clock=time.monotonic)
      `tokens`: tenant -> token (each tenant one the keeper has a buffer for); `hosts`: tenant ->
      PoolClient of the host pool, for that tenant's demotion (no entry: no demotion).
      .start() / .stop()     bind `path` (by default run_dir/gpu-keeper.sock, mode 0600) and serve
                             it on a thread; the maintenance thread beside it. stop() waits for
                             both, ends every session (as a hang-up: kvpool.gpu.keeper's
                             client_gone) and raises what the maintenance thread raised, if
                             anything. The keeper itself (its attach socket, its buffers) is the
                             caller's to start and stop.
      .maintain(now=None)    one maintenance round (the thread runs one every `maintenance_s`):
                             the quarantined clients whose process has exited are reaped
                             (GpuKeeper.reap_exited), reservations and leases past their TTL
                             expire (GpuTier.reap), and each tenant with a host pool demotes
                             (GpuKeeper.demote). Returns a Maintenance.
      .errors                error replies by ErrorCode (what peers sent that was refused).
      .sessions              the open sessions (client id -> KeeperSession).

A session, on the wire:
  * Who: at accept, the kernel's word on the peer (SO_PEERCRED: pid, uid; SO_PEERPIDFD where the
    kernel has it, a pidfd of the very process that connected). Its uid must be trusted (this
    user or root by default; the socket is 0600 in the private run dir anyway).
  * Hello(tenant, token, name) first, within `hello_timeout_s`, in frames of at most
    HELLO_FRAME_BYTES. A good token binds the session to its tenant and to a client id of the
    tier (HelloOk.session), registers the peer's process with the keeper (its pidfd: the
    quarantine of kvpool.gpu.tier waits for that process's exit), and answers the keeper's
    attach socket (HelloOk.arena), its instance id, the tenant's page size and pages, and a
    single-use ticket for the handout of the tenant's buffer and state segment
    (kvpool.gpu.handout). A connection says hello once.
  * Then Lookup, Acquire, Release, Reserve, Commit, Abort, Renew, Ping, Stats (the tenant's
    gpu_tier_* counters) in frames of at most kvpool.pool.protocol.CONTROL_FRAME_BYTES (no page bytes travel
    here: they are in the mapped buffer). A namespace must be the session's tenant's
    (UNAUTHENTICATED otherwise); hashes are distinct; a Release names a lease of this session, a
    Commit or Abort a reservation of this session (another session's is LEASE_LOST / INVALID
    and touches nothing). Renew moves only this session's own open reservations and leases
    (per id: the seconds ahead, or refused as not_yours / expired / unknown, left as it was;
    the hello advertises both TTLs, so a client renews as it does with the host pool). Lookup answers at once (a pending publish reads as missing).
  * Every frame gets one reply: a malformed or wrong-version frame a typed Error, and the
    connection keeps serving; a length prefix past the bound is answered OVERSIZED and that
    connection closed (its stream cannot be resynchronised). Other sessions are never affected.
  * Hang-up: the session's leases are released at once, its open reservations quarantined until
    its process has exited (GpuKeeper.client_gone), then reaped by the maintenance thread.

Every call into the tier holds GpuKeeper.tier_lock: the request handlers (on the serving thread)
and the maintenance thread never interleave on a catalog.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Collection
from pathlib import Path

from kvpool.client.pool_client import PoolClient
from kvpool.errors import (
    Busy,
    ErrorCode,
    InternalError,
    InvalidRequest,
    LeaseLost,
    OversizedFrame,
    PoolError,
    Unauthenticated,
)
from kvpool.gpu.keeper import GpuKeeper
from kvpool.pool import protocol as P
from kvpool.pool.handlers import MAX_NAMESPACE_FIELD_CHARS

SERVER_NAME = "kvgate-gpu-keeper/0.1"
HELLO_FRAME_BYTES = 8192  # a hello is at most ~1.6 KiB (kvpool.pool.protocol's name and token bounds)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5
_UCRED = struct.Struct("3i")


@dataclasses.dataclass
class KeeperSession:
    client: int
    pid: int
    uid: int
    pidfd: int | None  # SO_PEERPIDFD's, until the hello hands it to the keeper
    tenant: str | None = None
    name: str = ""


@dataclasses.dataclass(frozen=True)
class Maintenance:
    reaped: tuple[int, ...]  # clients whose quarantined reservations were freed (process exited)
    expired: tuple[int, int]  # reservations, leases past their TTL
    demoted: dict[str, dict[str, int]]  # tenant -> GpuKeeper.demote's outcomes


def peer_identity(sock: socket.socket) -> tuple[int, int, int | None]:
    """(pid, uid, pidfd or None) of the process at the other end of a Unix socket."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:  # an older kernel: the keeper opens a pidfd of `pid` at the hello
        pidfd = None
    return pid, uid, pidfd


class KeeperServer:
    def __init__(self, keeper: GpuKeeper, tokens: dict[str, str], *, path: str | os.PathLike | None = None,
                 hosts: dict[str, PoolClient] | None = None, maintenance_s: float = 0.2,
                 hello_timeout_s: float = 5.0, max_clients: int = 256,
                 trusted_uids: Collection[int] | None = None, clock=time.monotonic):  # noqa: ANN001
        unknown = set(tokens) - set(keeper.buffers)
        if unknown or not tokens:
            raise InvalidRequest(f"tokens for tenants without a buffer in this keeper: {sorted(unknown)}"
                                 if unknown else "a keeper's control plane needs at least one tenant's token")
        self.keeper = keeper
        self.tokens = dict(tokens)
        self.hosts = dict(hosts or {})
        self.path = Path(path) if path is not None else keeper.run_dir / "gpu-keeper.sock"
        self.maintenance_s = maintenance_s
        self.hello_timeout_s = hello_timeout_s
        self.max_clients = max_clients
        self.trusted_uids = frozenset({os.geteuid(), 0} if trusted_uids is None else trusted_uids)
        self.clock = clock
        self.sessions: dict[int, KeeperSession] = {}
        self.errors: collections.Counter[ErrorCode] = collections.Counter()
        self._ids = itertools.count(1)  # tier client ids; 0 is the keeper's demoter
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._maint: threading.Thread | None = None
        self._stop = threading.Event()
        self._failure: BaseException | None = None

    # -- one frame --------------------------------------------------------------------------
    def _encode(self, request_id: int, result: P.Reply) -> bytes:
        data = P.encode_reply(request_id, result)
        if len(data) - P.LENGTH.size > P.CONTROL_FRAME_BYTES:
            return self._error(request_id, InternalError(
                f"{type(result).__name__} of {len(data) - P.LENGTH.size} bytes exceeds the frame limit: not sent"))
        return data

    def _error(self, request_id: int, err: PoolError) -> bytes:
        self.errors[err.code] += 1
        return P.encode_reply(request_id, P.Error(err.code, err.message))

    def _dispatch(self, session: KeeperSession, payload: bytes) -> bytes:
        request_id = 0
        try:
            request_id, op = P.decode_request(payload)
            return self._encode(request_id, self._apply(session, op))
        except PoolError as err:
            return self._error(getattr(err, "request_id", request_id), err)
        except Exception as exc:  # noqa: BLE001 - answered as the keeper's own failure (every frame gets one reply)
            return self._error(request_id, InternalError(f"{type(exc).__name__}: {exc}"[:300]))

    def _apply(self, session: KeeperSession, op: P.Request) -> P.Reply:
        if isinstance(op, P.Hello):
            return self._hello(session, op)
        if session.tenant is None:
            raise Unauthenticated(f"{type(op).__name__} before a successful hello")
        if isinstance(op, P.Ping):
            return P.Pong()
        self._check_bounds(session, op)
        tenant, client, tier = session.tenant, session.client, self.keeper.tier
        now = self.clock()
        with self.keeper.tier_lock:
            if isinstance(op, P.Lookup):
                res = tier.lookup(tenant, op.ns, op.hashes)
                return P.LookupOk(res.hits, res.miss)
            if isinstance(op, P.Acquire):
                acq = tier.acquire(client, tenant, op.ns, op.hashes, now)
                return P.AcquireOk(acq.lease_id, acq.hits, acq.miss)
            if isinstance(op, P.Release):
                self._own_lease(session, op.lease_id)
                return P.ReleaseOk(list(tier.release(client, tenant, op.lease_id).stale))
            if isinstance(op, P.Reserve):
                res = tier.reserve(client, tenant, op.ns, op.hashes, op.lengths, now, op.boundary)
                return P.ReserveOk(res.reservation_id, list(res.slots))
            if isinstance(op, P.Commit):
                self._own_reservation(session, op.reservation_id)
                got = tier.commit(client, tenant, op.reservation_id, list(op.digests), op.kind)
                return P.CommitOk(got.committed, list(got.rejected))
            if isinstance(op, P.Abort):
                self._own_reservation(session, op.reservation_id)
                return P.AbortOk(tier.abort(client, tenant, op.reservation_id))
            if isinstance(op, P.Renew):  # only the session's own grants move (the catalog checks the client)
                got = tier.renew(client, tenant, op.reservations, op.leases, now)
                return P.RenewOk(list(got.reservations), list(got.leases))
            if isinstance(op, P.Stats):
                return P.StatsOk(tier.stats(tenant))
        raise InvalidRequest(f"{type(op).__name__} is not an operation of the GPU keeper")

    def _hello(self, session: KeeperSession, op: P.Hello) -> P.HelloOk:
        if session.tenant is not None:
            raise InvalidRequest(f"this connection is already authenticated (tenant {session.tenant!r}): a "
                                 "connection says hello once")
        expected = self.tokens.get(op.tenant)
        if expected is None or not hmac.compare_digest(expected.encode(), op.token.encode()):
            raise Unauthenticated(f"unknown tenant or bad token for tenant {op.tenant!r}")
        if session.uid not in self.trusted_uids:
            raise Unauthenticated(f"the peer runs as uid {session.uid}, not a trusted one")
        self.keeper.register_client(session.client, session.pid, session.pidfd)
        session.pidfd = None  # the keeper's now
        session.tenant, session.name = op.tenant, op.client_name
        desc = self.keeper.descriptor(op.tenant)
        cfg = self.keeper.tier.config
        return P.HelloOk(session.client, str(self.keeper.attach_path), self.keeper.instance, desc.page_size,
                         desc.num_pages, SERVER_NAME, False, self.keeper.mint_ticket(op.tenant),
                         reservation_ttl_s=cfg.reservation_ttl_s, lease_ttl_s=cfg.lease_ttl_s)

    @staticmethod
    def _check_bounds(session: KeeperSession, op: P.Request) -> None:
        if isinstance(op, (P.Lookup, P.Acquire, P.Reserve)):
            if op.ns.tenant != session.tenant:
                raise Unauthenticated(f"session of tenant {session.tenant!r} cannot use namespace of tenant "
                                      f"{op.ns.tenant!r}")
            for name in op.ns.__struct_fields__:
                value = getattr(op.ns, name)
                if isinstance(value, str) and len(value) > MAX_NAMESPACE_FIELD_CHARS:
                    raise InvalidRequest(f"namespace field {name} of {len(value)} characters (at most "
                                         f"{MAX_NAMESPACE_FIELD_CHARS})")
            if len(set(op.hashes)) != len(op.hashes):
                raise InvalidRequest("a block hash named twice in one request")
        elif isinstance(op, P.Renew):
            for what, ids in (("reservation id", op.reservations), ("lease id", op.leases)):
                if len(set(ids)) != len(ids):
                    raise InvalidRequest(f"a {what} named twice in one request")

    def _own_lease(self, session: KeeperSession, lease_id: int) -> None:
        """The peer check of a release: only the session the lease was granted to ends it."""
        if not self.keeper.tier.holds_lease(session.client, session.tenant, lease_id):
            raise LeaseLost(f"lease {lease_id} is not held by this session")

    def _own_reservation(self, session: KeeperSession, reservation_id: int) -> None:
        """The peer check of a commit or abort: only the session that reserved the pages."""
        if not self.keeper.tier.holds_reservation(session.client, session.tenant, reservation_id):
            raise InvalidRequest(f"reservation {reservation_id} is not open in this session")

    # -- one connection ---------------------------------------------------------------------
    def _frame_limit(self, session: KeeperSession) -> int:
        return HELLO_FRAME_BYTES if session.tenant is None else P.CONTROL_FRAME_BYTES

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid, pidfd = peer_identity(writer.get_extra_info("socket"))
        session = KeeperSession(next(self._ids), pid, uid, pidfd)
        try:
            if len(self.sessions) >= self.max_clients:
                writer.write(self._error(0, Busy(f"{len(self.sessions)} sessions open (at most "
                                                 f"{self.max_clients})")))
                await writer.drain()
                return
            self.sessions[session.client] = session
            hello_by = asyncio.get_running_loop().time() + self.hello_timeout_s
            while True:
                try:
                    # before the hello, the whole frame (header and body) within the hello's deadline
                    async with asyncio.timeout_at(hello_by if session.tenant is None else None):
                        header = await reader.readexactly(P.LENGTH.size)
                        (n,) = P.LENGTH.unpack(header)
                        limit = self._frame_limit(session)
                        if n > limit:
                            writer.write(self._error(0, OversizedFrame(f"a frame of {n} bytes, at most {limit} "
                                                                       f"here")))
                            await writer.drain()
                            return  # the stream cannot be resynchronised
                        payload = await reader.readexactly(n)
                except TimeoutError:
                    writer.write(self._error(0, Unauthenticated(f"no hello within {self.hello_timeout_s}s")))
                    await writer.drain()
                    return
                writer.write(self._dispatch(session, payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the peer hung up (mid-frame or between frames)
        finally:
            self.sessions.pop(session.client, None)
            writer.close()
            if session.pidfd is not None:
                os.close(session.pidfd)
            if session.tenant is not None:
                self.keeper.client_gone(session.client)

    # -- maintenance ------------------------------------------------------------------------
    def maintain(self, now: float | None = None) -> Maintenance:
        now = self.clock() if now is None else now
        reaped = tuple(self.keeper.reap_exited())
        with self.keeper.tier_lock:
            expired = self.keeper.tier.reap(now)
        demoted = {tenant: self.keeper.demote(tenant, host, now) for tenant, host in self.hosts.items()}
        return Maintenance(reaped, expired, demoted)

    def _maintenance(self) -> None:
        try:
            while not self._stop.wait(self.maintenance_s):
                self.maintain()
        except BaseException as exc:  # raised again by stop(), in the thread that started it
            self._failure = exc
            raise

    # -- serving ----------------------------------------------------------------------------
    def start(self) -> KeeperServer:
        if self.path.exists():
            self.path.unlink()  # a socket a crashed keeper left behind (the run dir is private)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, 0o600)
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        started: list[BaseException] = []

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                server = self._loop.run_until_complete(asyncio.start_unix_server(self._connection, sock=listener))
            except BaseException as exc:  # raised once, in the starting thread
                started.append(exc)
                ready.set()
                return
            ready.set()
            try:
                self._loop.run_forever()
            finally:
                server.close()
                for task in asyncio.all_tasks(self._loop):
                    task.cancel()
                self._loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(self._loop),
                                                             return_exceptions=True))
                self._loop.run_until_complete(server.wait_closed())
                self._loop.close()

        self._thread = threading.Thread(target=serve, name="gpu-keeper-control", daemon=True)
        self._thread.start()
        ready.wait()
        if started:
            self._thread.join()
            self._thread = None
            raise started[0]
        self._stop.clear()
        self._maint = threading.Thread(target=self._maintenance, name="gpu-keeper-maintenance", daemon=True)
        self._maint.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._maint is not None:
            self._maint.join()
            self._maint = None
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._thread = self._loop = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def __enter__(self) -> KeeperServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
