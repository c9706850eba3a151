"""The distributed stores the network tier runs on, as real processes the harness starts,
faults and stops (kvpool.tier.record's backends are clients of these).

  RedisServer(run_dir, maxmemory=None, policy="allkeys-lru", port=None, host="127.0.0.1", prefix=(),
              tenants=())
      .start()    `redis-server` on `host` (loopback by default; a network namespace's
                  address with that host's argv `prefix`), a free port unless given, no persistence,
                  its log in run_dir; waits until it answers PING
      tenants     with tenants, the server's access control is on (an ACL file, mode 0600,
                  in run_dir): the default user needs the admin password (`.url` carries
                  it), and each tenant has an ACL user `kvpool-TENANT` (acl_user) with a
                  random password, restricted to its own keys (kvpool.tier.record.tier_prefix:
                  `~kvpool:TENANT:*`) and to the tier's commands (GET, SET, EXISTS, DEL,
                  PING: no SCAN or KEYS, which ACL key patterns do not filter, no FLUSHALL).
                  Without tenants, no access control (any client reaches every key).
      .url        "redis://127.0.0.1:PORT/0" (with tenants: "redis://default:ADMIN@...")
      .tenant_url(tenant)   the tenant's tier URL: "redis://kvpool-TENANT:PASSWORD@HOST:PORT/0"
      .kill()     SIGKILL, as a storage node that dies (the heal is .start(): an empty store,
                  as a restarted node without persistence is)
      .stop()     SIGTERM, then what is left of its process group
      .client()   a redis-py client for the harness's own checks and data faults
  redis_binary() -> str | None   where redis-server is (None: not installed; `make test`
                  installs Debian's package)
  MooncakeMaster(run_dir, lease_ms=10000, host="127.0.0.1", prefix=())
      .start()    `mooncake_master` on `host` (loopback by default) with its built-in HTTP
                  metadata server, free ports; waits until its RPC port accepts connections
      .url        the tier URL (kvpool.tier.registry.open_tier): mooncake://HOST:PORT?metadata=...
      .kill() / .stop()   as RedisServer's (a restarted master comes back empty; its
                  clients remount their segments on their own, about 1 s later)
  MooncakeNode(run_dir, master, segment_bytes=256 MiB, host="127.0.0.1", prefix=())
      .start()    `mooncake_client` (Mooncake's standalone client) mounting `segment_bytes`
                  into the store: a storage node; clients whose tier URL says
                  segment_bytes=0 (MooncakeMaster.url(segment_bytes=0)) keep every page there
      .kill() / .stop()   as above (a restarted node comes back empty, as a new node on a
                  new port; the master still indexes what the dead one held until it unmounts
                  its segment, a client TTL after its last heartbeat)
  mooncake_binary() -> str | None   the master of the installed mooncake package
Mooncake's processes run with MC_TCP_BIND_ADDRESS=127.0.0.1 (set it in a client's process
before its first store is set up: `mooncake_env()`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

from kvgate.harness.system.cluster import free_port
from kvgate.harness.system.procs import spawn, stop_group, wait_ready
from kvpool.tier.record import tier_prefix

TENANT_COMMANDS = ("get", "getrange", "set", "exists", "del", "ping")  # what kvpool.tier.redis runs, and no more


def acl_user(tenant: str) -> str:
    return f"kvpool-{tenant}"


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
                 port: int | None = None, host: str = "127.0.0.1", prefix: tuple[str, ...] | list[str] = (),
                 tenants: tuple[str, ...] | list[str] = ()):
        self.host = host  # where it listens (a network namespace's address, with its `prefix`)
        self.prefix = list(prefix)  # the argv prefix that runs it in a host (kvgate.harness.system.netns)
        self.run_dir = Path(run_dir).resolve()  # absolute: a server may chdir before reading a file named here
        self.maxmemory = maxmemory
        self.policy = policy
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.run_dir / f"redis-{self.port}.log"
        # Credentials (not a test's random choice: unseeded, as the pool's tokens are)
        self.admin_password = secrets.token_hex(16) if tenants else None
        self.passwords = {t: secrets.token_hex(16) for t in tenants}  # tenant -> its ACL user's password

    @property
    def url(self) -> str:
        auth = f"default:{self.admin_password}@" if self.admin_password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def tenant_url(self, tenant: str) -> str:
        return f"redis://{acl_user(tenant)}:{self.passwords[tenant]}@{self.host}:{self.port}/0"

    def _acl_file(self) -> Path:
        lines = [f"user default on >{self.admin_password} ~* &* +@all"]
        cmds = " ".join(f"+{c}" for c in TENANT_COMMANDS)
        for tenant, password in self.passwords.items():
            lines.append(f"user {acl_user(tenant)} on >{password} resetkeys ~{tier_prefix(tenant)}* resetchannels "
                         f"-@all {cmds}")
        path = self.run_dir / f"redis-{self.port}.acl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

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
        if self.admin_password:
            args += ["--aclfile", str(self._acl_file())]
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


def mooncake_env(host: str = "127.0.0.1") -> dict[str, str]:
    """What Mooncake's processes need here: TCP bound to the host's address (loopback by
    default), logs on stderr."""
    return {"MC_TCP_BIND_ADDRESS": host, "GLOG_logtostderr": "1"}


class MooncakeMaster(_StoreProcess):
    def __init__(self, run_dir: Path, lease_ms: int = 10000, host: str = "127.0.0.1",
                 prefix: tuple[str, ...] | list[str] = (), client_ttl_s: int = 10):
        self.run_dir = Path(run_dir).resolve()  # absolute: a server may chdir before reading a file named here
        self.lease_ms = lease_ms
        self.client_ttl_s = client_ttl_s  # a client (a storage node) silent this long is unmounted
        self.host = host  # where it listens (a network namespace's address, with its `prefix`)
        self.prefix = list(prefix)
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.run_dir / f"mooncake-master-{self.rpc_port}.log"

    @property
    def url(self) -> str:
        return self.url_for()

    def url_for(self, segment_bytes: int = 64 * 2**20, buffer_bytes: int = 64 * 2**20,
                local_hostname: str = "127.0.0.1") -> str:
        """The tier URL of a client that mounts `segment_bytes` of its own memory (0: none),
        on a host whose address is `local_hostname`."""
        return (f"mooncake://{self.host}:{self.rpc_port}?metadata={self.metadata}"
                f"&segment_bytes={segment_bytes}&buffer_bytes={buffer_bytes}&local_hostname={local_hostname}")

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def start(self) -> MooncakeMaster:
        binary = mooncake_binary()
        if binary is None:
            raise FileNotFoundError("mooncake is not installed (pip install mooncake-transfer-engine-non-cuda)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        args = [*self.prefix, binary, f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http_port}",
                f"--http_metadata_server_host={self.host}", f"--metrics_port={self.metrics_port}",
                f"--metrics_host={self.host}", f"--default_kv_lease_ttl={self.lease_ms}", "--rpc_thread_num=2",
                f"--client_ttl={self.client_ttl_s}", "--logtostderr"]
        self.proc = spawn(args, self.log, env={**os.environ, **mooncake_env(self.host)})

        def accepting() -> bool | None:
            for port in (self.rpc_port, self.http_port):
                try:
                    socket.create_connection((self.host, port), 0.2).close()
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
    def __init__(self, run_dir: Path, master: MooncakeMaster, segment_bytes: int = 256 * 2**20,
                 host: str = "127.0.0.1", prefix: tuple[str, ...] | list[str] = ()):
        self.host = host
        self.prefix = list(prefix)
        self.run_dir = Path(run_dir).resolve()  # absolute: a server may chdir before reading a file named here
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
        # A restart is a new node (a new port, so a new segment name): the master unmounts the
        # dead one's segment after its client TTL instead of taking the new one for it.
        self.port = free_port()
        self.log = self.run_dir / f"mooncake-node-{self.port}.log"
        args = [*self.prefix, str(Path(binary).parent / "mooncake_client"),
                f"--master_server_address={self.master.host}:{self.master.rpc_port}",
                f"--metadata_server={self.master.metadata}", f"--host={self.host}",
                f"--port={self.port}", f"--global_segment_size={self.segment_bytes}", "--protocol=tcp",
                "--logtostderr"]
        self.proc = spawn(args, self.log, env={**os.environ, **mooncake_env(self.host)})

        def mounted() -> bool | None:  # its service port answers once its segment is mounted
            try:
                socket.create_connection((self.host, self.port), 0.2).close()
            except OSError:
                return None
            return True

        wait_ready(self.proc, mounted, 30.0, f"mooncake_client :{self.port}", self.log)
        return self
