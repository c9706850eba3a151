"""The network tier: kvpool's pages in a distributed store, for replicas on other hosts.

The host pool (kvpool.server) shares KV among the replicas of one host. Past one host,
pages go to an existing distributed store through one interface:

  Tier                  the interface every backend keeps (kvpool.tier_redis.RedisTier, ...),
                        each bound to one tenant's TierAuth:
    .put(ns, block_hash, page, digest) -> bool
                        store one page (complete or invisible: a reader never sees part of
                        one); False when the store refused it (full, or not admitted)
    .get(ns, block_hash, max_page_bytes=None) -> TierPage | None
                        the page as stored, authenticated and checked (below); None when the
                        store has no such key (never stored, or evicted: the store cannot
                        tell which). With `max_page_bytes`, a record longer than
                        record_bound(max_page_bytes) is TierCorrupt and is never read whole
                        (a store client cannot make a reader allocate more than one page)
    .get_record(ns, block_hash, max_page_bytes=None) -> bytes | None
                        the raw record under the block's key, unchecked (what .get decodes),
                        bounded as .get is
    .exists(ns, hashes) -> int
                        how many of `hashes`, from the first, the store holds (advisory, as
                        a host-pool lookup is: the get is what counts)
    .remove(ns, block_hash) -> None
    .close() -> None
    .caps               TierCaps: what the store guarantees (leases on reads, ...)
  Errors are typed: TierUnavailable (the store cannot be reached within the tier's
  timeout, or its access control refused the call: a transport_error miss), TierCorrupt
  (the record is not this tenant's record of this block in this namespace, or its bytes
  do not match the digest taken at publish: corrupt), TierRecordError (not a kvpool record
  at all: corrupt). TierIncompatible (incompatible, naming the fields) is kept for
  callers that tell it apart; a record of another namespace under a block's key can only
  have been moved there, so the reader calls it corrupt.

Trust: the store and every other client of it are untrusted. They can drop, move, copy,
replay and rewrite records, and list keys; they never see the tenant's tier secret.

  TierAuth.from_secret(tenant, secret)
                        a tenant's keys, derived from its tier secret (16 bytes or more,
                        shared by the tenant's replicas on every host; the store never sees
                        it) with keyed BLAKE2b, one `person` label per use, the tenant's
                        name as the input (two tenants given one secret still get
                        different keys):
    .mac_key            HMAC-SHA256 key of the tenant's records
    .name_key           keyed BLAKE2b key of the tenant's store keys
    .prefix             "kvpool:TENANT:": every key of the tenant starts with it (a Redis
                        ACL user of the tenant is restricted to `~kvpool:TENANT:*`); the
                        tenant name is [A-Za-z0-9_.-], 1 to 64 characters (no glob
                        characters in an ACL pattern)
    .key(ns, block_hash) -> str
                        the block's store key: the prefix, then a keyed BLAKE2b-128 of the
                        namespace and the block's chain hash. Opaque: a store client without
                        the secret cannot tell which namespaces or blocks (which prompts)
                        a tenant holds, nor compute the key of a block it knows.
  encode_record(auth, ns, block_hash, page, digest) / decode_record(auth, ns, block_hash, blob)
                        a record is TAG (32 bytes) then BODY: a 4-byte big-endian header
                        length, a msgpack header (magic, version, the writer's whole
                        namespace with its tenant, the block's chain hash, digest kind,
                        digest, length), then the page bytes. TAG = HMAC-SHA256(mac_key,
                        BODY). The reader checks the tag over the whole body first (a
                        record forged, damaged, of another tenant or written without the
                        secret is corrupt), then that the header names its own namespace
                        and block (a genuine record moved under another block's key, or
                        replayed from another namespace, is corrupt), then the length and
                        the digest: no byte is handed out before all of it holds. The cost,
                        measured on a 1 MiB page (a two-core EPYC): HMAC-SHA256 0.6 ms (keyed
                        BLAKE2b 1.5 ms; OpenSSL's SHA-256 uses the CPU's SHA instructions),
                        the whole decode 0.7 ms, a Redis GET of the record over loopback
                        4-8 ms. A record of version 1 (before records were authenticated) is
                        corrupt to this reader: the tier's pages are recomputed once.
  split_record(blob) -> (tag, header, page)
                        a record's parts, unauthenticated: for tools that inspect a store;
                        nothing it returns may be installed.
  tier_load(tier, ns, hashes, dest, deadline_s) -> LoadResult
                        install the longest run of the tier's pages into dest(i) (as
                        kvpool.client.load does from the host pool), digesting the bytes
                        as installed; every failure ends the run as one miss cause
  tier_publish(tier, ns, hashes, blocks) -> TierPublishResult
                        put each block's bytes with their digest; best effort, counted
  redact_url(url) -> str
                        the URL with its password replaced (for messages and records).
The backends (kvpool.tier_redis, kvpool.tier_mooncake) import this module; it imports no
backend. The backend a URL names is chosen by kvpool.tier_registry.open_tier.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import re
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
RECORD_VERSION = 2  # 2: authenticated (TAG, the block's hash in the header); 1 had neither
TAG_BYTES = 32  # HMAC-SHA256
_LENGTH_PREFIX = 4  # bytes of the header's length, big-endian, before the header
MIN_SECRET_BYTES = 16
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_PERSON_MAC = b"kvpool-tier-mac"  # BLAKE2b personalisation: at most 16 bytes each
_PERSON_KEY = b"kvpool-tier-key"
_PERSON_ROOT = b"kvpool-tier-root"


class TierError(PoolError):
    """Root of the network tier's errors; `cause` is the miss cause it stands for."""

    cause: MissCause = MissCause.TRANSPORT_ERROR


class TierUnavailable(TierError):
    """The store could not be reached, did not answer within the tier's timeout, or its
    access control refused the call."""

    cause = MissCause.TRANSPORT_ERROR


class TierCorrupt(TierError):
    """A record that is not this tenant's record of this block in this namespace (forged,
    moved, replayed, another tenant's), or whose page does not match its length or the
    digest taken at publish."""

    cause = MissCause.CORRUPT


class TierIncompatible(TierError):
    """A record written under another namespace: `fields` name the differences."""

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


@functools.lru_cache(maxsize=64)
def _ns_bytes(ns: Namespace) -> bytes:
    return msgspec.msgpack.encode(ns)


@dataclasses.dataclass(frozen=True)
class TierAuth:
    """One tenant's tier keys (see the module's docstring). The keys never leave the
    process: they are not in the repr."""

    tenant: str
    mac_key: bytes = dataclasses.field(repr=False)
    name_key: bytes = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        tier_prefix(self.tenant)  # a name fit for a key prefix
        if len(self.mac_key) != 32 or len(self.name_key) != 32:
            raise ValueError("tier keys are 32 bytes (TierAuth.from_secret derives them)")

    @classmethod
    def from_secret(cls, tenant: str, secret: str | bytes) -> TierAuth:
        root = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(root) < MIN_SECRET_BYTES:
            raise ValueError(f"a tier secret is at least {MIN_SECRET_BYTES} bytes, got {len(root)}")
        if len(root) > hashlib.blake2b.MAX_KEY_SIZE:
            root = hashlib.blake2b(root, person=_PERSON_ROOT).digest()

        def derive(person: bytes) -> bytes:
            return hashlib.blake2b(tenant.encode(), key=root, person=person, digest_size=32).digest()

        return cls(tenant, derive(_PERSON_MAC), derive(_PERSON_KEY))

    @property
    def prefix(self) -> str:
        return tier_prefix(self.tenant)

    def _own(self, ns: Namespace) -> None:
        if ns.tenant != self.tenant:
            raise ValueError(f"a tier of tenant {self.tenant!r} asked for a page of tenant {ns.tenant!r}")

    def key(self, ns: Namespace, block_hash: bytes) -> str:
        self._own(ns)
        name = hashlib.blake2b(_ns_bytes(ns) + bytes(block_hash), key=self.name_key, digest_size=16)
        return self.prefix + name.hexdigest()

    def tag(self, body: bytes | memoryview) -> bytes:
        return hmac.digest(self.mac_key, body, "sha256")


def tier_prefix(tenant: str) -> str:
    """The prefix of every store key of `tenant` (for a store's access control: Redis ACL
    `~kvpool:TENANT:*`). The name is 1-64 of [A-Za-z0-9_.-]: no glob character of an
    ACL pattern, no separator."""
    if not _TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"a tier tenant's name is 1-64 of [A-Za-z0-9_.-] (it is a store key prefix): {tenant!r}")
    return f"kvpool:{tenant}:"


class RecordHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    magic: str
    version: int
    namespace: dict[str, str | int]
    block_hash: bytes
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


MAX_HEADER_BYTES = 4096  # a record's header (the writer's namespace, the block, its digest): a few hundred bytes


def record_bound(max_page_bytes: int) -> int:
    """The most bytes a record of a page of at most `max_page_bytes` can have."""
    return TAG_BYTES + _LENGTH_PREFIX + MAX_HEADER_BYTES + int(max_page_bytes)


def record_too_long(size: int, max_page_bytes: int) -> TierCorrupt:
    return TierCorrupt(f"a record of {size}+ bytes under this key; a page here has at most {max_page_bytes} "
                       f"(a record is at most {record_bound(max_page_bytes)}): not read")


def namespace_digest(ns: Namespace) -> str:
    return hashlib.blake2b(msgspec.msgpack.encode(ns), digest_size=12).hexdigest()


def tier_key(auth: TierAuth, ns: Namespace, block_hash: bytes) -> str:
    return auth.key(ns, block_hash)


def encode_record(auth: TierAuth, ns: Namespace, block_hash: bytes, page: bytes | memoryview, digest: bytes,
                  kind: DigestKind = DigestKind.XXH3) -> bytes:
    """The record of one page: its tag, then its body (header, page)."""
    auth._own(ns)
    if len(digest) != DIGEST_BYTES:
        raise ValueError(f"a page digest is {DIGEST_BYTES} bytes, got {len(digest)}")
    header = _HEADER_ENCODER.encode(RecordHeader(RECORD_MAGIC, RECORD_VERSION, ns.as_dict(), bytes(block_hash),
                                                 kind.code, bytes(digest), len(page)))
    mac = hmac.new(auth.mac_key, digestmod="sha256")
    prefix = len(header).to_bytes(_LENGTH_PREFIX, "big") + header
    mac.update(prefix)
    mac.update(page)
    return mac.digest() + prefix + bytes(page)


def _frame(blob: bytes) -> int:
    """The header's length, once the record's framing holds (TierRecordError if not)."""
    if len(blob) < TAG_BYTES + _LENGTH_PREFIX:
        raise TierRecordError(f"a tier record of {len(blob)} bytes: shorter than its tag and length prefix")
    n = int.from_bytes(blob[TAG_BYTES:TAG_BYTES + _LENGTH_PREFIX], "big")
    if n > len(blob) - TAG_BYTES - _LENGTH_PREFIX:
        raise TierRecordError(f"a tier record's header claims {n} bytes; "
                              f"{len(blob) - TAG_BYTES - _LENGTH_PREFIX} follow")
    return n


def _header(raw: bytes | memoryview) -> RecordHeader:
    try:
        header = _HEADER_DECODER.decode(raw)
    except msgspec.DecodeError as exc:  # msgspec.ValidationError is a DecodeError
        raise TierRecordError(f"a tier record's header does not decode: {exc}") from exc
    if header.magic != RECORD_MAGIC or header.version != RECORD_VERSION:
        raise TierRecordError(f"not a kvpool tier record of version {RECORD_VERSION}: "
                              f"{header.magic!r} v{header.version}")
    return header


def split_record(blob: bytes) -> tuple[bytes, RecordHeader, bytes]:
    """(tag, header, page) of a record, NOT authenticated: for tools that inspect a store.
    Nothing it returns may be installed (decode_record is the reader)."""
    n = _frame(blob)
    start = TAG_BYTES + _LENGTH_PREFIX
    return bytes(blob[:TAG_BYTES]), _header(memoryview(blob)[start:start + n]), bytes(blob[start + n:])


def decode_record(auth: TierAuth, ns: Namespace, block_hash: bytes, blob: bytes) -> TierPage:
    """The page of a record, if it is this tenant's record of `block_hash` under `ns` and
    its bytes are intact; else TierCorrupt (or TierRecordError). Checked in full before a
    byte of it is returned."""
    auth._own(ns)
    n = _frame(blob)
    view = memoryview(blob)
    if not hmac.compare_digest(view[:TAG_BYTES], auth.tag(view[TAG_BYTES:])):
        raise TierCorrupt(f"the record under this key is not authenticated by tenant {auth.tenant!r}'s tier key "
                          "(forged, damaged, another tenant's, or written without the secret)")
    start = TAG_BYTES + _LENGTH_PREFIX
    header = _header(view[start:start + n])
    if header.namespace != ns.as_dict():
        try:
            writer = Namespace.from_dict(dict(header.namespace))
            fields = ns.differing_fields(writer) + (("tenant",) if writer.tenant != ns.tenant else ())
        except (TypeError, ValueError):
            fields = ("namespace",)
        raise TierCorrupt(f"a record of another namespace ({', '.join(fields) or 'namespace'}) under this key: "
                          "moved or replayed there")
    if header.block_hash != bytes(block_hash):
        raise TierCorrupt("a record of another block under this key: moved or copied there")
    data = bytes(view[start + n:])
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
