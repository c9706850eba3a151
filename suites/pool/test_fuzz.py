"""Hypothesis fuzz at the two boundaries a request crosses, seeded from --kv-seed.

  protocol frames   generated envelopes and bodies (any msgpack value, known op names with
                    fields of any type, raw bytes) against a live daemon process, before
                    and after a hello: every frame gets one typed reply and nothing else
                    changes; afterwards the daemon serves a valid client the bytes it
                    holds, its accounting exactly as before.
  kv_transfer_params
                    any JSON value through the connector's own parser (RequestParams.of,
                    what the scheduler runs before any hook): it never raises; a value it
                    does not accept turns the pool off for that request and says why.
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st

from kvgate.harness.system.pool import PoolProcess
from kvpool.pool import protocol as P
from kvpool.client.transfer import load, publish
from kvpool.connector.params import RequestParams
from kvpool.pool.keys import Namespace, block_hashes
from suites.pool.test_malformed import _ask  # one frame, one reply (asserting the daemon answered)

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
OPS = ["hello", "ping", "lookup", "acquire", "read", "release", "reserve", "write", "commit", "abort", "evict",
       "capacity", "stats", "metrics", "renew"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
field_names = st.sampled_from(["ns", "hashes", "lengths", "lease_id", "reservation_id", "indexes", "digests",
                               "slots", "data", "pages", "tenant", "token", "client_name", "wait_pending_ms",
                               "boundary", "reservations", "leases", "zz"])
bodies = st.one_of(values, st.builds(lambda op, fields: {"type": op, **fields}, st.sampled_from(OPS),
                                     st.dictionaries(field_names, st.one_of(values, st.just(NS.as_dict())),
                                                     max_size=4)))
envelopes = st.one_of(
    st.tuples(st.sampled_from([1, 1, 1, 0, 2, -1, 2**40]), st.integers(-5, 2**40), bodies).map(list),
    values)
payloads = st.one_of(envelopes.map(msgspec.msgpack.encode), st.binary(max_size=200))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = PoolProcess.start(page_size=4096, num_pages=16, run_dir=tmp_path_factory.mktemp("fuzz-pool"))
    try:
        yield p
        assert p.stop() == 0
    finally:
        p.cleanup()


def test_generated_frames_get_one_typed_reply_each_and_change_nothing(pool, test_seed):
    hs = block_hashes(range(64), 16)
    data = [np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8) for i in range(4)]
    with pool.client() as c:
        publish(c, NS, hs, data)
        before = c.stats()
    authed = socket.socket(socket.AF_UNIX)
    authed.settimeout(10)
    authed.connect(pool.address["unix"])
    assert isinstance(_ask(authed, P.encode_request(0, P.Hello("default", pool.token))[4:]), P.HelloOk)
    seen: dict[str, int] = {}

    @hseed(test_seed)
    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(payload=payloads, before_hello=st.booleans())
    def one(payload: bytes, before_hello: bool) -> None:
        if before_hello:  # a fresh connection: the frame is all it says
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(pool.address["unix"])
                reply = _ask(s, payload)
        else:
            reply = _ask(authed, payload)
        assert isinstance(reply, msgspec.Struct), reply
        name = type(reply).__name__ if not isinstance(reply, P.Error) else f"Error:{reply.code}"
        seen[name] = seen.get(name, 0) + 1

    one()
    authed.close()
    assert sum(v for k, v in seen.items() if k.startswith("Error:")) >= 200, seen  # mostly refused, typed
    with pool.client() as c:
        after = c.stats()
        out = [np.zeros(4096, np.uint8) for _ in range(4)]
        assert load(c, NS, hs, out.__getitem__).loaded == 4
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
    for key in ("committed_pages", "free_pages", "reserved_pages", "leased_pages", "capacity_pages"):
        assert after[key] == before[key], (key, before[key], after[key], seen)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                     st.text(max_size=12)),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=10), inner, max_size=4)),
                           max_leaves=10)
kvpool_objects = st.dictionaries(st.sampled_from(["tag", "load", "publish", "publish_tokens", "zz"]), json_values,
                                 max_size=5)


def test_any_kv_transfer_params_is_parsed_without_raising(test_seed):
    @hseed(test_seed)
    @settings(max_examples=500, deadline=None, database=None)
    @given(params=st.one_of(json_values, st.builds(lambda k: {"kvpool": k}, st.one_of(json_values, kvpool_objects))))
    def one(params: object) -> None:
        p = RequestParams.of(SimpleNamespace(kv_transfer_params=params, request_id="r"))
        ours = params.get("kvpool") if isinstance(params, dict) else None
        if p.error is None:  # accepted: every field it took has the type it must have
            assert isinstance(p.load, bool) and isinstance(p.publish, bool)
            assert p.publish_tokens is None or (isinstance(p.publish_tokens, int) and p.publish_tokens >= 0)
            assert p.tag is None or isinstance(p.tag, str)
        else:  # refused: the pool is off for that request, and the reason names what was wrong
            assert not p.load and not p.publish and p.error
        if ours is not None and not isinstance(ours, dict):
            assert p.error is not None

    one()
