"""The one way the harness starts, waits for and stops the processes of the system under
test (pool daemons, fault proxies, vLLM replicas).

  spawn(args, log_path, env=None)   a child in its own session (so its whole process group
                                    can be signalled), stdout and stderr appended to the log.
  wait_ready(proc, probe, timeout, what, log_path, note_every=None)
                                    poll `probe()` until it returns something other than
                                    None; StartError (with the log's tail) if the process
                                    exits first or the timeout passes. `note_every` seconds
                                    a progress line goes to stderr.
  stop_group(proc, grace)           SIGTERM the leader, then SIGKILL what is left of its
                                    process group; waits until the group is gone.
  terminate(proc, timeout)          SIGTERM one process and wait for its exit status; past
                                    the timeout it is killed and TimeoutExpired raised.
  listeners(pgid, port) / listening(pgid, port)
                                    the TCP sockets listening on the port, the group's and
                                    others' (read from /proc); whether the group alone listens:
                                    a probe answered on a port is then known to be answered by
                                    the process started on it, not by another that holds it.
  kill_group(pgid) / group_alive(pgid) / group_pids(pgid) / tail(path)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class StartError(RuntimeError):
    """A process did not come up; the message carries its log's tail."""


def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child
    try:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=REPO)
    finally:
        log.close()


def wait_ready(proc: subprocess.Popen, probe: Callable[[], T | None], timeout: float, what: str, log_path: Path,
               *, poll_s: float = 0.02, note_every: float | None = None) -> T:
    t0 = time.monotonic()
    deadline = t0 + timeout
    last_note = t0
    while True:
        if proc.poll() is not None:
            raise StartError(f"{what} exited with {proc.returncode}; log {log_path}:\n{tail(log_path)}")
        found = probe()
        if found is not None:
            return found
        now = time.monotonic()
        if now > deadline:
            kill_group(proc.pid)
            proc.wait()
            raise StartError(f"{what} not ready within {timeout}s; log {log_path}:\n{tail(log_path)}")
        if note_every is not None and now - last_note > note_every:
            last_note = now
            print(f"kvgate: waiting for {what} ({now - t0:.0f} s)", file=sys.stderr, flush=True)
        time.sleep(poll_s)


def accepting(port: int, host: str = "127.0.0.1") -> Callable[[], bool | None]:
    """A wait_ready probe: True once something accepts a TCP connection on the port."""

    def probe() -> bool | None:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return None

    return probe


TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


def listeners(pgid: int, port: int) -> tuple[int, int]:
    """The TCP sockets listening on `port`, as (held by a process of group `pgid`, held by
    none of them). They are read from the group leader's /proc/PID/net (its network namespace,
    where a replica runs in one), their owners from each group member's /proc/PID/fd. Two
    servers that both set SO_REUSEPORT listen on one port side by side (vLLM 0.24's API server
    does), and the kernel splits the connections between them. (0, 0) when the leader is gone."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pgid}/net/{table}").read_text().splitlines()[1:]
        except (FileNotFoundError, ProcessLookupError):
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return 0, 0
    owned = set()
    for pid in group_pids(pgid):
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link in inodes:
                    owned.add(link)
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue  # gone meanwhile, or not ours to read
    return len(owned), len(inodes - owned)


def listening(pgid: int, port: int) -> bool:
    """Whether group `pgid` listens on `port`, and nothing else does."""
    ours, others = listeners(pgid, port)
    return ours > 0 and others == 0


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the leader (vllm serve shuts its engine down and frees its shared memory),
    then SIGKILL whatever of its process group is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    _wait_gone(proc.pid, 10)  # engine processes exit after the leader
    kill_group(proc.pid)
    proc.wait()
    _wait_gone(proc.pid, 15)


def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return proc.returncode


def _wait_gone(pgid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def group_pids(pgid: int) -> list[int]:
    """The live processes of group `pgid` (read from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    out.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return out


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: Path, n: int = 6000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError as exc:
        return f"(no log: {exc})"
