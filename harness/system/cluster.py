"""The live system: a pool daemon and real `vllm serve` replicas on loopback.

  ReplicaSpec        one replica: name, CPU core, KV size, connector on/off, failure
                     policy, model directory / revision override, fault-control file.
  Cluster.start(...) starts the pool and every replica in parallel (each pinned to its own
                     core with an explicit KV size), waits for /health, captures every log
                     under the run's report folder. Raises ClusterStartError with the tail
                     of the failing log.
  cluster.stop()     terminates every process group it started and removes the pool's
                     shared memory; safe to call twice, registered with atexit and on
                     SIGTERM so an interrupted run leaves no orphans.
  cluster.reset()    disarms every fault, empties the pool (capacity squeeze to 0 and back)
                     and every replica's own prefix cache, between tests.

Ports are picked free at start and names carry the pid, so concurrent runs (xdist
workers) do not collide.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvgate.harness.client.http import healthy, reset_prefix_cache
from kvgate.harness.system.pool import PoolProcess, unique_name
from kvgate.harness.system.procs import (StartError, group_alive, group_pids, kill_group, listeners, spawn, stop_group,
                                         wait_ready)
from kvpool.pool.arena import processes_mapping, segment_label

CONNECTOR = "kvpool.connector:KVPoolConnector"
FAULT_CONNECTOR = "kvgate.faults.connector:FaultConnector"  # wraps the connector of a replica with a fault-control file
AUDIT_CONNECTOR = "kvpool.connector.audit:AuditConnector"


class ClusterStartError(StartError):
    """A pool or replica did not come up; the message carries its log tail."""


class OrphanError(RuntimeError):
    """A process or shared-memory segment of the cluster survived stop()."""


_HANDED: set[int] = set()
_HANDED_LOCK = threading.Lock()


def free_port() -> int:
    """A port nothing listens on now, and never one this process handed out before: the kernel
    may give the same ephemeral port to two binds in a row, and two replicas told one port
    leave the second without a server while its health check is answered by the first's.
    Another process (a second test worker) may still be handed the same port: a replica is
    healthy only once its own process group listens on its port (Cluster._wait_healthy)."""
    with _HANDED_LOCK:
        for _ in range(1000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED:
                _HANDED.add(port)
                return port
    raise OSError("no port free that was not handed out before")


PORT_RETRIES = 2  # starts again on another port, for a replica whose port another process took


BIND_SITES = ("create_server_socket", "serve_http")  # where vLLM's API server binds its port and listens


def _port_taken(replica: Replica) -> bool:
    """Whether this start's part of the replica's log says its API server could not bind or
    listen (errno 98 in a traceback through BIND_SITES), not another of its sockets (the
    engine's own ports print the same errno)."""
    try:
        with open(replica.log_path, "rb") as log:
            log.seek(replica.log_from)
            text = log.read().decode(errors="replace")
    except OSError:
        return False
    return "address already in use" in text.lower() and any(site in text for site in BIND_SITES)


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    name: str
    core: str  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0"
    kv_bytes: int = 512 * 2**20
    connector: bool = True
    audit: bool = False
    policy: str = "recompute"  # kv_load_failure_policy
    model_dir: Path | None = None  # default: the cluster's model
    model_revision: str = ""  # overrides the model fingerprint in the namespace
    max_model_len: int = 16384
    max_num_batched_tokens: int = 4096
    faults_file: str = ""
    extra_env: tuple[tuple[str, str], ...] = ()
    extra_args: tuple[str, ...] = ()  # more `vllm serve` flags (e.g. another connector)
    via_proxy: bool = False  # reach the pool through a fault proxy (kvgate.faults.proxy)
    proxy_remote: bool = True  # that proxy: over TCP, pages as frames, as from another host (else a Unix
    # socket on this host: the arena stays mapped and only the frames around the pages cross it)
    connector_extra: tuple[tuple[str, object], ...] = ()  # more kv_connector_extra_config settings
    check_params: bool = False  # kvpool.connector.http's check in front of the server: bad kvpool params get a 400
    # Another V1 connector instead of kvpool's ("module:Class"), with its own settings; still
    # wrapped by the fault connector and the audit when faults_file / audit are set.
    inner: str = ""
    inner_extra: tuple[tuple[str, object], ...] = ()
    python: str = ""  # the interpreter of `vllm serve` (default: this one), e.g. a peer's own environment
    # Another host (kvgate.harness.system.netns): the argv prefix that runs the replica there, and
    # the host's address it listens on (the harness reaches it through the hosts' bridge).
    netns: tuple[str, ...] = ()
    host: str = "127.0.0.1"


@dataclasses.dataclass
class Replica:
    spec: ReplicaSpec
    port: int
    proc: subprocess.Popen
    log_path: Path
    log_from: int = 0  # where this process's part of the log begins (a restart appends to the same file)

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"


class Cluster:
    def __init__(self, model_dir: Path, report_dir: Path, *, page_size: int, pool_pages: int = 1024,
                 pool_args: tuple[str, ...] = ()):
        self.model_dir = Path(model_dir)
        self.report_dir = Path(report_dir)
        self.page_size = page_size
        self.pool_pages = pool_pages
        self.pool_args = pool_args
        self.history_dir = self.report_dir / "history"
        self.pool: PoolProcess | None = None
        self.replicas: dict[str, Replica] = {}
        self.faults: dict[str, Path] = {}  # replica -> its fault-control file (kvgate.faults.backend)
        self.history = None  # the harness's own records (requests, nemesis actions), set at start
        self.proxies: dict = {}  # replica -> its kvgate.harness.system.proxy.ProxyProcess (specs with via_proxy)
        self.pool_tcp_port = free_port()  # fixed, so a restarted pool keeps its address for the proxies
        self._killed: set[str] = set()  # replicas the nemesis killed (not a crash of their own)
        self._sockdirs: list[str] = []  # directories of the local proxies' sockets
        # processes the replicas depend on besides the pool (a GPU keeper: kvgate.harness.system.keeper),
        # each with stop(): stopped after the replicas, before the pool
        self.companions: list = []
        self._stopped = False

    # -- start ---------------------------------------------------------------------------
    def start(self, specs: list[ReplicaSpec], timeout: float = 600.0) -> Cluster:
        self.report_dir.mkdir(parents=True, exist_ok=True)
        if self.history_dir.exists():  # a history belongs to one cluster run
            shutil.rmtree(self.history_dir)
        self.history_dir.mkdir(parents=True)
        from kvgate.harness.client import http
        from kvpool.connector.history import HistoryWriter

        self.history = HistoryWriter(self.history_dir, "harness", "client")
        http.RECORDER = self.history
        for spec in specs:
            if spec.faults_file:
                self.faults[spec.name] = Path(spec.faults_file)
                self.faults[spec.name].write_text("{}")
        atexit.register(self.stop)
        self._install_sigterm()
        self.pool = PoolProcess.start(page_size=self.page_size, num_pages=self.pool_pages,
                                      name=unique_name("kvgate-live"), log_path=self.report_dir / "pool.log",
                                      extra_args=("--tcp", f"127.0.0.1:{self.pool_tcp_port}", *self.pool_args))
        for spec in specs:
            self.replicas[spec.name] = self._spawn(spec)
        try:
            with ThreadPoolExecutor(len(specs)) as ex:
                list(ex.map(lambda r: self._wait_healthy(r, timeout), list(self.replicas.values())))
        except BaseException:
            self.stop()
            raise
        return self

    def _proxy_for(self, spec: ReplicaSpec):  # noqa: ANN202
        """The replica's fault proxy, started on first use; it outlives replica restarts."""
        if spec.name not in self.proxies:
            from kvgate.harness.system.proxy import ProxyProcess

            if spec.proxy_remote:
                upstream, listen = self.pool.tcp, "tcp:127.0.0.1:0"
            else:  # a short path: a Unix socket's name has at most 107 bytes
                sockdir = tempfile.mkdtemp(prefix="kvg-proxy-")
                self._sockdirs.append(sockdir)
                listen = f"unix:{sockdir}/{spec.name}.sock"
                upstream = self.pool.unix
            self.proxies[spec.name] = ProxyProcess.start(
                upstream, listen, self.report_dir / f"proxy-{spec.name}.json", seed=0,
                history_dir=self.history_dir, remote=spec.proxy_remote, replica=spec.name,
                log_path=self.report_dir / f"proxy-{spec.name}.log")
        return self.proxies[spec.name]

    def arm_proxy(self, replica: str, faults: dict) -> None:
        """Set the transport faults of a replica's proxy (kvgate.faults.proxy control format)."""
        self.proxies[replica].configure(faults)

    def kv_transfer_config(self, spec: ReplicaSpec) -> dict:
        if spec.inner:
            extra = {"replica": spec.name, "history_dir": str(self.history_dir), **dict(spec.inner_extra)}
            return connector_config(spec.inner, extra, spec.policy, audit=spec.audit, faults_file=spec.faults_file)
        pool = self._proxy_for(spec).address if spec.via_proxy else self.pool.unix
        extra = {"pool": pool, "token": self.pool.token, "replica": spec.name,
                 "history_dir": str(self.history_dir), "model_id": "kvgate-tiny", **dict(spec.connector_extra)}
        if spec.model_revision:
            extra["model_revision"] = spec.model_revision
        return connector_config(CONNECTOR, extra, spec.policy, audit=spec.audit, faults_file=spec.faults_file)

    def _spawn(self, spec: ReplicaSpec) -> Replica:
        port = free_port()
        model = spec.model_dir or self.model_dir
        args = [*spec.netns, spec.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(model), "--served-model-name", "tiny", "--host", spec.host, "--port", str(port),
                "--max-model-len", str(spec.max_model_len), "--kv-cache-memory-bytes", str(spec.kv_bytes),
                "--max-num-batched-tokens", str(spec.max_num_batched_tokens), "--dtype", "bfloat16",
                "--seed", "0", "--enable-prefix-caching", "--disable-uvicorn-access-log"]
        if spec.connector:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config(spec))]
        if spec.check_params:
            args += ["--middleware", "kvpool.connector.http.check_kv_transfer_params"]
        args += list(spec.extra_args)
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": spec.core, "VLLM_SERVER_DEV_MODE": "1",
                    "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"})
        env.update(dict(spec.extra_env))
        log_path = self.report_dir / f"replica-{spec.name}.log"
        log_from = log_path.stat().st_size if log_path.exists() else 0
        return Replica(spec, port, spawn(args, log_path, env), log_path, log_from)

    def _wait_healthy(self, replica: Replica, timeout: float) -> Replica:
        """Wait until the replica answers /health from its own process group's socket, the only
        one listening on its port (another process that holds the port answers for nobody). A
        replica whose port another process took after free_port chose it (a second test worker)
        is started again on another port, up to PORT_RETRIES times, within the one `timeout`:
        one whose API server failed to bind or listen there, or one listening beside another
        server on it (both with SO_REUSEPORT). Returns the replica healthy, which is then
        self.replicas[name]."""
        name = replica.spec.name
        t0 = time.monotonic()
        deadline = t0 + timeout
        for attempt in range(PORT_RETRIES + 1):

            def probe(r: Replica = replica) -> str | None:
                ours, others = listeners(r.proc.pid, r.port)
                if ours and others:
                    return "shared"
                return "healthy" if ours and healthy(r.url) else None

            try:
                found = wait_ready(replica.proc, probe, max(1.0, deadline - time.monotonic()), f"replica {name}",
                                   replica.log_path, poll_s=0.5, note_every=30)
            except StartError as exc:
                if attempt == PORT_RETRIES or not _port_taken(replica):
                    raise ClusterStartError(str(exc)) from exc
                found = "taken"
            if found == "healthy":
                break
            why = {"shared": "shared with another server", "taken": "could not bind or listen there"}[found]
            if attempt == PORT_RETRIES:
                raise ClusterStartError(f"replica {name}'s port :{replica.port} {why}, {attempt + 1} times")
            print(f"kvgate: replica {name}'s port :{replica.port}: {why}; starting it on another",
                  file=sys.stderr, flush=True)
            self.nemesis("replica_port_taken", replica=name, port=replica.port, pid=replica.proc.pid, why=why)
            stop_group(replica.proc)
            replica = self.replicas[name] = self._spawn(replica.spec)
        print(f"kvgate: replica {name} healthy on :{replica.port} after {time.monotonic() - t0:.0f} s",
              file=sys.stderr, flush=True)
        return replica

    def add_replica(self, spec: ReplicaSpec, timeout: float = 600.0) -> Replica:
        """Start one more replica on the running pool (e.g. another model revision)."""
        if spec.name in self.replicas:
            raise ValueError(f"replica {spec.name} already exists")
        if spec.faults_file:
            self.faults[spec.name] = Path(spec.faults_file)
            self.faults[spec.name].write_text("{}")
        replica = self.replicas[spec.name] = self._spawn(spec)
        return self._wait_healthy(replica, timeout)

    def remove_replica(self, name: str) -> None:
        replica = self.replicas.pop(name)
        self.faults.pop(name, None)
        stop_group(replica.proc)
        if group_alive(replica.proc.pid):
            raise OrphanError(f"replica {name} process group {replica.proc.pid} survived")

    def nemesis(self, action: str, **fields: object) -> None:
        """Record a fault the harness itself performs (killing the pool, a replica) in the
        run's history, next to the requests it affects."""
        if self.history is not None:
            self.history.write("nemesis", action=action, **fields)

    def kill_replica(self, name: str) -> None:
        """SIGKILL a replica's whole process group (server, engine, workers): a crash."""
        replica = self.replicas[name]
        segments = _shm_mapped_by_group(replica.proc.pid)
        self.nemesis("replica_kill", replica=name, pid=replica.proc.pid)
        self._killed.add(name)
        kill_group(replica.proc.pid)
        replica.proc.wait()
        deadline = time.monotonic() + 15
        while group_alive(replica.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        # A process killed outright unlinks nothing: remove the shared memory only it had mapped.
        still_used = _shm_mapped_by_others(segments)
        for path in sorted(segments - still_used):
            path.unlink(missing_ok=True)
        self.nemesis("replica_shm_cleanup", replica=name, removed=len(segments - still_used))

    def restart_replica(self, name: str, timeout: float = 600.0) -> Replica:
        """Start a killed (or stopped) replica again with the same spec: the heal step."""
        return self.restart_replicas([name], timeout)[0]

    def restart_replicas(self, names: list[str], timeout: float = 600.0) -> list[Replica]:
        """Start several killed (or stopped) replicas again, all at once (their starts overlap,
        as the cluster's own start does), and wait until each is healthy."""
        for name in names:
            if self.replicas[name].proc.poll() is None:
                raise RuntimeError(f"replica {name} is still running")
        started = []
        for name in names:
            self.replicas[name] = self._spawn(self.replicas[name].spec)
            started.append(self.replicas[name])
        for i, (name, replica) in enumerate(zip(names, started)):
            replica = started[i] = self._wait_healthy(replica, timeout)
            self._killed.discard(name)
            self.nemesis("replica_restart", replica=name, pid=replica.proc.pid)
        return started

    def pool_for(self, replica: str) -> PoolProcess | None:
        """The pool daemon a replica publishes to (None while it is down)."""
        return self.pool if self.pool is not None and self.pool.proc.poll() is None else None

    def crashed(self) -> list[str]:
        """Processes of the cluster that are gone although nobody stopped or killed them."""
        out = [f"replica {r.spec.name} (exit {r.proc.returncode})" for r in self.replicas.values()
               if r.proc.poll() is not None and r.spec.name not in self._killed]
        if self.pool is not None and self.pool.proc.poll() is not None:
            out.append(f"pool (exit {self.pool.proc.returncode})")
        return out

    # -- between tests -------------------------------------------------------------------
    def reset(self) -> None:
        for path in self.faults.values():  # disarm every fault
            path.write_text("{}")
        for proxy in self.proxies.values():
            proxy.heal()
        with self.pool.client(name="reset") as c:
            pages = c.stats()["num_pages"]
            c.set_capacity(0)
            c.set_capacity(pages)
        for r in self.replicas.values():
            reset_prefix_cache(r.url)

    # -- stop ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop everything; raise OrphanError if a process or the segment survived."""
        if self._stopped:
            return
        self._stopped = True
        from kvgate.harness.client import http

        if http.RECORDER is self.history:
            http.RECORDER = None
        for r in self.replicas.values():
            stop_group(r.proc)
        for proxy in self.proxies.values():
            proxy.stop()
        for companion in self.companions:
            companion.stop()
        for sockdir in self._sockdirs:
            shutil.rmtree(sockdir, ignore_errors=True)
        if self.pool is not None:
            try:
                self.pool.stop()
            finally:
                self.pool.cleanup()
        left = [f"replica {r.spec.name} process group {r.proc.pid}" for r in self.replicas.values()
                if group_alive(r.proc.pid)]
        left += [f"proxy of {name} (pid {p.proc.pid})" for name, p in self.proxies.items() if p.proc.poll() is None]
        left += [f"{type(c).__name__} (pid {c.proc.pid})" for c in self.companions if c.proc.poll() is None]
        if self.pool is not None:
            mapping = {pid: labels for pid, labels in processes_mapping(segment_label(self.pool.name, "")).items()
                       if pid != os.getpid()}
            left += [f"pid {pid} mapping the pool's segments {labels}" for pid, labels in mapping.items()]
        if left:
            raise OrphanError(f"left behind after stop: {left}")

    def _install_sigterm(self) -> None:
        install_sigterm_unwind()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def connector_config(inner: str, extra: dict, policy: str, *, audit: bool = False, faults_file: str = "") -> dict:
    """vLLM's --kv-transfer-config for connector `inner` ("module:Class") with its settings
    `extra`: wrapped by the fault-injecting connector (kvgate.faults.connector) when a fault-control
    file is given, and by the audit (kvpool.connector.audit) outside that when `audit` is set."""
    extra = dict(extra)
    connector = inner
    if faults_file:
        extra.update(fault_inner=connector, faults_file=faults_file)
        connector = FAULT_CONNECTOR
    if audit:
        extra["audit_inner"] = connector
        connector = AUDIT_CONNECTOR
    module, _, cls = connector.partition(":")
    return {"kv_connector": cls, "kv_connector_module_path": module, "kv_role": "kv_both",
            "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}


def install_sigterm_unwind() -> None:
    """A SIGTERM to the harness (CI cancelling a job) raises SystemExit in the main thread,
    which unwinds through every finally block and fixture, so clusters stop cleanly. Only
    from the main thread, and only where no other handler is installed."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


def _shm_of(pid: str) -> set[Path]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {Path(line.split(maxsplit=5)[5].strip()) for line in f
                    if len(line.split(maxsplit=5)) == 6 and line.split(maxsplit=5)[5].startswith("/dev/shm/")}
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return set()  # the process is gone (or not ours): it maps nothing we may remove


def _shm_mapped_by_group(pgid: int) -> set[Path]:
    """Every /dev/shm file mapped by a process of the group (read from /proc/PID/maps)."""
    out: set[Path] = set()
    for pid in group_pids(pgid):
        out |= _shm_of(str(pid))
    return out


def _shm_mapped_by_others(paths: set[Path]) -> set[Path]:
    """The subset of `paths` some live process still maps."""
    used: set[Path] = set()
    if not paths:
        return used
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            used |= _shm_of(entry.name) & paths
    return used


DEFAULT_CHUNK = 2048  # max_num_batched_tokens of the default pair: longer prompts prefill in chunks


def default_cluster(model_dir: Path, report_dir: Path) -> tuple[Cluster, list[ReplicaSpec]]:
    """The embedded default system: a local pool and two replicas of the tiny model, both
    audited; A on core 0 with failure policy `fail` and kvpool.connector.http's parameter check
    (a malformed kvpool section gets a 400 there), B on core 1 with `recompute` (the
    connector serves such a request without the pool); each with a fault-control file in
    the report folder. B reaches the pool through a fault
    proxy on a Unix socket (its arena mapped: pages through shared memory, the frames
    around them through the proxy), where its transport faults are injected."""
    specs = [ReplicaSpec(name, core=core, policy=policy, audit=True, max_num_batched_tokens=DEFAULT_CHUNK,
                         faults_file=str(Path(report_dir) / f"faults-{name}.json"), via_proxy=name == "B",
                         proxy_remote=False, check_params=name == "A")
             for name, core, policy in (("A", "0", "fail"), ("B", "1", "recompute"))]
    return Cluster(model_dir, report_dir, page_size=128 * 1024, pool_pages=1024), specs


SMALL_KV_BLOCKS = 64  # the small replica's whole KV cache: a finished request's freed blocks are reused at once


def small_kv_spec(report_dir: Path, name: str = "D", core: str = "1") -> ReplicaSpec:
    """The "remote" replica: a KV cache of 64 blocks of 128 tokens (8 MiB on the tiny
    model), so a request of more than 64 - n blocks after one of n blocks must run in the
    blocks the first one freed (the stream-delay scenarios need exactly that pressure);
    and its pool traffic over TCP through a fault proxy in remote mode (pages travel as
    frames, as from another host), with a 3 s client timeout, for the transport faults."""
    block_bytes = 128 * 1024  # 128 tokens x 1024 bytes of KV per token on the tiny model
    return ReplicaSpec(name, core=core, kv_bytes=SMALL_KV_BLOCKS * block_bytes, audit=True,
                       max_model_len=(SMALL_KV_BLOCKS - 1) * 128, max_num_batched_tokens=DEFAULT_CHUNK,
                       faults_file=str(Path(report_dir) / f"faults-{name}.json"), via_proxy=True,
                       connector_extra=(("timeout_s", 3.0), ("load_deadline_s", 5.0)))
