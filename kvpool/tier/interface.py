"""The interface every network-tier backend keeps (Tier), and the load and publish of a run of
blocks through any of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from kvpool.pool.records import Miss
from kvpool.client.backend import LoadResult
from kvpool.pool.copy import as_segments, copy_digest_as, total_size
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.errors import MissCause
from kvpool.pool.keys import Namespace
from kvpool.tier.record import TierAuth, TierCaps, TierError, TierIncompatible, TierPage


class Tier(Protocol):
    caps: TierCaps
    auth: TierAuth

    def put(self, ns: Namespace, block_hash: bytes, page: bytes | memoryview, digest: bytes,
            kind: DigestKind = DigestKind.XXH3) -> bool: ...
    def get(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> TierPage | None: ...
    def get_record(self, ns: Namespace, block_hash: bytes, max_page_bytes: int | None = None) -> bytes | None: ...
    def exists(self, ns: Namespace, hashes: list[bytes]) -> int: ...
    def remove(self, ns: Namespace, block_hash: bytes) -> None: ...
    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class TierPublishResult:
    requested: int
    put: int  # stored
    refused: int  # the store would not take them (full)
    error: str | None = None  # the put that ended the run early, if one did


def tier_load(tier: Tier, ns: Namespace, hashes: Sequence[bytes], dest: Callable[[int], Any],
              deadline_s: float | None = None) -> LoadResult:
    """Install the longest run of the tier's pages into dest(i) (the block's segments, in
    page byte order). A missing key is `never_published` (the store cannot tell an evicted
    one), a TierError its own cause, a run past its deadline `timeout`. The record is
    authenticated and bound to its key (decode_record: else `corrupt`, and nothing of it is
    installed); the page's digest is checked on the record's bytes, and again on the bytes
    as installed."""
    t0 = time.monotonic()
    loaded = 0
    miss: Miss | None = None
    for i, h in enumerate(hashes):
        if deadline_s is not None and time.monotonic() - t0 > deadline_s:
            miss = Miss(i, MissCause.TIMEOUT)
            break
        target = as_segments(dest(i))
        try:
            page = tier.get(ns, h, max_page_bytes=total_size(target))
        except TierIncompatible as exc:
            miss = Miss(i, exc.cause, exc.fields)
            break
        except TierError as exc:
            miss = Miss(i, exc.cause)
            break
        if page is None:
            miss = Miss(i, MissCause.NEVER_PUBLISHED)
            break
        if total_size(target) != len(page.data):
            miss = Miss(i, MissCause.INCOMPATIBLE, ("page_bytes",))
            break
        if copy_digest_as(page.kind, [np.frombuffer(page.data, dtype=np.uint8)], target) != page.digest:
            miss = Miss(i, MissCause.CORRUPT)
            break
        loaded += 1
    return LoadResult(len(hashes), loaded, miss, time.monotonic() - t0)


def tier_publish(tier: Tier, ns: Namespace, hashes: Sequence[bytes], blocks: Sequence[Any]) -> TierPublishResult:
    """Put each block (its segments, in page byte order) under its hash with its digest.
    Best effort: a store that cannot be reached ends the run (the rest is not tried)."""
    put = refused = 0
    for h, block in zip(hashes, blocks):
        data = b"".join(bytes(s) for s in as_segments(block))
        try:
            if tier.put(ns, h, data, page_digest(data)):
                put += 1
            else:
                refused += 1
        except TierError as exc:
            return TierPublishResult(len(hashes), put, refused, f"{type(exc).__name__}: {exc}")
    return TierPublishResult(len(hashes), put, refused)


def redact_url(url: str) -> str:
    """The URL with its password replaced (for messages and records)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
