"""The wire protocol: every message round-trips; bad frames raise typed errors."""

import msgspec
import pytest

from kvpool.pool import protocol as P
from kvpool.pool.records import EvictOutcome, Hits, Miss, Renewal, RenewRefusal, Slot, SlotStatus
from kvpool.errors import ErrorCode, MalformedFrame, MissCause, WrongVersion, error_from_code, Unauthenticated
from kvpool.pool.keys import Namespace

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
H = [b"\x01" * 16, b"\x02" * 16]

REQUESTS = [
    P.Hello("default", "secret", "replica-a"), P.Ping(), P.Lookup(NS, H), P.Acquire(NS, H), P.Release(3),
    P.Reserve(NS, H, [10, 20], 1), P.WritePages(4, [0], [b"abc"]), P.Commit(4, [b"d" * 16]), P.Abort(4),
    P.ReadPages(3, [0, 1]), P.Evict(NS, H), P.SetCapacity(9), P.Stats(), P.Metrics(), P.Renew([4, 5], [3]),
    P.Renew(),
]
REPLIES = [
    P.HelloOk(1, "arena", b"i" * 16, 4096, 8, "srv", False), P.Pong(),
    P.LookupOk(Hits([1], [2], [3], b"d" * 16), Miss(1, MissCause.INCOMPATIBLE, ("kv_dtype",))),
    P.AcquireOk(5, Hits(), Miss(0, MissCause.THROTTLED)), P.ReleaseOk([]),
    P.ReserveOk(7, [Slot(SlotStatus.RESERVED, 1, 0), Slot(SlotStatus.EXISTS)]), P.WriteOk(1),
    P.CommitOk(1, [2]), P.AbortOk(3), P.PagesOk([b"x"]), P.EvictOk([EvictOutcome.LEASED]),
    P.CapacityOk(2), P.StatsOk({"a": 1}), P.MetricsOk("m 1"), P.Error(ErrorCode.BUSY, "full"),
    P.HelloOk(1, "arena", b"i" * 16, 4096, 8, "srv", False, b"t", 30.0, 60.0),
    P.RenewOk([Renewal(4, 29.5), Renewal(5, 0.0, RenewRefusal.NOT_YOURS)], [Renewal(3, 0.0, RenewRefusal.EXPIRED)]),
]


@pytest.mark.parametrize("op", REQUESTS, ids=lambda o: type(o).__name__)
def test_requests_round_trip(op):
    data = P.encode_request(42, op)
    assert P.LENGTH.unpack(data[:4])[0] == len(data) - 4
    assert P.decode_request(data[4:]) == (42, op)


@pytest.mark.parametrize("reply", REPLIES, ids=lambda o: type(o).__name__)
def test_replies_round_trip(reply):
    assert P.decode_reply(P.encode_reply(9, reply)[4:]) == (9, reply)


def test_wrong_version_is_not_malformed():
    data = P.encode_request(5, P.Ping(), version=P.PROTOCOL_VERSION + 1)
    with pytest.raises(WrongVersion) as info:
        P.decode_request(data[4:])
    assert info.value.request_id == 5


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgspec.msgpack.encode({"v": 1}), msgspec.msgpack.encode([1, 2]),
    msgspec.msgpack.encode([1, 2, {"type": "nope"}]), msgspec.msgpack.encode([1, 2, {"type": "release"}]),
    msgspec.msgpack.encode([1, 2, {"type": "release", "lease_id": "x"}]),
    msgspec.msgpack.encode([1, 2, {"type": "ping", "extra": 1}]),
    msgspec.msgpack.encode([1, -1, {"type": "ping"}]),
    msgspec.msgpack.encode([1, 2, {"type": "lookup", "ns": {**NS.as_dict(), "block_size": 0}, "hashes": []}]),
])
def test_malformed_payloads_raise_malformed(payload):
    with pytest.raises(MalformedFrame):
        P.decode_request(payload)


def test_error_codes_map_back_to_exception_types():
    err = error_from_code(ErrorCode.UNAUTHENTICATED, "no")
    assert isinstance(err, Unauthenticated) and err.message == "no"


def test_a_lookup_that_does_not_wait_encodes_as_before_and_one_that_waits_round_trips():
    """A caller that does not ask to wait sends the frame an older daemon decodes (its
    Lookup forbids unknown fields); a wait travels and comes back as sent."""
    plain = P.encode_request(1, P.Lookup(NS, H))
    assert b"wait_pending_ms" not in plain
    assert P.decode_request(plain[4:]) == (1, P.Lookup(NS, H, 0))
    waiting = P.encode_request(2, P.Lookup(NS, H, wait_pending_ms=250))
    assert P.decode_request(waiting[4:]) == (2, P.Lookup(NS, H, 250))


def test_a_negative_wait_is_malformed():
    body = msgspec.msgpack.encode([1, 2, {"type": "lookup", "ns": NS.as_dict(), "hashes": [], "wait_pending_ms": -1}])
    with pytest.raises(MalformedFrame):
        P.decode_request(body)


def test_a_renew_names_at_most_max_renew_ids_of_each():
    P.decode_request(P.encode_request(1, P.Renew(list(range(P.MAX_RENEW_IDS))))[4:])
    with pytest.raises(MalformedFrame):
        P.decode_request(P.encode_request(1, P.Renew(list(range(P.MAX_RENEW_IDS + 1))))[4:])
    with pytest.raises(MalformedFrame):
        P.decode_request(P.encode_request(1, P.Renew([], list(range(P.MAX_RENEW_IDS + 1))))[4:])


def test_hello_ok_of_a_daemon_before_renew_decodes_with_no_ttl():
    """A daemon that predates Renew sends no TTLs: the client reads 0 (and does not renew)."""
    old = msgspec.msgpack.encode([P.PROTOCOL_VERSION, 3, {"type": "hello_ok", "session": 1, "arena": "a",
                                  "arena_instance": b"i", "page_size": 4096, "num_pages": 8, "server": "s",
                                  "restarted_after_crash": False}])
    _, hello = P.decode_reply(old)
    assert isinstance(hello, P.HelloOk) and hello.reservation_ttl_s == 0.0 and hello.lease_ttl_s == 0.0


# -- the records the replies carry (kvpool.pool.records) ------------------------------------

from kvpool.pool.digest import KINDS, DigestKind  # noqa: E402
from kvpool.pool.records import PageRef  # noqa: E402


def _hits3(kinds: bytes = b"") -> Hits:
    return Hits([7, 8, 9], [1, 2, 3], [10, 20, 30], b"a" * 16 + b"b" * 16 + b"c" * 16, kinds)


@pytest.mark.parametrize("columns", [
    dict(generations=[1]),  # generations short, the rest agree
    dict(lengths=[10]),  # lengths short, the rest agree
    dict(digests=b"a" * 16),  # digests short, the rest agree
], ids=["generations", "lengths", "digests"])
def test_hits_refuse_any_one_column_that_disagrees_with_the_pages_and_say_how(columns):
    base = dict(pages=[7, 8], generations=[1, 2], lengths=[10, 20], digests=b"a" * 32)
    with pytest.raises(ValueError, match=r"Hits columns disagree: 2 pages, \d+ generations, \d+ lengths, \d+ digest bytes"):
        Hits(**{**base, **columns})


@pytest.mark.parametrize("kinds", [b"\x00", b"\x00\x01\x00\x00", bytes([0, 0, len(KINDS)])],
                         ids=["too_few", "too_many", "one_past_the_last_code"])
def test_hits_refuse_a_kinds_column_of_another_length_or_an_unknown_kind_and_say_how(kinds):
    with pytest.raises(ValueError, match=r"Hits: \d+ digest kinds for 3 pages, or an unknown kind"):
        _hits3(kinds)


def test_hits_index_gives_each_page_its_own_columns_and_digest_kind():
    hits = _hits3(bytes([DigestKind.SKETCH.code, DigestKind.XXH3.code, DigestKind.SKETCH.code]))
    assert [hits[i] for i in range(3)] == [PageRef(7, 1, 10, b"a" * 16, DigestKind.SKETCH),
                                           PageRef(8, 2, 20, b"b" * 16, DigestKind.XXH3),
                                           PageRef(9, 3, 30, b"c" * 16, DigestKind.SKETCH)]
    assert [hits.kind(i) for i in range(3)] == [DigestKind.SKETCH, DigestKind.XXH3, DigestKind.SKETCH]
    assert list(hits) == [hits[0], hits[1], hits[2]]
    # no kinds column: every page xxh3-128
    assert [r.kind for r in _hits3()] == [DigestKind.XXH3] * 3


def test_hits_negative_index_counts_from_the_end_and_a_slice_gives_those_pages():
    hits = _hits3(bytes([DigestKind.XXH3.code, DigestKind.XXH3.code, DigestKind.SKETCH.code]))
    assert hits[-1] == hits[2] and hits[-1].page == 9 and hits[-1].kind == DigestKind.SKETCH
    assert hits[-3].page == 7
    assert [r.page for r in hits[1:]] == [8, 9]
    assert hits[0:2] == [hits[0], hits[1]]
    assert [r.page for r in hits[::-1]] == [9, 8, 7]
    assert hits.total_bytes == 60 and len(hits) == 3 and bool(hits) and not Hits()


# -- the envelope's checks and their messages (kvpool.pool.protocol) ------------------------

def test_a_frame_after_the_hello_holds_max_pages_pages_and_the_control_bytes():
    assert P.frame_limit(4096) == 16 * 4096 + 4 * 1024 * 1024
    assert P.frame_limit(1) == P.MAX_PAGES_PER_FRAME + P.CONTROL_FRAME_BYTES


@pytest.mark.parametrize("rid", [0, 1, 2**63 - 1])
def test_a_request_id_from_0_to_2_63_minus_1_is_served(rid):
    assert P.decode_request(msgspec.msgpack.encode([P.PROTOCOL_VERSION, rid, {"type": "ping"}])) == (rid, P.Ping())
    assert P.decode_reply(msgspec.msgpack.encode([P.PROTOCOL_VERSION, rid, {"type": "pong"}])) == (rid, P.Pong())


@pytest.mark.parametrize("rid", [-1, 2**63, 2**64 - 1])
def test_a_request_id_outside_0_to_2_63_minus_1_is_malformed_and_says_so(rid):
    with pytest.raises(MalformedFrame, match=rf"^request id {rid} out of range$"):
        P.decode_request(msgspec.msgpack.encode([P.PROTOCOL_VERSION, rid, {"type": "ping"}]))


def test_each_decoding_error_says_what_failed_and_carries_the_request_id():
    with pytest.raises(MalformedFrame, match=r"^frame is not a \[version, id, body\] envelope: "):
        P.decode_request(b"\xc1")
    with pytest.raises(MalformedFrame, match=r"^frame is not a \[version, id, body\] envelope: "):
        P.decode_reply(msgspec.msgpack.encode([1, 2]))
    with pytest.raises(WrongVersion, match=rf"^protocol version 7 not served; this daemon speaks {P.PROTOCOL_VERSION}$") as info:
        P.decode_request(msgspec.msgpack.encode([7, 11, {"type": "ping"}]))
    assert info.value.request_id == 11
    with pytest.raises(MalformedFrame, match=r"^request body does not decode: ") as info:
        P.decode_request(msgspec.msgpack.encode([P.PROTOCOL_VERSION, 12, {"type": "nope"}]))
    assert info.value.request_id == 12
    with pytest.raises(WrongVersion, match=rf"^daemon replied with protocol version 7, expected {P.PROTOCOL_VERSION}$"):
        P.decode_reply(msgspec.msgpack.encode([7, 13, {"type": "pong"}]))
    with pytest.raises(MalformedFrame, match=r"^reply body does not decode: "):
        P.decode_reply(msgspec.msgpack.encode([P.PROTOCOL_VERSION, 14, {"type": "nope"}]))
