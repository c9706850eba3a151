"""The distributed stores the network tier runs on, as real processes the harness starts,
faults and stops (kvpool.tier's backends are clients of these).

  RedisServer(run_dir, maxmemory=None, policy="allkeys-lru", port=None, host="127.0.0.1", prefix=())
      .start()    `redis-server` on `host` (loopback by default; a network namespace's
                  address with that host's argv `prefix`), a free port unless given, no persistence,
                  its log in run_dir; waits until it answers PING
      .url        "redis://127.0.0.1:PORT/0"
      .kill()     SIGKILL, as a storage node that dies (the heal is .start(): an empty store,
                  as a restarted node without persistence is)
      .stop()     SIGTERM, then what is left of its process group
      .client()   a redis-py client for the harness's own checks and data faults
  redis_binary() -> str | None   where redis-server is (None: not installed; `make test`
                  installs Debian's package)
  MooncakeMaster(run_dir, lease_ms=10000)
      .start()    `mooncake_master` on loopback with its built-in HTTP metadata server, free
                  ports; waits until its RPC port accepts connections
      .url        the tier URL (kvpool.tier.open_tier): mooncake://HOST:PORT?metadata=...
      .kill() / .stop()   as RedisServer's (a restarted master comes back empty; its
                  clients remount their segments on their own, about 1 s later)
  MooncakeNode(run_dir, master, segment_bytes=256 MiB)
      .start()    `mooncake_client` (Mooncake's standalone client) mounting `segment_bytes`
                  into the store: a storage node; clients whose tier URL says
                  segment_bytes=0 (MooncakeMaster.url(segment_bytes=0)) keep every page there
      .kill() / .stop()   as above (a restarted node comes back empty; the master still
                  indexes what it held until it drops the dead segment)
  mooncake_binary() -> str | None   the master of the installed mooncake package
Mooncake's processes run with MC_TCP_BIND_ADDRESS=127.0.0.1 (set it in a client's process
before its first store is set up: `mooncake_env()`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from harness.system.cluster import free_port
from harness.system.procs import spawn, stop_group, wait_ready


def redis_binary() -> str | None:
    return shutil.which("redis-server")


class _StoreProcess:
    """A store's server process: kill() as a node that dies, stop() as a clean shutdown."""

    proc: subprocess.Popen | None = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=10.0)
            self.proc = None

    def __enter__(self):  # noqa: ANN204
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(_StoreProcess):
    def __init__(self, run_dir: Path, maxmemory: int | None = None, policy: str = "allkeys-lru",
                 port: int | None = None, host: str = "127.0.0.1", prefix: tuple[str, ...] | list[str] = ()):
        self.host = host  # where it listens (a network namespace's address, with its `prefix`)
        self.prefix = list(prefix)  # the argv prefix that runs it in a host (harness.system.netns)
        self.run_dir = Path(run_dir)
        self.maxmemory = maxmemory
        self.policy = policy
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.run_dir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self):  # noqa: ANN201 - redis.Redis
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self) -> RedisServer:
        binary = redis_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        args = [*self.prefix, binary, "--bind", self.host, "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", str(self.run_dir), "--protected-mode", "no"]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy]
        self.proc = spawn(args, self.log)

        def answers() -> bool | None:
            import redis

            try:
                return True if self.client().ping() else None
            except redis.ConnectionError:
                return None

        wait_ready(self.proc, answers, 30.0, f"redis-server :{self.port}", self.log)
        return self




def mooncake_binary() -> str | None:
    try:
        import mooncake
    except (ImportError, OSError):  # not installed, or its verbs library missing (make servers)
        return None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    return str(path) if path.exists() else shutil.which("mooncake_master")


def mooncake_env() -> dict[str, str]:
    """What Mooncake's processes need here: TCP bound to loopback, logs on stderr."""
    return {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_logtostderr": "1"}


class MooncakeMaster(_StoreProcess):
    def __init__(self, run_dir: Path, lease_ms: int = 10000):
        self.run_dir = Path(run_dir)
        self.lease_ms = lease_ms
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.run_dir / f"mooncake-master-{self.rpc_port}.log"

    @property
    def url(self) -> str:
        return self.url_for()

    def url_for(self, segment_bytes: int = 64 * 2**20, buffer_bytes: int = 64 * 2**20) -> str:
        """The tier URL of a client that mounts `segment_bytes` of its own memory (0: none)."""
        return (f"mooncake://127.0.0.1:{self.rpc_port}?metadata=http://127.0.0.1:{self.http_port}/metadata"
                f"&segment_bytes={segment_bytes}&buffer_bytes={buffer_bytes}")

    def start(self) -> MooncakeMaster:
        binary = mooncake_binary()
        if binary is None:
            raise FileNotFoundError("mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        args = [binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http_port}",
                "--http_metadata_server_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                "--metrics_host=127.0.0.1", f"--default_kv_lease_ttl={self.lease_ms}", "--rpc_thread_num=2",
                "--logtostderr"]
        self.proc = spawn(args, self.log, env={**os.environ, **mooncake_env()})

        def accepting() -> bool | None:
            for port in (self.rpc_port, self.http_port):
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                except OSError:
                    return None
            return True

        wait_ready(self.proc, accepting, 30.0, f"mooncake_master :{self.rpc_port}", self.log)
        return self


    def wait_remounted(self, tier, timeout_s: float = 20.0) -> None:  # noqa: ANN001 - a MooncakeTier
        """After a restart: until the client's health check passes (it remounts by itself)."""
        deadline = time.monotonic() + timeout_s
        while tier._s.health_check() != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake client not healthy {timeout_s} s after the master's restart")
            time.sleep(0.25)


class MooncakeNode(_StoreProcess):
    def __init__(self, run_dir: Path, master: MooncakeMaster, segment_bytes: int = 256 * 2**20):
        self.run_dir = Path(run_dir)
        self.master = master
        self.segment_bytes = segment_bytes
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.run_dir / f"mooncake-node-{self.port}.log"

    def start(self) -> MooncakeNode:
        binary = mooncake_binary()
        if binary is None:
            raise FileNotFoundError("mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        args = [str(Path(binary).parent / "mooncake_client"), f"--master_server_address=127.0.0.1:{self.master.rpc_port}",
                f"--metadata_server=http://127.0.0.1:{self.master.http_port}/metadata", "--host=127.0.0.1",
                f"--port={self.port}", f"--global_segment_size={self.segment_bytes}", "--protocol=tcp",
                "--logtostderr"]
        self.proc = spawn(args, self.log, env={**os.environ, **mooncake_env()})

        def mounted() -> bool | None:  # its service port answers once its segment is mounted
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            except OSError:
                return None
            return True

        wait_ready(self.proc, mounted, 30.0, f"mooncake_client :{self.port}", self.log)
        return self
