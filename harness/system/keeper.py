"""A GPU keeper (`python -m kvpool keeper`) in its own process, as an operator runs it: the
tier a replica reaches with `pool = "keeper:RUN_DIR"` (kvpool.gpu.tier_backend).

  KeeperProcess(run_dir, *args, backing="memfd", before=None)
        starts the keeper on `run_dir` (a private directory that exists) with tenant
        default=tok, 64 KiB pages, 8 of them and a maintenance tick of 50 ms unless `args`
        say otherwise (later options win), and waits until its address file names a new
        instance of this process (not `before`). `.address`, `.log`, `.proc`.
  .output()      the keeper's log.
  .kill()        SIGKILL (a crash: its run directory stays behind).
  .terminate()   SIGTERM, then its exit status.
  .stop()        SIGKILL if it still runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kvpool
from kvpool.errors import PoolError
from kvpool.gpu.tier_client import KeeperAddress, read_keeper_address

ROOT = Path(kvpool.__file__).resolve().parent.parent  # this tree, for the keeper's process too
START_S = 60.0


class KeeperProcess:
    def __init__(self, run_dir: Path, *args: str, backing: str = "memfd", before: bytes | None = None,
                 start_s: float = START_S):
        self.run_dir = Path(run_dir)
        self.log = self.run_dir.parent / f"{self.run_dir.name}-{time.monotonic_ns()}.log"
        self.address: KeeperAddress | None = None
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpool", "keeper", "--backing", backing, "--run-dir", str(self.run_dir),
                 "--tenant", "default=tok", "--page-size", "64KiB", "--pages", "8", "--maintenance-s", "0.05",
                 *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        end = time.monotonic() + start_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the keeper exited {self.proc.returncode}: {self.output()}")
            with contextlib.suppress(PoolError):
                addr = read_keeper_address(self.run_dir)
                if addr.instance != before and addr.pid == self.proc.pid:
                    self.address = addr
                    return
            if time.monotonic() > end:
                self.stop()
                raise TimeoutError(f"no address from the keeper within {start_s} s: {self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
