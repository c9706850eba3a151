"""The GPU keeper's command (`kvpool keeper`, kvpool.gpu.cli) and a keeper's restart under a new
instance id, followed by the replicas' TierLink (kvpool.gpu.tier_client), without a GPU: the
keeper runs as its own process from the command (`python -m kvpool keeper --backing memfd`: host
memfds behind the same protocol), the host pool on a thread, the replicas' links in this process
(each its own session and mapping).

  guard                                      oracle                              control
  a link never uses a grant of a killed      the instance-1 lease refused        InstanceBlindTierLink: the old
  instance in the next (instance check)      (WrongInstance), the instance-2     lease releases instance 2's
                                             lease of the same id intact; the    lease of the same id; the old
                                             old page index refused              page index reads another block
  a link maps the new instance's buffer      a publish through instance 2 loads  StaleMappingTierLink: P writes
                                             byte-exact in another link          the old buffer; C's bytes differ
  the killed keeper's heartbeat              KeeperStale past the bound on a     (the existing HeartbeatBlindTierClient,
                                             pinned clock, served by the host    test_gpu_keeper_wire.py)
                                             pool meanwhile
  a link keeps an old instance's mapping     C's (open lease) and P's (open      EagerUnmapTierLink as C, then
  while a grant of it is open                reservation) instance-1 mappings    as P: that mapping closed at
                                             open after the reconnect, closed    the reconnect
                                             when that grant ends

Also: the command's SIGTERM stop (address file first, sessions ended, heartbeat 0: KeeperStale at
once, a clean restart after), and every bad flag's typed error and exit code.
What is not checked here: device memory (suites/gpu), the connector's use of the link.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvgate.faults.keeper_controls import EagerUnmapTierLink, InstanceBlindTierLink, StaleMappingTierLink
from kvgate.harness.scenarios import gpu_keeper_wire as W
from kvgate.harness.system.keeper import KeeperProcess
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.errors import MissCause, PoolError, TransportError
from kvpool.gpu import cli as keeper_cli
from kvpool.gpu.tier import fall_through
from kvpool.gpu.tier_client import ADDRESS_FILE, KeeperStale, TierLink, read_keeper_address
from kvpool.pool.digest import DigestKind, page_digest

PAGE = 64 * 1024
STALE_S = 5.0


class PinnedClock:
    def __init__(self) -> None:
        self.pinned: int | None = None

    def __call__(self) -> int:
        return time.monotonic_ns() if self.pinned is None else self.pinned


Keeper = KeeperProcess  # `python -m kvpool keeper` in its own process (kvgate.harness.system.keeper)


@contextlib.contextmanager
def host_pool():
    pool = thread_pool(page_size=PAGE, num_pages=16)
    host = PoolClient(f"unix:{pool.unix_path}", "default", "tok", name="test")
    try:
        yield pool, host
    finally:
        host.close()
        pool.stop_thread()


def host_publish(host: PoolClient, keys: list[bytes], seed: int) -> None:
    res = host.reserve(W.NS, keys, [PAGE] * len(keys))
    digests = []
    for i in range(len(keys)):
        data = W.page_bytes(seed, i, PAGE)
        host.write_page(res, i, data)
        digests.append(page_digest(data, DigestKind.XXH3))
    assert host.commit(res.reservation_id, digests).committed == len(keys)


def host_run(host: PoolClient):  # noqa: ANN201
    def run(hashes):  # noqa: ANN001, ANN202
        found = host.lookup(W.NS, hashes)
        return len(found.hits), None if found.miss is None else found.miss.cause
    return run


def publish(link: TierLink, keys: list[bytes], seed: int):  # noqa: ANN201
    """Reserve, write block i's seeded bytes (page_bytes(seed, i)), sketch, commit."""
    res = link.reserve(W.NS, keys, [PAGE] * len(keys))
    digests = []
    for i in range(len(keys)):
        view = link.page_view(res, i)
        view[:] = W.page_bytes(seed, i, PAGE).tobytes()
        digests.append(page_digest(np.frombuffer(view, np.uint8), DigestKind.SKETCH))
    assert link.commit(res, digests).committed == len(keys)
    return res


def read(link: TierLink, lease) -> tuple[list[str], list[int]]:  # noqa: ANN001
    """Each leased page's blake2b, and the indexes whose generation or sketch does not match."""
    out, bad = [], []
    for i, ref in enumerate(lease.result.hits):
        data = np.frombuffer(link.page_view(lease, i), np.uint8)[: ref.length].copy()
        if link.generation(lease, i) != ref.generation or page_digest(data, DigestKind.SKETCH) != ref.digest:
            bad.append(i)
        out.append(W.blake(data))
    return out, bad


def expected(seed: int, n: int) -> list[str]:
    return [W.blake(W.page_bytes(seed, i, PAGE)) for i in range(n)]


def outcome(fn) -> str:  # noqa: ANN001
    try:
        fn()
    except PoolError as exc:
        return type(exc).__name__
    return "ok"


# -- a killed keeper, restarted ----------------------------------------------------------------

def restart_verdict(tmp_path: Path, name: str, seed: int, p_cls: type[TierLink] = TierLink,
                    c_cls: type[TierLink] = TierLink) -> dict[str, object]:
    """P publishes A through instance 1 and C loads it, keeping its lease; P leaves a reservation
    open. The keeper is SIGKILLed: C's lookups fall through to the host pool (which holds A), and
    judged on a clock pinned past the heartbeat's bound, KeeperStale. A keeper is started again
    from the command: C's next lookup reconnects by itself (a new instance, an empty tier); P
    publishes B through it and C loads B, holding its lease; then C presents its instance-1 lease
    and P its instance-1 reservation."""
    run_dir = tmp_path / name
    run_dir.mkdir(mode=0o700)
    A, B = W.KEYS(3), W.KEYS(3, base=20_000)
    out: dict[str, object] = {}
    clock = PinnedClock()
    with host_pool() as (_, host):
        host_publish(host, A, seed)
        k1 = Keeper(run_dir)
        k2 = None
        p = p_cls(run_dir, "default", "tok", name="P", stale_after_s=STALE_S, timeout_s=10.0).connect()
        c = c_cls(run_dir, "default", "tok", name="C", stale_after_s=STALE_S, timeout_s=10.0, clock_ns=clock).connect()
        try:
            first = k1.address.instance
            assert p.instance == c.instance == first
            publish(p, A, seed)
            old_lease = c.acquire(W.NS, A)  # kept past the kill
            blakes, bad = read(c, old_lease)
            out["instance1_byte_exact"] = blakes == expected(seed, 3) and bad == []
            old_res = p.reserve(W.NS, W.KEYS(1, base=40_000), [PAGE])
            c_map1, p_map1 = c.client.tier, p.client.tier

            k1.kill()
            seg = fall_through(A, [("gpu", c.run(W.NS)), ("host", host_run(host))])
            out["down"] = (seg.segments, seg.miss)
            beat = c.client.tier.keeper_heartbeat_ns()
            clock.pinned = beat + int(STALE_S * 1e9) + 1
            out["stale"] = outcome(lambda: c.lookup(W.NS, A))
            out["stale_counted"] = c.metrics.registry.get_sample_value("kvpool_client_keeper_stale_total")
            seg = fall_through(A, [("gpu", c.run(W.NS)), ("host", host_run(host))])
            out["down_stale"] = (seg.segments, seg.miss)
            clock.pinned = None

            k2 = Keeper(run_dir, before=first)
            out["recovery_noted"] = "did not stop cleanly" in k2.address.recovery_note
            found = c.lookup(W.NS, A)  # reconnects by itself
            out["after_restart"] = (len(found.hits), found.miss.cause if found.miss else None)
            out["c_instance"] = c.instance == k2.address.instance != first
            out["c_reconnects"] = c.reconnects
            # C's instance-1 lease is still open: its mapping stays until that lease ends
            out["old_map_kept"] = (c_map1.closed, c.retired)

            publish(p, B, seed + 1)  # P reconnects by itself
            # P's instance-1 reservation is still open (a copy into it may still run): its mapping stays
            out["p_old_map_kept"] = (p_map1.closed, p.retired)
            new_lease = c.acquire(W.NS, B)
            assert new_lease.lease_id == old_lease.lease_id, "the control needs colliding lease ids"
            blakes, bad = read(c, new_lease)
            out["instance2_byte_exact"] = blakes == expected(seed + 1, 3)
            out["instance2_digest_bad"] = bad

            def old_view() -> str:
                try:
                    data = bytes(c.page_view(old_lease, 0))
                except PoolError as exc:
                    return type(exc).__name__
                return "byte_exact" if W.blake(data) == expected(seed, 1)[0] else "other_bytes"
            out["old_view"] = old_view()
            out["old_release"] = outcome(lambda: c.release(old_lease))
            out["old_map_dropped_at_release"] = (c_map1.closed, c.retired)
            out["new_release"] = outcome(lambda: c.release(new_lease))
            out["old_commit"] = outcome(lambda: p.commit(old_res, [b"\0" * 16]))
            out["p_old_map_dropped_at_commit"] = p_map1.closed
        finally:
            p.close()
            c.close()
            k1.stop()
            if k2 is not None:
                k2.stop()
    return out


GOOD_RESTART = {
    "instance1_byte_exact": True,
    "down": ((("host", 0, 3),), None),
    "stale": "KeeperStale", "stale_counted": 1.0,
    "down_stale": ((("host", 0, 3),), None),
    "recovery_noted": True,
    "after_restart": (0, MissCause.NEVER_PUBLISHED),
    "c_instance": True, "c_reconnects": 1,
    "instance2_byte_exact": True, "instance2_digest_bad": [],
    "old_view": "WrongInstance", "old_release": "WrongInstance", "new_release": "ok", "old_commit": "WrongInstance",
    "old_map_kept": (False, 1), "old_map_dropped_at_release": (True, 0),
    "p_old_map_kept": (False, 1), "p_old_map_dropped_at_commit": True,
}


def test_a_killed_keeper_restarts_under_a_new_instance_and_the_link_follows(tmp_path, test_seed):
    assert restart_verdict(tmp_path, "k", test_seed) == GOOD_RESTART


def test_a_link_that_skips_the_instance_check_is_caught(tmp_path, test_seed):
    """Control: C presents its instance-1 lease to instance 2. Its release ends the instance-2
    lease of the same id, whose holder then finds it gone; its page index reads another block."""
    got = restart_verdict(tmp_path, "blind", test_seed, c_cls=InstanceBlindTierLink)
    assert got["old_release"] == "ok" and got["new_release"] == "LeaseLost", got
    assert got["old_view"] == "other_bytes", got  # the byte-exact oracle
    assert got != GOOD_RESTART


def test_a_link_that_keeps_its_old_mapping_is_caught(tmp_path, test_seed):
    """Control: P follows the new instance's session but writes through the old buffer's mapping:
    C's load through instance 2 is not byte-exact (and its sketch check sees it)."""
    got = restart_verdict(tmp_path, "stalemap", test_seed, p_cls=StaleMappingTierLink)
    assert got["instance2_byte_exact"] is False, "the byte-exact oracle missed a write into the old mapping"
    assert got["instance2_digest_bad"] == [0, 1, 2]
    assert got != GOOD_RESTART


def test_a_link_that_unmaps_under_an_open_lease_is_caught(tmp_path, test_seed):
    """Control: C's instance-1 mapping dropped at the reconnect while its instance-1 lease is
    open (a copy out of those pages may still run on the GPU: it would read unmapped memory; no
    GPU test runs such a copy across a restart yet). Caught by the mapping's state at the
    reconnect; everything else of the restart as before."""
    got = restart_verdict(tmp_path, "eager", test_seed, c_cls=EagerUnmapTierLink)
    assert got["old_map_kept"] == (True, 0), got
    assert {k: v for k, v in got.items() if not k.startswith("old_map")} == \
        {k: v for k, v in GOOD_RESTART.items() if not k.startswith("old_map")}
    assert got != GOOD_RESTART


def test_a_link_that_unmaps_under_an_open_reservation_is_caught(tmp_path, test_seed):
    """Control: P's instance-1 mapping dropped at the reconnect while its instance-1 reservation
    is open (a copy into those pages may still run on the GPU: it would write unmapped memory).
    Caught by the mapping's state at the reconnect; everything else of the restart as before."""
    got = restart_verdict(tmp_path, "eager-p", test_seed, p_cls=EagerUnmapTierLink)
    assert got["p_old_map_kept"] == (True, 0), got
    assert {k: v for k, v in got.items() if k != "p_old_map_kept"} == \
        {k: v for k, v in GOOD_RESTART.items() if k != "p_old_map_kept"}
    assert got != GOOD_RESTART


# -- SIGTERM --------------------------------------------------------------------------------------

def test_sigterm_stops_the_keeper_cleanly_and_a_restart_finds_nothing_left(tmp_path, test_seed):
    run_dir = tmp_path / "k"
    run_dir.mkdir(mode=0o700)
    k, k2 = Keeper(run_dir), None
    link = TierLink(run_dir, "default", "tok", name="P", stale_after_s=STALE_S).connect()
    try:
        publish(link, W.KEYS(2), test_seed)
        link.reserve(W.NS, W.KEYS(1, base=9_000), [PAGE])  # open at the stop: quarantined with the instance
        assert k.terminate() == 0, k.output()
        assert "2 sessions ended" not in k.output()  # one session: the link's
        assert "1 sessions ended, 1 producers' reservations quarantined" in k.output(), k.output()
        assert sorted(p.name for p in run_dir.iterdir()) == ["keeper.lock"]  # no address, no socket
        assert link.client.keeper_stale()  # the heartbeat set to 0 at the stop: stale at once
        with pytest.raises(PoolError) as gone:
            link.lookup(W.NS, W.KEYS(2))
        assert type(gone.value).__name__ == "KeeperStale"  # no address file: the old heartbeat judges

        k2 = Keeper(run_dir, before=k.address.instance)
        assert k2.address.recovery_note == ""  # a clean stop leaves nothing to recover
        found = link.lookup(W.NS, W.KEYS(2))
        assert found.miss.cause == MissCause.NEVER_PUBLISHED and link.reconnects == 1
        assert k2.terminate() == 0
    finally:
        link.close()
        k.stop()
        if k2 is not None:
            k2.stop()


# -- bad flags ------------------------------------------------------------------------------------

def run_main(argv: list[str], capsys) -> tuple[int, str]:  # noqa: ANN001
    from kvpool.cli import main
    try:
        code = main(["keeper", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    return code, capsys.readouterr().err


def test_every_bad_flag_is_a_typed_error_with_its_exit_code(tmp_path, capsys):
    good = ["--backing", "memfd", "--tenant", "default=tok", "--pages", "4"]
    rd = str(tmp_path / "rd")
    bad_tokens = tmp_path / "tokens.json"
    bad_tokens.write_text("[1, 2]")
    cases = {
        "page size": (["--page-size", "1000"], 2, "KeeperUsage: --page-size"),
        "capacity": (["--backing", "memfd", "--tenant", "a=b", "--capacity", "1KiB"], 2, "KeeperUsage: --capacity"),
        "gpu": (["--gpu", "-1", *good], 2, "KeeperUsage: --gpu"),
        "backing": (["--backing", "cuda"], 2, "invalid choice: 'cuda'"),
        "size text": (["--page-size", "lots"], 2, "not a size"),
        "tenant": (["--backing", "memfd", "--tenant", "noequals"], 2, "--tenant takes NAME=TOKEN"),
        "quota": ([*good, "--quota", "default=x"], 2, "--quota 'default=x' is not TENANT=PAGES"),
        "quota tenant": ([*good, "--quota", "other=2"], 2, "KeeperUsage: --quota names tenants"),
        "quota size": ([*good, "--quota", "default=9"], 2, "KeeperUsage: 4 pages leave -5"),
        "watermarks": ([*good, "--low-free", "0.5", "--high-free", "0.1"], 2, "KeeperUsage: --low-free"),
        "ttl": ([*good, "--lease-ttl", "0"], 2, "--lease-ttl must be positive"),
        "max": ([*good, "--reservation-max", "0"], 2, "--reservation-max must be positive"),
        "max below ttl": ([*good, "--lease-max", "30", "--lease-ttl", "60"], 2,
                          "KeeperUsage: --lease-max 30.0 is shorter than --lease-ttl 60.0"),
        "reservation max below ttl": ([*good, "--reservation-max", "10"], 2,
                                      "KeeperUsage: --reservation-max 10.0 is shorter than --reservation-ttl 30.0"),
        "token file": ([*good, "--token-file", str(tmp_path / "none.json")], 2, "--token-file"),
        "token file shape": ([*good, "--token-file", str(bad_tokens)], 2, "not a JSON object of tenant names"),
        "host address": ([*good, "--host-pool", "nowhere"], 2, "KeeperUsage: --host-pool"),
        "host tenant alone": ([*good, "--host-tenant", "default=x"], 2, "without --host-pool"),
        "host tenant unknown": ([*good, "--host-pool", "unix:/x", "--host-tenant", "zz=x"], 2,
                                "name tenants the keeper does not have"),
        "host unreachable": ([*good, "--run-dir", rd, "--host-pool", f"unix:{tmp_path}/no.sock"], 3,
                             "KeeperUnavailable: --host-pool"),
    }
    got = {}
    for name, (argv, _, _) in cases.items():
        got[name] = run_main(argv, capsys)
    for name, (_, code, text) in cases.items():
        assert got[name][0] == code and text in got[name][1], (name, got[name])

    # a run directory another user can change
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    code, err = run_main([*good, "--run-dir", str(open_dir / "k")], capsys)
    assert code == 2 and "InsecureRunDir" in err and str(open_dir) in err

    # a keeper already there (its lock held)
    args = keeper_cli.keeper_parser(__import__("argparse").ArgumentParser()).parse_args([*good, "--run-dir", rd])
    running = keeper_cli.KeeperProcess(keeper_cli.config_from_args(args)).start()
    try:
        code, err = run_main([*good, "--run-dir", rd], capsys)
        assert code == 2 and f"KeeperAlreadyRunning: a keeper (pid {os.getpid()})" in err
        assert read_keeper_address(rd).instance == running.keeper.instance  # untouched by the refusal
    finally:
        running.stop()
    assert not (Path(rd) / ADDRESS_FILE).exists()

    # device memory on a host without CUDA
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        code, err = run_main(["--tenant", "a=b", "--pages", "4", "--run-dir", rd, "--backing", "vmm"], capsys)
        assert code == 3 and "KeeperUnavailable: --backing vmm on GPU 0" in err


def test_a_keeper_restarted_under_another_token_is_a_transport_error_miss_not_an_escape(tmp_path, test_seed):
    """The new instance refuses the link's token (Unauthenticated): its lookups through the
    fall-through run are transport_error misses (the host pool serves), and a direct call raises
    a TransportError naming the refusal, never the hello's own error type (which escaped the
    fall-through before)."""
    run_dir = tmp_path / "k"
    run_dir.mkdir(mode=0o700)
    k, k2 = Keeper(run_dir), None
    link = TierLink(run_dir, "default", "tok", name="P", stale_after_s=STALE_S).connect()
    try:
        publish(link, W.KEYS(2), test_seed)
        assert k.terminate() == 0, k.output()
        k2 = Keeper(run_dir, "--tenant", "default=another", before=k.address.instance)
        assert link.run(W.NS)(W.KEYS(2)) == (0, MissCause.TRANSPORT_ERROR)
        with pytest.raises(PoolError) as refused:
            link.lookup(W.NS, W.KEYS(2))
        # the old instance's heartbeat was retired at its stop: KeeperStale, a TransportError
        assert isinstance(refused.value, TransportError) and "Unauthenticated" in str(refused.value), refused.value
    finally:
        link.close()
        k.stop()
        if k2 is not None:
            k2.stop()
