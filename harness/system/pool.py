"""Starting pool daemons for tests, benches and the gate.

  unique_name(prefix)            a segment / run-dir name no other process or xdist worker uses.
  PoolProcess.start(...)         `python -m kvpool serve` as a child process; waits for its address.
  pool.restart(catalog=NAME)     a new daemon on the same name and run dir; with `catalog`, the
                                 known-bad catalog of a negative control (python -m kvgate.faults.pool).
  pool.stop()                    SIGTERM and wait; asserts the daemon removed its segment.
  pool.kill()                    SIGKILL (a crash: the segment and pid file stay behind).
  pool.client(...)               a PoolClient over the Unix socket (or TCP).
  thread_pool(...)               the same daemon in a background thread (fast, for unit-level
                                 suites that still want real sockets and shared memory).
  ManualClock                    a clock for thread_pool(clock=...) that only the test moves: grant
                                 expiry decided by the test, not by how the machine schedules it.
  PRODUCTION_TTL_ARGS            `kvpool serve` options naming the grant TTLs production runs with.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvgate.harness.system.procs import StartError, spawn, terminate, wait_ready
from kvpool.client.pool_client import PoolClient
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import PoolDaemon, read_address

_counter = itertools.count()


class PoolStartError(StartError):
    """The pool daemon did not come up (the message carries its log's tail)."""
DEFAULT_TENANT = "default"
# The reservation and lease TTLs production runs with (kvpool's defaults), passed by name by the
# benches of long forward steps (seed003's 256k prompts, the GPU live bench): their publishes and
# loads must outlive these by renewing (kvpool.client.keepalive), and a change of kvpool's default
# must not change what they measure unnoticed.
PRODUCTION_RESERVATION_TTL_S = 30.0
PRODUCTION_LEASE_TTL_S = 60.0
PRODUCTION_TTL_ARGS = ("--reservation-ttl", str(PRODUCTION_RESERVATION_TTL_S),
                       "--lease-ttl", str(PRODUCTION_LEASE_TTL_S))


def unique_name(prefix: str = "kvg") -> str:
    return f"{prefix}-{os.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"


@dataclasses.dataclass
class PoolProcess:
    name: str
    run_dir: Path
    token: str
    proc: subprocess.Popen
    address: dict
    log_path: Path
    args: list[str]
    prefix: tuple[str, ...] = ()  # the argv prefix that runs it in another host (kvgate.harness.system.netns)

    @classmethod
    def start(cls, *, page_size: int = 64 * 1024, num_pages: int = 256, name: str | None = None,
              run_dir: Path | None = None, log_path: Path | None = None, token: str | None = None,
              extra_args: tuple[str, ...] = (), timeout: float = 20.0, prefix: tuple[str, ...] = ()) -> PoolProcess:
        name = name or unique_name()
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix=f"{name}-"))
        token = token or secrets.token_hex(8)
        log_path = log_path or run_dir / "pool.log"
        args = ["--name", name, "--run-dir", str(run_dir), "--page-size", str(page_size), "--pages", str(num_pages),
                "--tenant", f"{DEFAULT_TENANT}={token}", *extra_args]
        return cls._spawn(name, run_dir, token, log_path, args, timeout, prefix=tuple(prefix))

    @classmethod
    def _spawn(cls, name: str, run_dir: Path, token: str, log_path: Path, args: list[str], timeout: float,
               catalog: str | None = None, prefix: tuple[str, ...] = (), module: str | None = None,
               what: str = "the pool daemon") -> PoolProcess:
        """`module`: another daemon's entry point (`python -m MODULE serve ARGS`: a known-bad
        daemon of faults/), instead of kvpool's (or kvgate.faults.pool's with `catalog`)."""
        (run_dir / "address.json").unlink(missing_ok=True)
        if module is not None:
            command = [sys.executable, "-m", module, "serve"]
        elif catalog is None:
            command = [sys.executable, "-m", "kvpool", "serve"]
        else:
            command = [sys.executable, "-m", "kvgate.faults.pool", "serve", "--catalog", catalog]
        proc = spawn([*prefix, *command, *args], log_path)

        def address() -> dict | None:
            try:
                found = read_address(run_dir, timeout=0.2)
            except TimeoutError:
                return None
            return found if found.get("pid") == proc.pid else None

        try:
            found = wait_ready(proc, address, timeout, what, log_path, poll_s=0.0)
        except StartError as exc:
            raise PoolStartError(str(exc)) from exc
        return cls(name, run_dir, token, proc, found, log_path, args, prefix)

    def restart(self, timeout: float = 20.0, catalog: str | None = None) -> PoolProcess:
        """Start a new daemon with the same arguments (after stop() or kill()); `catalog`
        names a known-bad catalog (kvgate.faults.controls) for this daemon only."""
        if self.proc.poll() is None:
            raise RuntimeError("restart() needs the old daemon stopped or killed first")
        new = self._spawn(self.name, self.run_dir, self.token, self.log_path, self.args, timeout, catalog,
                          self.prefix)
        self.proc, self.address = new.proc, new.address
        return self

    @property
    def unix(self) -> str:
        return f"unix:{self.address['unix']}"

    @property
    def tcp(self) -> str:
        return f"tcp:{self.address['tcp']}"

    def client(self, *, tcp: bool = False, zero_copy: bool = True, name: str = "", timeout_s: float = 5.0) -> PoolClient:
        return PoolClient(self.tcp if tcp else self.unix, DEFAULT_TENANT, self.token, name=name,
                          zero_copy=zero_copy, timeout_s=timeout_s)

    def stop(self, timeout: float = 10.0) -> int:
        return terminate(self.proc, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        """Whatever happened, leave no process behind (its segments go with it)."""
        self.kill()


class ManualClock:
    """The time a thread_pool's grants live by (deadlines, renewals, the reaper), moved only by
    `advance`; `settle(daemon)` returns once the daemon's reaper has finished a round at the
    current time (PoolDaemon.reaped_at)."""

    def __init__(self, start: float = 1000.0):
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        with self._lock:
            self._now += seconds
            return self._now

    def settle(self, daemon: PoolDaemon, timeout_s: float = 30.0) -> None:
        now = self()
        give_up = time.monotonic() + timeout_s
        while daemon.reaped_at is None or daemon.reaped_at < now:
            if time.monotonic() > give_up:
                raise TimeoutError(f"the pool's reaper did not finish a round at {now} within {timeout_s} s")
            time.sleep(daemon.config.reap_interval_s / 4)


def thread_pool(*, page_size: int = 4096, num_pages: int = 64, token: str = "tok", catalog_factory=None,  # noqa: ANN001
                clock=None, **kwargs) -> PoolDaemon:  # noqa: ANN001
    name = kwargs.pop("name", None) or unique_name("kvgt")
    run_dir = kwargs.pop("run_dir", None) or Path(tempfile.mkdtemp(prefix=f"{name}-"))
    tenants = kwargs.pop("tenants", None) or {DEFAULT_TENANT: token}
    config = PoolConfig(name=name, page_size=page_size, num_pages=num_pages, run_dir=run_dir,
                        tenants=tenants, **kwargs)
    extra = {k: v for k, v in (("catalog_factory", catalog_factory), ("clock", clock)) if v is not None}
    return PoolDaemon(config, **extra).start_thread()
