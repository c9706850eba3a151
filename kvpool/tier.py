"""The network tier: kvpool's pages in a distributed store, for replicas on other hosts.

The host pool (kvpool.server) shares KV among the replicas of one host. Past one host,
pages go to an existing distributed store through one interface:

  Tier                  the interface every backend keeps (kvpool.tier_redis.RedisTier, ...):
    .put(ns, block_hash, page, digest) -> bool
                        store one page (complete or invisible: a reader never sees part of
                        one); False when the store refused it (full, or not admitted)
    .get(ns, block_hash) -> TierPage | None
                        the page as stored, checked (below); None when the store has no
                        such key (never stored, or evicted: the store cannot tell which)
    .exists(ns, hashes) -> int
                        how many of `hashes`, from the first, the store holds (advisory, as
                        a host-pool lookup is: the get is what counts)
    .remove(ns, block_hash) -> None
    .close() -> None
    .caps               TierCaps: what the store guarantees (leases on reads, ...)
  Errors are typed: TierUnavailable (the store cannot be reached within the tier's
  timeout: a transport_error miss), TierCorrupt (the bytes do not match the digest taken
  at publish: corrupt), TierIncompatible (the record was written under another namespace:
  incompatible, naming the fields), TierRecordError (not a kvpool record at all).

  encode_record(ns, page, digest) / decode_record(ns, blob)
                        a record is a msgpack header (magic, version, the writer's whole
                        namespace, digest kind, digest, length) then the page bytes. The
                        reader checks the namespace field by field, the length and the
                        digest before it hands out a byte: stale or foreign bytes are never
                        installed.
  tier_load(tier, ns, hashes, dest, deadline_s) -> LoadResult
                        install the longest run of the tier's pages into dest(i) (as
                        kvpool.client.load does from the host pool), digesting the bytes
                        as installed; every failure ends the run as one miss cause
  tier_publish(tier, ns, hashes, blocks) -> TierPublishResult
                        put each block's bytes with their digest; best effort, counted
  open_tier(url, timeout_s) -> Tier
                        the backend a URL names: redis:// or unix:// (RedisTier), mooncake://
                        (kvpool.tier_mooncake.MooncakeTier)
  tier_key(ns, block_hash) -> str
                        the store's key: tenant, a digest of the namespace, the block's
                        chain hash. Two namespaces never share a key; the header's check
                        is the second line (a key written by a buggy or stale writer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import numpy as np

from kvpool.catalog import Miss
from kvpool.client import LoadResult
from kvpool.copy import as_segments, copy_digest_as, total_size
from kvpool.digest import DIGEST_BYTES, DigestKind, kind_of, page_digest
from kvpool.errors import MissCause, PoolError
from kvpool.keys import Namespace

RECORD_MAGIC = "kvpool-tier"
RECORD_VERSION = 1
_LENGTH_PREFIX = 4  # bytes of the header's length, big-endian, before the header


class TierError(PoolError):
    """Root of the network tier's errors; `cause` is the miss cause it stands for."""

    cause: MissCause = MissCause.TRANSPORT_ERROR


class TierUnavailable(TierError):
    """The store could not be reached, or did not answer within the tier's timeout."""

    cause = MissCause.TRANSPORT_ERROR


class TierCorrupt(TierError):
    """A record's page does not match its length or the digest taken at publish."""

    cause = MissCause.CORRUPT


class TierIncompatible(TierError):
    """A record written under another namespace (same key): `fields` name the differences."""

    cause = MissCause.INCOMPATIBLE

    def __init__(self, message: str, fields: tuple[str, ...]):
        super().__init__(message)
        self.fields = fields


class TierRecordError(TierError):
    """The value under a tier key is not a kvpool record this build can read."""

    cause = MissCause.CORRUPT


@dataclasses.dataclass(frozen=True)
class TierCaps:
    """What a store guarantees, for the connector and the gate to read."""

    name: str
    read_leases: bool  # a page being read is kept until the read ends (Mooncake); else a miss
    atomic_put: bool  # a put is complete or invisible
    evicts: bool  # the store drops pages on its own when full


class RecordHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    magic: str
    version: int
    namespace: dict[str, str | int]
    digest_kind: int
    digest: bytes
    length: int


@dataclasses.dataclass(frozen=True)
class TierPage:
    """A page read from the tier, checked: its bytes, digest and kind."""

    data: bytes
    digest: bytes
    kind: DigestKind


_HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(RecordHeader)


def namespace_digest(ns: Namespace) -> str:
    return hashlib.blake2b(msgspec.msgpack.encode(ns), digest_size=12).hexdigest()


def tier_key(ns: Namespace, block_hash: bytes) -> str:
    return f"kvpool:{ns.tenant}:{namespace_digest(ns)}:{block_hash.hex()}"


def encode_record(ns: Namespace, page: bytes | memoryview, digest: bytes,
                  kind: DigestKind = DigestKind.XXH3) -> bytes:
    """The record of one page: its header, then its bytes."""
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a page digest is {DIGEST_BYTES} bytes, got {len(digest)}")
    header = _HEADER_ENCODER.encode(RecordHeader(RECORD_MAGIC, RECORD_VERSION, ns.as_dict(), kind.code,
                                                 bytes(digest), len(page)))
    return len(header).to_bytes(_LENGTH_PREFIX, "big") + header + bytes(page)


def decode_record(ns: Namespace, blob: bytes) -> TierPage:
    """The page of a record, if it was written under `ns` and its bytes are intact."""
    if len(blob) < _LENGTH_PREFIX:
        raise TierRecordError(f"a tier record of {len(blob)} bytes: shorter than its length prefix")
    n = int.from_bytes(blob[:_LENGTH_PREFIX], "big")
    if n > len(blob) - _LENGTH_PREFIX:
        raise TierRecordError(f"a tier record's header claims {n} bytes; {len(blob) - _LENGTH_PREFIX} follow")
    try:
        header = _HEADER_DECODER.decode(blob[_LENGTH_PREFIX:_LENGTH_PREFIX + n])
    except msgspec.DecodeError as exc:  # msgspec.ValidationError is a DecodeError
        raise TierRecordError(f"a tier record's header does not decode: {exc}") from exc
    if header.magic != RECORD_MAGIC or header.version != RECORD_VERSION:
        raise TierRecordError(f"not a kvpool tier record of version {RECORD_VERSION}: "
                              f"{header.magic!r} v{header.version}")
    try:
        writer = Namespace.from_dict(dict(header.namespace))
    except (TypeError, ValueError) as exc:
        raise TierRecordError(f"a tier record's namespace does not decode: {exc}") from exc
    fields = ns.differing_fields(writer) + (("tenant",) if writer.tenant != ns.tenant else ())
    if fields:
        raise TierIncompatible(f"the record was written under another namespace ({', '.join(fields)})", fields)
    data = blob[_LENGTH_PREFIX + n:]
    if len(data) != header.length:
        raise TierCorrupt(f"the record's page has {len(data)} bytes; {header.length} were stored")
    try:
        kind = kind_of(header.digest_kind)
    except IndexError as exc:
        raise TierRecordError(f"unknown digest kind {header.digest_kind}") from exc
    if page_digest(data, kind) != header.digest:
        raise TierCorrupt("the record's page does not match the digest taken at publish")
    return TierPage(data, header.digest, kind)


class Tier(Protocol):
    caps: TierCaps

    def put(self, ns: Namespace, block_hash: bytes, page: bytes | memoryview, digest: bytes,
            kind: DigestKind = DigestKind.XXH3) -> bool: ...
    def get(self, ns: Namespace, block_hash: bytes) -> TierPage | None: ...
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
    one), a TierError its own cause, a run past its deadline `timeout`. The page's digest
    is checked twice: on the record's bytes (decode_record), and on the bytes as installed."""
    t0 = time.monotonic()
    loaded = 0
    miss: Miss | None = None
    for i, h in enumerate(hashes):
        if deadline_s is not None and time.monotonic() - t0 > deadline_s:
            miss = Miss(i, MissCause.TIMEOUT)
            break
        try:
            page = tier.get(ns, h)
        except TierIncompatible as exc:
            miss = Miss(i, exc.cause, exc.fields)
            break
        except TierError as exc:
            miss = Miss(i, exc.cause)
            break
        if page is None:
            miss = Miss(i, MissCause.NEVER_PUBLISHED)
            break
        target = as_segments(dest(i))
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


def open_tier(url: str, timeout_s: float = 1.0) -> Tier:
    """The tier a URL names: "redis://HOST:PORT/DB", "rediss://..." or "unix:///path" (Redis);
    "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata" (Mooncake Store; also
    `segment_bytes`, `buffer_bytes`, `protocol`, `devices`, `local_hostname`)."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from kvpool.tier_redis import RedisTier

        return RedisTier(url, timeout_s=timeout_s)
    if url.startswith("mooncake://"):
        from urllib.parse import parse_qs, urlsplit

        from kvpool.tier_mooncake import MooncakeTier

        parts = urlsplit(url)
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if "metadata" not in q:
            raise ValueError(f"{url!r}: a mooncake tier needs ?metadata=http://HOST:PORT/metadata")
        sizes = {k: int(q[k]) for k in ("segment_bytes", "buffer_bytes") if k in q}
        return MooncakeTier(parts.netloc, q["metadata"], q.get("local_hostname", "127.0.0.1"),
                            protocol=q.get("protocol", "tcp"), devices=q.get("devices", ""), timeout_s=timeout_s,
                            **sizes)
    raise ValueError(f"no network tier for {url!r}: redis://HOST:PORT/DB, unix:///path or mooncake://HOST:PORT?...")
