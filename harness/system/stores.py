"""The distributed stores the network tier runs on, as real processes the harness starts,
faults and stops (kvpool.tier's backends are clients of these).

  RedisServer(run_dir, maxmemory=None, policy="allkeys-lru", port=None)
      .start()    `redis-server` on loopback (a free port unless given), no persistence,
                  its log in run_dir; waits until it answers PING
      .url        "redis://127.0.0.1:PORT/0"
      .kill()     SIGKILL, as a storage node that dies (the heal is .start(): an empty store,
                  as a restarted node without persistence is)
      .stop()     SIGTERM, then what is left of its process group
      .client()   a redis-py client for the harness's own checks and data faults
  redis_binary() -> str | None   where redis-server is (None: not installed; `make test`
                  installs Debian's package)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

from harness.system.procs import spawn, stop_group, wait_ready


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, run_dir: Path, maxmemory: int | None = None, policy: str = "allkeys-lru",
                 port: int | None = None):
        self.run_dir = Path(run_dir)
        self.maxmemory = maxmemory
        self.policy = policy
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.run_dir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):  # noqa: ANN201 - redis.Redis
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self) -> RedisServer:
        binary = redis_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        args = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
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

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=10.0)
            self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
