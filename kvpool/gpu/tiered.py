"""Tiers in lookup order as one pool backend (kvpool.client.backend.PoolBackend): a lookup or a
load that misses the first tier (a keeper's, kvpool.gpu.tier_backend) falls through to the next
(the host pool's PoolClient), in the order kvpool.gpu.tier.fall_through defines, and the generic
publish and load (kvpool.client.transfer), the connector's copier and every wrapper that speaks
PoolBackend (the audit, the fault injectors) use it unchanged.

  TieredBackend([(name, backend), ...])     the members in lookup order (the GPU tier first).
      Their page sizes must agree, and a member after the first that takes one digest kind only
      (`digest_kind`) must take the first's (a publish falls through to it with the first's
      digests): else TierMismatch at construction. `page_size` is theirs; `digest_kind` the
      first's (TierBackend: kv-sketch-1, which the host pool takes too, trusted and scrubbed).
      A member that cannot be reached at construction (a keeper not started yet: its page size
      raises TransportError, PoolTimeout or Busy) joins late, as long as another member answered
      (else its error is raised): until its page size can be read it is asked nothing, each
      call that would have asked it counts an error (tiered_<name>_errors) and takes its miss
      (transport_error), and the next member is asked. The first call that reads its page size
      lets it in; one of another page size is left out for good (MemberLeftOut, a
      TransportError: its miss stays transport_error; `left_out` names why, stats count
      tiered_<name>_left_out) and logged once.
  .lookup(ns, hashes, wait_pending_s)   fall_through over the members' lookups (each gives how
      many blocks from the first it holds, and its miss cause): the first member holding a run
      at a block serves the whole run, where it stops the first member is asked again; the
      result's miss is the first block no member holds, its cause the first one other than
      never_published in member order (with that member's fields). `pending` is 0 (a member's
      reservation id means nothing here); wait_pending_s goes to every member's lookup.
  .acquire(ns, hashes)   the same order over the members' acquires: each run a member holds is
      leased by that member as it answers (one lease per member and run, no lookup first, so
      nothing moves between a lookup and its lease), and where its lease stops the first
      member is asked again. One lease id of the composite's own for all of them (0 when
      nothing was leased); the hits in block order, each with its member's page, digest and
      digest kind (transfer.load verifies each page with the kind of the member that served
      it). Nothing leased is leaked: an error that ends the acquire releases every lease it
      took first.
  A member's error in a lookup or an acquire is that member's miss for its run (TransportError,
      KeeperStale and WrongInstance included: transport_error; PoolTimeout: timeout; Busy:
      throttled; any other PoolError: transport_error, as transfer.load counts them), counted
      in stats (tiered_<name>_errors), and the next member is asked: a dead tier's lookups are
      transport_error and the host pool serves. Where every member raised at the first block
      (no member answered at all), the last member's error is raised, the others' attached as
      notes: the caller sees an unreachable pool as with one backend (the scheduler's backoff
      after a timeout, the load's cause).
  .read_page(lease, i)   block i's page, read by the member that granted it, through its lease.
  .release(lease_id)     releases every member lease of the composite lease; a member's error
      does not skip the others, and the first error is raised once all were tried (typed, the
      others and the stale pages of the rest as notes). `stale` is the union of the members'
      stale pages: page numbers are per member, so a stale page of one member that another's
      hit shares cuts the load there too (never the other way round: a stale page is never
      missed).
  .report_corrupt(lease_id, indexes)    to the member that granted each index (InvalidRequest
      for a member that takes no reports: the keeper's tier scrubs its pages on the GPU).
  .call_deadline(s)      every member's that has one (PoolClient), entered together.
  .renew(reservations, leases)   the composite's ids mapped to their members' grants, each member
      asked once for its own; a composite id's answer is its shortest member TTL, or the first
      refusal among its members' answers; an id that is not the composite's is refused UNKNOWN.
      `reservation_ttl_s` / `lease_ttl_s`: the shortest a member advertises (one that cannot be
      reached is left out), so a keepalive renews in time for every member.

Publish falls through as the lookup does (docs/gpu-tier.md, "Fall-through": what the GPU tier
cannot place goes to the host pool): reserve(ns, hashes, lengths, boundary) reserves in the
first member; the blocks it answers NO_CAPACITY (it evicts nothing to make room: room is made by
demotion to the host pool) are reserved in the next member, and so on; every other answer
(reserved, exists, pending, not admitted) stands. A member that cannot be reached (TransportError,
PoolTimeout, Busy) passes all its blocks on; where the last member cannot be reached, its blocks
stay NO_CAPACITY and the error is counted (tiered_<name>_errors), unless no member answered at
all: then it is raised. Any other error aborts what was reserved and is raised. The
composite's reservation id is its own; each slot is its member's; reserved_view / write_page go
to the slot's member; commit(id, digests, kind) commits each member's part with its digests (the
digests of the RESERVED slots in slot order, as transfer.publish gives them; `rejected` in the
same numbering); a member's failed commit does not skip the others, its error is raised after
and abort(id) then aborts the parts not committed (the sum of pages freed).

  .evict(ns, hashes)     every member's evict, a member's error raised after the others ran (the
      keeper's tier refuses a client's evict, so a composite with one refuses a reset: the
      connector answers "retry"). Per block, LEASED if a member holds it leased, else EVICTED if
      a member evicted it, else NOT_FOUND; a namespace reset's outcomes (one per page taken out)
      are the members' concatenated.
  .stats()               each member's stats, keys prefixed `<name>_` (a member without stats,
      the TierBackend, has none; one whose stats call failed gives `<name>_stats_error` 1), and
      the composite's own: tiered_<name>_blocks (blocks its acquires leased from the member),
      tiered_<name>_errors.
  .close()               every member's, the first error raised after.

What it is not: a probe (kvpool.client.pool_client.PoolClient.probe) of the host pool's index;
every lookup asks the members in order. It lives in kvpool.gpu, beside the order it follows
(kvpool.gpu.tier.fall_through): kvpool.client is a layer below kvpool.gpu and cannot import it.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from kvpool.client.backend import PoolBackend
from kvpool.errors import (
    Busy,
    InvalidRequest,
    LeaseLost,
    MalformedFrame,
    MissCause,
    PoolError,
    PoolTimeout,
    TransportError,
)
from kvpool.gpu.tier import UNREACHABLE, KeeperRefused, ask_in_order, fall_through, raise_first
from kvpool.pool.digest import DigestKind
from kvpool.pool.keys import NAMESPACE_RESET, Namespace
from kvpool.pool.records import (
    AcquireResult,
    CommitResult,
    EvictOutcome,
    Hits,
    LookupResult,
    Miss,
    ReleaseResult,
    Renewal,
    RenewRefusal,
    RenewResult,
    ReserveResult,
    Slot,
    SlotStatus,
)

log = logging.getLogger(__name__)



class MemberLeftOut(TransportError):
    """A member that joined late with another page size than the others': never asked again."""


class TierMismatch(InvalidRequest):
    """The members cannot serve as one backend: their page sizes differ, or a member after the
    first takes one digest kind only and not the first's."""


def miss_cause_of(exc: PoolError) -> MissCause:
    """A member's error as the miss of its run (as kvpool.client.transfer.load counts errors)."""
    if isinstance(exc, PoolTimeout):
        return MissCause.TIMEOUT
    if isinstance(exc, Busy):
        return MissCause.THROTTLED
    return MissCause.TRANSPORT_ERROR


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """Blocks [start, end) of a composite lease, leased by member `member` as `lease`."""

    member: int
    start: int
    end: int
    lease: AcquireResult


@dataclasses.dataclass(slots=True)
class _Part:
    """One member's reservation of a composite one: `result` its answer, `at[j]` the composite
    slot of its slot j, `reserved_at` the composite reserved-slot numbers of its reserved slots."""

    member: int
    result: ReserveResult
    at: list[int]
    reserved_at: list[int]
    committed: bool = False


def _concat_hits(parts: Sequence[Hits]) -> Hits:
    kinds = b"".join(h.kinds if h.kinds else bytes([DigestKind.XXH3.code]) * len(h) for h in parts)
    return Hits(pages=[p for h in parts for p in h.pages],
                generations=[g for h in parts for g in h.generations],
                lengths=[n for h in parts for n in h.lengths],
                digests=b"".join(h.digests for h in parts), kinds=kinds)


class TieredBackend:
    def __init__(self, members: Sequence[tuple[str, PoolBackend]]):
        if not members:
            raise InvalidRequest("a tiered backend needs at least one member")
        names = [name for name, _ in members]
        if len(set(names)) != len(names) or not all(names):
            raise InvalidRequest(f"member names must be distinct and non-empty, got {names}")
        self.names = tuple(names)
        self.members = tuple(b for _, b in members)
        sizes: dict[str, int] = {}
        late: dict[int, PoolError] = {}  # member -> why its page size could not be read
        for k, (name, b) in enumerate(members):
            try:
                sizes[name] = int(b.page_size)
            except KeeperRefused:  # it answered and refused this replica: a configuration to fix, not to wait for
                raise
            except UNREACHABLE as exc:
                late[k] = exc
        if not sizes:
            raise_first(list(late.values())[::-1], "members that could not be reached")
        if len(set(sizes.values())) != 1:
            raise TierMismatch(f"the members' page sizes differ: {sizes}")
        self.page_size = next(iter(sizes.values()))
        self.digest_kind = DigestKind(getattr(self.members[0], "digest_kind", DigestKind.XXH3))
        for name, b in members[1:]:
            fixed = getattr(b, "digest_kind", None)
            if fixed is not None and DigestKind(fixed) != self.digest_kind:
                raise TierMismatch(f"member {name!r} takes {DigestKind(fixed).value} digests only; a publish "
                                   f"falls through to it with the first member's {self.digest_kind.value}")
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._leases: dict[int, tuple[Segment, ...]] = {}
        self._reservations: dict[int, list[_Part]] = {}
        self._late = set(late)  # members not asked yet: their page size is read at their first call
        self.left_out: dict[str, str] = {}  # member name -> why it is never asked
        self.counters: dict[str, int] = {f"tiered_{n}_{what}": 0 for n in names
                                         for what in ("blocks", "errors", "left_out")}
        for k, exc in late.items():
            log.warning("tier member %r could not be reached at start (%s: %s): the next member serves its "
                        "blocks until it answers", names[k], type(exc).__name__, exc)

    def _member(self, k: int) -> PoolBackend:
        """Member k, to be asked: a late member's page size is read first (its error is the
        caller's, a miss of that member), and one of another page size is left out for good.
        Two threads may read a late member's page size at once; one decides, under the lock."""
        name = self.names[k]
        with self._lock:
            if name in self.left_out:
                raise MemberLeftOut(self.left_out[name])
            late = k in self._late
        if late:
            size = int(self.members[k].page_size)
            decided = False
            with self._lock:
                if k in self._late:
                    self._late.discard(k)
                    decided = True
                    if size != self.page_size:
                        self.left_out[name] = (f"member {name!r} joined with pages of {size} bytes, the others' "
                                               f"are {self.page_size}: left out")
                        self.counters[f"tiered_{name}_left_out"] = 1
                refused = self.left_out.get(name)
            if refused is not None:
                if decided:
                    log.error("%s", refused)
                raise MemberLeftOut(refused)
            if decided:
                log.info("tier member %r answered: asked from now on", name)
        return self.members[k]

    def _asked(self, late: bool = False) -> list[tuple[int, PoolBackend]]:
        """The members a call to every member asks (stats, the TTLs, deadlines): all but those
        left out and (unless `late`) those not reached yet. An evict asks the late ones too: a
        reset must not succeed past a tier it could not reach."""
        with self._lock:
            return [(k, b) for k, b in enumerate(self.members) if (late or k not in self._late)
                    and self.names[k] not in self.left_out]

    def _count(self, member: int, what: str, n: int = 1) -> None:
        with self._lock:
            self.counters[f"tiered_{self.names[member]}_{what}"] += n

    # -- what the pool advertises -------------------------------------------------------------
    def _shortest(self, attr: str) -> float:
        ttls = []
        for _, b in self._asked():
            if getattr(b, "renew", None) is None:
                continue
            try:
                ttl = float(getattr(b, attr, 0.0) or 0.0)
            except PoolError:  # a member that cannot be reached now (a keeper between instances)
                continue
            if ttl > 0:
                ttls.append(ttl)
        return min(ttls, default=0.0)

    @property
    def reservation_ttl_s(self) -> float:
        return self._shortest("reservation_ttl_s")

    @property
    def lease_ttl_s(self) -> float:
        return self._shortest("lease_ttl_s")

    @contextlib.contextmanager
    def call_deadline(self, seconds: float) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for _, b in self._asked():
                bound = getattr(b, "call_deadline", None)
                if bound is not None:
                    stack.enter_context(bound(seconds))
            yield

    # -- the lookup order -----------------------------------------------------------------------
    def _fall_through(self, hashes: Sequence[bytes], runs: list[tuple[str, object]]):  # noqa: ANN202
        """The lookup order over the members' runs (kvpool.gpu.tier.fall_through)."""
        return fall_through(hashes, runs)

    def _ask(self, hashes: Sequence[bytes], call, served: list[tuple[int, int, object]]) -> Miss | None:  # noqa: ANN001
        """kvpool.gpu.tier.ask_in_order over call(member, tail) -> (held, miss, answer), every
        member's error counted (tiered_<name>_errors). Appends to `served`, as they come,
        (member, start, answer) of each run that held blocks (the caller's, so that an acquire
        that fails midway releases what it leased); returns the miss, with its member's fields."""
        members = [(name, lambda tail, start, k=k: call(k, tail)) for k, name in enumerate(self.names)]
        return ask_in_order(hashes, members, miss_cause_of, served, self._fall_through,
                            lambda k: self._count(k, "errors"))[1]

    def lookup(self, ns: Namespace, hashes: Sequence[bytes], wait_pending_s: float = 0.0) -> LookupResult:
        def call(k: int, tail: Sequence[bytes]):  # noqa: ANN202
            found = self._member(k).lookup(ns, tail, wait_pending_s=wait_pending_s)
            if len(found.hits) > len(tail):
                raise MalformedFrame(f"member {self.names[k]!r}: a lookup of {len(tail)} blocks answered "
                                     f"{len(found.hits)}")
            return len(found.hits), found.miss, found.hits

        served: list[tuple[int, int, object]] = []
        miss = self._ask(hashes, call, served)
        return LookupResult(_concat_hits([hits for _, _, hits in served]), miss)

    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> AcquireResult:
        def call(k: int, tail: Sequence[bytes]):  # noqa: ANN202
            got = self._member(k).acquire(ns, tail)
            if got.lease_id and (not got.hits or len(got.hits) > len(tail)):  # a lease of nothing, or not ours
                with contextlib.suppress(PoolError):  # else its pool reclaims it at its TTL or disconnect
                    self.members[k].release(got.lease_id)
            if len(got.hits) > len(tail):
                raise MalformedFrame(f"member {self.names[k]!r}: an acquire of {len(tail)} blocks answered "
                                     f"{len(got.hits)}")
            return len(got.hits), got.miss, got

        served: list[tuple[int, int, object]] = []
        try:
            miss = self._ask(hashes, call, served)
        except BaseException as exc:
            try:
                self._undo_acquire([Segment(k, s, s + len(got.hits), got) for k, s, got in served])
            except PoolError as undo:
                exc.add_note(f"and releasing its leases failed: {type(undo).__name__}: {undo}")
            raise
        segments = [Segment(k, s, s + len(got.hits), got) for k, s, got in served]
        if not segments:
            return AcquireResult(0, Hits(), miss)
        for seg in segments:
            self._count(seg.member, "blocks", seg.end - seg.start)
        with self._lock:
            own = next(self._ids)
            self._leases[own] = tuple(segments)
        return AcquireResult(own, _concat_hits([seg.lease.hits for seg in segments]), miss)

    # -- a composite lease ------------------------------------------------------------------------
    def _segments(self, lease_id: int) -> tuple[Segment, ...]:
        with self._lock:
            segments = self._leases.get(lease_id)
        if segments is None:
            raise LeaseLost(f"lease {lease_id} is not one this tiered backend holds")
        return segments

    def _segment_of(self, lease_id: int, index: int) -> Segment:
        """The member lease that granted block `index` of the composite lease."""
        segments = self._segments(lease_id)
        k = bisect.bisect_right([s.start for s in segments], index) - 1
        if k < 0 or index >= segments[k].end:
            raise InvalidRequest(f"block {index} is not in lease {lease_id} of {segments[-1].end} blocks")
        return segments[k]

    def read_page(self, lease: AcquireResult, index: int) -> np.ndarray | bytes:
        seg = self._segment_of(lease.lease_id, index)
        return self.members[seg.member].read_page(seg.lease, index - seg.start)

    def _undo_acquire(self, segments: Sequence[Segment]) -> None:
        """An acquire that failed midway: every lease it took is released before its error rises."""
        self._release_all(segments, "the leases of an acquire that failed")

    def _release_all(self, segments: Sequence[Segment], what: str) -> ReleaseResult:
        """Release every member lease; the first error raised once all were tried."""
        stale: list[int] = []
        errors: list[BaseException] = []
        for seg in segments:
            try:
                stale += self.members[seg.member].release(seg.lease.lease_id).stale
            except BaseException as exc:  # noqa: BLE001 - raised below, once every member lease was tried
                exc.add_note(f"releasing member {self.names[seg.member]!r}'s lease of blocks "
                             f"{seg.start}..{seg.end - 1} ({what})")
                errors.append(exc)
        if errors and stale:
            errors[0].add_note(f"the other members' releases found stale pages {sorted(set(stale))}")
        raise_first(errors, what)
        return ReleaseResult(tuple(sorted(set(stale))))

    def release(self, lease_id: int) -> ReleaseResult:
        with self._lock:
            segments = self._leases.pop(lease_id, None)
        if segments is None:
            raise LeaseLost(f"lease {lease_id} is not one this tiered backend holds")
        return self._release_all(segments, f"lease {lease_id}")

    def report_corrupt(self, lease_id: int, indexes: Sequence[int]) -> list:
        out = []
        for i in indexes:
            seg = self._segment_of(lease_id, int(i))
            report = getattr(self.members[seg.member], "report_corrupt", None)
            if report is None:
                raise InvalidRequest(f"member {self.names[seg.member]!r} takes no reports of corrupt pages")
            out += report(seg.lease.lease_id, [int(i) - seg.start])
        return out

    # -- renewal ------------------------------------------------------------------------------------
    def renew(self, reservations: Sequence[int] = (), leases: Sequence[int] = ()) -> RenewResult:
        with self._lock:
            res_grants = {int(r): [(p.member, p.result.reservation_id) for p in self._reservations[int(r)]
                                   if not p.committed] for r in reservations if int(r) in self._reservations}
            lease_grants = {int(i): [(s.member, s.lease.lease_id) for s in self._leases[int(i)]]
                            for i in leases if int(i) in self._leases}
        asked: dict[int, tuple[list[int], list[int]]] = {}
        for grants, kind in ((res_grants, 0), (lease_grants, 1)):
            for parts in grants.values():
                for k, gid in parts:
                    asked.setdefault(k, ([], []))[kind].append(gid)
        answers: dict[tuple[int, int, int], Renewal] = {}  # (member, kind, member id) -> its answer
        errors: list[BaseException] = []
        for k, (res_ids, lease_ids) in asked.items():
            renew = getattr(self.members[k], "renew", None)
            if renew is None:
                continue  # a member that advertises no TTL holds its grants without renewal
            try:
                got = renew(res_ids, lease_ids)
            except PoolError as exc:
                exc.add_note(f"renewing member {self.names[k]!r}'s grants")
                errors.append(exc)
                continue
            for kind, replies in ((0, got.reservations), (1, got.leases)):
                for r in replies:
                    answers[(k, kind, r.id)] = r
        raise_first(errors, "renewals")

        def answer(own: int, kind: int, grants: dict[int, list[tuple[int, int]]]) -> Renewal:
            if own not in grants:
                return Renewal(own, 0.0, RenewRefusal.UNKNOWN)
            mine = [answers[(k, kind, gid)] for k, gid in grants[own] if (k, kind, gid) in answers]
            refused = next((r.refused for r in mine if r.refused is not None), None)
            if refused is not None:
                return Renewal(own, 0.0, refused)
            return Renewal(own, min((r.ttl_s for r in mine), default=0.0))

        return RenewResult(tuple(answer(int(r), 0, res_grants) for r in reservations),
                           tuple(answer(int(i), 1, lease_grants) for i in leases))

    # -- publishes --------------------------------------------------------------------------------
    def reserve(self, ns: Namespace, hashes: Sequence[bytes], lengths: Sequence[int],
                boundary: int | None = None) -> ReserveResult:
        if len(lengths) != len(hashes):
            raise InvalidRequest(f"{len(hashes)} hashes but {len(lengths)} lengths")
        slots: list[Slot | None] = [None] * len(hashes)
        parts: list[_Part] = []
        todo = list(range(len(hashes)))  # the composite slots still to place, in order
        bound = boundary  # blocks past it are not admitted: only whole offers carry it
        answered = False
        unreachable: list[PoolError] = []
        try:
            for k in range(len(self.members)):
                if not todo:
                    break
                try:
                    got = self._member(k).reserve(ns, [hashes[i] for i in todo], [lengths[i] for i in todo], bound)
                except UNREACHABLE as exc:
                    self._count(k, "errors")
                    unreachable.append(exc)
                    if k + 1 < len(self.members):
                        continue  # the next member is offered the same blocks
                    if not answered:
                        raise_first(unreachable[::-1], "members that could not be reached")
                    for i in todo:  # the last member is unreachable: what it was offered is not placed
                        slots[i] = Slot(SlotStatus.NO_CAPACITY)
                    break
                answered = True
                if len(got.slots) != len(todo):
                    if got.reservation_id:
                        parts.append(_Part(k, got, [], []))
                    raise MalformedFrame(f"member {self.names[k]!r}: a reserve of {len(todo)} blocks answered "
                                         f"{len(got.slots)} slots")
                if got.reservation_id:
                    parts.append(_Part(k, got, list(todo), []))
                spill = []
                for i, slot in zip(todo, got.slots):
                    slots[i] = slot
                    if slot.status == SlotStatus.NO_CAPACITY:
                        spill.append(i)
                todo, bound = spill, None  # what it could not place was admitted there: no boundary
        except BaseException as exc:
            try:
                self._abort_parts(parts, "the reservations of a reserve that failed")
            except PoolError as undo:  # its pool reclaims them at their TTL or the disconnect
                exc.add_note(f"and aborting its reservations failed: {type(undo).__name__}: {undo}")
            raise
        if not parts:
            return ReserveResult(0, tuple(s if s is not None else Slot(SlotStatus.NO_CAPACITY) for s in slots))
        reserved = [i for i, s in enumerate(slots) if s is not None and s.status == SlotStatus.RESERVED]
        number = {i: n for n, i in enumerate(reserved)}
        for p in parts:
            p.reserved_at = [number[p.at[j]] for j, s in enumerate(p.result.slots) if s.status == SlotStatus.RESERVED]
        with self._lock:
            own = next(self._ids)
            self._reservations[own] = parts
        return ReserveResult(own, tuple(slots))  # type: ignore[arg-type] - every slot was answered

    def _parts(self, reservation_id: int) -> list[_Part]:
        with self._lock:
            parts = self._reservations.get(int(reservation_id))
        if parts is None:
            raise InvalidRequest(f"reservation {reservation_id} is not one this tiered backend holds open")
        return parts

    def _slot_of(self, reservation: ReserveResult, slot: int) -> tuple[_Part, int]:
        """The member reservation that reserved composite slot `slot`, and its slot there."""
        for p in self._parts(reservation.reservation_id):
            j = p.at.index(slot) if slot in p.at else -1
            if j >= 0 and p.result.slots[j].status == SlotStatus.RESERVED:
                return p, j
        raise InvalidRequest(f"slot {slot} of reservation {reservation.reservation_id} is not reserved")

    def reserved_view(self, reservation: ReserveResult, slot: int) -> np.ndarray | None:
        part, j = self._slot_of(reservation, slot)
        return self.members[part.member].reserved_view(part.result, j)

    def write_page(self, reservation: ReserveResult, slot: int, data: np.ndarray | bytes) -> None:
        part, j = self._slot_of(reservation, slot)
        self.members[part.member].write_page(part.result, j, data)

    def commit(self, reservation_id: int, digests: Sequence[bytes],
               kind: DigestKind = DigestKind.XXH3) -> CommitResult:
        """Each member's part with its digests; a part that fails does not skip the others, the
        first error is raised after, and the reservation stays open for abort() of the parts
        not committed."""
        parts = self._parts(reservation_id)
        want = sum(len(p.reserved_at) for p in parts)
        if len(digests) != want:
            raise InvalidRequest(f"{len(digests)} digests for {want} reserved pages")
        committed, rejected = 0, []
        errors: list[BaseException] = []
        for p in parts:
            if p.committed:
                continue
            try:
                out = self.members[p.member].commit(p.result.reservation_id, [digests[n] for n in p.reserved_at], kind)
            except PoolError as exc:
                exc.add_note(f"committing member {self.names[p.member]!r}'s part")
                errors.append(exc)
                continue
            p.committed = True
            committed += out.committed
            rejected += [p.reserved_at[j] for j in out.rejected]
        raise_first(errors, "commits")
        with self._lock:
            self._reservations.pop(int(reservation_id), None)
        return CommitResult(committed, tuple(sorted(rejected)))

    def _abort_parts(self, parts: Sequence[_Part], what: str) -> int:
        freed = 0
        errors: list[BaseException] = []
        for p in parts:
            if p.committed:
                continue
            try:
                freed += self.members[p.member].abort(p.result.reservation_id)
            except BaseException as exc:  # noqa: BLE001 - raised below, once every part was tried
                exc.add_note(f"aborting member {self.names[p.member]!r}'s part ({what})")
                errors.append(exc)
        raise_first(errors, what)
        return freed

    def abort(self, reservation_id: int) -> int:
        with self._lock:
            parts = self._reservations.pop(int(reservation_id), None)
        if parts is None:
            raise InvalidRequest(f"reservation {reservation_id} is not one this tiered backend holds open")
        return self._abort_parts(parts, f"reservation {reservation_id}")

    # -- administration ---------------------------------------------------------------------------
    def evict(self, ns: Namespace, hashes: Sequence[bytes]) -> list[EvictOutcome]:
        reset = list(hashes) == [NAMESPACE_RESET]
        answers: list[list[EvictOutcome]] = []
        asked: list[int] = []
        errors: list[BaseException] = []
        for k, member in self._asked(late=True):
            try:
                answers.append(list(member.evict(ns, hashes)))
                asked.append(k)
            except PoolError as exc:
                exc.add_note(f"evicting from member {self.names[k]!r}")
                errors.append(exc)
        raise_first(errors, "evictions")
        if reset:
            return [o for a in answers for o in a]
        for k, a in zip(asked, answers):
            if len(a) != len(hashes):
                raise MalformedFrame(f"member {self.names[k]!r}: an evict of {len(hashes)} blocks answered {len(a)}")
        out = []
        for per_block in zip(*answers):
            out.append(EvictOutcome.LEASED if EvictOutcome.LEASED in per_block else
                       EvictOutcome.EVICTED if EvictOutcome.EVICTED in per_block else EvictOutcome.NOT_FOUND)
        return out

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k, member in self._asked():
            name = self.names[k]
            stats = getattr(member, "stats", None)
            if stats is None:
                continue
            try:
                out.update({f"{name}_{k}": v for k, v in stats().items()})
            except PoolError:
                out[f"{name}_stats_error"] = 1
        with self._lock:
            out.update(self.counters)
        return out

    def close(self) -> None:
        with self._lock:
            self._leases.clear()
            self._reservations.clear()
        errors: list[BaseException] = []
        for name, member in zip(self.names, self.members):
            try:
                member.close()
            except BaseException as exc:  # noqa: BLE001 - raised below, once every member was closed
                exc.add_note(f"closing member {name!r}")
                errors.append(exc)
        raise_first(errors, "closing")
