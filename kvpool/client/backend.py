"""The interface every pool backend keeps (the real client, fault injectors, audit wrappers),
the results of its two operations, and the pool's addresses.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvpool.pool.records import (
    AcquireResult,
    CommitResult,
    EvictOutcome,
    LookupResult,
    Miss,
    ReleaseResult,
    RenewResult,
    ReserveResult,
)
from kvpool.pool.digest import DigestKind
from kvpool.errors import (
    InvalidRequest,
)
from kvpool.pool.keys import Namespace


# Where block i goes: the caller's memory as one buffer or a list of segments (e.g. one
# per layer). load() copies the page into it and digests the bytes as installed, so the
# check covers what the engine will read.
Destination = Callable[[int], "np.ndarray | Sequence[np.ndarray]"]


@dataclasses.dataclass(frozen=True, slots=True)
class PublishResult:
    offered: int
    committed: int
    exists: int
    pending: int
    not_admitted: int
    no_capacity: int
    rejected: int  # the daemon's verify found other bytes than the digest claimed


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    requested: int
    loaded: int  # leading blocks installed and verified
    miss: Miss | None  # why the run stopped before `requested` (None if it did not)
    seconds: float
    error: str = ""  # what stopped it, where something failed (a miss of the pool's own answer has none)


class PoolBackend(Protocol):
    """What a pool offers its users. Wrappers (faults, audit) implement it too.

    Renewal is a capability: `reservation_ttl_s` / `lease_ttl_s` are the TTLs the pool
    advertised (0: it did not; a backend may lack them, and renew(), altogether), and
    renew() moves the deadlines of this connection's own grants (kvpool.client.keepalive).
    So is `digest_kind`: the kind of digest its commits must carry where it takes one kind
    only (a GPU keeper's tier: kv-sketch-1); a backend without it takes XXH3 (the pool daemon
    re-verifies those)."""

    page_size: int
    reservation_ttl_s: float
    lease_ttl_s: float

    def lookup(self, ns: Namespace, hashes: Sequence[bytes], wait_pending_s: float = 0.0) -> LookupResult: ...
    def acquire(self, ns: Namespace, hashes: Sequence[bytes]) -> AcquireResult: ...
    def release(self, lease_id: int) -> ReleaseResult: ...
    def read_page(self, lease: AcquireResult, index: int) -> np.ndarray | bytes: ...
    def reserved_view(self, reservation: ReserveResult, slot: int) -> np.ndarray | None: ...
    def reserve(self, ns: Namespace, hashes: Sequence[bytes], lengths: Sequence[int],
                boundary: int | None = None) -> ReserveResult: ...
    def write_page(self, reservation: ReserveResult, slot: int, data: np.ndarray | bytes) -> None: ...
    def commit(self, reservation_id: int, digests: Sequence[bytes],
               kind: DigestKind = DigestKind.XXH3) -> CommitResult: ...
    def abort(self, reservation_id: int) -> int: ...
    def renew(self, reservations: Sequence[int] = (), leases: Sequence[int] = ()) -> RenewResult: ...
    def evict(self, ns: Namespace, hashes: Sequence[bytes]) -> list[EvictOutcome]: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def parse_address(address: str) -> tuple[int, object]:
    kind, _, rest = address.partition(":")
    if kind == "unix" and rest:
        return socket.AF_UNIX, rest
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        if host and port.isdigit():
            return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, (host.strip("[]"), int(port))
    raise InvalidRequest(f"pool address {address!r} is not 'unix:PATH' or 'tcp:HOST:PORT'")
