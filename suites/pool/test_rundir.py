"""The run directory and the socket a tenant sends its token to (kvpool.pool.private_dir,
kvpool.pool.daemon, kvpool.pool.cli, kvpool.client.pool_client): a directory above the run directory that
another user (uid 65534) created, or a link of theirs in the chain, is refused by the
daemon and by `kvpool serve` with InsecureRunDir naming it; a client refuses a socket
another user listens on (UntrustedPool, SO_PEERCRED) before it sends a byte. And the
hostile rundir scenario's attempt with its control (the old creation, a client that asks
the kernel nothing), caught by the same judgement.

Acting as another user needs root: those tests are skipped without it (the group-writable
ones run as anyone)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvgate.harness.scenarios.hostile.rundir import OTHER_UID, _listen, _wait, as_other_user, attempt, judge, sticky_tmp
from kvpool import errors
from kvpool.client.pool_client import PoolClient
from kvpool.pool.private_dir import ensure_private_dir
from kvpool.pool.config import PoolConfig
from kvpool.pool.daemon import InsecureRunDir, PoolDaemon

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")


@pytest.fixture
def base():
    """A directory as /tmp is (root's, sticky, world-writable), under /tmp so that uid 65534 can reach it."""
    import shutil

    b = sticky_tmp() if os.geteuid() == 0 else Path(__import__("tempfile").mkdtemp())
    yield b
    shutil.rmtree(b)


def start(run_dir: Path) -> PoolDaemon:
    config = PoolConfig(name=f"rundir-{os.getpid()}", page_size=4096, num_pages=4, run_dir=run_dir, tcp_host=None,
                        tenants={"default": "tok"}, heartbeat_s=0.0)
    return PoolDaemon(config).start_thread()


def refused(run_dir: Path) -> InsecureRunDir:
    """The daemon's refusal (a daemon that starts is stopped, and the test fails)."""
    try:
        d = start(run_dir)
    except InsecureRunDir as exc:
        return exc
    d.stop_thread()
    raise AssertionError(f"the daemon started in {run_dir}")


@root_only
def test_daemon_refuses_a_parent_another_user_created(base):
    parent = base / "kvgate-0"
    parent.mkdir(mode=0o755)
    os.chown(parent, OTHER_UID, OTHER_UID)
    exc = refused(parent / "pool")
    assert exc.path == str(parent) and f"owned by uid {OTHER_UID}" in exc.reason, exc
    assert not (parent / "pool").exists()  # a refusal creates nothing


@root_only
@pytest.mark.parametrize("link", ["parent", "run-dir"])
def test_daemon_refuses_another_users_link_in_the_chain(base, link):
    theirs = base / "theirs"
    theirs.mkdir(mode=0o700)
    if link == "parent":  # /tmp/kvgate-0 -> a directory of theirs
        os.chown(theirs, OTHER_UID, OTHER_UID)
        planted, run_dir = base / "kvgate-0", base / "kvgate-0" / "pool"
    else:  # the run directory itself -> a directory that passes every check on its own
        planted = run_dir = base / "pool"
    planted.symlink_to(theirs)
    os.lchown(planted, OTHER_UID, OTHER_UID)
    exc = refused(run_dir)
    assert exc.path == str(planted) and "symbolic link owned by uid 65534" in exc.reason, exc


def test_daemon_refuses_a_group_writable_parent(tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o775)
    exc = refused(parent / "pool")
    assert exc.path == str(parent) and "writable by group or others" in exc.reason, exc


def test_a_trusted_chain_is_made_private_and_links_of_its_own_are_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(real)
    got = ensure_private_dir(tmp_path / "link" / "a" / "b")
    assert got == real / "a" / "b" and (real / "a").stat().st_mode & 0o777 == 0o700
    assert got.stat().st_mode & 0o777 == 0o700


@root_only
def test_kvpool_serve_refuses_a_parent_another_user_created(base):
    parent = base / "kvgate-0"
    parent.mkdir(mode=0o755)
    os.chown(parent, OTHER_UID, OTHER_UID)
    proc = subprocess.Popen([sys.executable, "-m", "kvpool", "serve", "--run-dir", str(parent / "pool"), "--tcp",
                             "none", "--pages", "4", "--page-size", "4096"], stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2 and "run directory refused" in err and str(parent) in err, err
    assert not (parent / "pool").exists()


@root_only
def test_client_refuses_a_socket_another_user_listens_on(base):
    run_dir = base / "pool"
    pid, listener = as_other_user(_listen, str(run_dir), 2.0)
    try:
        assert listener.readline().strip() == "ready"
        t0 = time.monotonic()
        with pytest.raises(errors.PoolError) as exc:
            PoolClient(f"unix:{run_dir}/pool.sock", "default", "the-token", timeout_s=1.0)
        refused_s = time.monotonic() - t0  # the refusal's own time, not the other user's exit
    finally:
        got = _wait(pid, listener, "socket")
    assert type(exc.value).__name__ == "UntrustedPool" and isinstance(exc.value, errors.TransportError), exc.value
    assert f"uid {OTHER_UID}" in str(exc.value) and refused_s < 1.0  # refused at once, not at its timeout
    assert got.strip() == ""  # not one byte, the hello and its token least of all


@root_only
@pytest.mark.parametrize("legacy", [False, True], ids=["fixed", "control-legacy-run-dir"])
def test_hostile_rundir_attempt_and_its_control(legacy):
    """The gate's hostile-rundir-precreated: the pool refuses, the client sends nothing; the
    control (the old creation and a client that asks the kernel nothing) hands the other
    user the tenant's token, caught by the same checks for the reason the scenario file names."""
    out = attempt("tenant-token-0123456789", legacy=legacy)
    v = judge(out)
    if not legacy:
        assert v.valid is True, v.evidence["checks_failed"]
    else:
        assert v.valid is False and out["token_received"], out
        assert any("received nothing of the tenant's token" in f for f in v.evidence["checks_failed"])


@root_only
def test_client_keeps_its_attach_ticket_from_another_users_socket(base, tmp_path):
    """The daemon is genuine but its attach socket has been replaced by another user's (the
    ticket it would send is the tenant's segment, once): the client sends nothing there,
    and moves its pages in frames."""
    daemon = start(tmp_path / "pool")
    try:
        pid, listener = as_other_user(_listen, str(base / "theirs"), 2.0)
        try:
            assert listener.readline().strip() == "ready"
            os.replace(base / "theirs" / "pool.sock", daemon.attach_path)
            with PoolClient(f"unix:{daemon.unix_path}", "default", "tok", timeout_s=1.0) as c:
                assert c.arena is None and f"uid {OTHER_UID}" in c.attach_error, c.attach_error
                c.ping()
        finally:
            got = _wait(pid, listener, "socket")
    finally:
        daemon.stop_thread()
    assert got.strip() == ""  # the ticket never left


def test_the_default_token_is_written_once_and_kept_by_a_restart(tmp_path):
    from kvpool.pool.cli import tenants_from_args

    run_dir = tmp_path / "run"
    first = tenants_from_args([], None, run_dir)
    assert set(first) == {"default"}
    assert (run_dir / "tokens.json").stat().st_mode & 0o777 == 0o600
    again = tenants_from_args([], None, run_dir, command="kvpool keeper")  # a restart, or a second instance
    assert again == first  # its clients' token still holds


@pytest.mark.parametrize("case", ["readable by others", "not JSON", "a link"])
def test_a_tokens_file_that_is_not_private_or_not_tokens_is_refused_not_overwritten(tmp_path, case):
    from kvpool.pool.cli import tenants_from_args

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    path = run_dir / "tokens.json"
    if case == "a link":
        (tmp_path / "elsewhere.json").write_text('{"default": "x"}')
        path.symlink_to(tmp_path / "elsewhere.json")
    else:
        path.write_text('{"default": "x"}' if case == "readable by others" else "{")
        path.chmod(0o644 if case == "readable by others" else 0o600)
    before = path.read_bytes() if case != "a link" else None
    with pytest.raises(SystemExit) as exc:
        tenants_from_args([], None, run_dir)
    assert exc.value.code == 2
    if before is not None:
        assert path.read_bytes() == before  # left as it was, for the operator
