"""A publish's digests vouch for the producer's bytes, never for the page's: the reserved page
lies in a segment every client of the tenant maps writable, so another client may write it
between the copy and the hash (the hostile scenario's scribbler did, at random, in a CI run:
kvgate.harness.scenarios.hostile.scribble's round check found a page installed with other bytes
than A's). Here that write comes at the one moment it matters, every time: the page is written
right after the copy into it, before anything else reads it. Oracle: B installs A's bytes or
nothing. Control (kvgate.faults.transport_controls.digest_of_the_page, the digest of the page
after the copy): the daemon's re-verification passes the other client's bytes and B installs
them."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvgate.faults.transport_controls import digest_of_the_page
from kvgate.harness.system.pool import thread_pool
from kvpool.client.pool_client import PoolClient
from kvpool.client.transfer import load, publish
from kvpool.errors import MissCause
from kvpool.pool.copy import copy_digest, copy_digest_as
from kvpool.pool.digest import DigestKind, page_digest
from kvpool.pool.keys import Namespace, block_hashes

PAGE = 4096
NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)
FOREIGN = 0xA5


@pytest.fixture
def pool():
    d = thread_pool(page_size=PAGE, num_pages=16)
    yield d
    d.stop_thread()


def client(d, name: str) -> PoolClient:  # noqa: ANN001
    return PoolClient(f"unix:{d.unix_path}", "default", "tok", name=name)


@contextlib.contextmanager
def written_after_the_copy(pages: np.ndarray, monkeypatch: pytest.MonkeyPatch):
    """Every copy into the tenant's page segment is followed at once by another client's write
    of the same bytes (the segment is shared memory: A's view and the other client's are the
    same page)."""
    real = np.copyto
    hits = []

    def copyto(dst, src, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        real(dst, src, *a, **kw)
        if isinstance(dst, np.ndarray) and dst.size and np.shares_memory(dst, pages):
            dst[:] = FOREIGN
            hits.append(dst.size)

    monkeypatch.setattr(np, "copyto", copyto)
    yield hits


def exchange(d, monkeypatch: pytest.MonkeyPatch, kind: DigestKind) -> tuple[int, list[int], str | None, int]:  # noqa: ANN001
    keys = block_hashes(range(16 * 3), 16)
    rng = np.random.default_rng(7)
    data = [rng.integers(0, 255, PAGE, dtype=np.uint8) for _ in keys]  # never FOREIGN throughout
    with client(d, "A") as a, client(d, "B") as b:
        assert a.arena is not None and b.arena is not None  # the shared mapping, or no such write
        pages = np.frombuffer(a.arena._mmap, dtype=np.uint8)
        with written_after_the_copy(pages, monkeypatch) as hits:
            committed = publish(a, NS, keys, data, kind=kind).committed
        monkeypatch.undo()
        assert hits, "no copy into the page segment was written after: the fault did not act"
        out = [np.zeros(PAGE, np.uint8) for _ in keys]
        res = load(b, NS, keys, out.__getitem__)
        wrong = [i for i in range(res.loaded) if not np.array_equal(out[i], data[i])]
        return committed, wrong, None if res.miss is None else res.miss.cause.value, res.loaded


@pytest.mark.parametrize("kind", [DigestKind.XXH3, DigestKind.SKETCH])
def test_a_write_into_the_page_after_the_copy_is_never_installed(pool, monkeypatch, kind):
    committed, wrong, cause, loaded = exchange(pool, monkeypatch, kind)
    assert wrong == []  # the oracle: B installs A's bytes or nothing
    if kind is DigestKind.XXH3:  # the daemon re-verifies: nothing committed, so nothing to load
        assert committed == 0 and loaded == 0 and cause == MissCause.NEVER_PUBLISHED.value
    else:  # trusted at commit (the daemon scrubs at rest): B's own check refuses the first page
        assert loaded == 0 and cause == MissCause.CORRUPT.value


@pytest.mark.parametrize("kind", [DigestKind.XXH3, DigestKind.SKETCH])
def test_control_the_digest_of_the_page_is_caught_by_the_same_oracle(pool, monkeypatch, kind):
    with digest_of_the_page():
        committed, wrong, cause, loaded = exchange(pool, monkeypatch, kind)
    assert committed == 3 and loaded == 3 and cause is None
    assert wrong == [0, 1, 2]  # caught: B installed the other client's bytes, three of three


def test_the_digest_side_is_named_and_checked():
    src, dst = [np.arange(64, dtype=np.uint8)], [np.zeros(64, np.uint8)]
    assert copy_digest(src, dst, of="src") == copy_digest(src, dst) == page_digest(src[0])
    assert copy_digest_as(DigestKind.SKETCH, src, dst, of="src") == page_digest(src[0], DigestKind.SKETCH)
    with pytest.raises(ValueError, match="'dst' or 'src'"):
        copy_digest(src, dst, of="page")
