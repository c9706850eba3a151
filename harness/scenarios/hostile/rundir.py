"""Hostile scenario: rundir (see kvgate.harness.scenarios.hostile). Another local user (uid
65534, `nobody`) pre-creates the directory above a pool's run directory, in a sticky
world-writable directory as /tmp is, then puts its own directory with a listening socket
where the run directory's pool.sock is. The pool must refuse to start there, and a
tenant's client must refuse that socket before it sends a byte, its token above all.

  attempt(token, legacy=False) -> dict
      the attempt, with the tenant's real token, against a real daemon (in a thread) and
      a real client: what the daemon said, what the client said, what the other user
      received. `legacy`: the known-bad run-dir creation and the client that asks the
      kernel nothing (kvgate.faults.identity_controls: LegacyRunDirDaemon, UncheckedPeerClient).
  rundir_precreated(cluster, corpus, seed, control=None) -> Verdict
      the scenario: the attempt with the cluster pool's token, judged by its own checks;
      control "legacy_run_dir": the attempt with `legacy`, whose token the other user
      collects (caught by the scenario's own checks: "received nothing of the tenant's token").

Acting as another user needs root (a forked child that sets its uid); without it the attempt cannot
be made and the run says so (a failed verdict, never a pass).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from kvgate.harness.checkers.verdict import Checks, Verdict
from kvgate.harness.workload.prompts import Corpus
from kvpool.client.pool_client import PoolClient
from kvpool.errors import PoolError
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import InsecureRunDir, PoolDaemon

OTHER_UID = 65534  # nobody
LISTEN_S = 3.0  # how long the other user's socket waits for a client and its bytes
CLIENT_TIMEOUT_S = 1.0


# -- the other user's half: run in a forked child whose uid and gid are OTHER_UID ----------

def _precreate(out: IO[str], path: str) -> None:
    """The directory above someone's run directory, this user's own (mode 0755)."""
    os.mkdir(path, 0o755)
    os.chmod(path, 0o755)


def _listen(out: IO[str], run_dir: str, seconds: float) -> None:
    """Move whatever is at `run_dir` aside (this user owns the directory above it), make a
    directory of its own there with a socket pool.sock anyone may connect to, say "ready",
    accept one connection and write what arrives within `seconds`, as hex."""
    if os.path.lexists(run_dir):
        os.rename(run_dir, f"{run_dir}.moved-{os.getpid()}")
    os.mkdir(run_dir, 0o755)
    path = os.path.join(run_dir, "pool.sock")
    got = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as srv:
        srv.bind(path)
        os.chmod(path, 0o777)
        srv.listen(4)
        srv.settimeout(seconds)
        out.write("ready\n")
        out.flush()
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            conn = None
        if conn is not None:
            with conn:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    conn.settimeout(max(deadline - time.monotonic(), 0.01))
                    try:
                        chunk = conn.recv(65536)
                    except TimeoutError:
                        break
                    if not chunk:
                        break
                    got += chunk
    out.write(got.hex() + "\n")


def as_other_user(fn: Callable[..., None], *args: object) -> tuple[int, IO[str]]:
    """fn(out, *args) in a forked child of uid and gid OTHER_UID (needs root): its pid and
    the read end of what it writes to `out` (its last line "error ..." if it raised).
    Forked, not executed: the other user may not be able to reach this interpreter."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls and the pipe, then _exit
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            with os.fdopen(w, "w") as out:
                try:
                    fn(out, *args)
                    code = 0
                except OSError as exc:
                    out.write(f"error {type(exc).__name__}: {exc}\n")
        finally:
            os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)


def _wait(pid: int, out: IO[str], what: str) -> str:
    text = out.read()
    out.close()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(f"the other user's {what} failed: {text.strip()[-400:]}")
    return text


def sticky_tmp() -> Path:
    """A fresh directory as /tmp is (root's, mode 1777) to play in, so the host's /tmp/kvgate-*
    are never touched."""
    base = Path(tempfile.mkdtemp(prefix="kvgate-hostile-rundir-", dir="/tmp"))
    os.chmod(base, 0o1777)
    return base


def attempt(token: str, *, legacy: bool = False, tenant: str = "default") -> dict:
    if os.geteuid() != 0:
        raise AssertionError("acting as another local user (uid 65534) needs root: the attempt was not made")
    from kvgate.faults.identity_controls import LegacyRunDirDaemon, UncheckedPeerClient

    daemon_cls, client_cls = (LegacyRunDirDaemon, UncheckedPeerClient) if legacy else (PoolDaemon, PoolClient)
    base = sticky_tmp()
    out: dict = {"legacy": legacy}
    daemon = None
    try:
        parent = base / f"kvgate-{os.geteuid()}"
        run_dir = parent / "pool"
        _wait(*as_other_user(_precreate, str(parent)), "mkdir")
        out["parent_owner"] = parent.stat().st_uid
        config = PoolConfig(name=f"hostile-rundir-{os.getpid()}", page_size=4096, num_pages=4, run_dir=run_dir,
                            tcp_host=None, tenants={tenant: token}, heartbeat_s=0.0)
        try:
            daemon = daemon_cls(config).start_thread()
            out["daemon"] = "started"
        except InsecureRunDir as exc:
            out["daemon"] = "refused"
            out["daemon_error"] = f"{type(exc).__name__}: {exc}"
        pid, listener = as_other_user(_listen, str(run_dir), LISTEN_S)
        try:
            ready = listener.readline().strip()
            if ready != "ready":
                raise AssertionError(f"the other user's socket did not come up: {ready} {listener.read()[-400:]}")
            try:
                with client_cls(f"unix:{run_dir}/pool.sock", tenant, token, name="victim",
                                timeout_s=CLIENT_TIMEOUT_S):
                    out["client"] = "connected"
            except PoolError as exc:
                out["client"] = type(exc).__name__
                out["client_error"] = str(exc)
        finally:
            got = _wait(pid, listener, "socket")
        received = bytes.fromhex(got.strip().splitlines()[-1]) if got.strip() else b""
        out["received_bytes"] = len(received)
        out["token_received"] = token.encode() in received
    finally:
        if daemon is not None:
            daemon.stop_thread()
        shutil.rmtree(base, ignore_errors=False)
    return out


def judge(out: dict) -> Verdict:
    c = Checks()
    c.check("the pool refused to start under a directory another user owns", out["daemon"] == "refused"
            and f"owned by uid {OTHER_UID}" in out.get("daemon_error", ""), out.get("daemon_error", out["daemon"]))
    c.check("the client refused the other user's socket as UntrustedPool", out.get("client") == "UntrustedPool",
            out.get("client_error", out.get("client")))
    c.check("the other user received nothing of the tenant's token", not out["token_received"],
            f"{out['received_bytes']} bytes")
    c.check("the other user received no byte at all", out["received_bytes"] == 0, out["received_bytes"])
    c.evidence.update(out)
    return c.verdict("another user's directory above the run directory: the pool refused it, the client sent "
                     "nothing to the other user's socket")


def rundir_precreated(cluster, corpus: Corpus, seed: int, *, control: str | None = None) -> Verdict:  # noqa: ANN001
    if control not in (None, "legacy_run_dir"):
        raise ValueError(f"unknown control {control!r}")
    cluster.nemesis("hostile_rundir", other_uid=OTHER_UID, control=control)
    return judge(attempt(cluster.pool.token, legacy=control is not None))


RUNNERS: dict[str, Callable[..., Verdict]] = {"rundir_precreated": rundir_precreated}
