"""Renewal at the GPU keeper, over its socket (the host pool's Renew, kvpool.gpu.tier.GpuTier.renew
behind KeeperServer): a producer whose copy into the tier's pages waits behind a long forward
keeps its reservation past the TTL by renewing it, as it does at the host pool (the 256k run of
seed 003 lost two chunks' blocks to a TTL before renewal). The keeper's control-plane clock is
the test's (it moves only when told), so every deadline here is the scenario's, never a race:

  guard                         oracle                                 control
  a renewed reservation         committed, loaded byte-exact in        the same reservation
  outlives its TTL              another process                        unrenewed: reaped; its
                                                                       commit refused, its blocks
                                                                       never visible
Plus: the hello advertises both TTLs; renewals never pass the grant's maximum age and never
resurrect an expired grant; another session's ids are refused (not_yours) and left as they were;
an id named twice in one Renew is an InvalidRequest.
"""

from __future__ import annotations

from kvgate.harness.scenarios import gpu_keeper_wire as W
from kvpool.pool.digest import DigestKind, page_digest

from .test_gpu_keeper_wire import PAGE, expected, keeper, procs, replica

TTL_S, MAX_S = 30.0, 100.0


def manual_keeper(start, tmp_path):  # noqa: ANN001, ANN201
    return keeper(start, tmp_path, "k", 16, keeper="GpuKeeper", server="KeeperServer", maintenance_s=3600.0,
                  manual_clock=True, tier={"reservation_ttl_s": TTL_S, "reservation_max_s": MAX_S,
                                           "lease_ttl_s": 60.0})


def digests(seed: int, pages: list[int]) -> list[bytes]:
    return [page_digest(W.page_bytes(seed, p, PAGE), DigestKind.SKETCH) for p in pages]


def test_a_renewed_reservation_outlives_its_ttl_and_commits_and_the_unrenewed_control_is_reaped(tmp_path, test_seed):
    with procs() as start:
        k, path = manual_keeper(start, tmp_path)
        p, c = replica(start, path), replica(start, path)
        assert p.ok("ttls") == (TTL_S, 60.0)  # the hello advertises them: the client renews

        keys, control_keys = W.KEYS(4), W.KEYS(4, base=1000)
        rid, slots = p.ok("reserve", keys)
        rid_control, slots_control = p.ok("reserve", control_keys)
        pages, pages_control = [s for _, s in slots], [s for _, s in slots_control]

        k.ok("advance", 20.0)
        assert p.ok("renew", [rid], []) == ([(rid, TTL_S, None)], [])
        k.ok("advance", 20.0)  # t+40: past the first deadline (t+30), before the renewed one (t+50)
        assert k.ok("maintain") == ((1, 0),)  # the control's reservation, not the renewed one

        p.ok("write", pages, test_seed, None)
        assert p.ok("commit", rid, digests(test_seed, pages)) == (4,)
        blakes, bad, stale, miss = c.ok("load", keys)
        assert miss is None and bad == [] and stale == [] and blakes == expected(test_seed, pages)

        # the control: the same publish without its renewal, caught by the same oracle
        p.ok("write", pages_control, test_seed + 1, None)
        refused = p.ask("commit", rid_control, digests(test_seed + 1, pages_control))
        assert refused[0] == "error" and refused[1] == "InvalidRequest", refused
        assert c.ok("lookup", control_keys) == (0, "never_published")
        _, _, _, miss_control = c.ok("load", control_keys)
        assert miss_control == "never_published"
        # expired stays expired: a renewal does not resurrect it
        assert p.ok("renew", [rid_control], []) == ([(rid_control, 0.0, "expired")], [])


def test_renewals_stop_at_the_maximum_age_and_move_only_the_sessions_own_grants(tmp_path):
    with procs() as start:
        k, path = manual_keeper(start, tmp_path)
        p, other = replica(start, path), replica(start, path)
        rid, _ = p.ok("reserve", W.KEYS(2))
        theirs, _ = p.ok("reserve", W.KEYS(2, base=500))  # P's too: the other session tries to renew it
        got = []
        for _ in range(3):
            k.ok("advance", 25.0)
            if not got:  # t+25: refused, and left due at t+30 (renewed, it would be due at t+55)
                assert other.ok("renew", [theirs], []) == ([(theirs, 0.0, "not_yours")], [])
            got.append(p.ok("renew", [rid], [])[0][0])
            if len(got) == 2:  # t+50: the other session's renewal moved nothing
                assert p.ok("renew", [theirs], []) == ([(theirs, 0.0, "expired")], [])
        # t+25 -> t+55; t+50 -> t+80; t+75 -> min(t+105, t+100): the maximum age caps the last
        assert got == [(rid, TTL_S, None), (rid, TTL_S, None), (rid, 25.0, None)]
        k.ok("advance", 26.0)  # t+101: past the cap
        assert p.ok("renew", [rid], []) == ([(rid, 0.0, "expired")], [])
        assert k.ok("maintain") == ((2, 0),)
        refused = p.ask("renew", [rid, rid], [])
        assert refused[0] == "error" and refused[1] == "InvalidRequest", refused
        lease, _ = other.ok("acquire", W.KEYS(2))  # nothing committed: no lease to renew
        assert lease == 0
        assert p.ok("renew", [], [12345]) == ([], [(12345, 0.0, "unknown")])


def test_a_lease_is_renewed_by_its_holder_and_the_max_flags_reach_the_tier(tmp_path, test_seed):
    from kvpool.gpu import cli as keeper_cli

    with procs() as start:
        k, path = manual_keeper(start, tmp_path)
        p, c = replica(start, path), replica(start, path)
        p.ok("publish", W.KEYS(2), test_seed)
        lease, _ = c.ok("acquire", W.KEYS(2))
        assert lease
        k.ok("advance", 50.0)  # the lease's TTL is 60 s
        assert c.ok("renew", [], [lease]) == ([], [(lease, 60.0, None)])
        assert p.ok("renew", [], [lease]) == ([], [(lease, 0.0, "not_yours")])
        k.ok("advance", 50.0)  # t+100: past the first deadline (t+60), before the renewed one (t+110)
        assert k.ok("maintain") == ((0, 0),)
        assert c.ok("release", lease) == ([],)

    parser = keeper_cli.keeper_parser(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--backing", "memfd", "--tenant", "default=tok", "--pages", "4", "--run-dir",
                              str(tmp_path / "rd"), "--reservation-max", "120", "--lease-max", "240"])
    tier = keeper_cli.config_from_args(args).tier
    assert (tier.reservation_max_s, tier.lease_max_s) == (120.0, 240.0)
