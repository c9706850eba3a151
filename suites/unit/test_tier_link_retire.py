"""TierLink's retired mappings, without a keeper: a client replaced while a grant of it is open
keeps its mapping until that grant ends through the link or the replaced instance's longest TTL
has passed (a grant its caller lost must not keep a whole buffer mapped, and under VMM
allocated, for ever); the link's close closes every client even when one of them fails to.
The keeper-backed behaviour (open lease and reservation across a restart, each with its
control) is suites/pool/test_gpu_keeper_restart.py."""

from __future__ import annotations

import pytest

from kvpool.errors import TransportError
from kvpool.gpu.tier_client import TierLease, TierLink


class Hello:
    def __init__(self, instance: bytes):
        self.arena_instance = instance


class FakeClient:
    """What TierLink touches of a TierClient when it retires, sweeps and closes one."""

    def __init__(self, instance: bytes, client_id: int, ttls: tuple[float, float] = (30.0, 60.0),
                 fail_close: bool = False):
        self.hello, self.client_id = Hello(instance), client_id
        self.reservation_ttl_s, self.lease_ttl_s = ttls
        self.session_open, self.closed, self.fail_close = True, False, fail_close
        self.tier, self.connected = None, False

    def peer_closed(self) -> bool:  # the link then looks for the keeper's address again
        return True

    def keeper_stale(self) -> bool:
        return False

    @property
    def instance(self) -> bytes:
        return self.hello.arena_instance

    def end_session(self) -> None:
        self.session_open = False

    def close(self) -> None:
        self.session_open = False
        if self.fail_close:
            raise OSError("close failed")
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def retire(link: TierLink, old: FakeClient, new: FakeClient, lease_id: int = 5) -> TierLease:
    link.client = old
    link._granted("lease", old, lease_id)  # noqa: SLF001 - as acquire records it
    link._adopt(old, new)  # noqa: SLF001 - as a reconnect does
    return TierLease(old.instance, old.client_id, None)


def test_a_retired_mapping_lives_until_its_grant_ends_or_the_longest_ttl_passes(tmp_path):
    clock = Clock()
    link = TierLink(tmp_path, "default", "tok", clock=clock)
    old, new = FakeClient(b"\1" * 16, 1), FakeClient(b"\2" * 16, 1)
    retire(link, old, new)
    assert (old.session_open, old.closed, link.retired) == (False, False, 1)  # session ended, mapping kept
    clock.now += 59.9  # the old instance's lease TTL is 60 s, its longest
    link._sweep_retired()  # noqa: SLF001
    assert (old.closed, link.retired) == (False, 1)
    clock.now += 0.1
    with pytest.raises(TransportError):  # no address file here: every call sweeps first, then fails
        link.lookup(None, [])
    assert (old.closed, link.retired) == (True, 0)
    assert link._open == {}  # noqa: SLF001 - the lost grant is forgotten with its mapping

    # an explicit bound, and a grant ended through the link before it: dropped at once
    link2 = TierLink(tmp_path, "default", "tok", clock=clock, retire_max_s=5.0)
    old2 = FakeClient(b"\3" * 16, 2)
    lease = retire(link2, old2, FakeClient(b"\4" * 16, 1))
    link2._ended("lease", lease, 5)  # noqa: SLF001 - as a refused release does
    assert (old2.closed, link2.retired) == (True, 0)
    old3 = FakeClient(b"\5" * 16, 3, ttls=(0.0, 0.0))  # advertised no TTL: the default bound
    link3 = TierLink(tmp_path, "default", "tok", clock=clock)
    retire(link3, old3, FakeClient(b"\6" * 16, 1))
    clock.now += 59.0
    link3._sweep_retired()  # noqa: SLF001
    assert link3.retired == 1
    clock.now += 1.0
    link3._sweep_retired()  # noqa: SLF001
    assert link3.retired == 0 and old3.closed


def test_a_failed_close_of_a_retired_mapping_is_kept_not_raised_over_the_callers_error(tmp_path):
    link = TierLink(tmp_path, "default", "tok", clock=Clock(), retire_max_s=1.0)
    bad = FakeClient(b"\1" * 16, 1, fail_close=True)
    lease = retire(link, bad, FakeClient(b"\2" * 16, 1))
    link._ended("lease", lease, 5)  # noqa: SLF001
    assert link.retired == 0 and len(link.close_errors) == 1 and "OSError: close failed" in link.close_errors[0]


def test_close_closes_every_client_even_when_one_fails(tmp_path):
    link = TierLink(tmp_path, "default", "tok", clock=Clock())
    bad, good, current = FakeClient(b"\1" * 16, 1, fail_close=True), FakeClient(b"\2" * 16, 2), FakeClient(b"\3" * 16, 1)
    retire(link, bad, FakeClient(b"\x09" * 16, 9))
    retire(link, good, current, lease_id=6)
    with pytest.raises(OSError):
        link.close()
    assert good.closed and current.closed and link.retired == 0 and link.client is None
