"""What the catalog answers: the records of its results, which the wire protocol carries and
the clients read. Plain values: no state, no I/O.

  Hits / PageRef                   a run of hits, stored by column; indexing gives a PageRef
                                   (page, generation, length, digest, digest kind).
  Miss                             where a run stopped and why (kvpool.errors.MissCause).
  Slot / SlotStatus                one block's outcome of a reserve.
  LookupResult, AcquireResult, ReserveResult, CommitResult, ReleaseResult
                                   the catalog's answer to each call (kvpool.pool.catalog).
  EvictOutcome, CorruptOutcome     one block's outcome of an evict; the daemon's answer to a
                                   loader's report of a corrupt page.
  Renewal / RenewRefusal / RenewResult
                                   one reservation's or lease's answer to a renew: the seconds
                                   its new deadline lies ahead, or why it was refused.
"""

from __future__ import annotations

import dataclasses
import enum

import msgspec

from kvpool.errors import MissCause
from kvpool.pool.digest import DIGEST_BYTES, KINDS, DigestKind


class CorruptOutcome(enum.StrEnum):
    """The daemon's answer to a loader's report of a corrupt page (after its own check)."""

    DROPPED = "dropped"  # the page's bytes at rest do not match its digest: out of the pool
    INTACT = "intact"  # they match: the loader's copy went wrong on its way, the page stays


class SlotStatus(enum.StrEnum):
    RESERVED = "reserved"  # a page is yours to write, then commit
    EXISTS = "exists"  # already committed under this namespace: nothing to write
    PENDING = "pending"  # another publish of the same block is in flight
    NOT_ADMITTED = "not_admitted"  # the admission policy declined it
    NO_CAPACITY = "no_capacity"  # every page is leased or reserved


class EvictOutcome(enum.StrEnum):
    EVICTED = "evicted"
    LEASED = "leased"  # refused: a loader holds it
    NOT_FOUND = "not_found"
    # a namespace's reset only (reset_namespace): one outcome per page it took out of the pool
    DROPPED = "dropped"  # committed and leased: out of the index now, freed when its loaders release it
    CANCELLED = "cancelled"  # reserved by an open publish: its commit is rejected

class RenewRefusal(enum.StrEnum):
    """Why a reservation or lease was not renewed (it is left as it was)."""

    UNKNOWN = "unknown"  # never granted, or committed, aborted, released, or expired long ago
    EXPIRED = "expired"  # its deadline passed (reaped, or about to be): never resurrected
    NOT_YOURS = "not_yours"  # another client's: untouched


class Renewal(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One id's answer to a renew: `ttl_s` seconds from now to its new deadline (seconds, not
    a time: the daemon's clock is not the client's), or `refused` and ttl_s 0. The deadline
    never moves past the grant's maximum age (CatalogConfig.reservation_max_s, lease_max_s):
    near it, ttl_s is shorter than the TTL."""

    id: int
    ttl_s: float = 0.0
    refused: RenewRefusal | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RenewResult:
    reservations: tuple[Renewal, ...]
    leases: tuple[Renewal, ...] = ()

    @property
    def refused(self) -> tuple[Renewal, ...]:
        return tuple(r for r in (*self.reservations, *self.leases) if r.refused is not None)


class PageRef(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    page: int
    generation: int
    length: int
    digest: bytes
    kind: DigestKind = DigestKind.XXH3  # how `digest` was taken (kvpool.pool.digest)


class Hits(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A run of hits, stored by column (cheap to build, encode and decode); indexing
    gives PageRefs."""

    pages: list[int] = []
    generations: list[int] = []
    lengths: list[int] = []
    digests: bytes = b""
    kinds: bytes = b""  # DigestKind.code per page; empty: every page xxh3-128

    def __post_init__(self) -> None:
        n = len(self.pages)
        if len(self.generations) != n or len(self.lengths) != n or len(self.digests) != n * DIGEST_BYTES:
            raise ValueError(f"Hits columns disagree: {n} pages, {len(self.generations)} generations, "
                             f"{len(self.lengths)} lengths, {len(self.digests)} digest bytes")
        if len(self.kinds) not in (0, n) or (self.kinds and max(self.kinds) >= len(KINDS)):
            raise ValueError(f"Hits: {len(self.kinds)} digest kinds for {n} pages, or an unknown kind")

    def kind(self, i: int) -> DigestKind:
        return KINDS[self.kinds[i]] if self.kinds else DigestKind.XXH3

    def kind_list(self) -> list[DigestKind]:
        """Every page's kind, in order (one lookup where all pages share a kind)."""
        n = len(self.pages)
        if not self.kinds:
            return [DigestKind.XXH3] * n
        if self.kinds.count(self.kinds[0]) == n:
            return [KINDS[self.kinds[0]]] * n
        return [KINDS[k] for k in self.kinds]

    def __len__(self) -> int:
        return len(self.pages)

    def __bool__(self) -> bool:
        return bool(self.pages)

    def _ref(self, i: int) -> PageRef:
        return PageRef(self.pages[i], self.generations[i], self.lengths[i],
                       self.digests[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES], self.kind(i))

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - an int or a slice
        if isinstance(i, slice):
            return [self._ref(j) for j in range(*i.indices(len(self.pages)))]
        if i < 0:
            i += len(self.pages)
        return self._ref(i)

    def __iter__(self):  # noqa: ANN204
        return (self._ref(i) for i in range(len(self.pages)))

    @property
    def total_bytes(self) -> int:
        return sum(self.lengths)


class Miss(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    index: int  # the block at which the run stopped
    cause: MissCause
    fields: tuple[str, ...] = ()  # for INCOMPATIBLE: the namespace fields that differ


@dataclasses.dataclass(frozen=True, slots=True)
class LookupResult:
    hits: Hits
    miss: Miss | None
    # The open reservation publishing the first missing block (same tenant and
    # namespace), 0 if none: a caller may wait for it to close and look up again.
    pending: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class AcquireResult:
    lease_id: int  # 0 when nothing was leased
    hits: Hits
    miss: Miss | None


class Slot(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    status: SlotStatus
    page: int = -1
    generation: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ReserveResult:
    reservation_id: int  # 0 when no page was reserved
    slots: tuple[Slot, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class CommitResult:
    committed: int
    rejected: tuple[int, ...]  # slot indexes whose verify failed (freed)


@dataclasses.dataclass(frozen=True, slots=True)
class ReleaseResult:
    stale: tuple[int, ...]  # pages whose generation moved while leased (must be empty)

