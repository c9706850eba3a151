"""The pool daemon: owns each tenant's catalog and arena, serves the wire protocol.

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
  * Bounded per frame: after a hello a frame, either way, is at most `frame_limit` bytes
    (by default kvpool.pool.protocol.frame_limit(page_size): 16 pages and 4 MiB for the rest);
    every list a request carries has a static bound (kvpool.pool.protocol: 65536 blocks, 16
    pages) checked by the decoder before its elements are read, and names each block hash,
    lease index or reservation slot at most once, within what the session holds (indexes
    within its lease, slots within its reservation, one digest per reserved page); a
    namespace's text fields are at most 1024 characters. Anything else is MALFORMED or
    INVALID and does nothing; no reply over the frame limit is sent (INTERNAL instead). A
    connection says hello once (each hello mints an attach ticket): a second is INVALID.
  * Commit by digest kind (kvpool.pool.digest): xxh3-128 pages are re-hashed in the thread
    pool before they become visible (a mismatch is rejected, never visible; with
    `verify_commits` off they are trusted like kv-sketch-1 pages); kv-sketch-1 pages
    (taken by a GPU over the KV it copied) are trusted at commit. Loaders verify every
    page they install whatever its kind.
  * The scrub, at rest, on a thread of its own, one round per `scrub_interval_s` per
    tenant segment: first up to `scrub_pages_per_round` commits taken on trust and not
    yet scrubbed (the fresh queue: at most one entry per page of the segment, an evicted
    page's entry removed with it), then the next `scrub_rest_pages_per_round` committed
    pages of a cyclic cursor over the page ids (every page of every digest kind, O(1)
    memory; by default `scrub_rest_bytes_per_s`, 8 MiB/s, worth of pages a round, at least
    one). With the defaults, at 64 KiB pages: 320 fresh pages/s, and 6 pages a round at
    rest, 120 pages/s: a page corrupted at rest is found within one cycle, num_pages / 120
    s (34 s for 4,096 pages); at 512 KiB pages, 1 page a round, 20 pages/s. A page whose
    bytes no longer match its digest is dropped (Catalog.discard). Stats: `scrub_queued`
    (fresh entries, at most `scrub_queue_bound`, the segment's pages), `scrubbed_pages`,
    `scrub_corrupt`, `scrub_gone` (freed before their turn), `scrub_cycles`.
  * A loader whose digest check refuses a leased page reports it (ReportCorrupt: indexes
    of its own lease, each at most once). The daemon does not take its word: it re-hashes
    the page at rest in the thread pool and, only if the bytes there do not match, drops
    the page and its index entry at once (a later lookup misses as `evicted`); bytes that
    match mean the copy went wrong on the loader's side, and the page stays (a buggy or
    hostile loader cannot empty its tenant's pool of good pages this way, nor cost the
    daemon more than a read of the pages it already leases). Stats `report_dropped`,
    `report_intact`.
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
  * Tenants are apart in the data plane too: each has its own arena segment (an
    anonymous, size-sealed memfd of its quota of pages, `quotas`; the tenants not named
    there share the rest of `num_pages` evenly) and its own catalog, so its pages, page
    ids, eviction, ghosts, lease and reservation ids, lookup waits and stats are its own
    and another tenant's load cannot evict them. No segment has a name in /dev/shm: a
    client on the daemon's host gets its tenant's two segments (kvpool.pool.arena: the pages,
    and the daemon's private state sealed read-only) as file descriptors over the attach
    socket (run_dir/attach.sock), in exchange for the single-use ticket of its hello
    (valid for `hello_timeout_s`; at most `max_unauthenticated` attach connections at
    once, the oldest closed past it). A client elsewhere (or refused the descriptors)
    moves page bytes in frames. The index a probe reads, the generations and the
    heartbeat are written by the daemon only: its clients can map them read-only and in
    no other way (`arena_factory` makes the segments: kvpool.pool.arena.Arena.anonymous).
  * The run dir (default $XDG_RUNTIME_DIR/NAME, else /tmp/kvgate-$UID/NAME) is created or
    checked with every directory above it (kvpool.pool.private_dir.ensure_private_dir): each
    owned by the daemon's user or root, none writable by another user (but sticky /tmp),
    no link another user owns, the run dir itself the daemon's and mode 0700; otherwise
    start-up is refused (InsecureRunDir naming the directory and why).
  * Start-up finds what a crashed daemon left (pid file, sockets), removes it and says so
    (its segments went with its last mapping); graceful shutdown removes the sockets and
    the pid file.
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
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop
from prometheus_client import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

from kvpool.pool import protocol as P
from kvpool.pool.arena import Arena, segment_label
from kvpool.pool.catalog import AdmissionPolicy, Catalog, CatalogConfig, CorruptOutcome, LookupResult, LoadLimits, Miss
from kvpool.pool.digest import page_digest
from kvpool.pool.index import ShmIndex
from kvpool.errors import (
    Busy,
    ErrorCode,
    InternalError,
    InvalidRequest,
    LeaseLost,
    MissCause,
    OversizedFrame,
    PoolError,
    Unauthenticated,
)
from kvpool.pool.metrics import PoolMetrics
from kvpool.pool.private_dir import InsecureDirectory, ensure_private_dir

log = logging.getLogger("kvpool.pool.daemon")
SERVER_NAME = "kvgate-pool/0.1"
_TICKET_BYTES = 16


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
    # The largest frame after a hello, either way (requests and replies); 0: derived from the
    # page size, kvpool.pool.protocol.frame_limit (16 pages and 4 MiB for everything else).
    max_frame: int = 0
    max_clients: int = 256
    max_queue: int = 64
    io_threads: int = 2
    admission: AdmissionPolicy = AdmissionPolicy()
    limits: LoadLimits = LoadLimits()
    reservation_ttl_s: float = 30.0
    lease_ttl_s: float = 60.0
    reap_interval_s: float = 0.5
    # The heartbeat in each tenant's private segment (kvpool.pool.arena): same-host clients trust a probe of
    # the segment's index only while it is fresh, so a stopped daemon is noticed within a
    # few beats without a round trip. 0: no heartbeat (clients then always ask the daemon).
    heartbeat_s: float = 0.02
    # "HOST:PORT" of a Prometheus HTTP endpoint (GET /metrics) serving the pool's metrics,
    # pool-wide (an operator's scrape, not a tenant's); port 0 picks one, written to
    # address.json as "metrics". Empty: none (admins still read them over the socket).
    metrics_addr: str = ""
    max_lookup_wait_s: float = 2.0  # cap on a lookup's wait for a pending publish (Lookup.wait_pending_ms)
    # The scrub at rest, on its own thread (never in the requests' way), one round per interval
    # and tenant segment: at most `scrub_pages_per_round` commits taken on trust and not yet
    # scrubbed (the fresh queue, at most one entry per page: 320 pages/s by default), then the
    # next committed pages of the cyclic pass over every page: `scrub_rest_pages_per_round`
    # (0: no pass at rest), or by default `scrub_rest_bytes_per_s` worth of pages a round, at
    # least one (8 MiB/s: xxh3-128 costs well under 1% of a core at that rate, kv-sketch-1's
    # host reference some 7-25%).
    scrub_interval_s: float = 0.05
    scrub_pages_per_round: int = 16
    scrub_rest_pages_per_round: int | None = None
    scrub_rest_bytes_per_s: int = 8 * 1024 * 1024
    # Re-hash xxh3-128 pages before they become visible (False: trust them as kv-sketch-1
    # pages are trusted, and scrub them at rest; every loader verifies every page anyway).
    verify_commits: bool = True
    # Before a successful hello a connection costs the daemon little and not for long:
    hello_timeout_s: float = 5.0  # it is closed (after a typed error) if no hello succeeds by then
    max_hello_frame: int = 4096  # its largest frame: a bigger length prefix is refused before any byte of it
    max_unauthenticated: int = 64  # connections awaiting their hello, at most; past it the oldest is closed
    # Tenants allowed the pool-wide operations (capacity, pool-wide stats and metrics); none
    # named: the only tenant of a single-tenant pool, and nobody in a pool of several.
    admins: frozenset[str] = frozenset()
    # Pages of each tenant's own segment; the tenants not named share the rest of num_pages.
    quotas: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def frame_limit(self) -> int:
        """The largest frame after a hello (bytes, without its length prefix)."""
        return self.max_frame or P.frame_limit(self.page_size)

    def is_admin(self, tenant: str) -> bool:
        if self.admins:
            return tenant in self.admins
        return len(self.tenants) == 1 and tenant in self.tenants

    def tenant_pages(self) -> dict[str, int]:
        """The pages of each tenant's segment (InvalidRequest for quotas that do not fit)."""
        unknown = sorted(set(self.quotas) - set(self.tenants))
        if unknown:
            raise InvalidRequest(f"quotas name tenants the pool does not have: {unknown}")
        bad = {t: q for t, q in self.quotas.items() if not isinstance(q, int) or q <= 0}
        if bad:
            raise InvalidRequest(f"quotas must be positive page counts: {bad}")
        others = [t for t in self.tenants if t not in self.quotas]
        rest = self.num_pages - sum(self.quotas.values())
        share = rest // len(others) if others else 0
        if others and share < 1:
            raise InvalidRequest(f"{self.num_pages} pages leave {rest} for the {len(others)} tenants without a "
                                 f"quota: less than one page each")
        return {t: self.quotas.get(t, share) for t in self.tenants}

    def scrub_rest_pages(self) -> int:
        """Pages of the scrub's pass at rest per round and tenant segment."""
        if self.scrub_rest_pages_per_round is not None:
            return self.scrub_rest_pages_per_round
        return max(1, round(self.scrub_rest_bytes_per_s * self.scrub_interval_s / self.page_size))

    def resolved_run_dir(self) -> Path:
        return self.run_dir if self.run_dir is not None else default_run_dir(self.name)


@dataclasses.dataclass
class _Session:
    client: int
    peer: str
    tenant: str | None = None
    name: str = ""
    waiting: bool = False  # a lookup of this session is parked on a pending publish


@dataclasses.dataclass
class _TenantPool:
    """One tenant's part of the daemon: its segment, its catalog, what waits on them."""

    tenant: str
    arena: Arena
    catalog: Catalog
    # reservation id -> futures of the lookups parked on it, resolved when it closes
    parked: dict[int, list[asyncio.Future]] = dataclasses.field(default_factory=dict)
    lease_started: dict[int, float] = dataclasses.field(default_factory=dict)
    waits: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"lookup_waits": 0, "lookup_wait_us": 0, "lookup_waiting": 0})
    # the scrub's and the loaders' reports' outcomes (the queue and cursor are the catalog's)
    scrubbed: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"scrubbed_pages": 0, "scrub_corrupt": 0, "scrub_gone": 0,
                                 "report_dropped": 0, "report_intact": 0})


class PoolAlreadyRunning(PoolError):
    """Another live daemon owns this name."""


class InsecureRunDir(InsecureDirectory):
    """The run dir, or a directory above it, can be changed by another user (its owner, a
    group, a link it planted): the daemon will not put its sockets there."""

    what = "run directory"


ArenaFactory = Callable[[str, int, int], Arena]  # (label, page_size, num_pages) -> a tenant's segments


class PoolDaemon:
    def __init__(self, config: PoolConfig, catalog_factory: type[Catalog] = Catalog,
                 arena_factory: ArenaFactory = Arena.anonymous):
        if not config.tenants:
            raise InvalidRequest("a pool needs at least one tenant token (PoolConfig.tenants)")
        if not (config.scrub_interval_s > 0 and config.scrub_pages_per_round >= 0
                and config.scrub_rest_bytes_per_s >= 0 and config.scrub_rest_pages() >= 0):
            raise InvalidRequest(f"the scrub needs an interval > 0 and rates >= 0, got interval "
                                 f"{config.scrub_interval_s} s, {config.scrub_pages_per_round} fresh pages a round, "
                                 f"{config.scrub_rest_pages()} pages a round at rest")
        self.config = config
        self._quota = config.tenant_pages()
        self._catalog_factory = catalog_factory
        self._arena_factory = arena_factory
        self.run_dir = config.resolved_run_dir()
        self.metrics = PoolMetrics()
        self.restarted_after_crash = False
        self.recovery_note = ""
        self.pools: dict[str, _TenantPool] = {}
        self.unix_path: Path | None = None
        self.attach_path: Path | None = None
        self._tickets: dict[bytes, tuple[str, float]] = {}  # attach ticket -> (tenant, deadline)
        self._attaching: dict[int, asyncio.Future] = {}  # attach connections being served, oldest first
        self.tcp_port: int | None = None
        self.metrics_address: str | None = None  # "HOST:PORT" the metrics endpoint listens on, with --metrics
        self._metrics_http = None  # prometheus_client's WSGI server, with --metrics
        self._sessions = itertools.count(1)
        self._clients: dict[int, asyncio.StreamWriter] = {}  # authenticated connections
        self._unauthenticated: dict[int, _Connection] = {}  # connections still to say hello
        self._queued = 0
        self._executor: ThreadPoolExecutor | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = threading.Event()

    # -- start-up and recovery -----------------------------------------------------------
    def _make_run_dir(self) -> Path:
        """The run dir, created or checked with every directory above it (kvpool.pool.private_dir):
        the sockets are only as private as each of them."""
        return ensure_private_dir(self.run_dir, error=InsecureRunDir)

    def _recover_and_create(self) -> None:
        self.run_dir = self._make_run_dir()
        notes = []
        pid_file = self.run_dir / "pid"
        if pid_file.exists():
            old = _read_pid(pid_file)
            if old is not None and old != os.getpid() and _alive(old):
                raise PoolAlreadyRunning(f"pool {self.config.name!r} is served by live pid {old} ({pid_file})")
            notes.append(f"previous daemon (pid {old}) did not shut down cleanly")
            pid_file.unlink()
        stale = [name for name in ("pool.sock", "attach.sock") if (self.run_dir / name).exists()]
        for name in stale:
            (self.run_dir / name).unlink()
        if stale:
            notes.append(f"removed its stale {' and '.join(stale)}")
        if notes:
            self.restarted_after_crash = True
            self.recovery_note = "; ".join(notes) + "; starting with an empty pool"
            log.warning("kvgate pool %s: %s", self.config.name, self.recovery_note)
        pid_file.write_text(str(os.getpid()))
        cfg = self.config
        for tenant, pages in self._quota.items():
            arena = self._arena_factory(segment_label(cfg.name, tenant), cfg.page_size, pages)
            catalog = self._catalog_factory(
                CatalogConfig(num_pages=pages, page_size=cfg.page_size, admission=cfg.admission,
                              limits=cfg.limits, reservation_ttl_s=cfg.reservation_ttl_s,
                              lease_ttl_s=cfg.lease_ttl_s),
                generations=arena.generations, shm_index=ShmIndex(arena.index_entries),
            )
            self.pools[tenant] = _TenantPool(tenant, arena, catalog)

    def _cleanup(self) -> None:
        for tp in self.pools.values():
            tp.catalog = None  # drops the generation view into the arena
            with contextlib.suppress(PoolError):  # views still held: the memory goes with the last of them
                tp.arena.close()
        self.pools = {}
        for name in ("pool.sock", "attach.sock", "address.json", "pid"):
            (self.run_dir / name).unlink(missing_ok=True)

    # -- running -------------------------------------------------------------------------
    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._recover_and_create()
        self._executor = ThreadPoolExecutor(max_workers=self.config.io_threads, thread_name_prefix="kvpool-io")
        self._scrub_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-scrub")
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
            attach = self._attach_socket()
            if self.config.metrics_addr:
                self._serve_metrics(self.config.metrics_addr)
            self._write_address()
            reaper = asyncio.create_task(self._reap())
            scrubber = asyncio.create_task(self._scrub())
            beater = asyncio.create_task(self._heartbeat()) if self.config.heartbeat_s > 0 else None
            attacher = asyncio.create_task(self._serve_attach(attach))
            self.ready.set()
            await self._stop.wait()
            reaper.cancel()
            scrubber.cancel()
            if beater is not None:
                beater.cancel()
            attacher.cancel()
            attach.close()
            for srv in self._servers:
                srv.close()
            for conn in [*self._clients.values(), *self._unauthenticated.values()]:
                conn.close()
            for srv in self._servers:
                await srv.wait_closed()
        finally:
            if self._metrics_http is not None:
                self._metrics_http.shutdown()
                self._metrics_http.server_close()
                self._metrics_http = None
            self._executor.shutdown(wait=True)
            self._scrub_executor.shutdown(wait=True)
            self._cleanup()
            self.ready.set()

    def _serve_metrics(self, addr: str) -> None:
        """Prometheus's HTTP server on a thread of its own. Every scrape takes the gauges on
        the event loop (the catalog's owner), then reads the registry."""
        host, sep, port = addr.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"metrics address {addr!r} is not HOST:PORT")
        daemon = self

        class _Scrape(Collector):
            def collect(self):  # noqa: ANN202
                loop = daemon._loop
                if loop is not None and loop.is_running():
                    asyncio.run_coroutine_threadsafe(daemon._refresh_metrics(), loop).result(timeout=5.0)
                yield from daemon.metrics.registry.collect()

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Scrape())
        host = host or "127.0.0.1"
        self._metrics_http, _ = start_http_server(int(port), host, registry=registry)
        self.metrics_address = f"{host}:{self._metrics_http.server_address[1]}"

    async def _refresh_metrics(self) -> None:
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        self.metrics.refresh(self.pool_stats())
        for tp in self.pools.values():
            self.metrics.refresh_tenant(tp.tenant, tp.catalog.stats())

    def address(self) -> dict[str, object]:
        return {
            "name": self.config.name,
            "unix": str(self.unix_path) if self.unix_path else None,
            "tcp": f"{self.config.tcp_host}:{self.tcp_port}" if self.tcp_port else None,
            "attach": str(self.attach_path) if self.attach_path else None,
            "tenant_pages": self._quota,
            "pid": os.getpid(),
            "restarted_after_crash": self.restarted_after_crash,
            "recovery_note": self.recovery_note,
            "metrics": self.metrics_address,
        }

    def _write_address(self) -> None:
        tmp = self.run_dir / "address.json.tmp"
        tmp.write_text(json.dumps(self.address()))
        tmp.replace(self.run_dir / "address.json")

    def stop(self) -> None:
        """Ask the serving loop to shut down (thread-safe)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def run(self, dumpable: bool = False) -> None:
        """Serve in this thread until SIGTERM or SIGINT. A daemon process is made
        non-dumpable first (unless `dumpable`): processes of its own user can then neither
        ptrace it nor open its /proc/PID/fd or mem, so a tenant's client running as the
        daemon's user cannot take another tenant's segment from it (root still can)."""
        if not dumpable:
            _set_dumpable(False)

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
            now = time.monotonic()
            for tp in self.pools.values():
                tp.catalog.reap(now)
                self._wake_closed(tp)
            for ticket in [t for t, (_, deadline) in self._tickets.items() if deadline <= now]:
                del self._tickets[ticket]

    async def _heartbeat(self) -> None:
        """Beat on the event loop itself: a loop that is stopped, wedged or far behind stops
        beating, which is what a same-host prober needs to know before it skips the round trip."""
        while True:
            now = time.monotonic_ns()
            for tp in self.pools.values():
                tp.arena.beat(now)
            await asyncio.sleep(self.config.heartbeat_s)

    async def _scrub(self) -> None:
        """Re-take the digest of committed pages at rest, one round per interval and tenant
        segment: the fresh commits taken on trust first, then the cyclic pass over every
        committed page. A page that no longer holds that commit is skipped (`scrub_gone`);
        one whose bytes do not match is dropped from the pool (`scrub_corrupt`; a loader
        holding it re-checks it itself, and its page is freed at the release)."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.scrub_interval_s)
            for tp in self.pools.values():
                fresh = tp.catalog.scrub_fresh(cfg.scrub_pages_per_round)
                await self._scrub_pages(tp, fresh + self._scrub_targets(tp), len(fresh))

    def _scrub_targets(self, tp: _TenantPool) -> list[tuple[int, int]]:
        """This round's pages of the pass at rest."""
        return tp.catalog.scrub_cycle(self.config.scrub_rest_pages())

    async def _scrub_pages(self, tp: _TenantPool, targets: list[tuple[int, int]], fresh: int) -> None:
        """Hash `targets` (page, generation) in one trip to the scrub's thread; the first
        `fresh` of them leave the fresh queue once their outcome is counted."""
        cat = tp.catalog
        jobs = []
        for page, gen in targets:
            kind = cat.committed_as(page, gen)
            if kind is not None:
                jobs.append((page, gen, kind, cat.digest[page].tobytes(), tp.arena.page(page, int(cat.length[page]))))
        if jobs:
            got = await self._loop.run_in_executor(
                self._scrub_executor, lambda: [page_digest(view, kind) for _, _, kind, _, view in jobs])
        else:
            got = []
        hashed = {(page, gen): (kind, want, digest) for (page, gen, kind, want, _), digest in zip(jobs, got)}
        for i, (page, gen) in enumerate(targets):
            found = hashed.get((page, gen))
            if found is None or cat.committed_as(page, gen) is None:  # freed or reused (maybe while hashed)
                tp.scrubbed["scrub_gone"] += 1
            elif hmac.compare_digest(found[2], found[1]):
                tp.scrubbed["scrubbed_pages"] += 1
            else:
                cat.discard(page, gen)
                tp.scrubbed["scrub_corrupt"] += 1
                log.warning("kvgate pool %s: tenant %s page %d (generation %d) no longer matches its %s digest at "
                            "rest: dropped", self.config.name, tp.tenant, page, gen, found[0].value)
            if i < fresh:
                cat.scrubbed(page, gen)

    async def report_corrupt(self, session: _Session, op: P.ReportCorrupt) -> P.ReportOk:
        """A loader's digest check refused these pages of its lease: re-hash each at rest
        and drop the ones whose bytes there do not match (see the module docstring)."""
        tp = self.pools[session.tenant]
        cat = tp.catalog
        pages = self._own_lease(session, op.lease_id)
        if len(op.indexes) > len(pages) or len(set(op.indexes)) != len(op.indexes):
            raise InvalidRequest(f"{len(op.indexes)} indexes for a lease of {len(pages)} pages: each at most once")
        generations = cat._leases[op.lease_id].generations  # noqa: SLF001 - the daemon owns the catalog
        targets = []
        for i in op.indexes:
            if not 0 <= i < len(pages):
                raise InvalidRequest(f"index {i} outside lease of {len(pages)} pages")
            targets.append((pages[i], generations[i]))
        jobs = []
        for page, gen in targets:
            kind = cat.committed_as(page, gen)  # None: dropped already (a leased page is never reused)
            if kind is not None:
                jobs.append((page, gen, kind, cat.digest[page].tobytes(), tp.arena.page(page, int(cat.length[page]))))
        got = await self._offload(lambda: [page_digest(view, kind) for _, _, kind, _, view in jobs])
        hashed = {(page, gen): (kind, want, digest) for (page, gen, kind, want, _), digest in zip(jobs, got)}
        outcomes = []
        for page, gen in targets:
            found = hashed.get((page, gen))
            if found is None or cat.committed_as(page, gen) is None or not hmac.compare_digest(found[2], found[1]):
                if cat.discard(page, gen):
                    tp.scrubbed["report_dropped"] += 1
                    log.warning("kvgate pool %s: tenant %s page %d (generation %d), reported corrupt by client %d, "
                                "no longer matches its %s digest at rest: dropped", self.config.name, tp.tenant,
                                page, gen, session.client, found[0].value if found else "?")
                outcomes.append(CorruptOutcome.DROPPED)
            else:
                tp.scrubbed["report_intact"] += 1
                outcomes.append(CorruptOutcome.INTACT)
        return P.ReportOk(outcomes)

    # -- handing a tenant its segment --------------------------------------------------------
    def _attach_socket(self) -> socket.socket:
        self.attach_path = self.run_dir / "attach.sock"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(self.attach_path))
        os.chmod(self.attach_path, 0o600)
        sock.listen(64)
        sock.setblocking(False)
        return sock

    async def _serve_attach(self, listener: socket.socket) -> None:
        """Accept attach connections; each gets at most one descriptor, for a valid ticket.
        At most `max_unauthenticated` are served at once: past it the oldest is closed, so
        that idle connections cannot keep a client with a ticket from its segment."""
        loop = self._loop
        ids = itertools.count()
        while True:
            conn, _ = await loop.sock_accept(listener)
            if len(self._attaching) >= self.config.max_unauthenticated:
                oldest = next(iter(self._attaching))
                self.metrics.requests.labels("attach", ErrorCode.BUSY.value).inc()
                self._attaching.pop(oldest).cancel()  # its handler's finally closes the connection
            n = next(ids)
            task = asyncio.ensure_future(self._attach_one(conn))
            self._attaching[n] = task
            task.add_done_callback(lambda t, n=n: self._attached(n, t))

    def _attached(self, n: int, task: asyncio.Future) -> None:
        self._attaching.pop(n, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("attach handler failed", exc_info=task.exception())

    async def _attach_one(self, conn: socket.socket) -> None:
        """Read a ticket (16 bytes, within the hello timeout); answer b"\x00" with the
        ticket's tenant's two segments attached (SCM_RIGHTS: the private one, sealed
        read-only, then the pages), or b"\x01" and nothing."""
        loop = self._loop
        result = "ok"
        try:
            ticket = b""
            async with asyncio.timeout(self.config.hello_timeout_s):
                while len(ticket) < _TICKET_BYTES:
                    chunk = await loop.sock_recv(conn, _TICKET_BYTES - len(ticket))
                    if not chunk:
                        break
                    ticket += chunk
            entry = self._tickets.pop(ticket, None)
            if entry is None or entry[1] <= time.monotonic() or entry[0] not in self.pools:
                result = ErrorCode.UNAUTHENTICATED.value
                await loop.sock_sendall(conn, b"\x01")
                return
            socket.send_fds(conn, [b"\x00"], list(self.pools[entry[0]].arena.handout_fds()))
        except TimeoutError:
            result = "timeout"
        except OSError:  # the peer went away or did not read: it gets nothing, nobody else is touched
            result = "transport_error"
        finally:
            conn.close()
            self.metrics.requests.labels("attach", result).inc()

    def _ticket(self, tenant: str) -> bytes:
        ticket = secrets.token_bytes(_TICKET_BYTES)
        self._tickets[ticket] = (tenant, time.monotonic() + self.config.hello_timeout_s)
        return ticket

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
            return self._reply(request_id, op_name, result)
        except PoolError as err:
            return self._error(getattr(err, "request_id", request_id), op_name, err)

    async def _finish(self, request_id: int, op_name: str, pending: Awaitable[P.Reply]) -> bytes:
        try:
            result = await pending
        except PoolError as err:
            return self._error(request_id, op_name, err)
        return self._reply(request_id, op_name, result)

    def _reply(self, request_id: int, op_name: str, result: P.Reply) -> bytes:
        """The encoded reply, at most the frame limit: the bounds of kvpool.pool.protocol and the
        handlers' checks keep every reply under it, and one that is not is a daemon bug,
        answered as one rather than sent."""
        data = P.encode_reply(request_id, result)
        if len(data) - P.LENGTH.size > self.config.frame_limit:
            return self._error(request_id, op_name, InternalError(
                f"{type(result).__name__} of {len(data) - P.LENGTH.size} bytes exceeds the frame limit of "
                f"{self.config.frame_limit}: not sent"))
        self.metrics.requests.labels(op_name, "ok").inc()
        return data

    def _error(self, request_id: int, op_name: str, err: PoolError) -> bytes:
        self.metrics.requests.labels(op_name, err.code.value).inc()
        return P.encode_reply(request_id, P.Error(err.code, err.message))

    def _apply(self, session: _Session, op: P.Request) -> P.Reply | Awaitable[P.Reply]:
        if isinstance(op, P.Hello):
            expected = self.config.tenants.get(op.tenant)
            if expected is None or not hmac.compare_digest(expected.encode(), op.token.encode()):
                raise Unauthenticated(f"unknown tenant or bad token for tenant {op.tenant!r}")
            if session.tenant is not None:  # each hello mints an attach ticket; a session has one
                raise InvalidRequest(f"this connection is already authenticated (tenant {session.tenant!r}): a "
                                     "connection says hello once")
            session.tenant, session.name = op.tenant, op.client_name
            arena = self.pools[op.tenant].arena
            return P.HelloOk(session.client, str(self.attach_path), arena.instance, arena.page_size,
                             arena.num_pages, SERVER_NAME, self.restarted_after_crash, self._ticket(op.tenant))
        if session.tenant is None:
            raise Unauthenticated(f"{type(op).__name__} before a successful hello")
        self._check_bounds(op)
        tenant = session.tenant
        tp = self.pools[tenant]
        cat = tp.catalog
        now = time.monotonic()
        if isinstance(op, P.Ping):
            return P.Pong()
        if isinstance(op, P.Lookup):
            self._check_tenant(op.ns, tenant)
            res = cat.lookup(tenant, op.ns, op.hashes)
            wait_s = min(op.wait_pending_ms / 1000, self.config.max_lookup_wait_s)
            if res.pending and wait_s > 0:
                session.waiting = True
                return self._lookup_waiting(session, tp, op, res, wait_s)
            return P.LookupOk(res.hits, res.miss)
        if isinstance(op, P.Acquire):
            self._check_tenant(op.ns, tenant)
            acq = cat.acquire(session.client, tenant, op.ns, op.hashes, now)
            if acq.lease_id:
                tp.lease_started[acq.lease_id] = now
                self.metrics.hits.labels("remote").inc()
                self.metrics.hit_blocks.inc(len(acq.hits))
                self.metrics.bytes_read.inc(acq.hits.total_bytes)
            if acq.miss is not None:
                self.metrics.misses.labels(acq.miss.cause.value).inc()
            return P.AcquireOk(acq.lease_id, acq.hits, acq.miss)
        if isinstance(op, P.Release):
            self._own_lease(session, op.lease_id)
            rel = cat.release(op.lease_id)
            started = tp.lease_started.pop(op.lease_id, None)
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
            self._wake_closed(tp)
            return P.AbortOk(freed)
        if isinstance(op, P.ReadPages):
            return self._read_pages(session, op)
        if isinstance(op, P.Evict):
            self._check_tenant(op.ns, tenant)
            outcomes = cat.evict(tenant, op.ns, op.hashes)
            self.metrics.evictions.inc(sum(o == "evicted" for o in outcomes))
            return P.EvictOk(outcomes)
        if isinstance(op, (P.SetCapacity, P.SetLimits, P.Stats, P.Metrics)) and not self.config.is_admin(tenant):
            if isinstance(op, P.Stats):  # a tenant sees its own segment, never the pool's or another tenant's
                return P.StatsOk(self._tenant_stats(tp))
            raise Unauthenticated(f"{type(op).__name__} is a pool-wide operation: tenant {tenant!r} is not an "
                                  "admin of this pool")
        if isinstance(op, P.SetCapacity):
            target = self.pools.get(op.tenant or tenant)
            if target is None:
                raise InvalidRequest(f"SetCapacity of tenant {op.tenant!r}: the pool has no such tenant")
            evicted = target.catalog.set_capacity(op.pages)
            self.metrics.evictions.inc(evicted)
            return P.CapacityOk(evicted)
        if isinstance(op, P.SetLimits):
            target = self.pools.get(op.tenant or tenant)
            if target is None:
                raise InvalidRequest(f"SetLimits of tenant {op.tenant!r}: the pool has no such tenant")
            old = target.catalog.set_limits(LoadLimits(per_client=op.per_client, total=op.total))
            return P.LimitsOk(old.per_client, old.total)
        if isinstance(op, P.Stats):
            return P.StatsOk(self.pool_stats())
        if isinstance(op, P.Metrics):
            self._refresh_gauges()
            return P.MetricsOk(self.metrics.exposition())
        if isinstance(op, P.ReportCorrupt):
            return self.report_corrupt(session, op)
        raise InvalidRequest(f"unhandled op {type(op).__name__}")

    def _check_bounds(self, op: P.Request) -> None:
        """What one frame may name, beyond the decoder's static bounds (kvpool.pool.protocol):
        each block hash, lease index and reservation slot at most once (a repeat would only
        repeat the work and the reply), and a namespace whose text fields are at most
        MAX_NAMESPACE_FIELD_CHARS each (a namespace is interned while the pool has pages of
        it). The handlers check what the session holds: indexes within its lease, slots
        within its reservation, one digest per reserved page, payloads of the reserved
        length. InvalidRequest otherwise; nothing of the frame is done."""
        if isinstance(op, (P.Lookup, P.Acquire, P.Reserve, P.Evict)):
            for name in op.ns.__struct_fields__:
                value = getattr(op.ns, name)
                if isinstance(value, str) and len(value) > MAX_NAMESPACE_FIELD_CHARS:
                    raise InvalidRequest(f"namespace field {name} of {len(value)} characters (at most "
                                         f"{MAX_NAMESPACE_FIELD_CHARS})")
            _check_distinct("block hash", op.hashes)
        elif isinstance(op, P.ReadPages):
            _check_distinct("lease index", op.indexes)
        elif isinstance(op, P.WritePages):
            _check_distinct("reservation slot", op.slots)

    @staticmethod
    def _tenant_stats(tp: _TenantPool) -> dict[str, int]:
        stats = {**tp.catalog.stats(), **tp.waits, **tp.scrubbed, "scrub_queued": tp.catalog.scrub_queued(),
                 "scrub_queue_bound": tp.catalog.config.num_pages}
        own = tp.catalog.tenant_stats(tp.tenant)
        return {**stats, **own}

    def pool_stats(self) -> dict[str, int]:
        """Every tenant's stats summed (the page size is the pool's)."""
        total: dict[str, int] = {}
        for tp in self.pools.values():
            for key, value in self._tenant_stats(tp).items():
                total[key] = total.get(key, 0) + value
        total["page_size"] = self.config.page_size
        total["tenants"] = len(self.pools)
        return total

    # -- lookups that wait for a pending publish -------------------------------------------
    async def _lookup_waiting(self, session: _Session, tp: _TenantPool, op: P.Lookup, res: LookupResult,
                              wait_s: float) -> P.LookupOk:
        """Park until the first missing block's publish closes, look up again; repeat
        while the answer stops at a pending block, until `wait_s` has passed."""
        loop = self._loop
        t0 = loop.time()
        deadline = t0 + wait_s
        result = "abandoned"  # unless it returns: cancelled because its client went away
        tp.waits["lookup_waiting"] += 1
        try:
            while res.pending:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    result = MissCause.IN_FLIGHT.value
                    assert res.miss is not None  # a pending reservation is always at the first miss
                    tp.catalog.count_miss(MissCause.IN_FLIGHT)
                    self.metrics.misses.labels(MissCause.IN_FLIGHT.value).inc()
                    return P.LookupOk(res.hits, Miss(res.miss.index, MissCause.IN_FLIGHT))
                await self._until_closed(tp, res.pending, remaining)
                res = tp.catalog.lookup(session.tenant, op.ns, op.hashes)
            result = "settled"
            return P.LookupOk(res.hits, res.miss)
        finally:
            waited = loop.time() - t0
            session.waiting = False
            tp.waits["lookup_waiting"] -= 1
            tp.waits["lookup_waits"] += 1
            tp.waits["lookup_wait_us"] += round(waited * 1e6)
            self.metrics.lookup_waits.labels(result).inc()
            self.metrics.lookup_wait_seconds.observe(waited)

    async def _until_closed(self, tp: _TenantPool, reservation_id: int, timeout: float) -> None:
        """Return when the reservation closes (see _wake_closed) or `timeout` passes."""
        parked = self._loop.create_future()
        tp.parked.setdefault(reservation_id, []).append(parked)
        try:
            await asyncio.wait((parked,), timeout=timeout)
        finally:
            if not parked.done():  # timed out or cancelled: unpark
                parked.cancel()
                others = tp.parked.get(reservation_id)
                if others is not None:
                    others.remove(parked)
                    if not others:
                        del tp.parked[reservation_id]

    @staticmethod
    def _wake_closed(tp: _TenantPool) -> None:
        """Wake the lookups parked on the tenant's reservations that are no longer open.
        Called after every catalog call that can close one: commit, abort, drop_client, reap."""
        if not tp.parked:
            return
        cat = tp.catalog
        for rid in [r for r in tp.parked if not cat.reservation_open(r)]:
            for parked in tp.parked.pop(rid):
                if not parked.done():
                    parked.set_result(None)

    @staticmethod
    def _check_tenant(ns, tenant: str) -> None:  # noqa: ANN001
        if ns.tenant != tenant:
            raise Unauthenticated(f"session of tenant {tenant!r} cannot use namespace of tenant {ns.tenant!r}")

    def _own_lease(self, session: _Session, lease_id: int) -> list[int]:
        lease = self.pools[session.tenant].catalog._leases.get(lease_id)  # noqa: SLF001 - the daemon owns the catalog
        if lease is None or lease.client != session.client:
            raise LeaseLost(f"lease {lease_id} is not held by this session")
        return lease.pages

    def _own_reservation(self, session: _Session, reservation_id: int) -> list[int]:
        res = self.pools[session.tenant].catalog._reservations.get(reservation_id)  # noqa: SLF001
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
        tp = self.pools[session.tenant]
        arena, cat = tp.arena, tp.catalog
        lengths = [int(cat.length[p]) for p in pages]
        if not (op.kind.verified_at_commit and self.config.verify_commits):
            # Trusted at commit (the writer took it over the bytes it copied; every loader
            # re-takes it over what it installed); the scrub re-takes it at rest.
            res = cat.commit(op.reservation_id, list(op.digests), op.kind, scrub_first=True)
            self._wake_closed(tp)
            self.metrics.bytes_written.inc(sum(n for n, p in zip(lengths, pages) if cat.state[p]))
            return P.CommitOk(res.committed, list(res.rejected))

        def verify() -> list[bytes | None]:
            return [page_digest(arena.page(p, n)) for p, n in zip(pages, lengths)]

        actual = await self._offload(verify)
        # The reservation may have expired while hashing; commit re-checks it.
        digests = [a if hmac.compare_digest(a, c) else None for a, c in zip(actual, op.digests)]
        res = cat.commit(op.reservation_id, digests)
        self._wake_closed(tp)
        self.metrics.bytes_written.inc(sum(n for n, d in zip(lengths, digests) if d is not None))
        return P.CommitOk(res.committed, list(res.rejected))

    async def _write_pages(self, session: _Session, op: P.WritePages) -> P.WriteOk:
        pages = self._own_reservation(session, op.reservation_id)
        if len(op.slots) != len(op.data):
            raise InvalidRequest(f"{len(op.slots)} slots but {len(op.data)} payloads")
        tp = self.pools[session.tenant]
        targets = []
        for slot, data in zip(op.slots, op.data):
            if not 0 <= slot < len(pages):
                raise InvalidRequest(f"slot {slot} outside reservation of {len(pages)} pages")
            expected = int(tp.catalog.length[pages[slot]])
            if len(data) != expected:
                raise InvalidRequest(f"slot {slot}: {len(data)} bytes, reserved {expected}")
            targets.append((pages[slot], data))
        arena = tp.arena

        def write() -> int:
            for page, data in targets:
                arena.page(page, len(data))[:] = memoryview(data)
            return len(targets)

        return P.WriteOk(await self._offload(write))

    async def _read_pages(self, session: _Session, op: P.ReadPages) -> P.PagesOk:
        """The bytes of distinct pages of the session's lease: at most the lease's pages and
        MAX_PAGES_PER_FRAME (protocol), so the reply is at most that many pages."""
        pages = self._own_lease(session, op.lease_id)
        tp = self.pools[session.tenant]
        targets = []
        for i in op.indexes:
            if not 0 <= i < len(pages):
                raise InvalidRequest(f"index {i} outside lease of {len(pages)} pages")
            targets.append((pages[i], int(tp.catalog.length[pages[i]])))
        arena = tp.arena
        return P.PagesOk(await self._offload(lambda: [arena.page(p, n).tobytes() for p, n in targets]))


MAX_NAMESPACE_FIELD_CHARS = 1024  # each text field of a namespace (a model id, a revision, ...)


def _check_distinct(what: str, items: list) -> None:
    """InvalidRequest unless every item is distinct (one frame names each block, page or
    slot at most once: a repeat would only repeat the work and the reply)."""
    if len(set(items)) != len(items):
        seen: set = set()
        first = next(x for x in items if x in seen or seen.add(x))  # add() is None: falsy
        raise InvalidRequest(f"{what} {first!r} named more than once in one frame "
                             f"({len(items) - len(set(items))} repeats)")


def _set_dumpable(on: bool) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, int(on), 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


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


def main_serve(config: PoolConfig, catalog_factory: type[Catalog] | None = None, dumpable: bool = False) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        daemon = PoolDaemon(config) if catalog_factory is None else PoolDaemon(config, catalog_factory=catalog_factory)
        daemon.run(dumpable=dumpable)
    except (PoolAlreadyRunning, InsecureRunDir, InvalidRequest) as exc:
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
        if self.pending is not None and len(self.buf) > self.daemon.config.frame_limit + P.LENGTH.size:
            self.transport.pause_reading()  # pipelined behind a parked lookup: bound the buffer
        self._pump()

    def _pump(self) -> None:
        d = self.daemon
        while self.pending is None and not self.closed and not self.write_paused:
            if len(self.buf) < P.LENGTH.size:
                return
            (n,) = P.LENGTH.unpack_from(self.buf)
            pre_auth = self.session.tenant is None
            limit = d.config.max_hello_frame if pre_auth else d.config.frame_limit
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
            tp = d.pools.get(self.session.tenant) if self.session.tenant is not None else None
            if tp is not None and tp.catalog is not None:
                tp.catalog.drop_client(self.session.client)
                d._wake_closed(tp)
