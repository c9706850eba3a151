"""Worker processes of the GPU keeper's control-plane tests (suites/pool/test_gpu_keeper_wire.py),
started with the `spawn` method, each obeying the commands its parent sends over a pipe and
answering each with ("ok", ...) or ("error", type name, text). Host stand-in buffers (memfds)
take the place of device memory: the same protocol, descriptors and state segment.

  keeper_process(conn, run_dir, page_size, pages, tokens, keeper="GpuKeeper", server="KeeperServer",
                 maintenance_s=0.05)
      a GpuKeeper (or a control of kvgate.faults.keeper_controls, by name) and its KeeperServer;
      answers ("ok", control socket path, pid) once serving, then:
      ("sessions",)      the server's open sessions;      ("stats",)   the tier's counters;
      ("errors",)        the server's error replies by code; ("exit",)
  replica_process(conn, path, tenant, token, client="TierClient", stale_after_s=30.0, timeout_s=10.0)
      a replica's TierClient (or a control, by name), connected; answers ("ok", client id, pid),
      then:
      ("reserve", keys)               -> reservation id, [(status, page)]
      ("write", pages, seed, nbytes)  the seeded bytes (page_bytes) into the first `nbytes` of
                                      each page (None: all of it), through the mapping
      ("commit", rid, digests) / ("abort", rid) / ("release", lease_id) / ("lookup", keys)
      ("publish", keys, seed)         reserve, write, sketch, commit: -> committed, [page]
      ("load", keys)                  acquire, copy each page out, check its generation and its
                                      kv-sketch-1 digest against the lease's, release: ->
                                      [blake2b of each page's bytes], [indexes whose digest
                                      differs], stale pages the release named
      ("hangup",)                     the connection closed, the process and its mapping alive
                                      (a producer whose socket ended before its last copy landed)
      ("exit",)
  KEYS(n, base)  n block hashes of one prefix; NS the namespace of the tests; page_bytes(seed, page, size).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import numpy as np

from kvpool.errors import PoolError
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.pool.keys import Namespace, block_hashes

NS = Namespace("m", "r1", "tok", "bfloat16", "cuda", 16, 2, 2, 64)


def KEYS(n: int, base: int = 0) -> list[bytes]:  # noqa: N802 - a table of keys
    return block_hashes(range(base, base + 16 * n), 16)


def page_bytes(seed: int, page: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, page]).integers(0, 256, size, dtype=np.uint8)


def blake(data: bytes | memoryview | np.ndarray) -> str:
    return hashlib.blake2b(bytes(data), digest_size=16).hexdigest()


def _answer(conn: Any, fn) -> None:  # noqa: ANN001, ANN401 - a multiprocessing connection
    try:
        conn.send(("ok", *fn()))
    except (PoolError, AssertionError, ValueError, IndexError) as exc:  # the parent judges it
        conn.send(("error", type(exc).__name__, str(exc)))


def keeper_process(conn: Any, run_dir: str, page_size: int, pages: dict[str, int],  # noqa: ANN401
                   tokens: dict[str, str], keeper: str = "GpuKeeper", server: str = "KeeperServer",
                   maintenance_s: float = 0.05, manual_clock: bool = False, tier: dict | None = None) -> None:
    from kvgate.faults.keeper_controls import KEEPERS, SERVERS
    from kvgate.harness.scenarios.gpu_tier import ManualClock
    from kvpool.gpu.keeper import memfd_allocation
    from kvpool.gpu.tier import GpuTierConfig

    clock = ManualClock() if manual_clock else time.monotonic
    k = KEEPERS[keeper](GpuTierConfig(page_size=page_size, pages=pages, **(tier or {})), run_dir, memfd_allocation)
    with k, SERVERS[server](k, tokens, maintenance_s=maintenance_s, clock=clock) as s:
        conn.send(("ok", str(s.path), os.getpid()))
        while True:
            cmd = conn.recv()
            if cmd[0] == "advance":  # the control plane's clock (manual_clock): TTLs run out when told
                clock.advance(cmd[1])
                conn.send(("ok",))
            elif cmd[0] == "maintain":  # one maintenance round now, at the clock's time
                m = s.maintain()
                conn.send(("ok", m.expired))
            elif cmd[0] == "sessions":
                conn.send(("ok", len(s.sessions)))
            elif cmd[0] == "stats":
                with k.tier_lock:
                    conn.send(("ok", k.tier.stats()))
            elif cmd[0] == "errors":
                conn.send(("ok", {code.value: n for code, n in s.errors.items()}))
            elif cmd[0] == "exit":
                conn.send(("ok",))
                return
            else:
                conn.send(("error", "ValueError", f"unknown command {cmd[0]!r}"))


def replica_process(conn: Any, path: str, tenant: str, token: str, client: str = "TierClient",  # noqa: ANN401, C901
                    stale_after_s: float = 30.0, timeout_s: float = 10.0) -> None:
    from kvgate.faults.keeper_controls import CLIENTS

    c = CLIENTS[client](path, tenant, token, name=f"replica-{os.getpid()}", stale_after_s=stale_after_s,
                        timeout_s=timeout_s)
    c.connect()
    size = c.tier.descriptor.page_size
    conn.send(("ok", c.client_id, os.getpid()))

    def write(pages, seed, nbytes) -> tuple:  # noqa: ANN001
        for p in pages:
            n = size if nbytes is None else nbytes
            c.tier.page_view(p)[:n] = page_bytes(seed, p, size)[:n].tobytes()
        return ()

    def publish(keys, seed) -> tuple:  # noqa: ANN001
        res = c.reserve(NS, keys, [size] * len(keys))
        pages = [s.page for s in res.slots if s.page >= 0]
        if not res.reservation_id:
            return 0, [s.status.value for s in res.slots]
        write(pages, seed, None)
        digests = [page_digest(np.frombuffer(c.tier.page_view(p), np.uint8), DigestKind.SKETCH) for p in pages]
        got = c.commit(res.reservation_id, digests)
        return got.committed, pages

    def load(keys) -> tuple:  # noqa: ANN001
        acq = c.acquire(NS, keys)
        if not acq.lease_id:
            return [], [], [], acq.miss.cause.value
        out, bad = [], []
        for i, ref in enumerate(acq.hits):
            data = np.frombuffer(c.tier.page_view(ref.page), np.uint8)[: ref.length].copy()
            if c.tier.generation(ref.page) != ref.generation or page_digest(data, DigestKind.SKETCH) != ref.digest:
                bad.append(i)
            out.append(blake(data))
        rel = c.release(acq.lease_id)
        return out, bad, list(rel.stale), None

    try:
        while True:
            cmd = conn.recv()
            op = cmd[0]
            if op == "reserve":
                def reserve(keys=cmd[1]) -> tuple:  # noqa: ANN001
                    res = c.reserve(NS, keys, [size] * len(keys))
                    return res.reservation_id, [(s.status.value, s.page) for s in res.slots]
                _answer(conn, reserve)
            elif op == "write":
                _answer(conn, lambda: write(*cmd[1:]))
            elif op == "commit":
                _answer(conn, lambda: (c.commit(cmd[1], cmd[2]).committed,))
            elif op == "abort":
                _answer(conn, lambda: (c.abort(cmd[1]),))
            elif op == "renew":
                def renew(res=cmd[1], leases=cmd[2]) -> tuple:  # noqa: ANN001
                    got = c.renew(res, leases)
                    return tuple([(r.id, r.ttl_s, None if r.refused is None else r.refused.value) for r in rs]
                                 for rs in (got.reservations, got.leases))
                _answer(conn, renew)
            elif op == "ttls":
                conn.send(("ok", c.reservation_ttl_s, c.lease_ttl_s))
            elif op == "release":
                _answer(conn, lambda: (list(c.release(cmd[1]).stale),))
            elif op == "acquire":
                def acquire(keys=cmd[1]) -> tuple:  # noqa: ANN001
                    acq = c.acquire(NS, keys)
                    return acq.lease_id, list(acq.hits.pages)
                _answer(conn, acquire)
            elif op == "lookup":
                def lookup(keys=cmd[1]) -> tuple:  # noqa: ANN001
                    found = c.lookup(NS, keys)
                    return len(found.hits), None if found.miss is None else found.miss.cause.value
                _answer(conn, lookup)
            elif op == "publish":
                _answer(conn, lambda: publish(cmd[1], cmd[2]))
            elif op == "load":
                _answer(conn, lambda: load(cmd[1]))
            elif op == "hangup":
                c._sock.close()  # noqa: SLF001 - the socket ends, the mapping stays
                c._sock = None  # noqa: SLF001
                conn.send(("ok",))
            elif op == "exit":
                conn.send(("ok",))
                return
            else:
                conn.send(("error", "ValueError", f"unknown command {op!r}"))
    finally:
        c.close()
