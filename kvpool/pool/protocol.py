"""The pool's wire protocol: typed, versioned msgpack frames (msgspec).

A frame is a 4-byte big-endian length followed by a msgpack array
`[version, request_id, op]`; `op` is one of the tagged structs below. Every request gets
exactly one reply `[version, request_id, result]`, where `result` is the op's `...Ok`
struct or an `Error` (an ErrorCode and a message). The first request of a connection
must be `Hello` (tenant + token). Decoding is two-step: the envelope first, so a frame
of another version is answered WRONG_VERSION rather than MALFORMED.

Fields are added compatibly within a version: a new field has a default and its struct
omits defaults when encoding, so a caller that does not use it sends the same frame as
before (e.g. `Lookup.wait_pending_ms`). A new op is used only where the daemon says it
serves it: a client renews (Renew) only when the hello advertised a reservation or lease TTL
(`HelloOk.reservation_ttl_s`, `lease_ttl_s`, 0 from a daemon that predates them); an older
daemon would answer the op MALFORMED.

  encode_request / decode_request   client -> daemon
  encode_reply / decode_reply       daemon -> client
  read_frame / frame                length-prefixed framing with a size limit

Bounds (what one frame may make the daemon do; checked before any work):
  * every block hash is HASH_BYTES (16) bytes; a hash list (Lookup, Acquire, Reserve,
    Evict) and Reserve's lengths hold at most MAX_BLOCKS_PER_FRAME entries, a Commit at
    most that many digests of at most DIGEST_BYTES each (checked by the decoder: a longer
    list is MALFORMED before its elements are read);
  * page bytes travel at most MAX_PAGES_PER_FRAME pages a frame (WritePages' slots and
    data, ReadPages' indexes and so its PagesOk);
  * a Renew names at most MAX_RENEW_IDS reservation ids and as many lease ids (each at most
    once: the daemon checks);
  * Hello's tenant and client name are at most MAX_NAME_CHARS characters, its token
    MAX_TOKEN_CHARS;
  * after a hello a frame (either way) is at most `frame_limit(page_size)` bytes:
    MAX_PAGES_PER_FRAME pages and CONTROL_FRAME_BYTES for everything else. What only the
    session's state bounds (indexes within the lease and distinct, slots within the
    reservation and distinct, hashes distinct) the daemon checks (kvpool.pool.handlers).
"""

from __future__ import annotations

import struct
from typing import Annotated, Union

import msgspec

from kvpool.pool.records import CorruptOutcome, EvictOutcome, Hits, Miss, Renewal, Slot
from kvpool.pool.digest import DIGEST_BYTES, DigestKind
from kvpool.errors import ErrorCode, MalformedFrame, WrongVersion
from kvpool.pool.keys import HASH_BYTES, Namespace

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME = 64 * 1024 * 1024 + 4096  # a relay's limit when it does not know the page size
LENGTH = struct.Struct(">I")

MAX_BLOCKS_PER_FRAME = 65536  # blocks named in one frame: a prompt of 1M tokens at block size 16
MAX_PAGES_PER_FRAME = 16  # pages of bytes in one WritePages or PagesOk (the client moves one at a time)
MAX_NAME_CHARS = 256  # a tenant's or a client's name
MAX_TOKEN_CHARS = 1024  # a tenant's token
MAX_RENEW_IDS = 4096  # reservations (and as many leases) one Renew names: far more than a client holds at once
# Every frame other than page bytes: a maximal Reserve (65536 hashes and lengths) is 1.5 MiB,
# its ReserveOk, a maximal LookupOk / AcquireOk (65536 hits) 2.3 MiB, Metrics' text well under.
CONTROL_FRAME_BYTES = 4 * 1024 * 1024


def frame_limit(page_size: int) -> int:
    """The largest frame after a hello, either way, for pages of `page_size` bytes."""
    return MAX_PAGES_PER_FRAME * page_size + CONTROL_FRAME_BYTES


BlockHash = Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
Hashes = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS_PER_FRAME)]
Lengths = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCKS_PER_FRAME)]
Digests = Annotated[list[Annotated[bytes, msgspec.Meta(max_length=DIGEST_BYTES)]],
                    msgspec.Meta(max_length=MAX_BLOCKS_PER_FRAME)]
PageIndexes = Annotated[list[int], msgspec.Meta(max_length=MAX_PAGES_PER_FRAME)]
PageData = Annotated[list[bytes], msgspec.Meta(max_length=MAX_PAGES_PER_FRAME)]
GrantIds = Annotated[list[int], msgspec.Meta(max_length=MAX_RENEW_IDS)]


class Envelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    v: int
    id: int
    body: msgspec.Raw


# -- requests ---------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    tenant: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
    token: Annotated[str, msgspec.Meta(max_length=MAX_TOKEN_CHARS)]
    client_name: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)] = ""


class Ping(msgspec.Struct, tag="ping", forbid_unknown_fields=True):
    pass


class Lookup(msgspec.Struct, tag="lookup", forbid_unknown_fields=True, omit_defaults=True):
    """`wait_pending_ms`: if the first missing block's publish is in flight (reserved,
    not yet committed, same tenant and namespace), wait up to this long (capped by the
    daemon's `max_lookup_wait_s`) for it to commit or abort, then answer; a wait that
    runs out answers MissCause.IN_FLIGHT. 0: answer at once (pending reads as missing)."""

    ns: Namespace
    hashes: Hashes
    wait_pending_ms: Annotated[int, msgspec.Meta(ge=0)] = 0


class Acquire(msgspec.Struct, tag="acquire", forbid_unknown_fields=True):
    ns: Namespace
    hashes: Hashes


class Release(msgspec.Struct, tag="release", forbid_unknown_fields=True):
    lease_id: int


class Reserve(msgspec.Struct, tag="reserve", forbid_unknown_fields=True):
    ns: Namespace
    hashes: Hashes
    lengths: Lengths
    boundary: int | None = None


class WritePages(msgspec.Struct, tag="write", forbid_unknown_fields=True):
    """Page bytes sent over the socket, for a client that cannot map the arena."""

    reservation_id: int
    slots: PageIndexes  # indexes into the reservation's pages, distinct
    data: PageData


class Commit(msgspec.Struct, tag="commit", forbid_unknown_fields=True, omit_defaults=True):
    """`kind`: how the digests were taken. xxh3-128 digests are re-taken by the daemon
    before the pages become visible; kv-sketch-1 digests (a GPU's) are trusted at commit,
    checked end to end by every loader and scrubbed at rest by the daemon."""
    reservation_id: int
    digests: Digests  # the publisher's digest of each reserved page, in order
    kind: DigestKind = DigestKind.XXH3


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    reservation_id: int


class ReadPages(msgspec.Struct, tag="read", forbid_unknown_fields=True):
    """Leased page bytes sent over the socket, for a client that cannot map the arena."""

    lease_id: int
    indexes: PageIndexes  # indexes into the lease's pages, distinct


class Evict(msgspec.Struct, tag="evict", forbid_unknown_fields=True):
    """Evict the blocks named (each answered: evicted, leased, not found); `hashes` the one
    key kvpool.pool.keys.NAMESPACE_RESET: reset the namespace (everything published under
    it leaves the pool; one outcome per page: evicted, dropped, cancelled)."""

    ns: Namespace
    hashes: Hashes


class SetCapacity(msgspec.Struct, tag="capacity", forbid_unknown_fields=True, omit_defaults=True):
    """Squeeze (or restore) one tenant's usable pages: `tenant`'s segment, by default the
    caller's own."""
    pages: int
    tenant: str = ""


class SetLimits(msgspec.Struct, tag="limits", forbid_unknown_fields=True, omit_defaults=True):
    """Set one tenant's load limits (concurrent leases per client and in all; 0: none), by
    default the caller's own: what an operator tightens during a warm-up fan-out."""
    per_client: int
    total: int
    tenant: str = ""


class Stats(msgspec.Struct, tag="stats", forbid_unknown_fields=True):
    pass


class Metrics(msgspec.Struct, tag="metrics", forbid_unknown_fields=True):
    pass


MAX_REPORT_INDEXES = 65536  # a lease's pages at most (the blocks of one Acquire)


class ReportCorrupt(msgspec.Struct, tag="report_corrupt", forbid_unknown_fields=True):
    """The loader's digest check refused these pages of its lease (indexes into the lease's
    pages, each at most once; the lease still held). The daemon re-hashes each at rest and
    drops those whose bytes there do not match; it never drops a page on the word alone.
    A longer list than MAX_REPORT_INDEXES is MALFORMED before its elements are read."""

    lease_id: int
    indexes: Annotated[list[int], msgspec.Meta(max_length=MAX_REPORT_INDEXES)]


class Renew(msgspec.Struct, tag="renew", forbid_unknown_fields=True, omit_defaults=True):
    """The session is still working on these reservations (leases) of its own: move each
    deadline to now + its TTL (never past the grant's maximum age). Answered per id, in
    order (RenewOk): the seconds to the new deadline, or a refusal (kvpool.pool.records.
    RenewRefusal: unknown, expired, not_yours), the grant left as it was. Sent only to a
    daemon whose hello advertised the TTL."""

    reservations: GrantIds = msgspec.field(default_factory=list)
    leases: GrantIds = msgspec.field(default_factory=list)


Request = Union[Hello, Ping, Lookup, Acquire, Release, Reserve, WritePages, Commit, Abort,
                ReadPages, Evict, SetCapacity, SetLimits, Stats, Metrics, ReportCorrupt, Renew]


# -- replies ----------------------------------------------------------------------------
class HelloOk(msgspec.Struct, tag="hello_ok"):
    """`arena`: the daemon's attach socket (a Unix socket path); a client on the same
    host connects to it and sends `ticket` (single-use, for this session, valid for the
    daemon's hello timeout) to be handed its tenant's segment as a file descriptor.
    `reservation_ttl_s`, `lease_ttl_s`: how long a reservation or lease lives unless renewed
    (Renew); 0: the daemon does not say (it predates Renew: a client does not renew)."""
    session: int
    arena: str
    arena_instance: bytes
    page_size: int
    num_pages: int
    server: str
    restarted_after_crash: bool
    ticket: bytes = b""
    reservation_ttl_s: float = 0.0
    lease_ttl_s: float = 0.0


class Pong(msgspec.Struct, tag="pong"):
    pass


class LookupOk(msgspec.Struct, tag="lookup_ok"):
    hits: Hits
    miss: Miss | None


class AcquireOk(msgspec.Struct, tag="acquire_ok"):
    lease_id: int
    hits: Hits
    miss: Miss | None


class ReleaseOk(msgspec.Struct, tag="release_ok"):
    stale: list[int]


class ReserveOk(msgspec.Struct, tag="reserve_ok"):
    reservation_id: int
    slots: list[Slot]


class WriteOk(msgspec.Struct, tag="write_ok"):
    written: int


class CommitOk(msgspec.Struct, tag="commit_ok"):
    committed: int
    rejected: list[int]


class AbortOk(msgspec.Struct, tag="abort_ok"):
    freed: int


class PagesOk(msgspec.Struct, tag="pages_ok"):
    data: list[bytes]


class EvictOk(msgspec.Struct, tag="evict_ok"):
    outcomes: list[EvictOutcome]


class CapacityOk(msgspec.Struct, tag="capacity_ok"):
    evicted: int


class LimitsOk(msgspec.Struct, tag="limits_ok"):
    per_client: int  # the limits before the change
    total: int


class StatsOk(msgspec.Struct, tag="stats_ok"):
    stats: dict[str, int]


class MetricsOk(msgspec.Struct, tag="metrics_ok"):
    text: str


class Error(msgspec.Struct, tag="error"):
    code: ErrorCode
    message: str


class ReportOk(msgspec.Struct, tag="report_ok"):
    outcomes: list[CorruptOutcome]  # per reported index: dropped (corrupt at rest) or intact


class RenewOk(msgspec.Struct, tag="renew_ok"):
    reservations: list[Renewal]  # one per id asked, in order
    leases: list[Renewal]


Reply = Union[HelloOk, Pong, LookupOk, AcquireOk, ReleaseOk, ReserveOk, WriteOk, CommitOk,
              AbortOk, PagesOk, EvictOk, CapacityOk, LimitsOk, StatsOk, MetricsOk, Error, ReportOk, RenewOk]

_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(Envelope)
_request = msgspec.msgpack.Decoder(Request)
_reply = msgspec.msgpack.Decoder(Reply)


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


def encode_request(request_id: int, op: Request, version: int = PROTOCOL_VERSION) -> bytes:
    return frame(_encoder.encode((version, request_id, op)))


def encode_reply(request_id: int, result: Reply) -> bytes:
    return frame(_encoder.encode((PROTOCOL_VERSION, request_id, result)))


def _envelope_of(payload: bytes) -> Envelope:
    try:
        env = _envelope.decode(payload)
    except msgspec.DecodeError as exc:  # includes ValidationError
        raise MalformedFrame(f"frame is not a [version, id, body] envelope: {exc}") from exc
    if env.id < 0 or env.id >= 2**63:
        raise MalformedFrame(f"request id {env.id} out of range")
    return env


def decode_request(payload: bytes) -> tuple[int, Request]:
    """(request id, op). Raises MalformedFrame or WrongVersion (with `.request_id` set)."""
    env = _envelope_of(payload)
    if env.v != PROTOCOL_VERSION:
        err = WrongVersion(f"protocol version {env.v} not served; this daemon speaks {PROTOCOL_VERSION}")
        err.request_id = env.id  # type: ignore[attr-defined]
        raise err
    try:
        op = _request.decode(env.body)
    except msgspec.DecodeError as exc:
        err2 = MalformedFrame(f"request body does not decode: {exc}")
        err2.request_id = env.id  # type: ignore[attr-defined]
        raise err2 from exc
    except (TypeError, ValueError) as exc:  # Namespace.__post_init__ rejects a field
        err3 = MalformedFrame(f"request body is invalid: {exc}")
        err3.request_id = env.id  # type: ignore[attr-defined]
        raise err3 from exc
    return env.id, op


def decode_reply(payload: bytes) -> tuple[int, Reply]:
    env = _envelope_of(payload)
    if env.v != PROTOCOL_VERSION:
        raise WrongVersion(f"daemon replied with protocol version {env.v}, expected {PROTOCOL_VERSION}")
    try:
        return env.id, _reply.decode(env.body)
    except msgspec.DecodeError as exc:
        raise MalformedFrame(f"reply body does not decode: {exc}") from exc
