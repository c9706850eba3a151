"""The network tier's record: its authentication (one tenant's TierAuth: HMAC-SHA256 tags,
opaque keyed keys), its format and bound, and the tier's typed errors.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import re

import msgspec

from kvpool.pool.digest import DIGEST_BYTES, DigestKind, kind_of, page_digest
from kvpool.errors import MissCause, PoolError
from kvpool.pool.keys import Namespace


RECORD_MAGIC = "kvpool-tier"
RECORD_VERSION = 2  # 2: authenticated (TAG, the block's hash in the header); 1 had neither
TAG_BYTES = 32  # HMAC-SHA256
LENGTH_PREFIX = 4  # bytes of the header's length, big-endian, before the header
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


HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(RecordHeader)


MAX_HEADER_BYTES = 4096  # a record's header (the writer's namespace, the block, its digest): a few hundred bytes


def record_bound(max_page_bytes: int) -> int:
    """The most bytes a record of a page of at most `max_page_bytes` can have."""
    return TAG_BYTES + LENGTH_PREFIX + MAX_HEADER_BYTES + int(max_page_bytes)


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
    header = HEADER_ENCODER.encode(RecordHeader(RECORD_MAGIC, RECORD_VERSION, ns.as_dict(), bytes(block_hash),
                                                 kind.code, bytes(digest), len(page)))
    mac = hmac.new(auth.mac_key, digestmod="sha256")
    prefix = len(header).to_bytes(LENGTH_PREFIX, "big") + header
    mac.update(prefix)
    mac.update(page)
    return mac.digest() + prefix + bytes(page)


def _frame(blob: bytes) -> int:
    """The header's length, once the record's framing holds (TierRecordError if not)."""
    if len(blob) < TAG_BYTES + LENGTH_PREFIX:
        raise TierRecordError(f"a tier record of {len(blob)} bytes: shorter than its tag and length prefix")
    n = int.from_bytes(blob[TAG_BYTES:TAG_BYTES + LENGTH_PREFIX], "big")
    if n > len(blob) - TAG_BYTES - LENGTH_PREFIX:
        raise TierRecordError(f"a tier record's header claims {n} bytes; "
                              f"{len(blob) - TAG_BYTES - LENGTH_PREFIX} follow")
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
    start = TAG_BYTES + LENGTH_PREFIX
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
    start = TAG_BYTES + LENGTH_PREFIX
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
