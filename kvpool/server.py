"""The pool daemon: owns the catalog and the arena, serves the wire protocol.

  PoolConfig                   frozen configuration (geometry, addresses, tenants, limits).
  PoolDaemon(config).run()     serve until SIGTERM / SIGINT, then free the shared memory.
  PoolDaemon.start_thread()    the same daemon in a background thread (tests, benches);
                               returns a handle whose .stop() shuts it down gracefully.

Contracts:
  * Unix socket and TCP (loopback by default), one asyncio loop; catalog mutations run
    on the loop thread only, page hashing for verify runs in a bounded thread pool.
  * Every frame gets exactly one reply. A malformed, wrong-version or unauthenticated
    frame is answered with a typed Error and the connection stays usable; an oversized
    length prefix is answered and that connection is closed (its stream cannot be
    resynchronised). Other clients are never affected.
  * Bounded: at most `max_clients` authenticated connections and `max_queue` requests
    waiting for the thread pool; past either the reply is BUSY. Before its hello a
    connection takes no client slot: at most `max_unauthenticated` of them (a new one
    closes the oldest, with a BUSY error), each frame at most `max_hello_frame` bytes (a
    larger length prefix is answered and the connection closed before its bytes are
    read), and one that has not authenticated within `hello_timeout_s` gets an
    Unauthenticated error and is closed.
  * A client's open reservations and leases are dropped when its connection closes,
    and expire after their TTL in any case (an abandoned publish is reclaimed).
  * A lookup with `wait_pending_ms` whose first missing block is being published (an
    open reservation of the same tenant and namespace; never another tenant's) is
    parked on that reservation, not the loop: it is woken when the reservation closes
    (commit, abort, its publisher's connection dropping, its TTL), looks up again and
    waits for a publish further on within the same bound (capped by
    `max_lookup_wait_s`). A bound that runs out answers MissCause.IN_FLIGHT, counted
    with the other misses; waits are counted and timed (stats `lookup_waits`,
    `lookup_wait_us`, `lookup_waiting`; metrics kvpool_lookup_waits{result},
    kvpool_lookup_wait_seconds). A waiting lookup whose client disconnects is dropped.
  * Pool-wide operations (SetCapacity, Metrics, the pool's Stats) are for admin tenants
    (`admins`; by default the only tenant of a single-tenant pool). Another tenant's
    Stats counts only its own pages; its SetCapacity or Metrics is refused as
    Unauthenticated.
  * Start-up finds what a crashed daemon left (pid file, shared-memory segment),
    removes it and says so; graceful shutdown removes segment, socket and pid file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import inspect
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop

from kvpool import protocol as P
from kvpool.arena import Arena
from kvpool.catalog import AdmissionPolicy, Catalog, CatalogConfig, LookupResult, LoadLimits, Miss
from kvpool.digest import page_digest
from kvpool.errors import (
    Busy,
    ErrorCode,
    InvalidRequest,
    LeaseLost,
    MissCause,
    OversizedFrame,
    PoolError,
    Unauthenticated,
)
from kvpool.metrics import PoolMetrics

log = logging.getLogger("kvpool.server")
SERVER_NAME = "kvgate-pool/0.1"


def default_run_dir(name: str) -> Path:
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvgate-{os.getuid()}")
    return base / name


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    name: str = "kvgate-pool"  # shared-memory segment name and run-dir name
    page_size: int = 64 * 1024
    num_pages: int = 4096
    run_dir: Path | None = None  # pid file, Unix socket, address.json
    unix_socket: bool = True
    tcp_host: str | None = "127.0.0.1"
    tcp_port: int = 0  # 0: pick a free port (written to address.json)
    tenants: Mapping[str, str] = dataclasses.field(default_factory=dict)  # tenant -> token
    max_frame: int = P.DEFAULT_MAX_FRAME
    max_clients: int = 256
    max_queue: int = 64
    io_threads: int = 2
    admission: AdmissionPolicy = AdmissionPolicy()
    limits: LoadLimits = LoadLimits()
    reservation_ttl_s: float = 30.0
    lease_ttl_s: float = 60.0
    reap_interval_s: float = 0.5
    max_lookup_wait_s: float = 2.0  # cap on a lookup's wait for a pending publish (Lookup.wait_pending_ms)
    # Before a successful hello a connection costs the daemon little and not for long:
    hello_timeout_s: float = 5.0  # it is closed (after a typed error) if no hello succeeds by then
    max_hello_frame: int = 4096  # its largest frame: a bigger length prefix is refused before any byte of it
    max_unauthenticated: int = 64  # connections awaiting their hello, at most; past it the oldest is closed
    # Tenants allowed the pool-wide operations (capacity, pool-wide stats and metrics); none
    # named: the only tenant of a single-tenant pool, and nobody in a pool of several.
    admins: frozenset[str] = frozenset()

    def is_admin(self, tenant: str) -> bool:
        if self.admins:
            return tenant in self.admins
        return len(self.tenants) == 1 and tenant in self.tenants

    def resolved_run_dir(self) -> Path:
        return self.run_dir if self.run_dir is not None else default_run_dir(self.name)


@dataclasses.dataclass
class _Session:
    client: int
    peer: str
    tenant: str | None = None
    name: str = ""
    waiting: bool = False  # a lookup of this session is parked on a pending publish


class PoolAlreadyRunning(PoolError):
    """Another live daemon owns this name."""


class PoolDaemon:
    def __init__(self, config: PoolConfig, catalog_factory: type[Catalog] = Catalog):
        if not config.tenants:
            raise InvalidRequest("a pool needs at least one tenant token (PoolConfig.tenants)")
        self.config = config
        self._catalog_factory = catalog_factory
        self.run_dir = config.resolved_run_dir()
        self.metrics = PoolMetrics()
        self.restarted_after_crash = False
        self.recovery_note = ""
        self.arena: Arena | None = None
        self.catalog: Catalog | None = None
        self.unix_path: Path | None = None
        self.tcp_port: int | None = None
        self._sessions = itertools.count(1)
        self._clients: dict[int, asyncio.StreamWriter] = {}  # authenticated connections
        self._unauthenticated: dict[int, _Connection] = {}  # connections still to say hello
        self._queued = 0
        self._lease_started: dict[int, float] = {}
        # reservation id -> futures of the lookups parked on it, resolved when it closes
        self._parked: dict[int, list[asyncio.Future]] = {}
        self._wait_counts = {"lookup_waits": 0, "lookup_wait_us": 0, "lookup_waiting": 0}
        self._executor: ThreadPoolExecutor | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()

    # -- start-up and recovery -----------------------------------------------------------
    def _recover_and_create(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        pid_file = self.run_dir / "pid"
        notes = []
        if pid_file.exists():
            old = _read_pid(pid_file)
            if old is not None and old != os.getpid() and _alive(old):
                raise PoolAlreadyRunning(f"pool {self.config.name!r} is served by live pid {old} ({pid_file})")
            notes.append(f"previous daemon (pid {old}) did not shut down cleanly")
            pid_file.unlink()
        if Arena.exists(self.config.name):
            size = os.stat(f"/dev/shm/{self.config.name}").st_size
            Arena.unlink(self.config.name)
            notes.append(f"discarded its shared-memory arena /dev/shm/{self.config.name} ({size} bytes)")
        sock = self.run_dir / "pool.sock"
        if sock.exists():
            sock.unlink()
            notes.append("removed its stale socket")
        if notes:
            self.restarted_after_crash = True
            self.recovery_note = "; ".join(notes) + "; starting with an empty pool"
            log.warning("kvgate pool %s: %s", self.config.name, self.recovery_note)
        self.arena = Arena.create(self.config.name, self.config.page_size, self.config.num_pages)
        pid_file.write_text(str(os.getpid()))
        cfg = self.config
        self.catalog = self._catalog_factory(
            CatalogConfig(num_pages=cfg.num_pages, page_size=cfg.page_size, admission=cfg.admission,
                          limits=cfg.limits, reservation_ttl_s=cfg.reservation_ttl_s,
                          lease_ttl_s=cfg.lease_ttl_s),
            generations=self.arena._gens,
        )

    def _cleanup(self) -> None:
        if self.arena is not None:
            self.catalog = None  # drops the generation view into the arena
            with contextlib.suppress(PoolError):  # views still held: unlink frees it anyway
                self.arena.close()
            Arena.unlink(self.config.name)
            self.arena = None
        for name in ("pool.sock", "address.json", "pid"):
            (self.run_dir / name).unlink(missing_ok=True)

    # -- running -------------------------------------------------------------------------
    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._recover_and_create()
        self._executor = ThreadPoolExecutor(max_workers=self.config.io_threads, thread_name_prefix="kvpool-io")
        try:
            if self.config.unix_socket:
                self.unix_path = self.run_dir / "pool.sock"
                self._servers.append(await self._loop.create_unix_server(self._protocol, path=str(self.unix_path)))
                os.chmod(self.unix_path, 0o600)
            if self.config.tcp_host is not None:
                srv = await self._loop.create_server(self._protocol, host=self.config.tcp_host,
                                                     port=self.config.tcp_port)
                self.tcp_port = srv.sockets[0].getsockname()[1]
                self._servers.append(srv)
            self._write_address()
            reaper = asyncio.create_task(self._reap())
            self.ready.set()
            await self._stop.wait()
            reaper.cancel()
            for srv in self._servers:
                srv.close()
            for conn in [*self._clients.values(), *self._unauthenticated.values()]:
                conn.close()
            for srv in self._servers:
                await srv.wait_closed()
        finally:
            self._executor.shutdown(wait=True)
            self._cleanup()
            self.ready.set()

    def address(self) -> dict[str, object]:
        return {
            "name": self.config.name,
            "unix": str(self.unix_path) if self.unix_path else None,
            "tcp": f"{self.config.tcp_host}:{self.tcp_port}" if self.tcp_port else None,
            "arena": self.config.name,
            "pid": os.getpid(),
            "restarted_after_crash": self.restarted_after_crash,
            "recovery_note": self.recovery_note,
        }

    def _write_address(self) -> None:
        tmp = self.run_dir / "address.json.tmp"
        tmp.write_text(json.dumps(self.address()))
        tmp.replace(self.run_dir / "address.json")

    def stop(self) -> None:
        """Ask the serving loop to shut down (thread-safe)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def run(self) -> None:
        """Serve in this thread until SIGTERM or SIGINT."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
            await self.serve()

        uvloop.run(main())

    def start_thread(self) -> PoolDaemon:
        error: list[BaseException] = []

        def target() -> None:
            try:
                uvloop.run(self.serve())
            except BaseException as exc:  # re-raised in the starting thread below
                error.append(exc)
                self.ready.set()
                raise

        self._thread = threading.Thread(target=target, name=f"kvpool-{self.config.name}", daemon=True)
        self._thread.start()
        self.ready.wait()
        if error:
            raise error[0]
        return self

    def stop_thread(self, timeout: float = 10.0) -> None:
        self.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"pool daemon {self.config.name!r} did not stop within {timeout}s")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            assert self.catalog is not None
            self.catalog.reap(time.monotonic())
            self._wake_closed()

    # -- connections ---------------------------------------------------------------------
    def _protocol(self) -> _Connection:
        return _Connection(self)

    def _dispatch(self, session: _Session, payload: bytes) -> bytes | Awaitable[bytes]:
        """The encoded reply, or an awaitable of it for ops whose work leaves the loop."""
        request_id = 0
        op_name = "frame"
        try:
            request_id, op = P.decode_request(payload)
            op_name = type(op).__name__.lower()
            result = self._apply(session, op)
            if inspect.isawaitable(result):
                return self._finish(request_id, op_name, result)
            self.metrics.requests.labels(op_name, "ok").inc()
            return P.encode_reply(request_id, result)
        except PoolError as err:
            return self._error(getattr(err, "request_id", request_id), op_name, err)

    async def _finish(self, request_id: int, op_name: str, pending: Awaitable[P.Reply]) -> bytes:
        try:
            result = await pending
        except PoolError as err:
            return self._error(request_id, op_name, err)
        self.metrics.requests.labels(op_name, "ok").inc()
        return P.encode_reply(request_id, result)

    def _error(self, request_id: int, op_name: str, err: PoolError) -> bytes:
        self.metrics.requests.labels(op_name, err.code.value).inc()
        return P.encode_reply(request_id, P.Error(err.code, err.message))

    def _apply(self, session: _Session, op: P.Request) -> P.Reply | Awaitable[P.Reply]:
        cat = self.catalog
        assert cat is not None and self.arena is not None
        if isinstance(op, P.Hello):
            expected = self.config.tenants.get(op.tenant)
            if expected is None or not hmac.compare_digest(expected.encode(), op.token.encode()):
                raise Unauthenticated(f"unknown tenant or bad token for tenant {op.tenant!r}")
            session.tenant, session.name = op.tenant, op.client_name
            return P.HelloOk(session.client, self.arena.name, self.arena.instance, self.arena.page_size,
                             self.arena.num_pages, SERVER_NAME, self.restarted_after_crash)
        if session.tenant is None:
            raise Unauthenticated(f"{type(op).__name__} before a successful hello")
        tenant = session.tenant
        now = time.monotonic()
        if isinstance(op, P.Ping):
            return P.Pong()
        if isinstance(op, P.Lookup):
            self._check_tenant(op.ns, tenant)
            res = cat.lookup(tenant, op.ns, op.hashes)
            wait_s = min(op.wait_pending_ms / 1000, self.config.max_lookup_wait_s)
            if res.pending and wait_s > 0:
                session.waiting = True
                return self._lookup_waiting(session, op, res, wait_s)
            return P.LookupOk(res.hits, res.miss)
        if isinstance(op, P.Acquire):
            self._check_tenant(op.ns, tenant)
            acq = cat.acquire(session.client, tenant, op.ns, op.hashes, now)
            if acq.lease_id:
                self._lease_started[acq.lease_id] = now
                self.metrics.hits.labels("remote").inc()
                self.metrics.hit_blocks.inc(len(acq.hits))
                self.metrics.bytes_read.inc(acq.hits.total_bytes)
            if acq.miss is not None:
                self.metrics.misses.labels(acq.miss.cause.value).inc()
            return P.AcquireOk(acq.lease_id, acq.hits, acq.miss)
        if isinstance(op, P.Release):
            self._own_lease(session, op.lease_id)
            rel = cat.release(op.lease_id)
            started = self._lease_started.pop(op.lease_id, None)
            if started is not None:
                self.metrics.lease_seconds.observe(now - started)
            return P.ReleaseOk(list(rel.stale))
        if isinstance(op, P.Reserve):
            self._check_tenant(op.ns, tenant)
            evictions = cat.counters["evictions"]
            res = cat.reserve(session.client, tenant, op.ns, op.hashes, op.lengths, now, op.boundary)
            self.metrics.evictions.inc(cat.counters["evictions"] - evictions)
            return P.ReserveOk(res.reservation_id, list(res.slots))
        if isinstance(op, P.WritePages):
            return self._write_pages(session, op)
        if isinstance(op, P.Commit):
            return self._commit(session, op)
        if isinstance(op, P.Abort):
            self._own_reservation(session, op.reservation_id)
            freed = cat.abort(op.reservation_id)
            self._wake_closed()
            return P.AbortOk(freed)
        if isinstance(op, P.ReadPages):
            return self._read_pages(session, op)
        if isinstance(op, P.Evict):
            self._check_tenant(op.ns, tenant)
            outcomes = cat.evict(tenant, op.ns, op.hashes)
            self.metrics.evictions.inc(sum(o == "evicted" for o in outcomes))
            return P.EvictOk(outcomes)
        if isinstance(op, (P.SetCapacity, P.Stats, P.Metrics)) and not self.config.is_admin(tenant):
            if isinstance(op, P.Stats):  # a tenant sees its own pages, never the pool's or another tenant's
                return P.StatsOk(cat.tenant_stats(tenant))
            raise Unauthenticated(f"{type(op).__name__} is a pool-wide operation: tenant {tenant!r} is not an "
                                  "admin of this pool")
        if isinstance(op, P.SetCapacity):
            evicted = cat.set_capacity(op.pages)
            self.metrics.evictions.inc(evicted)
            return P.CapacityOk(evicted)
        if isinstance(op, P.Stats):
            return P.StatsOk({**cat.stats(), **self._wait_counts})
        if isinstance(op, P.Metrics):
            self.metrics.refresh(cat.stats())
            return P.MetricsOk(self.metrics.exposition())
        raise InvalidRequest(f"unhandled op {type(op).__name__}")

    # -- lookups that wait for a pending publish -------------------------------------------
    async def _lookup_waiting(self, session: _Session, op: P.Lookup, res: LookupResult,
                              wait_s: float) -> P.LookupOk:
        """Park until the first missing block's publish closes, look up again; repeat
        while the answer stops at a pending block, until `wait_s` has passed."""
        loop = self._loop
        t0 = loop.time()
        deadline = t0 + wait_s
        result = "abandoned"  # unless it returns: cancelled because its client went away
        self._wait_counts["lookup_waiting"] += 1
        try:
            while res.pending:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    result = MissCause.IN_FLIGHT.value
                    assert res.miss is not None  # a pending reservation is always at the first miss
                    self.catalog.count_miss(MissCause.IN_FLIGHT)
                    self.metrics.misses.labels(MissCause.IN_FLIGHT.value).inc()
                    return P.LookupOk(res.hits, Miss(res.miss.index, MissCause.IN_FLIGHT))
                await self._until_closed(res.pending, remaining)
                res = self.catalog.lookup(session.tenant, op.ns, op.hashes)
            result = "settled"
            return P.LookupOk(res.hits, res.miss)
        finally:
            waited = loop.time() - t0
            session.waiting = False
            self._wait_counts["lookup_waiting"] -= 1
            self._wait_counts["lookup_waits"] += 1
            self._wait_counts["lookup_wait_us"] += round(waited * 1e6)
            self.metrics.lookup_waits.labels(result).inc()
            self.metrics.lookup_wait_seconds.observe(waited)

    async def _until_closed(self, reservation_id: int, timeout: float) -> None:
        """Return when the reservation closes (see _wake_closed) or `timeout` passes."""
        parked = self._loop.create_future()
        self._parked.setdefault(reservation_id, []).append(parked)
        try:
            await asyncio.wait((parked,), timeout=timeout)
        finally:
            if not parked.done():  # timed out or cancelled: unpark
                parked.cancel()
                others = self._parked.get(reservation_id)
                if others is not None:
                    others.remove(parked)
                    if not others:
                        del self._parked[reservation_id]

    def _wake_closed(self) -> None:
        """Wake the lookups parked on reservations that are no longer open. Called after
        every catalog call that can close one: commit, abort, drop_client, reap."""
        if not self._parked:
            return
        cat = self.catalog
        for rid in [r for r in self._parked if not cat.reservation_open(r)]:
            for parked in self._parked.pop(rid):
                if not parked.done():
                    parked.set_result(None)

    @staticmethod
    def _check_tenant(ns, tenant: str) -> None:  # noqa: ANN001
        if ns.tenant != tenant:
            raise Unauthenticated(f"session of tenant {tenant!r} cannot use namespace of tenant {ns.tenant!r}")

    def _own_lease(self, session: _Session, lease_id: int) -> list[int]:
        lease = self.catalog._leases.get(lease_id)  # noqa: SLF001 - the daemon owns the catalog
        if lease is None or lease.client != session.client:
            raise LeaseLost(f"lease {lease_id} is not held by this session")
        return lease.pages

    def _own_reservation(self, session: _Session, reservation_id: int) -> list[int]:
        res = self.catalog._reservations.get(reservation_id)  # noqa: SLF001
        if res is None or res.client != session.client:
            raise InvalidRequest(f"reservation {reservation_id} is not open in this session")
        return res.pages

    async def _offload(self, fn, *args):  # noqa: ANN001, ANN202
        if self._queued >= self.config.max_queue:
            raise Busy(f"{self._queued} requests already queued (limit {self.config.max_queue})")
        self._queued += 1
        try:
            return await self._loop.run_in_executor(self._executor, fn, *args)
        finally:
            self._queued -= 1

    async def _commit(self, session: _Session, op: P.Commit) -> P.CommitOk:
        pages = self._own_reservation(session, op.reservation_id)
        if len(op.digests) != len(pages):
            raise InvalidRequest(f"{len(op.digests)} digests for {len(pages)} reserved pages")
        arena, cat = self.arena, self.catalog
        lengths = [int(cat.length[p]) for p in pages]

        def verify() -> list[bytes | None]:
            return [page_digest(arena.page(p, n)) for p, n in zip(pages, lengths)]

        actual = await self._offload(verify)
        # The reservation may have expired while hashing; commit re-checks it.
        digests = [a if hmac.compare_digest(a, c) else None for a, c in zip(actual, op.digests)]
        res = cat.commit(op.reservation_id, digests)
        self._wake_closed()
        self.metrics.bytes_written.inc(sum(n for n, d in zip(lengths, digests) if d is not None))
        return P.CommitOk(res.committed, list(res.rejected))

    async def _write_pages(self, session: _Session, op: P.WritePages) -> P.WriteOk:
        pages = self._own_reservation(session, op.reservation_id)
        if len(op.slots) != len(op.data):
            raise InvalidRequest(f"{len(op.slots)} slots but {len(op.data)} payloads")
        targets = []
        for slot, data in zip(op.slots, op.data):
            if not 0 <= slot < len(pages):
                raise InvalidRequest(f"slot {slot} outside reservation of {len(pages)} pages")
            expected = int(self.catalog.length[pages[slot]])
            if len(data) != expected:
                raise InvalidRequest(f"slot {slot}: {len(data)} bytes, reserved {expected}")
            targets.append((pages[slot], data))
        arena = self.arena

        def write() -> int:
            for page, data in targets:
                arena.page(page, len(data))[:] = memoryview(data)
            return len(targets)

        return P.WriteOk(await self._offload(write))

    async def _read_pages(self, session: _Session, op: P.ReadPages) -> P.PagesOk:
        pages = self._own_lease(session, op.lease_id)
        targets = []
        for i in op.indexes:
            if not 0 <= i < len(pages):
                raise InvalidRequest(f"index {i} outside lease of {len(pages)} pages")
            targets.append((pages[i], int(self.catalog.length[pages[i]])))
        arena = self.arena
        return P.PagesOk(await self._offload(lambda: [arena.page(p, n).tobytes() for p, n in targets]))


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_address(run_dir: Path, timeout: float = 10.0) -> dict[str, object]:
    """Wait for a daemon in `run_dir` to publish its address.json; return it."""
    deadline = time.monotonic() + timeout
    path = run_dir / "address.json"
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.02)
    raise TimeoutError(f"no pool daemon published {path} within {timeout}s")


def main_serve(config: PoolConfig, catalog_factory: type[Catalog] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    daemon = PoolDaemon(config) if catalog_factory is None else PoolDaemon(config, catalog_factory=catalog_factory)
    try:
        daemon.run()
    except PoolAlreadyRunning as exc:
        print(f"kvpool serve: {exc}", file=sys.stderr)
        return 2
    return 0



class _Connection(asyncio.Protocol):
    """One client connection: frames are answered in order, one at a time. Ops whose work
    runs in the thread pool pause reading until their reply is written; a client that
    does not read its replies pauses reading too (the kernel buffers bound the queue).
    A lookup parked on a pending publish keeps reading, so that its client's hang-up is
    seen at once (and the lookup dropped); what the client sends meanwhile is buffered,
    up to one maximal frame, then reading pauses as for any other op."""

    def __init__(self, daemon: PoolDaemon):
        self.daemon = daemon
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.session: _Session | None = None
        self.pending: asyncio.Future | None = None
        self.closed = False
        self.write_paused = False
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        d = self.daemon
        self.transport = transport  # type: ignore[assignment]
        self.session = _Session(next(d._sessions), str(transport.get_extra_info("peername") or "unix"))
        if len(d._unauthenticated) >= d.config.max_unauthenticated:
            # Full of connections that have not said who they are: the oldest goes, so that a
            # flood of idle ones cannot keep a client that says hello at once from getting in.
            oldest = d._unauthenticated.pop(next(iter(d._unauthenticated)))
            d.metrics.requests.labels("connect", ErrorCode.BUSY.value).inc()
            oldest.transport.write(d._error(0, "hello", Busy(
                f"{d.config.max_unauthenticated} connections awaiting their hello: the oldest is closed")))
            oldest.close()
        d._unauthenticated[self.session.client] = self
        self._hello_timer = asyncio.get_running_loop().call_later(d.config.hello_timeout_s, self._hello_expired)

    def _hello_expired(self) -> None:
        if self.closed or self.session is None or self.session.tenant is not None:
            return
        d = self.daemon
        err = Unauthenticated(f"no successful hello within {d.config.hello_timeout_s} s")
        self.transport.write(d._error(0, "hello", err))
        self.close()

    def _authenticated(self) -> None:
        """The hello succeeded: the connection leaves the pre-auth pool for a client slot."""
        d = self.daemon
        d._unauthenticated.pop(self.session.client, None)
        d._clients[self.session.client] = self
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.pending is not None and len(self.buf) > self.daemon.config.max_frame + P.LENGTH.size:
            self.transport.pause_reading()  # pipelined behind a parked lookup: bound the buffer
        self._pump()

    def _pump(self) -> None:
        d = self.daemon
        while self.pending is None and not self.closed and not self.write_paused:
            if len(self.buf) < P.LENGTH.size:
                return
            (n,) = P.LENGTH.unpack_from(self.buf)
            pre_auth = self.session.tenant is None
            limit = d.config.max_hello_frame if pre_auth else d.config.max_frame
            if n > limit:
                err = OversizedFrame(f"frame of {n} bytes exceeds the limit of {limit}"
                                     + (" before a successful hello" if pre_auth else ""))
                self.transport.write(d._error(0, "frame", err))
                self.close()
                return
            if len(self.buf) < P.LENGTH.size + n:
                return
            payload = bytes(self.buf[P.LENGTH.size : P.LENGTH.size + n])
            del self.buf[: P.LENGTH.size + n]
            if pre_auth and len(d._clients) >= d.config.max_clients:
                self._refuse(payload)  # no client slot for it: BUSY, then closed
                return
            reply = d._dispatch(self.session, payload)
            if pre_auth and self.session.tenant is not None:
                self._authenticated()
            if isinstance(reply, bytes):
                self.transport.write(reply)
                continue
            if not self.session.waiting:
                self.transport.pause_reading()
            self.pending = asyncio.ensure_future(reply)
            self.pending.add_done_callback(self._replied)

    def _replied(self, task: asyncio.Future) -> None:
        self.pending = None
        if self.closed or task.cancelled():
            return
        self.transport.write(task.result())  # _finish turns every PoolError into a reply
        if not self.write_paused:
            self.transport.resume_reading()
        self._pump()

    def _refuse(self, payload: bytes) -> None:
        request_id = 0
        with contextlib.suppress(PoolError):
            request_id = P.decode_request(payload)[0]
        d = self.daemon
        err = Busy(f"too many clients (limit {d.config.max_clients})")
        self.transport.write(d._error(request_id, "connect", err))
        self.close()

    def pause_writing(self) -> None:
        self.write_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.pending is None:
            self.transport.resume_reading()
        self._pump()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        d = self.daemon
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self.session is not None:
            d._unauthenticated.pop(self.session.client, None)
        if self.session is not None:
            d._clients.pop(self.session.client, None)
            if self.session.waiting and self.pending is not None:
                self.pending.cancel()  # a lookup parked on a pending publish: nobody reads its answer
            if d.catalog is not None:
                d.catalog.drop_client(self.session.client)
                d._wake_closed()
