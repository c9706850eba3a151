"""The transport nemesis (kvgate.faults.proxy) as a child process, for live replicas and the gate.

  ProxyProcess.start(upstream, listen, control_file, seed, history_dir=..., remote=...)
      `python -m kvgate.faults.proxy` started and waited for; `.address` is what the replica's
      connector connects to. `.configure(faults)` / `.heal()` write its control file,
      `.stop()` returns the final {"fired", "stats"} it printed, `.kill()`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvgate.faults.proxy import ProxyError, write_control
from kvgate.harness.system.procs import StartError, spawn, terminate, wait_ready


@dataclasses.dataclass
class ProxyProcess:
    """`python -m kvgate.faults.proxy` as a child process (for live replicas and the gate)."""

    proc: subprocess.Popen
    address: str
    control_file: Path
    log_path: Path

    @classmethod
    def start(cls, upstream: str, listen: str, control_file: str | Path, seed: int, *,
              history_dir: str | Path | None = None, remote: bool | None = None, log_path: str | Path | None = None,
              replica: str = "proxy", timeout: float = 20.0) -> ProxyProcess:
        control_file = Path(control_file)
        ready = control_file.with_name(f".{control_file.name}.ready.{os.getpid()}.{threading.get_ident()}")
        ready.unlink(missing_ok=True)
        log_path = Path(log_path) if log_path else control_file.with_name(f"{control_file.stem}.proxy.log")
        args = [sys.executable, "-m", "kvgate.faults.proxy", "--upstream", upstream, "--listen", listen,
                "--control", str(control_file), "--seed", str(seed), "--ready-file", str(ready)]
        if history_dir:
            args += ["--history", str(history_dir), "--replica", replica]
        if remote is not None:
            args.append("--remote" if remote else "--no-remote")
        proc = spawn(args, log_path)
        try:
            wait_ready(proc, lambda: True if ready.exists() else None, timeout, "the fault proxy", log_path)
        except StartError as exc:
            raise ProxyError(str(exc)) from exc
        info = json.loads(ready.read_text())
        ready.unlink()
        return cls(proc, info["address"], control_file, log_path)

    def configure(self, faults: Mapping[str, Mapping[str, Any]]) -> None:
        """Write the control file; the process picks it up within ~10 ms (or on its next frame)."""
        write_control(self.control_file, faults)

    def heal(self) -> None:
        self.configure({})

    def stop(self, timeout: float = 10.0) -> dict[str, Any]:
        """SIGTERM; returns the final {"fired": ..., "stats": ...} the process printed."""
        terminate(self.proc, timeout)
        lines = [ln for ln in self.log_path.read_text().splitlines() if ln.startswith('{"fired"')]
        if self.proc.returncode != 0 or not lines:
            raise ProxyError(f"proxy exited with {self.proc.returncode}; log:\n{self.log_path.read_text()[-4000:]}")
        return json.loads(lines[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
