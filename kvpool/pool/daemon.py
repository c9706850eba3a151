"""The pool daemon: owns each tenant's catalog and arena, serves the wire protocol.

  PoolConfig                   frozen configuration (geometry, addresses, tenants, limits;
                               kvpool.pool.config).
  PoolDaemon(config).run()     serve until SIGTERM / SIGINT, then free the shared memory.
  PoolDaemon.start_thread()    the same daemon in a background thread (tests, benches);
                               returns a handle whose .stop() shuts it down gracefully.
  read_address(run_dir)        wait for a daemon in run_dir to publish its address.json.
  main_serve(config)           the body of `kvpool serve` (kvpool.pool.cli).

This module is the daemon's start-up and recovery, its listeners (Unix socket, TCP, the
attach socket, the metrics endpoint), its serving loop (with the reaper and the heartbeat)
and its shutdown. PoolDaemon has its other parts mixed in, each from a module of its own
that states its contracts:

  kvpool.pool.connection   one client connection: the framing, one reply per frame, the
                           pre-hello bounds, a client's hang-up (Connection).
  kvpool.pool.handlers     the request handlers: per-frame bounds, commit by digest kind,
                           a loader's report of a corrupt page, admin operations
                           (RequestHandlers).
  kvpool.pool.lookup_wait  lookups that wait for a publish in flight (LookupWaits).
  kvpool.pool.scrub        the scrub at rest (Scrubber).
  kvpool.pool.attach       tenants apart, and the handout of a tenant's segments over the
                           attach socket (SegmentHandout).
  kvpool.pool.state        what it keeps per connection and per tenant (Session, TenantPool).

Contracts:
  * Unix socket and TCP (loopback by default), one asyncio loop; catalog mutations run
    on the loop thread only, page hashing for verify runs in a bounded thread pool.
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
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop
from prometheus_client import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

from kvpool.errors import InvalidRequest, PoolError
from kvpool.pool.arena import Arena, segment_label
from kvpool.pool.attach import SegmentHandout
from kvpool.pool.catalog import Catalog, CatalogConfig
from kvpool.pool.config import PoolConfig
from kvpool.pool.connection import Connection
from kvpool.pool.handlers import RequestHandlers
from kvpool.pool.index import ShmIndex
from kvpool.pool.lookup_wait import LookupWaits
from kvpool.pool.metrics import PoolMetrics
from kvpool.pool.private_dir import InsecureDirectory, ensure_private_dir
from kvpool.pool.scrub import Scrubber
from kvpool.pool.state import TenantPool

log = logging.getLogger("kvpool.pool.daemon")


class PoolAlreadyRunning(PoolError):
    """Another live daemon owns this name."""


class InsecureRunDir(InsecureDirectory):
    """The run dir, or a directory above it, can be changed by another user (its owner, a
    group, a link it planted): the daemon will not put its sockets there."""

    what = "run directory"


ArenaFactory = Callable[[str, int, int], Arena]  # (label, page_size, num_pages) -> a tenant's segments


class PoolDaemon(RequestHandlers, LookupWaits, Scrubber, SegmentHandout):
    def __init__(self, config: PoolConfig, catalog_factory: type[Catalog] = Catalog,
                 arena_factory: ArenaFactory = Arena.anonymous, clock: Callable[[], float] = time.monotonic):
        if not config.tenants:
            raise InvalidRequest("a pool needs at least one tenant token (PoolConfig.tenants)")
        if not (config.scrub_interval_s > 0 and config.scrub_pages_per_round >= 0
                and config.scrub_rest_bytes_per_s >= 0 and config.scrub_rest_pages() >= 0):
            raise InvalidRequest(f"the scrub needs an interval > 0 and rates >= 0, got interval "
                                 f"{config.scrub_interval_s} s, {config.scrub_pages_per_round} fresh pages a round, "
                                 f"{config.scrub_rest_pages()} pages a round at rest")
        self.config = config
        # The time grants live by (reservation and lease deadlines, renewals, the reaper); a
        # test may pass a clock it moves itself, so that an expiry is decided by the test and
        # not by how the machine schedules it. Waits and timeouts keep the real clock.
        self.clock = clock
        self.reaped_at: float | None = None  # the clock's time at the end of the reaper's last round
        self._quota = config.tenant_pages()
        self._catalog_factory = catalog_factory
        self._arena_factory = arena_factory
        self.run_dir = config.resolved_run_dir()
        self.metrics = PoolMetrics()
        self.restarted_after_crash = False
        self.recovery_note = ""
        self.pools: dict[str, TenantPool] = {}
        self.unix_path: Path | None = None
        self.attach_path: Path | None = None
        self._tickets: dict[bytes, tuple[str, float]] = {}  # attach ticket -> (tenant, deadline)
        self._attaching: dict[int, asyncio.Future] = {}  # attach connections being served, oldest first
        self.tcp_port: int | None = None
        self.metrics_address: str | None = None  # "HOST:PORT" the metrics endpoint listens on, with --metrics
        self._metrics_http = None  # prometheus_client's WSGI server, with --metrics
        self._sessions = itertools.count(1)
        self._clients: dict[int, Connection] = {}  # authenticated connections
        self._unauthenticated: dict[int, Connection] = {}  # connections still to say hello
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
            if old is not None and old != os.getpid() and pid_alive(old):
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
                              lease_ttl_s=cfg.lease_ttl_s, reservation_max_s=cfg.reservation_max_s,
                              lease_max_s=cfg.lease_max_s),
                generations=arena.generations, shm_index=ShmIndex(arena.index_entries),
            )
            self.pools[tenant] = TenantPool(tenant, arena, catalog)

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
            except BaseException as exc:
                starting = not self.ready.is_set()  # then the starting thread re-raises it below
                error.append(exc)
                self.ready.set()
                if not starting:  # it stopped serving later: its thread's own error
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
            now = self.clock()
            for tp in self.pools.values():
                tp.catalog.reap(now)
                self._wake_closed(tp)
            real = time.monotonic()  # attach tickets are a wait of the real clock, not grants
            for ticket in [t for t, (_, deadline) in self._tickets.items() if deadline <= real]:
                del self._tickets[ticket]
            self.reaped_at = now

    async def _heartbeat(self) -> None:
        """Beat on the event loop itself: a loop that is stopped, wedged or far behind stops
        beating, which is what a same-host prober needs to know before it skips the round trip."""
        while True:
            now = time.monotonic_ns()
            for tp in self.pools.values():
                tp.arena.beat(now)
            await asyncio.sleep(self.config.heartbeat_s)

    # -- connections ---------------------------------------------------------------------
    def _protocol(self) -> Connection:
        return Connection(self)


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


def pid_alive(pid: int) -> bool:
    """A process of this pid exists (one of another user's counts)."""
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
