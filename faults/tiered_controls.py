"""Negative controls of the tiers as one backend (kvpool.gpu.tiered.TieredBackend): each is the
production composite with one guard dropped. Never served to a replica;
suites/pool/test_gpu_tiered.py runs each and asserts that the oracle it validates catches it.

  FirstTierOnlyBackend     no fall-through: the lookup order asks the first member only, so a
                           block it does not hold (never published there, demoted, or its keeper
                           dead) ends the run although the host pool holds it. Caught by the
                           loaded-block count and the miss cause.
  FirstMemberReadBackend   block i is read through the first member's lease (at i's place in its
                           own member's run), whichever member granted it: a block the host pool
                           served is read out of a page of the tier's lease. Caught by the
                           byte-exact oracle.
  ShortCircuitReleaseBackend
                           a composite release that stops at the first member's error: a dead
                           keeper's release failing leaves the host pool's lease of the same load
                           held. Caught by the host pool's answer to an evict of those blocks
                           (LEASED where they must be EVICTED).
  LeakyAcquireBackend      an acquire that fails midway releases nothing it leased. Caught the
                           same way.
  NeverJoinsBackend        a member that could not be reached at construction is left out for
                           good instead of joining once it answers: a keeper started after the
                           replica is never used. Caught by where a publish lands (the host
                           pool, not the tier) and by the blocks the tier serves (none).

And of the GPU engine over them (kvpool.gpu.tiered_engine.TieredEngine), run by
suites/unit/test_tiered_engine.py on member engines that model a stream each:
  FirstTierOnlyEngine      loads ask the first member engine only. Caught by the loaded-block
                           count and the miss cause.
  UnorderedTieredEngine    a member load is not ordered after the earlier member loads of the
                           same run: the next member's install of a block may land before the
                           direct install's write of a failed page into it. Caught by the
                           byte-exact oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.gpu.tier import fall_through
from kvpool.gpu.tiered import MemberLeftOut, Segment, TieredBackend
from kvpool.gpu.tiered_engine import TieredEngine
from kvpool.pool.records import ReleaseResult


class FirstTierOnlyBackend(TieredBackend):
    def _fall_through(self, hashes, runs):  # noqa: ANN001, ANN202
        return fall_through(hashes, runs[:1])


class FirstMemberReadBackend(TieredBackend):
    def read_page(self, lease, index):  # noqa: ANN001, ANN201
        seg = self._segment_of(lease.lease_id, index)
        first = self._segments(lease.lease_id)[0]
        local = (index - seg.start) % (first.end - first.start)
        return self.members[first.member].read_page(first.lease, local)


class ShortCircuitReleaseBackend(TieredBackend):
    def _release_all(self, segments: Sequence[Segment], what: str) -> ReleaseResult:
        stale: list[int] = []
        for seg in segments:
            stale += self.members[seg.member].release(seg.lease.lease_id).stale  # the first error ends it
        return ReleaseResult(tuple(sorted(set(stale))))


class LeakyAcquireBackend(TieredBackend):
    def _undo_acquire(self, segments: Sequence[Segment]) -> None:
        return None


class NeverJoinsBackend(TieredBackend):
    def _member(self, k):  # noqa: ANN001, ANN202
        if k in self._late:
            raise MemberLeftOut(f"member {self.names[k]!r} was not reachable at start: never asked")
        return super()._member(k)


class FirstTierOnlyEngine(TieredEngine):
    def _fall_through(self, hashes, runs):  # noqa: ANN001, ANN202
        return fall_through(hashes, runs[:1])


class UnorderedTieredEngine(TieredEngine):
    def _after(self, parts) -> None:  # noqa: ANN001
        pass  # the defect: no stream wait on the earlier member loads
