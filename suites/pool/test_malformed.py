"""A thousand and more generated malformed frames against a live daemon.

Every frame must get a typed Error reply; afterwards the daemon serves a valid client
correctly and its page accounting is exactly what it was.
"""

import random
import socket

import msgspec
import numpy as np

from kvgate.harness.system.pool import PoolProcess
from kvpool.pool import protocol as P
from kvpool.client.transfer import load, publish
from kvpool.errors import ErrorCode
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
FRAMES = 1200
ENC = msgspec.msgpack.encode


def _valid_bodies(rng: random.Random) -> list[object]:
    return [
        {"type": "lookup", "ns": NS.as_dict(), "hashes": [rng.randbytes(16)]},
        {"type": "reserve", "ns": NS.as_dict(), "hashes": [rng.randbytes(16)], "lengths": [64]},
        {"type": "release", "lease_id": rng.randrange(1, 1000)},
        {"type": "evict", "ns": NS.as_dict(), "hashes": []},
    ]


def _malformed(rng: random.Random, i: int) -> tuple[bytes, set[ErrorCode]]:
    """One malformed payload and the error codes that may answer it."""
    bad = {ErrorCode.MALFORMED}
    kind = i % 12
    if kind == 0:  # random bytes: may happen to decode as an envelope of another version
        return rng.randbytes(rng.randrange(0, 64)), {ErrorCode.MALFORMED, ErrorCode.WRONG_VERSION}
    if kind == 1:  # a valid frame cut short
        full = ENC([1, i, rng.choice(_valid_bodies(rng))])
        return full[: rng.randrange(0, len(full) - 1)], bad
    if kind == 2:  # one flipped byte in a valid frame: may still decode to some other error
        full = bytearray(ENC([1, i, rng.choice(_valid_bodies(rng))]))
        pos = rng.randrange(len(full))
        full[pos] ^= 1 << rng.randrange(8)
        return bytes(full), {ErrorCode.MALFORMED, ErrorCode.WRONG_VERSION, ErrorCode.UNAUTHENTICATED,
                             ErrorCode.INVALID, ErrorCode.LEASE_LOST, "__ok__"}
    if kind == 3:
        return ENC([rng.choice([0, 2, 7, 2**31]), i, {"type": "ping"}]), {ErrorCode.WRONG_VERSION}
    if kind == 4:
        return ENC([1, i, {"type": rng.choice(["", "pong", "drop_table", "HELLO", "lookup_ok"])}]), bad
    if kind == 5:  # wrong field types
        body = rng.choice(_valid_bodies(rng))
        field = rng.choice([k for k in body if k != "type"])
        body[field] = rng.choice(["str", -1.5, [None], {"x": 1}, None, True])
        return ENC([1, i, body]), bad
    if kind == 6:  # unknown extra field
        body = rng.choice(_valid_bodies(rng))
        body["zz_" + str(rng.randrange(100))] = 1
        return ENC([1, i, body]), bad
    if kind == 7:  # namespace with a broken field
        ns = NS.as_dict()
        key, values = rng.choice([("block_size", [0, -3, "x", None]), ("num_layers", [0, -1, 2.5]),
                                  ("tp_rank", [-3, 5, "x"]), ("model_id", [0, None, b"m"]), ("colour", ["red"])])
        ns[key] = rng.choice(values)
        return ENC([1, i, {"type": "lookup", "ns": ns, "hashes": []}]), bad
    if kind == 8:  # envelope of the wrong shape
        return ENC(rng.choice([[1], [1, i], {"v": 1, "id": i}, "frame", 17, [1, "id", {"type": "ping"}],
                               [1, -5, {"type": "ping"}], [1, i, {"type": "ping"}, "extra"]])), bad
    if kind == 9:  # semantically invalid but well-formed (unknown ids, sizes)
        body = rng.choice([
            {"type": "commit", "reservation_id": rng.randrange(10**6, 10**7), "digests": []},
            {"type": "abort", "reservation_id": rng.randrange(10**6, 10**7)},
            {"type": "read", "lease_id": rng.randrange(10**6, 10**7), "indexes": [0]},
            {"type": "release", "lease_id": rng.randrange(10**6, 10**7)},
            {"type": "capacity", "pages": rng.choice([-1, 10**9])},
            {"type": "reserve", "ns": NS.as_dict(), "hashes": [b"x" * 16], "lengths": [10**9]},
            {"type": "reserve", "ns": NS.as_dict(), "hashes": [b"x" * 16], "lengths": []},
            {"type": "write", "reservation_id": 1, "slots": [0], "data": [b"x"]},
        ])
        return ENC([1, i, body]), {ErrorCode.INVALID, ErrorCode.LEASE_LOST, ErrorCode.MALFORMED}
    if kind == 10:  # another tenant's namespace
        ns = {**NS.as_dict(), "tenant": "intruder"}
        return ENC([1, i, {"type": "lookup", "ns": ns, "hashes": []}]), {ErrorCode.UNAUTHENTICATED}
    # kind 11: a hello with a bad token (re-authentication attempt)
    return ENC([1, i, {"type": "hello", "tenant": "default", "token": rng.randbytes(4).hex()}]), {ErrorCode.UNAUTHENTICATED}


def _ask(sock: socket.socket, payload: bytes):
    sock.sendall(P.frame(payload))
    header = sock.recv(4, socket.MSG_WAITALL)
    assert len(header) == 4, "daemon closed the connection instead of answering"
    (n,) = P.LENGTH.unpack(header)
    return P.decode_reply(sock.recv(n, socket.MSG_WAITALL))[1]


def test_malformed_frames_get_typed_errors_and_change_nothing(tmp_path, test_seed):
    rng = random.Random(test_seed)
    pool = PoolProcess.start(page_size=4096, num_pages=16, run_dir=tmp_path)
    try:
        hs = block_hashes(range(64), 16)
        data = [np.random.default_rng(i).integers(0, 256, 4096, dtype=np.uint8) for i in range(4)]
        with pool.client() as c:
            publish(c, NS, hs, data)
            before = c.stats()
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(10)
        sock.connect(pool.address["unix"])
        assert isinstance(_ask(sock, P.encode_request(0, P.Hello("default", pool.token))[4:]), P.HelloOk)
        codes: dict[str, int] = {}
        for i in range(FRAMES):
            payload, allowed = _malformed(rng, i)
            reply = _ask(sock, payload)
            got = reply.code if isinstance(reply, P.Error) else "__ok__"
            assert got in allowed, f"frame {i} ({payload[:40]!r}) answered {reply}; replay with --kv-seed"
            codes[str(got)] = codes.get(str(got), 0) + 1
        # kinds 0-11 each answered; typed errors dominate
        assert sum(v for k, v in codes.items() if k != "__ok__") >= 1000, codes
        sock.close()
        with pool.client() as c:
            after = c.stats()
            out = [np.zeros(4096, np.uint8) for _ in range(4)]
            res = load(c, NS, hs, out.__getitem__)
            assert res.loaded == 4
            assert all(np.array_equal(a, b) for a, b in zip(out, data))
        for key in ("committed_pages", "free_pages", "reserved_pages", "leased_pages", "entries"):
            assert after[key] == before[key], (key, before[key], after[key])
        assert pool.stop() == 0
    finally:
        pool.cleanup()
